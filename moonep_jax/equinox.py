"""Equinox MoE layer over MoonEP expert parallelism: `moonep_jax.equinox.MoE` and `shard`.

Importing this module imports Equinox; the core package does not.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from moonep_jax.moe_block import MoESpec, init_params, moe_block, param_specs
from moonep_jax.router import ScoreFn, update_bias


class MoE(eqx.Module):
    """Routed mixture-of-experts FFN with perfectly balanced expert parallelism (MoonEP).

    The router (`router_w [H, E]`, replicated) picks K experts per token; the routed experts
    (`w_gate_up [E, H, 2F]`, `w_down [E, F, H]`, SwiGLU) are global arrays meant to be sharded
    over the EP mesh axis; an optional shared expert (`shared_w_gate_up [H, 2Fs]`,
    `shared_w_down [Fs, H]`, replicated) runs on every token. `__init__` creates plain arrays;
    `moonep_jax.equinox.shard(moe)` places them with the `NamedSharding`s of
    `moe.partition_specs()`.

    **Arguments:**
    - `hidden`, `ffn_hidden`, `num_experts`, `top_k`: H, F, E, K.
    - `mesh`: the device mesh (Explicit or Auto axis types).
    - `key`: a PRNG key for the initial weights.
    - `axis_name`: EP mesh axis (default "ep"). `data_axes`: further mesh axes the tokens are
      sharded over (data parallelism), default none.
    - `shared_ffn_hidden`: Fs of the shared expert, or None (default) for none.
    - `score_fn`: "softmax" (default) or "sigmoid". `renormalize`: renormalise the K weights.
    - `router_bias`: keep an aux-loss-free selection bias `[E]`.
    - `prefetch_slots`, `token_padding`, `implementation`: see `moonep_jax.EPConfig`.
    - `dtype`: dtype of the parameters (default float32); compute runs in x's dtype.

    **Returns** (of `__call__(x)`): `(y, aux)`, see `moonep_jax.moe_block.moe_block`.

    !!! info
        `router_bias` is state, not a parameter: its gradient is always zero, and it changes only
        through `update_router_bias`. Keep it out of optimizers that decay weights (for example
        `eqx.partition` with a filter that is False on it, or `optax.masked`).
    """

    router_w: jax.Array
    w_gate_up: jax.Array
    w_down: jax.Array
    router_bias: jax.Array | None
    shared_w_gate_up: jax.Array | None
    shared_w_down: jax.Array | None
    spec: MoESpec = eqx.field(static=True)

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, *,
                 mesh: jax.sharding.Mesh, key: jax.Array, axis_name: str = "ep",
                 data_axes: tuple[str, ...] = (), shared_ffn_hidden: int | None = None,
                 score_fn: ScoreFn = "softmax", renormalize: bool = True,
                 router_bias: bool = False, prefetch_slots: int | None = None,
                 token_padding: int = 1, implementation: str = "auto", dtype=jnp.float32):
        self.spec = MoESpec(
            num_experts=num_experts, top_k=top_k, hidden=hidden, ffn_hidden=ffn_hidden,
            mesh=mesh, axis_name=axis_name, data_axes=tuple(data_axes),
            shared_ffn_hidden=shared_ffn_hidden, score_fn=score_fn, renormalize=renormalize,
            router_bias=router_bias, prefetch_slots=prefetch_slots, token_padding=token_padding,
            implementation=implementation)
        values = init_params(key, self.spec, dtype)
        self.router_w = values["router_w"]
        self.w_gate_up = values["w_gate_up"]
        self.w_down = values["w_down"]
        self.router_bias = values.get("router_bias")
        self.shared_w_gate_up = values.get("shared_w_gate_up")
        self.shared_w_down = values.get("shared_w_down")

    def params(self) -> dict[str, jax.Array]:
        """The arrays, keyed as `moonep_jax.moe_block.init_params` names them."""
        return {name: getattr(self, name) for name in param_specs(self.spec)}

    def partition_specs(self) -> dict[str, PartitionSpec]:
        """Declared layout: `PartitionSpec` per parameter name (experts over the EP axis)."""
        return param_specs(self.spec)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Applies the layer to `x [T, H]`, tokens sharded over `(*data_axes, axis_name)`."""
        return moe_block(x, self.params(), self.spec)

    def update_router_bias(self, expert_counts: jax.Array, rate: float) -> MoE:
        """A copy with one aux-loss-free bias step from `aux["expert_counts"]` applied."""
        if self.router_bias is None:
            raise ValueError("`moonep_jax.equinox.MoE.update_router_bias`: the layer was built "
                             "with `router_bias=False`; build it with `router_bias=True`.")
        new_bias = update_bias(self.router_bias, expert_counts, rate)
        return eqx.tree_at(lambda m: m.router_bias, self, new_bias)


def shard(moe: MoE) -> MoE:
    """Places each parameter `name` of `moe` with its declared sharding.

    The sharding is `NamedSharding(moe.spec.mesh, moe.partition_specs()[name])`.

    Works eagerly (a `jax.device_put` per array) and under `jax.jit` / `eqx.filter_jit` (where
    `device_put` becomes a sharding constraint).
    """
    specs = moe.partition_specs()
    names = sorted(specs)
    placed = [jax.device_put(getattr(moe, name), NamedSharding(moe.spec.mesh, specs[name]))
              for name in names]
    return eqx.tree_at(lambda m: [getattr(m, name) for name in names], moe, placed)

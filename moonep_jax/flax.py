"""Flax NNX MoE layer over MoonEP expert parallelism: `moonep_jax.flax.MoE`.

Importing this module imports Flax; the core package does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moonep_jax.moe_block import MoESpec, init_params, moe_block, param_specs
from moonep_jax.router import ScoreFn, update_bias


class RouterBias(nnx.Variable):
    """DeepSeek-V3's aux-loss-free selection bias `[E]`.

    A state variable, not an `nnx.Param`: `nnx.grad` and `nnx.Optimizer(..., wrt=nnx.Param)` leave
    it alone; `MoE.update_router_bias` changes it.
    """


class MoE(nnx.Module):
    """Routed mixture-of-experts FFN with perfectly balanced expert parallelism (MoonEP).

    The router (`router_w [H, E]`, replicated) picks K experts per token; the routed experts
    (`w_gate_up [E, H, 2F]`, `w_down [E, F, H]`, SwiGLU) are global arrays sharded over the EP
    mesh axis; an optional shared expert (`shared_w_gate_up [H, 2Fs]`, `shared_w_down [Fs, H]`,
    replicated) runs on every token. Every variable carries its sharding as `out_sharding`
    metadata and is placed on `mesh` when created (`nnx.get_partition_spec` /
    `nnx.get_named_sharding` return the declared layout).

    **Arguments:**
    - `hidden`, `ffn_hidden`, `num_experts`, `top_k`: H, F, E, K.
    - `mesh`: the device mesh (Explicit or Auto axis types).
    - `rngs`: `nnx.Rngs` with a `params` stream.
    - `axis_name`: EP mesh axis (default "ep"). `data_axes`: further mesh axes the tokens are
      sharded over (data parallelism), default none.
    - `shared_ffn_hidden`: Fs of the shared expert, or None (default) for none.
    - `score_fn`: "softmax" (default) or "sigmoid". `renormalize`: renormalise the K weights.
    - `router_bias`: keep an aux-loss-free selection bias (a `RouterBias` variable).
    - `prefetch_slots`, `token_padding`, `implementation`: see `moonep_jax.EPConfig`.
    - `param_dtype`: dtype of every variable (default float32); compute runs in x's dtype.

    **Returns** (of `__call__(x)`): `(y, aux)`, see `moonep_jax.moe_block.moe_block`.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, *,
                 mesh: jax.sharding.Mesh, rngs: nnx.Rngs, axis_name: str = "ep",
                 data_axes: tuple[str, ...] = (), shared_ffn_hidden: int | None = None,
                 score_fn: ScoreFn = "softmax", renormalize: bool = True,
                 router_bias: bool = False, prefetch_slots: int | None = None,
                 token_padding: int = 1, implementation: str = "auto",
                 param_dtype=jnp.float32):
        self.spec = MoESpec(
            num_experts=num_experts, top_k=top_k, hidden=hidden, ffn_hidden=ffn_hidden,
            mesh=mesh, axis_name=axis_name, data_axes=tuple(data_axes),
            shared_ffn_hidden=shared_ffn_hidden, score_fn=score_fn, renormalize=renormalize,
            router_bias=router_bias, prefetch_slots=prefetch_slots, token_padding=token_padding,
            implementation=implementation)
        values = init_params(rngs.params(), self.spec, param_dtype)
        specs = param_specs(self.spec)

        def variable(cls, name):
            if name not in values:
                return None
            return cls(values[name], out_sharding=tuple(specs[name]), mesh=mesh)

        self.router_w = variable(nnx.Param, "router_w")
        self.router_bias = variable(RouterBias, "router_bias")
        self.w_gate_up = variable(nnx.Param, "w_gate_up")
        self.w_down = variable(nnx.Param, "w_down")
        self.shared_w_gate_up = variable(nnx.Param, "shared_w_gate_up")
        self.shared_w_down = variable(nnx.Param, "shared_w_down")

    def params(self) -> dict[str, jax.Array]:
        """The current arrays, keyed as `moonep_jax.moe_block.init_params` names them."""
        return {name: getattr(self, name)[...] for name in param_specs(self.spec)}

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Applies the layer to `x [T, H]`, tokens sharded over `(*data_axes, axis_name)`."""
        return moe_block(x, self.params(), self.spec)

    def update_router_bias(self, expert_counts: jax.Array, rate: float) -> None:
        """One aux-loss-free bias step from `aux["expert_counts"]` (DeepSeek-V3 uses rate 1e-3)."""
        if self.router_bias is None:
            raise ValueError("`moonep_jax.flax.MoE.update_router_bias`: the layer was built with "
                             "`router_bias=False`; build it with `router_bias=True`.")
        self.router_bias[...] = update_bias(self.router_bias[...], expert_counts, rate)

"""The routed MoE block that `moonep_jax.flax` and `moonep_jax.equinox` share, on global arrays.

`MoESpec` (static description), `init_params` / `param_specs` (the parameters and their
shardings) and `moe_block`: router + optional shared expert + `moonep_jax.moe_ffn` inside one
`jax.shard_map` over the mesh. The modules only hold the parameters and call `moe_block`. Like
the router (`moonep_jax.router`), it imports neither Flax nor Equinox.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from moonep_jax.config import EPConfig
from moonep_jax.layer import moe_ffn
from moonep_jax.plan import plan as make_plan
from moonep_jax.router import ScoreFn, check_score_fn, route
from moonep_jax.routing import expert_counts, maxvio


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """Static description of one routed MoE block; hashable, so modules keep it as static data.

    Args:
      num_experts: E, routed experts, `E % R == 0`.
      top_k: K, experts per token.
      hidden: H, model hidden size.
      ffn_hidden: F, intermediate size of each routed expert.
      mesh: the device mesh; must have `axis_name` and every name in `data_axes`.
      axis_name: the EP mesh axis; experts are sharded over it.
      data_axes: further mesh axes the tokens are sharded over (data parallelism), outermost
        first. Tokens are sharded over `(*data_axes, axis_name)`; each `data_axes` coordinate is
        an independent EP group holding a full copy of the experts.
      shared_ffn_hidden: intermediate size of the shared expert (a dense SwiGLU FFN on every
        token), or None for no shared expert.
      score_fn: router scores, "softmax" or "sigmoid".
      renormalize: renormalise the K selected weights to sum to 1.
      router_bias: keep a DeepSeek-V3 aux-loss-free selection bias `[E]`.
      prefetch_slots, token_padding, implementation: passed to `EPConfig`.
    """

    num_experts: int
    top_k: int
    hidden: int
    ffn_hidden: int
    mesh: jax.sharding.Mesh
    axis_name: str = "ep"
    data_axes: tuple[str, ...] = ()
    shared_ffn_hidden: int | None = None
    score_fn: ScoreFn = "softmax"
    renormalize: bool = True
    router_bias: bool = False
    prefetch_slots: int | None = None
    token_padding: int = 1
    implementation: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "data_axes", tuple(self.data_axes))
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(f"`moonep_jax.MoE`: `mesh` must be a jax.sharding.Mesh; "
                            f"got {type(self.mesh).__name__}.")
        names = self.mesh.axis_names
        for axis in self.token_axes:
            if axis not in names:
                raise ValueError(f"`moonep_jax.MoE`: mesh axis {axis!r} (from `axis_name` / "
                                 f"`data_axes`) is not in the mesh axes {names}.")
        if len(set(self.token_axes)) != len(self.token_axes):
            raise ValueError(f"`moonep_jax.MoE`: `data_axes` must be distinct and must not contain "
                             f"`axis_name`; got data_axes={self.data_axes}, "
                             f"axis_name={self.axis_name!r}.")
        if self.shared_ffn_hidden is not None and self.shared_ffn_hidden < 1:
            raise ValueError(f"`moonep_jax.MoE`: `shared_ffn_hidden` must be None or >= 1; "
                             f"got {self.shared_ffn_hidden}.")
        check_score_fn(self.score_fn, "moonep_jax.MoE")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"`moonep_jax.MoE`: `top_k` must satisfy 1 <= K <= E = "
                             f"{self.num_experts}; got K={self.top_k}.")
        self.ep_config(self.num_token_shards)  # checks E % R, B, tp with one token per rank

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes the tokens are sharded over, outermost first."""
        return (*self.data_axes, self.axis_name)

    @property
    def num_token_shards(self) -> int:
        """Number of token shards = product of the `token_axes` sizes."""
        return math.prod(self.mesh.shape[a] for a in self.token_axes)

    def ep_config(self, num_tokens: int) -> EPConfig:
        """The per-rank `EPConfig` for a global batch of `num_tokens` tokens."""
        return EPConfig(
            num_experts=self.num_experts, top_k=self.top_k,
            tokens_per_rank=num_tokens // self.num_token_shards, hidden=self.hidden,
            ffn_hidden=self.ffn_hidden, num_ranks=self.mesh.shape[self.axis_name],
            prefetch_slots=self.prefetch_slots, token_padding=self.token_padding,
            axis_name=self.axis_name, implementation=self.implementation)


def param_specs(spec: MoESpec) -> dict[str, P]:
    """`PartitionSpec` of every block parameter: experts over the EP axis, the rest replicated."""
    specs = {"router_w": P(None, None),
             "w_gate_up": P(spec.axis_name, None, None),
             "w_down": P(spec.axis_name, None, None)}
    if spec.router_bias:
        specs["router_bias"] = P(None)
    if spec.shared_ffn_hidden is not None:
        specs["shared_w_gate_up"] = P(None, None)
        specs["shared_w_down"] = P(None, None)
    return specs


def init_params(key: jax.Array, spec: MoESpec, dtype=jnp.float32) -> dict[str, jax.Array]:
    """Fresh parameters of the block (global arrays, not yet placed).

    Weights use fan-in scaled truncated normals; the router bias starts at zero.

    Returns:
      A dict with `router_w [H, E]`, `w_gate_up [E, H, 2F]`, `w_down [E, F, H]`, and when enabled
      `router_bias [E]`, `shared_w_gate_up [H, 2Fs]`, `shared_w_down [Fs, H]`.
    """
    H, E, F = spec.hidden, spec.num_experts, spec.ffn_hidden
    dense = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    stacked = jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
    keys = jax.random.split(key, 5)
    params = {"router_w": dense(keys[0], (H, E), dtype),
              "w_gate_up": stacked(keys[1], (E, H, 2 * F), dtype),
              "w_down": stacked(keys[2], (E, F, H), dtype)}
    if spec.router_bias:
        params["router_bias"] = jnp.zeros((E,), dtype)
    if spec.shared_ffn_hidden is not None:
        Fs = spec.shared_ffn_hidden
        params["shared_w_gate_up"] = dense(keys[3], (H, 2 * Fs), dtype)
        params["shared_w_down"] = dense(keys[4], (Fs, H), dtype)
    return params


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Dense SwiGLU FFN, `silu(x W_gate) * (x W_up) W_down`, with fp32 accumulation."""
    ffn = w_down.shape[0]
    h = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(h[:, :ffn]) * h[:, ffn:]).astype(x.dtype)
    return jnp.dot(h, w_down, preferred_element_type=jnp.float32).astype(x.dtype)


def _check_tokens(x: jax.Array, spec: MoESpec) -> None:
    shards = spec.num_token_shards
    if x.ndim != 2 or x.shape[1] != spec.hidden:
        raise ValueError(f"`moonep_jax.MoE`: `x` must have shape [T, H] = [T, {spec.hidden}]; "
                         f"got {list(x.shape)}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`moonep_jax.MoE`: `x` must be floating; got {x.dtype}.")
    if x.shape[0] % shards or x.shape[0] == 0:
        raise ValueError(f"`moonep_jax.MoE`: the token count T must be a positive multiple of the "
                         f"{shards} token shards over mesh axes {spec.token_axes}; "
                         f"got T={x.shape[0]}.")


def moe_block(x: jax.Array, params: Mapping[str, jax.Array],
              spec: MoESpec) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routed MoE block on global tokens: router, `moe_ffn`, shared expert, router statistics.

    Runs one `jax.shard_map` over `spec.mesh`; each token shard routes its own tokens with the
    replicated router and calls `moonep_jax.moe_ffn` with its EP rank's experts. Differentiable in
    `x` and every parameter except `router_bias` (reverse mode only). The shard_mapped core is
    jitted once per static configuration and cached, so eager calls cost one compilation, not one
    per call; under an outer `jax.jit` it is inlined as usual.

    Args:
      x: `[T, H]` global tokens, sharded (or to be sharded) over `spec.token_axes`.
      params: the arrays of `init_params` (same keys), experts sharded over `spec.axis_name`.
      spec: the static block description.

    Returns:
      `y [T, H]` (x's dtype, sharded like x) and `aux`, a dict of router statistics:
      `expert_counts [E] int32` (routed entries per expert over the whole batch), `maxvio []
      float32` (`max_e(T_e / mean) - 1`), `recv_slots [num_token_shards] int32`, the rows each
      rank received in the plan (rows with `recv_src >= 0`; ranks ordered like the token shards),
      and `num_invalid_ids [] int32`, the routed entries of the whole batch whose expert id is
      outside `[-1, E)` (dropped; see `moonep_jax.Plan.num_invalid_ids`). MoonEP's invariant
      makes every entry of `recv_slots` equal `S*K` (the router drops nothing), and the router
      never picks an invalid id, so `num_invalid_ids` is 0 unless the routing is broken.

    Raises:
      TypeError: under forward-mode autodiff (`jax.jvp`, `jax.jacfwd`), which is not supported.
    """
    _check_tokens(x, spec)
    cfg = spec.ep_config(x.shape[0])
    expected = param_specs(spec)
    if set(params) != set(expected):
        raise ValueError(f"`moonep_jax.MoE`: `params` must have the keys {sorted(expected)}; "
                         f"got {sorted(params)}.")
    block = _sharded_block(spec, cfg)
    try:
        y, counts, recv_slots, num_invalid_ids = block(x, dict(params))
    except TypeError as e:
        if "forward-mode autodiff" not in str(e):
            raise
        raise TypeError(_NO_FORWARD_MODE) from e
    aux = {"expert_counts": counts, "maxvio": maxvio(counts), "recv_slots": recv_slots,
           "num_invalid_ids": num_invalid_ids}
    return y, aux


_NO_FORWARD_MODE = (
    "`moonep_jax.MoE`: forward-mode autodiff (`jax.jvp`, `jax.jacfwd`, `jax.linearize`) is not "
    "supported: `moonep_jax.moe_ffn` and its ops define reverse-mode rules only "
    "(`jax.custom_vjp`). Use `jax.grad`, `jax.vjp` or `jax.jacrev`.")


# A few configurations per process (one per layer shape and mesh); each entry holds one jitted
# function and its compiled executables.
@functools.lru_cache(maxsize=64)
def _sharded_block(spec: MoESpec, cfg: EPConfig):
    """`jit(shard_map(per_shard))` of one static configuration: `(x, params) -> (y, counts,
    recv_slots, num_invalid_ids)`.

    Eagerly, an un-jitted `shard_map` runs its body op by op, compiling hundreds of small XLA
    programs on every call; one cached `jax.jit` compiles the block once per input shape.
    """
    tokens = P(spec.token_axes, None)

    def per_shard(x, params):
        logits = jnp.dot(x.astype(jnp.float32), params["router_w"].astype(jnp.float32))
        topk_idx, topk_w = route(logits, spec.top_k, score_fn=spec.score_fn,
                                 bias=params.get("router_bias"), renormalize=spec.renormalize)
        experts = {"w_gate_up": params["w_gate_up"].astype(x.dtype),
                   "w_down": params["w_down"].astype(x.dtype)}
        # One plan for the layer and the aux it reports (recv_slots is measured from the plan,
        # not assumed: it is the number the layer's shapes rely on).
        plan = make_plan(topk_idx, cfg)
        y = moe_ffn(x, topk_idx, topk_w, experts, cfg, plan=plan)
        if spec.shared_ffn_hidden is not None:
            y = y + swiglu(x, params["shared_w_gate_up"].astype(x.dtype),
                           params["shared_w_down"].astype(x.dtype))
        counts = jax.lax.psum(expert_counts(topk_idx, spec.num_experts), spec.token_axes)
        recv_slots = jnp.sum(plan.recv_src >= 0, dtype=jnp.int32)
        num_invalid_ids = jax.lax.psum(plan.num_invalid_ids[0], spec.token_axes)
        return y, counts, recv_slots.reshape(1), num_invalid_ids

    specs = param_specs(spec)
    sharded = jax.shard_map(per_shard, mesh=spec.mesh, in_specs=(tokens, specs),
                            out_specs=(tokens, P(), P(spec.token_axes), P()))
    if not all(t == AxisType.Explicit for t in spec.mesh.axis_types):
        return jax.jit(sharded)  # Auto axes: jit and shard_map place the inputs themselves

    def placed(x, params):
        # Explicit axes: shard_map requires its inputs to carry the in_specs already, so an
        # unsharded x (or parameter) is resharded first; a no-op for correctly placed inputs.
        def to(spec_of, value):
            return jax.sharding.reshard(value, NamedSharding(spec.mesh, spec_of))

        return sharded(to(tokens, x), {name: to(specs[name], value)
                                       for name, value in params.items()})

    return jax.jit(placed)

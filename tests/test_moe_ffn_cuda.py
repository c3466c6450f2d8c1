"""`moe_ffn` with implementation="cuda" against "xla" and an fp32 dense reference, on 1 and 2 GPUs.

bf16 activations and weights (the CuTe grouped GEMM takes bf16 only). On the same inputs:
- the CUDA planner's plan and the CUDA dispatch's received rows equal the xla ones bit for bit;
- the layer's output and its gradients w.r.t. `x`, `topk_w`, `w_gate_up` and `w_down` (of
  `sum(out * d_out)` for a fixed random cotangent) are within `||a - b|| / ||b|| < 1e-2` of the
  fp32 dense reference and of the xla path;
at maxvio 0, 1 and 20 with 10% of the entries dropped (-1), for training (B = epn) and for
inference with overflow experts (B = 1 < epn: foreign groups read their weights from the peer).
The backward prefetches the replica weights again instead of keeping them as residuals.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moonep_jax
from moonep_jax import routing
from moonep_jax.dispatch import dispatch
from moonep_jax.layer import moe_ffn
from moonep_jax.plan import plan

pytestmark = pytest.mark.gpu

# E / K = 32 > 21, so maxvio 20 is reachable with K distinct experts per token.
S, K, E, H, F = 128, 4, 128, 256, 128
BOUND = 1e-2
IMPLS = ("cuda", "xla")


def _config(R: int, impl: str, B: int | None) -> moonep_jax.EPConfig:
    return moonep_jax.EPConfig(num_experts=E, top_k=K, tokens_per_rank=S, hidden=H, ffn_hidden=F,
                               num_ranks=R, prefetch_slots=B, implementation=impl)


@pytest.fixture(params=[1, 2], ids=["R1", "R2"])
def mesh(request, mesh_factory):
    from moonep_jax._cuda import transport

    mesh = mesh_factory(request.param)
    transport.bootstrap(mesh, "ep")
    return mesh


def _routing(key, R: int, maxvio: float) -> jax.Array:
    """`[R, S, K]` ids: exactly balanced round-robin for maxvio 0 (random routings of this size
    have a noise floor near 1), else log-normal popularity tuned to `maxvio`."""
    if maxvio == 0:
        flat = np.arange(R * S * K).reshape(R, S, K)
        return jnp.asarray(flat % E, jnp.int32)  # E % K == 0: K distinct ids per token
    return routing.lognormal_for_maxvio(key, R, S, K, E, maxvio)[0]


def _inputs(seed: int, R: int, maxvio: float | None, rank0_ratio: float | None = None):
    """Global `(x, topk_idx, topk_w, w_gate_up, w_down, d_out)`; bf16 except ids and weights.

    With `rank0_ratio`, each of rank 0's experts is that many times as likely as any other
    (`routing.rank_skew`) instead of a maxvio target."""
    key = jax.random.key(seed)
    if rank0_ratio is None:
        topk_idx = _routing(key, R, maxvio)
    else:
        topk_idx = routing.rank_skew(key, R, S, K, E, rank0_ratio)
    topk_idx = routing.with_dropped(jax.random.fold_in(key, 1), topk_idx, 0.1)
    rng = np.random.default_rng(seed)
    bf16 = lambda shape, scale=1.0: jnp.asarray(  # noqa: E731
        rng.standard_normal(shape) * scale, jnp.bfloat16)
    return (bf16((R * S, H)), np.asarray(topk_idx).reshape(R * S, K),
            rng.random((R * S, K), np.float32), bf16((E, H, 2 * F), H ** -0.5),
            bf16((E, F, H), F ** -0.5), bf16((R * S, H)))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


# ---- the layers ---------------------------------------------------------------------------------


def _dense_moe(x, topk_idx, topk_w, w_gate_up, w_down):
    """fp32 reference without EP: every (token, k) entry through its expert's SwiGLU directly."""
    hi = jax.lax.Precision.HIGHEST
    out = jnp.zeros(x.shape, jnp.float32)
    for k in range(K):
        valid, expert = topk_idx[:, k] >= 0, jnp.maximum(topk_idx[:, k], 0)
        h = jnp.einsum("th,thf->tf", x, w_gate_up[expert], precision=hi)
        act = jax.nn.silu(h[:, :F]) * h[:, F:]
        y = jnp.einsum("tf,tfh->th", act, w_down[expert], precision=hi)
        out = out + jnp.where(valid[:, None], topk_w[:, k:k + 1] * y, 0.0)
    return out


def _ep_moe(cfg, mesh):
    def per_rank(x, topk_idx, topk_w, w_gate_up, w_down):
        return moe_ffn(x, topk_idx, topk_w, {"w_gate_up": w_gate_up, "w_down": w_down}, cfg)

    return jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))


def _with_grads(layer):
    """`(out, (d x, d topk_w, d w_gate_up, d w_down))` of `sum(out * d_out)` in fp32."""
    def run(x, topk_idx, topk_w, w_gate_up, w_down, d_out):
        def loss(x, topk_w, w_gate_up, w_down):
            out = layer(x, topk_idx, topk_w, w_gate_up, w_down)
            return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

        grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, topk_w, w_gate_up,
                                                                        w_down)
        return out, grads

    return run


@functools.cache
def _layer_fn(mesh, B: int | None, impl: str, train: bool):
    layer = _ep_moe(_config(mesh.shape["ep"], impl, B), mesh)
    if train:
        return jax.jit(_with_grads(layer))
    return jax.jit(lambda *args: layer(*args[:5]))


@functools.cache
def _reference_fn(train: bool):
    def reference(x, topk_idx, topk_w, w_gate_up, w_down, *rest):
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        return _dense_moe(f32(x), topk_idx, topk_w, f32(w_gate_up), f32(w_down))

    if not train:
        return jax.jit(reference)

    def with_grads(x, topk_idx, topk_w, w_gate_up, w_down, d_out):
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        return _with_grads(_dense_moe)(f32(x), topk_idx, topk_w, f32(w_gate_up), f32(w_down),
                                       f32(d_out))

    return jax.jit(with_grads)


@functools.cache
def _plans_and_rows_fn(mesh, B: int | None):
    """Both implementations' plans, and both dispatches of the xla plan, stacked over ranks."""
    R = mesh.shape["ep"]
    cfgs = {impl: _config(R, impl, B) for impl in IMPLS}

    def per_rank(x, topk_idx, topk_w):
        plans = {impl: plan(topk_idx, cfg) for impl, cfg in cfgs.items()}
        rows = {impl: dispatch(x, topk_w, plans["xla"], cfg) for impl, cfg in cfgs.items()}
        return jax.tree.map(lambda leaf: leaf[None], (plans, rows))

    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


# ---- tests --------------------------------------------------------------------------------------


def _assert_plans_and_rows_bitwise(mesh, B, args):
    plans, rows = jax.tree.map(np.asarray, _plans_and_rows_fn(mesh, B)(*args[:3]))
    for field in ("dst", "cu_seqlens", "zero_fill", "experts_to_copy", "recv_src", "recv_primary"):
        assert np.array_equal(getattr(plans["cuda"], field), getattr(plans["xla"], field)), field
    for name, cuda, xla in zip(("recv_x", "recv_w"), rows["cuda"], rows["xla"]):
        assert np.array_equal(cuda.view(np.uint8), xla.view(np.uint8)), name
    return plans["xla"]


@pytest.mark.parametrize("maxvio", [0.0, 1.0, 20.0])
def test_training_matches_xla_and_fp32_reference(mesh, seed, maxvio):
    """B = epn: forward and all four gradients."""
    args = _inputs(seed, mesh.shape["ep"], maxvio)
    _assert_plans_and_rows_bitwise(mesh, None, args)
    out, grads = _layer_fn(mesh, None, "cuda", True)(*args)
    xla_out, xla_grads = _layer_fn(mesh, None, "xla", True)(*args)
    ref_out, ref_grads = _reference_fn(True)(*args)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, ref_out) < BOUND and _rel(out, xla_out) < BOUND
    names = ("x", "topk_w", "w_gate_up", "w_down")
    for name, grad, xla_grad, ref_grad in zip(names, grads, xla_grads, ref_grads):
        assert grad.shape == ref_grad.shape, name
        assert _rel(grad, ref_grad) < BOUND, (name, _rel(grad, ref_grad))
        assert _rel(grad, xla_grad) < BOUND, (name, _rel(grad, xla_grad))
    d_topk_w = np.asarray(grads[1])
    assert (d_topk_w[args[1] < 0] == 0).all(), "dropped entries must get zero gradient"
    assert (d_topk_w[args[1] >= 0] != 0).mean() > 0.9


@pytest.mark.parametrize("skew", ["maxvio20", "rank0_hot"])
def test_inference_with_overflow_matches_xla_and_fp32_reference(mesh, seed, skew):
    """B = 1 < epn: remote experts beyond the first stay in their global rows, and the grouped
    GEMM reads their weights in place from the home rank. With rank 0's experts 16x as hot, rank
    1 takes over half of rank 0's entries, split over many experts: overflow groups for sure."""
    R, B = mesh.shape["ep"], 1
    args = (_inputs(seed, R, 20.0) if skew == "maxvio20"
            else _inputs(seed, R, None, rank0_ratio=16.0))
    p = _assert_plans_and_rows_bitwise(mesh, B, args)
    epn = E // R
    rows = np.diff(p.cu_seqlens, prepend=0, axis=1)[:, :E]  # [R, E] rows of every global group
    foreign = np.ones((R, E), bool)
    for r in range(R):
        foreign[r, r * epn:(r + 1) * epn] = False
    if R > 1 and skew == "rank0_hot":
        assert (rows[foreign] > 0).sum() >= 2, "the skewed routing must produce overflow groups"
    out = _layer_fn(mesh, B, "cuda", False)(*args)
    xla_out = _layer_fn(mesh, B, "xla", False)(*args)
    ref_out = _reference_fn(False)(*args)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, ref_out) < BOUND, _rel(out, ref_out)
    assert _rel(out, xla_out) < BOUND, _rel(out, xla_out)
    # Same call again: the barriers and mailboxes of the overflow rendezvous are reusable.
    again = _layer_fn(mesh, B, "cuda", False)(*args)
    assert np.array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))


def test_backward_prefetches_again_instead_of_saving_slots(mesh, seed):
    """One prefetch of both projections (gate_up, down) in the forward, and one per projection in
    the backward, both in the program jax emits and after XLA's optimisations (no CSE into a
    saved residual), and two reduce_grads. With R = 1 no slot can be used: no prefetch, no
    reduce_grad at all."""
    R = mesh.shape["ep"]
    per_call = 1 if R > 1 else 0
    args = _inputs(seed, R, 1.0)
    lowered = _layer_fn(mesh, None, "cuda", True).lower(*args)
    assert lowered.as_text().count("@moonep_prefetch") == 3 * per_call
    compiled = lowered.compile().as_text()
    assert compiled.count('custom_call_target="moonep_prefetch"') == 3 * per_call
    assert compiled.count('custom_call_target="moonep_reduce_grad"') == 2 * per_call
    assert compiled.count('custom_call_target="moonep_grouped_matmul_dw"') == 2
    forward_only = _layer_fn(mesh, None, "cuda", False).lower(*args).as_text()
    assert forward_only.count("@moonep_prefetch") == per_call


def test_training_step_with_command_buffers_bitwise_equal_to_without(mesh, seed):
    """The grouped GEMM handlers are kCmdBufferCompatible like every other moonep target, so XLA
    may trace them into command buffers (CUDA graphs): the step compiled with command buffers
    enabled for custom calls (and graphs of any size) runs, replays, and is bitwise equal to the
    step compiled without them. (XLA 0.11 forms command buffers from thunks, so the compiled HLO
    does not show them; tests/test_grouped_matmul_cuda.py captures the launchers directly.)"""
    args = _inputs(seed, mesh.shape["ep"], 1.0)
    lowered = _layer_fn(mesh, None, "cuda", True).lower(*args)
    captured = lowered.compile(compiler_options={
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL",
        "xla_gpu_graph_min_graph_size": 1})
    uncaptured = lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
    reference = jax.tree.leaves(uncaptured(*args))
    for _ in range(3):  # replays of the captured graphs, not just their first recording
        out = jax.tree.leaves(captured(*args))
        for a, b in zip(out, reference):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))

"""The CUDA path's custom calls name targets the extension registers (checked on any machine: the
layer is lowered for CUDA without a GPU, so a renamed target cannot break only on the GPU)."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import moonep_jax
from moonep_jax import _ffi, _impl
from moonep_jax._cuda import transport

pytestmark = pytest.mark.skipif(not _ffi.available(), reason="the CUDA extension is not built")

R, S, K, E, H, F = 2, 16, 2, 8, 64, 32


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lets the CUDA ops trace on CPU devices: a GPU backend and a bootstrapped mesh pretended."""
    monkeypatch.setattr(_impl, "jax", types.SimpleNamespace(default_backend=lambda: "gpu"))
    monkeypatch.setattr(transport, "mesh_devices", lambda cfg: np.arange(R, dtype=np.int32))
    return Mesh(np.array(jax.devices()[:R]), ("ep",))


def _lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _targets(fn, *args) -> set[str]:
    text = _lowered(fn, *args)
    return set(re.findall(r"custom_call @(\w+)", text)) | set(
        re.findall(r'call_target_name = "(\w+)"', text))


def _config(B=None):
    return moonep_jax.EPConfig(num_experts=E, top_k=K, tokens_per_rank=S, hidden=H, ffn_hidden=F,
                               num_ranks=R, prefetch_slots=B, implementation="cuda",
                               cuda=moonep_jax.CudaOptions(num_sms=4))


def _layer(mesh, B):
    cfg = _config(B)

    def layer(x, topk_idx, topk_w, w_gate_up, w_down):
        return jax.shard_map(
            lambda x, i, w, a, b: moonep_jax.moe_ffn(x, i, w, {"w_gate_up": a, "w_down": b}, cfg),
            mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, topk_idx, topk_w, w_gate_up, w_down)

    args = (jnp.zeros((R * S, H), jnp.bfloat16), jnp.zeros((R * S, K), jnp.int32),
            jnp.zeros((R * S, K)), jnp.zeros((E, H, 2 * F), jnp.bfloat16),
            jnp.zeros((E, F, H), jnp.bfloat16))
    return layer, args


def test_training_step_calls_only_registered_targets(cuda_lowering):
    layer, args = _layer(cuda_lowering, None)
    step = jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32)), argnums=(0, 2, 3, 4))
    targets = _targets(step, *args)
    registered = set(_ffi.lib().registrations())
    # Every target takes part in the layer and its backward at R > 1, except the histogram.
    assert targets == registered - {"moonep_tokens_per_expert"}, (targets, registered)


def test_inference_with_overflow_calls_only_registered_targets(cuda_lowering):
    layer, args = _layer(cuda_lowering, 2)  # B < epn: overflow groups
    targets = _targets(layer, *args)
    assert targets <= set(_ffi.lib().registrations()), targets
    assert "moonep_reduce_grad" not in targets and "moonep_plan" in targets


def _prefetch_calls(text: str) -> list[str]:
    """The operand lists of every moonep_prefetch custom call in lowered StableHLO."""
    return re.findall(r"custom_call @moonep_prefetch\(([^)]*)\)", text)


def test_layer_forward_prefetches_both_projections_in_one_call(cuda_lowering):
    """moe_ffn's forward: one moonep_prefetch (one rendezvous, one copy kernel) whose operands
    are experts_to_copy and both weight arrays; the backward adds one call per projection."""
    layer, args = _layer(cuda_lowering, None)
    forward = _prefetch_calls(_lowered(layer, *args))
    assert len(forward) == 1 and len(forward[0].split(",")) == 3, forward
    step = jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32)), argnums=(0, 2, 3, 4))
    calls = _prefetch_calls(_lowered(step, *args))
    assert sorted(len(c.split(",")) for c in calls) == [2, 2, 3], calls


def test_prefetch_refuses_more_weight_arrays_than_its_mailbox_slots(cuda_lowering):
    from moonep_jax._cuda import ops as cuda_ops

    cfg, max_weights = _config(), _ffi.lib().MAX_PREFETCH_WEIGHTS

    def prefetch_all(topk_idx, w):
        p = moonep_jax.plan(topk_idx, cfg)
        return cuda_ops.prefetch((w,) * (max_weights + 1), p, cfg)[0]

    prefetch_all = jax.shard_map(prefetch_all, mesh=cuda_lowering, in_specs=P("ep"),
                                 out_specs=P("ep"))
    with pytest.raises(ValueError, match=f"takes 1 to {max_weights} weight arrays per call; "
                                         f"got {max_weights + 1}"):
        _lowered(prefetch_all, jnp.zeros((R * S, K), jnp.int32), jnp.zeros((E, 2, 8), jnp.bfloat16))

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


def _targets(fn, *args) -> set[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return set(re.findall(r"custom_call @(\w+)", text)) | set(
        re.findall(r'call_target_name = "(\w+)"', text))


def _layer(mesh, B):
    cfg = moonep_jax.EPConfig(num_experts=E, top_k=K, tokens_per_rank=S, hidden=H, ffn_hidden=F,
                              num_ranks=R, prefetch_slots=B, implementation="cuda",
                              cuda=moonep_jax.CudaOptions(num_sms=4))

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

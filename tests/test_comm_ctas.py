"""`CudaOptions.num_sms`: the CTAs the communication kernels get, chosen when an op is traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import moonep_jax
from moonep_jax._cuda import transport


def _registered_mesh(monkeypatch, sm_counts):
    """A 4-device mesh registered as if bootstrapped, its devices reporting `sm_counts`."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    table = np.array([[d.id for d in mesh.devices.flat]], np.int32)  # CPUs: no device_table
    monkeypatch.setitem(transport._registered, (transport._shape_of(mesh), "ep"),
                        {table.tobytes(): table})
    monkeypatch.setattr(transport, "_sm_counts",
                        dict(zip((d.id for d in mesh.devices.flat), sm_counts)))
    return mesh


def _traced_ctas(mesh, num_sms):
    cfg = moonep_jax.EPConfig(num_experts=8, top_k=2, tokens_per_rank=4, hidden=8, ffn_hidden=8,
                              num_ranks=4, cuda=moonep_jax.CudaOptions(num_sms=num_sms))
    seen = []

    def body(x):
        seen.append(transport.comm_ctas(cfg, transport.mesh_devices(cfg)))
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(
        jnp.zeros(4))
    return seen[0]


def test_default_is_one_cta_per_sm_of_the_fewest_sm_device(monkeypatch):
    counts = [int(c) for c in np.random.default_rng().integers(60, 200, size=4)]
    mesh = _registered_mesh(monkeypatch, counts)
    assert _traced_ctas(mesh, None) == min(counts)
    assert _traced_ctas(mesh, 7) == 7


def test_unknown_sm_count_asks_for_an_explicit_num_sms(monkeypatch):
    mesh = _registered_mesh(monkeypatch, [132, None, 132, 132])
    with pytest.raises(RuntimeError, match=r"set `CudaOptions\(num_sms=...\)`"):
        _traced_ctas(mesh, None)
    assert _traced_ctas(mesh, 16) == 16

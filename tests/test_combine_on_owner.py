"""`CudaOptions.combine_on_owner`: where combine's first stage runs, chosen when the op is traced
(the staging result of the lowered `moonep_combine` call has a slot per other rank, or none)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import moonep_jax
from moonep_jax._cuda import comm, transport

R, S, K, H = 4, 6, 2, 16


def _registered_mesh(monkeypatch, on_one_gpu: list[bool | None]):
    """A mesh of len(on_one_gpu) EP groups of 4 CPU devices, registered as if bootstrapped, each
    group found on one GPU or not by bootstrap (None: a group of other processes, unseen)."""
    devices = np.array(jax.devices()[:R * len(on_one_gpu)]).reshape(len(on_one_gpu), R)
    mesh = Mesh(devices, ("data", "ep"))
    table = np.array([[d.id for d in row] for row in devices], np.int32)  # CPUs: no device_table
    monkeypatch.setitem(transport._registered, (transport._shape_of(mesh), "ep"),
                        {table.tobytes(): table})
    monkeypatch.setattr(transport, "_sm_counts", {int(i): 132 for i in table.flat})
    monkeypatch.setattr(transport, "_on_one_gpu", {
        tuple(int(i) for i in row): one for row, one in zip(table, on_one_gpu) if one is not None})
    return mesh


def _staging_slots(mesh, combine_on_owner: bool | None) -> int:
    """The slots of the staging result of `moonep_combine` as the CUDA combine lowers."""
    cfg = moonep_jax.EPConfig(num_experts=8, top_k=K, tokens_per_rank=S, hidden=H, ffn_hidden=8,
                              num_ranks=R, implementation="cuda",
                              cuda=moonep_jax.CudaOptions(combine_on_owner=combine_on_owner))
    groups = mesh.devices.shape[0]
    topk_idx = jnp.zeros((groups * R * S, K), jnp.int32)
    y = jnp.zeros((groups * R * cfg.nvs, H), jnp.bfloat16)

    def body(topk_idx, y):
        plan = moonep_jax.plan(topk_idx, dataclasses.replace(cfg, implementation="xla"))
        return comm.combine(y, plan, cfg)

    spec = P(("data", "ep"))
    text = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).lower(
        topk_idx, y).as_text()
    call = next(line for line in text.splitlines() if "moonep_combine" in line)
    results = re.findall(r"tensor<([0-9x]+)xbf16>", call.split("->")[-1])
    assert len(results) == 2 and results[0] == f"{S}x{H}", call  # out, staging
    rows, slots, hidden = map(int, results[1].split("x"))
    assert (rows, hidden) == (S, H), call
    return slots


@pytest.mark.parametrize("combine_on_owner", [None, True, False])
def test_ranks_on_one_gpu_read_in_place_by_default(monkeypatch, combine_on_owner):
    mesh = _registered_mesh(monkeypatch, [True])
    expected = min(R - 1, K // 2) if combine_on_owner else 0
    assert _staging_slots(mesh, combine_on_owner) == expected


@pytest.mark.parametrize("on_one_gpu", [[False], [None], [True, None]])
def test_ranks_on_several_gpus_sum_on_the_owner_by_default(monkeypatch, on_one_gpu):
    """Separate GPUs, or nothing known of the groups: the owners sum (fewest bytes over links);
    a group this process did not bootstrap does not count."""
    mesh = _registered_mesh(monkeypatch, on_one_gpu)
    expected = 0 if on_one_gpu[0] else min(R - 1, K // 2)
    assert _staging_slots(mesh, None) == expected
    assert _staging_slots(mesh, False) == 0


def test_groups_that_disagree_ask_for_an_explicit_choice(monkeypatch):
    mesh = _registered_mesh(monkeypatch, [True, False])
    with pytest.raises(ValueError, match=r"set `CudaOptions\(combine_on_owner=True\)`"):
        _staging_slots(mesh, None)
    assert _staging_slots(mesh, True) == min(R - 1, K // 2)


@pytest.mark.parametrize("bad", [1, 0, "yes"])
def test_combine_on_owner_must_be_none_or_a_bool(bad):
    with pytest.raises(ValueError, match=r"`CudaOptions.combine_on_owner` must be None"):
        moonep_jax.CudaOptions(combine_on_owner=bad)

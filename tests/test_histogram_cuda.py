"""The tokens_per_expert FFI handler against jnp, on every local GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.gpu


def _reference_counts(topk_idx, num_experts):
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    return jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, topk_idx, 0)].add(
        valid.astype(jnp.int32))


@pytest.mark.parametrize("num_experts", [8, 384, 20000])
def test_histogram_matches_jnp_per_rank(mesh_factory, seed, num_experts):
    from moonep_jax._cuda.histogram import tokens_per_expert

    num_ranks = len(jax.devices())
    mesh = mesh_factory(num_ranks)
    rng = np.random.default_rng(seed)
    S, K = 1000, 8
    topk_idx = rng.integers(0, num_experts, size=(num_ranks * S, K)).astype(np.int32)
    topk_idx[rng.random(topk_idx.shape) < 0.1] = -1  # dropped entries
    topk_idx[0, 0] = num_experts + 3  # out of range: counted as invalid, never indexed
    topk_idx[1, 1] = -7

    def per_rank(idx):
        counts, invalid = tokens_per_expert(idx, num_experts)
        return counts[None], invalid, _reference_counts(idx, num_experts)[None]

    f = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"),
                              out_specs=(P("ep"), P("ep"), P("ep"))))
    counts, invalid, expected = f(jax.device_put(topk_idx, jax.NamedSharding(mesh, P("ep"))))
    counts, invalid, expected = map(np.asarray, (counts, invalid, expected))
    assert counts.shape == (num_ranks, num_experts)
    np.testing.assert_array_equal(counts, expected)
    expected_invalid = np.zeros(num_ranks, np.int32)
    expected_invalid[0] = 2  # rows 0 and 1 both live on rank 0
    np.testing.assert_array_equal(invalid, expected_invalid)

"""Routing generators: determinism, distinct experts per token, skew targets, drop/duplicate passes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moonep_jax import routing


def _distinct_within_tokens(topk_idx) -> bool:
    topk_idx = np.asarray(topk_idx)
    ordered = np.sort(topk_idx, axis=-1)
    return bool((ordered[..., 1:] != ordered[..., :-1]).all())


GENERATORS = {
    "uniform": lambda key, R: routing.uniform(key, R, 64, 4, 16),
    "lognormal": lambda key, R: routing.lognormal(key, R, 64, 4, 16, 1.5),
    "rank_skew": lambda key, R: routing.rank_skew(key, R, 64, 4, 16, 6.0),
}


@pytest.mark.parametrize("name", GENERATORS)
def test_generators_are_deterministic_in_the_seed(name, seed):
    generate = GENERATORS[name]
    first = np.asarray(generate(seed, 4))
    assert first.shape == (4, 64, 4) and first.dtype == np.int32
    assert ((first >= 0) & (first < 16)).all()
    assert _distinct_within_tokens(first)
    assert np.array_equal(first, np.asarray(generate(jax.random.key(seed), 4)))
    assert not np.array_equal(first, np.asarray(generate(seed + 1, 4)))


@pytest.mark.parametrize("name", ["uniform", "lognormal"])
def test_a_ranks_tokens_do_not_depend_on_the_rank_count(name, seed):
    generate = GENERATORS[name]
    assert np.array_equal(np.asarray(generate(seed, 2)), np.asarray(generate(seed, 4))[:2])


def test_maxvio_of_known_counts():
    assert float(routing.maxvio(np.array([2, 2, 2, 2]))) == 0.0
    assert float(routing.maxvio(np.array([4, 0, 0, 0]))) == 3.0
    assert float(routing.maxvio(np.array([3, 1]))) == 0.5
    # [R, E] counts are summed over ranks first: each rank is skewed, the total is balanced.
    assert float(routing.maxvio(np.array([[2, 0], [0, 2]]))) == 0.0
    with pytest.raises(ValueError, match=r"`counts` must have shape \[E\] or \[R, E\]"):
        routing.maxvio(np.zeros((2, 2, 2)))


def test_expert_counts_ignore_dropped_entries():
    topk_idx = np.array([[[0, 1], [1, -1]], [[-1, -1], [3, 1]]], np.int32)
    assert np.asarray(routing.expert_counts(topk_idx, 4)).tolist() == [1, 3, 0, 1]


MAXVIO_SHAPE = (4, 1024, 4, 32)  # R, S, K, E: 512 entries per expert on average


@pytest.mark.parametrize("target", [0.2, 1.0, 4.0])
def test_lognormal_for_maxvio_reaches_the_target(target, seed):
    R, S, K, E = MAXVIO_SHAPE
    topk_idx, sigma, realised = routing.lognormal_for_maxvio(seed, R, S, K, E, target)
    assert np.asarray(topk_idx).shape == (R, S, K)
    assert _distinct_within_tokens(topk_idx)
    assert realised == pytest.approx(float(routing.maxvio(routing.expert_counts(topk_idx, E))))
    assert abs(realised - target) <= max(0.02 * target, 0.005), (sigma, realised)
    again = routing.lognormal_for_maxvio(seed, R, S, K, E, target)
    assert np.array_equal(np.asarray(again[0]), np.asarray(topk_idx)) and again[1] == sigma


def test_lognormal_for_maxvio_floors_an_unreachable_target(seed):
    """At 512 entries per expert the sampling noise alone exceeds maxvio 0.01 (about 0.1)."""
    _, sigma, realised = routing.lognormal_for_maxvio(seed, *MAXVIO_SHAPE, 0.01)
    assert sigma == 1e-5 and realised > 0.01


def test_rank_skew_weights_rank0s_experts(seed):
    R, S, E, ratio = 4, 2048, 16, 8.0
    counts = np.asarray(routing.expert_counts(routing.rank_skew(seed, R, S, 1, E, ratio), E))
    share = counts[:E // R].sum() / counts.sum()
    epn = E // R
    assert share == pytest.approx(ratio * epn / (ratio * epn + E - epn), abs=0.03)
    even = np.asarray(routing.expert_counts(routing.rank_skew(seed, R, S, 1, E, 1.0), E))
    assert even[:epn].sum() / even.sum() == pytest.approx(1 / R, abs=0.03)
    with pytest.raises(ValueError, match="`E` must be divisible by `R`"):
        routing.rank_skew(seed, 3, S, 1, E, ratio)


def test_with_dropped_drops_exactly_the_fraction(seed):
    topk_idx = np.asarray(routing.uniform(seed, 2, 50, 4, 8))
    for fraction in (0.0, 0.37, 1.0):
        dropped = np.asarray(routing.with_dropped(seed + 1, topk_idx, fraction))
        is_dropped = dropped == -1
        assert is_dropped.sum() == round(fraction * topk_idx.size)
        assert np.array_equal(dropped[~is_dropped], topk_idx[~is_dropped])
    with pytest.raises(ValueError, match=r"`fraction` must be in \[0, 1\]"):
        routing.with_dropped(seed, topk_idx, 1.5)


def test_with_duplicates_repeats_the_first_choice(seed):
    topk_idx = np.asarray(routing.uniform(seed, 2, 50, 4, 8))  # distinct ids within each token
    repeated = np.asarray(routing.with_duplicates(seed + 1, topk_idx, 0.3))
    changed = (repeated != topk_idx).any(axis=-1)
    assert changed.sum() == round(0.3 * 100)
    assert (repeated[changed] == repeated[changed][:, :1]).all()
    assert np.array_equal(repeated[..., 0], topk_idx[..., 0])
    assert np.array_equal(repeated[~changed], topk_idx[~changed])

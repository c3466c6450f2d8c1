"""Synthetic router outputs for tests and benchmarks, and the maxvio skew metric.

Every generator is deterministic in its `key` (a `jax.random` key or an int seed), works for any
number of EP ranks `R`, and returns the global routing `topk_idx [R, S, K] int32` (rank `r`'s
tokens are `topk_idx[r]`). Tokens never repeat an expert unless a `with_duplicates` pass adds
repeats on purpose. Rank `r`'s tokens are drawn with a key folded from `r`, so a rank's routing
does not depend on how many ranks there are.

`maxvio = max_e(T_e / mean_e T_e) - 1`, with `T_e` the global count of expert `e`: 0 is perfect
balance; the benchmarks sweep 0.2, 1, 10, 20 (`moonep_algorithm.md` §11.1).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

# Bisection of `lognormal_for_maxvio` (MoonEP's `solve_sigma_for_maxvio`, moonep_algorithm.md §11.1).
_SIGMA_LO, _SIGMA_HI, _BISECTION_STEPS = 1e-5, 10.0, 60


def expert_counts(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """`[E] int32` global count of every expert in `topk_idx` (any shape); -1 entries are ignored."""
    flat = jnp.asarray(topk_idx).reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    return jnp.zeros(num_experts, jnp.int32).at[jnp.where(valid, flat, 0)].add(valid.astype(jnp.int32))


def maxvio(counts: jax.Array) -> jax.Array:
    """The skew metric `max_e(T_e / mean) - 1`.

    Args:
      counts: `[E]` global expert counts, or `[R, E]` per-rank counts (summed over ranks first).

    Returns:
      A float32 scalar; NaN when no entry is routed at all.
    """
    counts = jnp.asarray(counts, jnp.float32)
    if counts.ndim not in (1, 2):
        raise ValueError(f"`maxvio`: `counts` must have shape [E] or [R, E]; got {list(counts.shape)}.")
    total = counts.reshape(-1, counts.shape[-1]).sum(axis=0)
    return total.max() / total.mean() - 1.0


def uniform(key, R: int, S: int, K: int, E: int) -> jax.Array:
    """Every token picks K distinct experts uniformly at random (top-k of random scores).

    Returns:
      `topk_idx [R, S, K] int32`.
    """
    _check_sizes("uniform", R, S, K, E)
    return _gumbel_top_k(_as_key(key), jnp.zeros(E), R, S, K)


def lognormal(key, R: int, S: int, K: int, E: int, sigma: float) -> jax.Array:
    """MoonEP's benchmark routing: shared log-normal expert popularity.

    Expert `e` has popularity `exp(normal(0, sigma))`, shared by all ranks; each token samples K
    distinct experts with probability proportional to popularity (sequentially, without
    replacement, done as a Gumbel top-k of the log-popularity). `sigma = 0` is uniform.

    Returns:
      `topk_idx [R, S, K] int32`.
    """
    _check_sizes("lognormal", R, S, K, E)
    if not sigma >= 0:
        raise ValueError(f"`lognormal`: `sigma` must be >= 0; got {sigma!r}.")
    return _lognormal(_as_key(key), R, S, K, E, jnp.float32(sigma))


def lognormal_for_maxvio(key, R: int, S: int, K: int, E: int, target: float):
    """A `lognormal` routing whose maxvio is close to `target` (MoonEP's sigma solver).

    Geometric bisection of sigma in `[1e-5, 10]`, at most 60 steps, stopping once
    `|maxvio - target| <= max(0.02 * target, 0.005)` and otherwise keeping the closest sigma seen.
    The key is the same for every sigma, so maxvio changes smoothly with sigma. Small shapes have a
    noise floor: a target below the maxvio of sigma ~ 0 returns sigma = 1e-5 ("floored").

    Returns:
      `(topk_idx [R, S, K] int32, sigma: float, realised_maxvio: float)`.
    """
    _check_sizes("lognormal_for_maxvio", R, S, K, E)
    if not target >= 0:
        raise ValueError(f"`lognormal_for_maxvio`: `target` must be >= 0; got {target!r}.")
    key = _as_key(key)

    def maxvio_of(sigma: float) -> float:
        return float(_lognormal_maxvio(key, R, S, K, E, jnp.float32(sigma)))

    tolerance = max(0.02 * target, 0.005)
    lo, hi = _SIGMA_LO, _SIGMA_HI
    best_sigma, best_maxvio = lo, maxvio_of(lo)
    if best_maxvio < target:
        for _ in range(_BISECTION_STEPS):
            mid = math.sqrt(lo * hi)
            mv = maxvio_of(mid)
            if abs(mv - target) < abs(best_maxvio - target):
                best_sigma, best_maxvio = mid, mv
            if abs(mv - target) <= tolerance:
                break
            lo, hi = (mid, hi) if mv < target else (lo, mid)
    topk_idx = _lognormal(key, R, S, K, E, jnp.float32(best_sigma))
    return topk_idx, best_sigma, best_maxvio


def rank_skew(key, R: int, S: int, K: int, E: int, ratio: float) -> jax.Array:
    """DeepEP-style rank skew: each of rank 0's experts is `ratio` times as likely as any other.

    Tokens pick K distinct experts with probability proportional to that weight (Gumbel top-k).
    `ratio = 1` is uniform; `ratio > 1` overloads home rank 0.

    Returns:
      `topk_idx [R, S, K] int32`.
    """
    _check_sizes("rank_skew", R, S, K, E)
    if E % R:
        raise ValueError(f"`rank_skew`: `E` must be divisible by `R` (E % R == 0); got E={E}, R={R}.")
    if not ratio > 0:
        raise ValueError(f"`rank_skew`: `ratio` must be > 0; got {ratio!r}.")
    on_rank0 = jnp.arange(E) < E // R
    log_weight = jnp.where(on_rank0, jnp.log(jnp.float32(ratio)), 0.0)
    return _gumbel_top_k(_as_key(key), log_weight, R, S, K)


def with_dropped(key, topk_idx: jax.Array, fraction: float) -> jax.Array:
    """Sets exactly `round(fraction * topk_idx.size)` entries, chosen at random, to -1 (dropped)."""
    _check_fraction("with_dropped", fraction)
    topk_idx = jnp.asarray(topk_idx)
    num_dropped = round(fraction * topk_idx.size)
    chosen = jax.random.permutation(_as_key(key), topk_idx.size)[:num_dropped]
    return topk_idx.reshape(-1).at[chosen].set(-1).reshape(topk_idx.shape)


def with_duplicates(key, topk_idx: jax.Array, fraction: float) -> jax.Array:
    """For `round(fraction * tokens)` random tokens, copies the k=0 id over every other k.

    Args:
      topk_idx: `[..., K]`, tokens along the leading axes.
    """
    _check_fraction("with_duplicates", fraction)
    topk_idx = jnp.asarray(topk_idx)
    K = topk_idx.shape[-1]
    tokens = topk_idx.reshape(-1, K)
    num_chosen = round(fraction * tokens.shape[0])
    chosen = jax.random.permutation(_as_key(key), tokens.shape[0])[:num_chosen]
    repeated = jnp.broadcast_to(tokens[chosen, :1], (num_chosen, K))
    return tokens.at[chosen].set(repeated).reshape(topk_idx.shape)


# ---- internals ----------------------------------------------------------------------------------


def _as_key(key) -> jax.Array:
    if isinstance(key, numbers.Integral):
        return jax.random.key(int(key))
    return key


def _check_sizes(name: str, R, S, K, E) -> None:
    for arg, value in (("R", R), ("S", S), ("K", K), ("E", E)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}`: `{arg}` must be a positive int; got {value!r}.")
    if K > E:
        raise ValueError(f"`{name}`: K distinct experts need K <= E; got K={K}, E={E}.")


def _check_fraction(name: str, fraction) -> None:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"`{name}`: `fraction` must be in [0, 1]; got {fraction!r}.")


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _gumbel_top_k(key, log_weight, R: int, S: int, K: int) -> jax.Array:
    """K distinct experts per token, sampled without replacement with probability ~ exp(log_weight).

    Adding Gumbel noise to log-weights and taking the top K is equivalent to drawing K times
    without replacement, each time proportionally to the remaining weights.
    """
    E = log_weight.shape[0]

    def rank_routing(r):
        noise = jax.random.gumbel(jax.random.fold_in(key, r), (S, E))
        return lax.top_k(log_weight[None, :] + noise, K)[1]

    return jax.vmap(rank_routing)(jnp.arange(R)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _lognormal(key, R, S, K, E, sigma) -> jax.Array:
    popularity_key, token_key = jax.random.split(key)
    log_popularity = sigma * jax.random.normal(popularity_key, (E,))
    return _gumbel_top_k(token_key, log_popularity, R, S, K)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _lognormal_maxvio(key, R, S, K, E, sigma) -> jax.Array:
    return maxvio(expert_counts(_lognormal(key, R, S, K, E, sigma), E))

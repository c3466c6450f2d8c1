"""Shared routings for the tests: small fixed shapes and a hypothesis strategy of skewed routings.

Routings are built with NumPy from a drawn seed (independent of `moonep_jax.routing`, which has
its own tests), as global `topk_idx [R, S, K] int32`. The shapes come from a short fixed list so
that a jitted planner compiles once per shape, however many examples run.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st

import moonep_jax


@dataclasses.dataclass(frozen=True)
class Shape:
    """One small EP geometry: R ranks, S tokens, top-K, E experts, B slots (None = epn), tp."""

    R: int
    S: int
    K: int
    E: int
    B: int | None = None
    tp: int = 1

    def config(self, **overrides) -> moonep_jax.EPConfig:
        kwargs = dict(num_experts=self.E, top_k=self.K, tokens_per_rank=self.S, hidden=8,
                      ffn_hidden=8, num_ranks=self.R, prefetch_slots=self.B,
                      token_padding=self.tp, implementation="xla")
        kwargs.update(overrides)
        return moonep_jax.EPConfig(**kwargs)


# Corners covered: R = 1; epn = 1; K > epn; inference overflow (B < epn); tp > 1 with odd sizes.
SHAPES = (
    Shape(R=1, S=5, K=2, E=4),
    Shape(R=2, S=8, K=3, E=6, B=1),
    Shape(R=2, S=16, K=4, E=8, tp=4),
    Shape(R=4, S=7, K=2, E=8),
    Shape(R=4, S=12, K=5, E=16, B=2, tp=3),
    Shape(R=8, S=3, K=1, E=8),
    Shape(R=8, S=9, K=6, E=16, B=1),
    Shape(R=8, S=16, K=4, E=32, tp=2),
)

PATTERNS = ("uniform", "lognormal", "one_hot_expert", "hot_rank", "all_local", "few_experts",
            "with_replacement", "tied_home")


def distinct_top_k(rng: np.random.Generator, log_weight: np.ndarray, R: int, S: int, K: int):
    """K distinct experts per token, drawn with probability ~ exp(log_weight) (Gumbel top-k).

    When K exceeds the number of experts with finite weight, the remaining picks repeat them.
    """
    scores = log_weight + rng.gumbel(size=(R, S, log_weight.shape[0]))
    picks = np.argsort(-scores, axis=-1, kind="stable")[..., :K]
    finite = np.isfinite(np.take_along_axis(scores, picks, axis=-1))
    return np.where(finite, picks, picks[..., :1]).astype(np.int32)


def make_routing(shape: Shape, pattern: str, rng: np.random.Generator, sigma: float = 1.0):
    """Global `topk_idx [R, S, K] int32` of one skew pattern (no -1 entries)."""
    R, S, K, E = shape.R, shape.S, shape.K, shape.E
    epn = E // R
    experts = np.arange(E)
    if pattern == "uniform":
        return distinct_top_k(rng, np.zeros(E), R, S, K)
    if pattern == "lognormal":
        return distinct_top_k(rng, sigma * rng.normal(size=E), R, S, K)
    if pattern == "one_hot_expert":  # every token's first choice is one expert
        hot = rng.integers(E)
        rest = distinct_top_k(rng, np.where(experts == hot, -np.inf, 0.0), R, S, K)
        return np.concatenate([np.full((R, S, 1), hot, np.int32), rest[..., :K - 1]], axis=-1)
    if pattern == "hot_rank":  # one home rank's experts are 20x as likely
        hot = rng.integers(R)
        return distinct_top_k(rng, np.where(experts // epn == hot, np.log(20.0), 0.0), R, S, K)
    if pattern == "all_local":  # each rank routes only to its own experts
        out = np.stack([
            distinct_top_k(rng, np.where(experts // epn == r, 0.0, -np.inf), 1, S, K)[0]
            for r in range(R)])
        return out.astype(np.int32)
    if pattern == "few_experts":  # all entries on 1-3 experts, with repeats inside tokens
        support = rng.choice(E, size=min(E, rng.integers(1, 4)), replace=False)
        return rng.choice(support, size=(R, S, K)).astype(np.int32)
    if pattern == "tied_home":  # one home's experts in turn: equal counts, so tie-breaks matter
        hot = rng.integers(R)
        turn = np.arange(R * S * K).reshape(R, S, K) % epn
        return (hot * epn + turn).astype(np.int32)
    if pattern == "with_replacement":  # independent picks: natural duplicate ids
        return rng.integers(0, E, size=(R, S, K), dtype=np.int32)
    raise ValueError(f"unknown routing pattern {pattern!r}")


def drop_entries(topk_idx: np.ndarray, rng: np.random.Generator, probability: float):
    """Each entry independently becomes -1 with `probability`."""
    return np.where(rng.random(topk_idx.shape) < probability, -1, topk_idx).astype(np.int32)


def repeat_first_choice(topk_idx: np.ndarray, rng: np.random.Generator, probability: float):
    """Each entry k > 0 independently takes its token's k = 0 id with `probability`."""
    repeat = rng.random(topk_idx.shape) < probability
    repeat[..., 0] = False
    return np.where(repeat, topk_idx[..., :1], topk_idx).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Case:
    shape: Shape
    pattern: str
    topk_idx: np.ndarray  # [R, S, K] int32

    def __repr__(self):  # hypothesis prints failing examples with this
        return (f"Case({self.shape}, {self.pattern!r}, topk_idx=np.array("
                f"{self.topk_idx.tolist()}, np.int32))")


@st.composite
def routing_cases(draw, shapes=SHAPES):
    """A `Case`: a shape from `shapes`, a skew pattern, sometimes -1 entries and repeated ids."""
    shape = draw(st.sampled_from(shapes))
    pattern = draw(st.sampled_from(PATTERNS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    topk_idx = make_routing(shape, pattern, rng, sigma=draw(st.floats(0.0, 4.0)))
    drop = draw(st.sampled_from((0.0, 0.0, 0.1, 0.5, 1.0)))
    repeat = draw(st.sampled_from((0.0, 0.0, 0.3)))
    topk_idx = drop_entries(repeat_first_choice(topk_idx, rng, repeat), rng, drop)
    return Case(shape, pattern, topk_idx)

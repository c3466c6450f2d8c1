"""The MoE router: expert scores, top-k selection and DeepSeek-V3's aux-loss-free bias.

Functions on local arrays, independent of Flax, Equinox and the mesh; `moonep_jax.moe_block` runs
them per token shard.

Aux-loss-free balancing (DeepSeek-V3, arXiv:2412.19437 §2.1.2): a per-expert bias `b` is added to
the scores **for the selection only**; the gate weights come from the unbiased scores of the
selected experts, renormalised over the K selected. After each step, `b_e += rate * sign(mean -
count_e)`: overloaded experts become less attractive, under-loaded ones more. The bias is not a
trainable parameter (no gradient flows into it).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

ScoreFn = Literal["softmax", "sigmoid"]
SCORE_FNS = ("softmax", "sigmoid")


def check_score_fn(score_fn: str, where: str) -> None:
    """Raises `ValueError` unless `score_fn` is one of `SCORE_FNS`."""
    if score_fn not in SCORE_FNS:
        raise ValueError(f"`{where}`: `score_fn` must be one of {SCORE_FNS}; got {score_fn!r}.")


def expert_scores(logits: jax.Array, score_fn: ScoreFn) -> jax.Array:
    """Router scores in fp32: softmax over experts, or an independent sigmoid per expert.

    Args:
      logits: `[T, E]` floating router logits.
      score_fn: "softmax" or "sigmoid" (DeepSeek-V3).

    Returns:
      `[T, E] float32` scores.
    """
    check_score_fn(score_fn, "moonep_jax.router.expert_scores")
    logits = logits.astype(jnp.float32)
    if score_fn == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def route(logits: jax.Array, top_k: int, *, score_fn: ScoreFn = "softmax",
          bias: jax.Array | None = None,
          renormalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of `T` tokens over `E` experts.

    Args:
      logits: `[T, E]` floating router logits.
      top_k: K, experts per token, `1 <= K <= E`.
      score_fn: "softmax" or "sigmoid".
      bias: optional `[E]` aux-loss-free selection bias. It only changes which experts are
        selected; the weights are the unbiased scores. No gradient flows into it.
      renormalize: divide the K selected weights by their sum (always sensible for sigmoid
        scores; for softmax it makes the weights of each token sum to 1).

    Returns:
      `topk_idx [T, K] int32` (distinct experts per token, highest selection score first) and
      `topk_w [T, K] float32`. Gradients flow into `logits` through `topk_w`.
    """
    if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"`moonep_jax.router.route`: `logits` must be a floating [T, E] array; "
                         f"got {logits.dtype}{list(logits.shape)}.")
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"`moonep_jax.router.route`: `top_k` must satisfy 1 <= K <= E = "
                         f"{num_experts}; got K={top_k}.")
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(f"`moonep_jax.router.route`: `bias` must have shape [E] = "
                         f"[{num_experts}]; got {list(bias.shape)}.")
    scores = expert_scores(logits, score_fn)
    selection = scores
    if bias is not None:
        selection = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]
    _, topk_idx = jax.lax.top_k(jax.lax.stop_gradient(selection), top_k)
    topk_w = jnp.take_along_axis(scores, topk_idx, axis=-1)
    if renormalize:
        # The guard only matters when every selected score underflowed to 0 (extreme bias).
        denom = jnp.maximum(jnp.sum(topk_w, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
        topk_w = topk_w / denom
    return topk_idx.astype(jnp.int32), topk_w


def update_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's bias update: `b_e + rate * sign(mean(counts) - counts_e)`.

    Args:
      bias: `[E]` current selection bias.
      counts: `[E]` global routed entries per expert of the last step (`aux["expert_counts"]`).
      rate: the bias update speed gamma (DeepSeek-V3 uses 0.001).

    Returns:
      The new `[E]` bias, same dtype as `bias`.
    """
    if bias.shape != counts.shape or bias.ndim != 1:
        raise ValueError(f"`moonep_jax.router.update_bias`: `bias` and `counts` must both have "
                         f"shape [E]; got {list(bias.shape)} and {list(counts.shape)}.")
    counts = counts.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(counts) - counts)
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)

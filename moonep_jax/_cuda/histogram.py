"""tokens_per_expert on the GPU: the per-rank histogram of routed expert ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moonep_jax import _ffi


def tokens_per_expert(topk_idx: jax.Array, num_experts: int, num_sms: int = 32):
    """Counts of each expert id in `topk_idx` (ids -1 ignored), computed by a CUDA kernel.

    Args:
      topk_idx: `[S, K] int32` expert ids, -1 for dropped entries.
      num_experts: E.
      num_sms: CTAs the kernel may use.

    Returns:
      `(tokens_per_expert [E] int32, num_invalid [1] int32)`; `num_invalid` counts ids outside
      `[-1, E)`, which are never used as an index.
    """
    _ffi.lib()  # raises with the reason when the extension is missing
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"`tokens_per_expert`: `topk_idx` must be int32; got {topk_idx.dtype}.")
    aval = jax.typeof(topk_idx)
    return jax.ffi.ffi_call(
        "moonep_tokens_per_expert",
        (aval.update(shape=(num_experts,)), aval.update(shape=(1,))),
    )(topk_idx, num_sms=np.int32(num_sms))

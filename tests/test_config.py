"""`EPConfig`: what it accepts and how it names what it rejects."""

from __future__ import annotations

import numpy as np
import pytest

import moonep_jax

SIZES = dict(num_experts=16, top_k=4, tokens_per_rank=32, hidden=8, ffn_hidden=8, num_ranks=4,
             prefetch_slots=2, token_padding=2)


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint16, int])
def test_sizes_of_any_integer_type_are_accepted_as_python_ints(integer):
    """Sizes often come from array shapes or NumPy arithmetic (`np.int64`)."""
    cfg = moonep_jax.EPConfig(**{name: integer(v) for name, v in SIZES.items()})
    reference = moonep_jax.EPConfig(**SIZES)
    assert cfg == reference and hash(cfg) == hash(reference)
    assert all(type(getattr(cfg, name)) is int for name in SIZES)
    assert cfg.nvs == reference.nvs and type(cfg.nvs) is int


@pytest.mark.parametrize("bad, error, message", [
    (4.0, TypeError, "`EPConfig.top_k` must be an int; got float 4.0"),
    (True, TypeError, "`EPConfig.top_k` must be an int; got bool True"),
    (np.float32(4), TypeError, "`EPConfig.top_k` must be an int; got float32"),
    (np.int64(0), ValueError, "`EPConfig.top_k` must be >= 1; got 0"),
])
def test_non_integer_or_small_sizes_are_rejected(bad, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        moonep_jax.EPConfig(**{**SIZES, "top_k": bad})


@pytest.mark.parametrize("num_sms", [None, 1, 132, 1024])
def test_cuda_num_sms_is_none_or_a_bounded_int(num_sms):
    """None (the default) means one CTA per SM of the device, chosen when an op is traced."""
    assert moonep_jax.CudaOptions(num_sms=num_sms).num_sms == num_sms
    assert moonep_jax.CudaOptions().num_sms is None


@pytest.mark.parametrize("bad", [0, 1025, True, 32.0])
def test_cuda_num_sms_out_of_range_is_rejected(bad):
    with pytest.raises(ValueError, match=r"`CudaOptions.num_sms` must be None \(one CTA per SM\)"):
        moonep_jax.CudaOptions(num_sms=bad)

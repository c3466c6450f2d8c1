"""The CuTe DSL kernels (zero_rows, grouped GEMM forward / dX / dW) against jnp, on one GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


# ---- zero_rows ----------------------------------------------------------------------------------

def _zero_rows(buf, zero_fill):
    """The `moonep_zero_rows` target, zeroing `buf` in place (operand 0 aliases result 0)."""
    return jax.ffi.ffi_call("moonep_zero_rows", jax.typeof(buf), input_output_aliases={0: 0})(
        buf, zero_fill)


def _zero_rows_reference(buf, zero_fill):
    rows = jnp.arange(buf.shape[0])[:, None]
    first = jnp.clip(zero_fill[:, 0], 0, buf.shape[0])
    end = jnp.clip(first + jnp.maximum(zero_fill[:, 1], 0), 0, buf.shape[0])
    padding = jnp.any((rows >= first[None]) & (rows < end[None]), axis=1)
    return jnp.where(padding[:, None], jnp.zeros_like(buf), buf)


@pytest.mark.parametrize("num_rows,hidden", [(1000, 7168), (37, 8), (4096, 2048)])
def test_zero_rows_matches_jnp(seed, num_rows, hidden):
    rng = np.random.default_rng(seed)
    num_groups = 24
    buf = rng.standard_normal((num_rows, hidden)).astype(jnp.bfloat16)
    first = rng.integers(0, num_rows, num_groups)
    count = rng.integers(0, 5, num_groups)
    count[rng.random(num_groups) < 0.3] = 0  # groups without padding
    zero_fill = np.stack([first, count], axis=1).astype(np.int32)
    zero_fill[0] = (num_rows - 2, 9)         # runs past the end: clamped
    zero_fill[1] = (num_rows + 50, 3)        # starts past the end: nothing
    zero_fill[2] = (-5, 2)                   # negative start: clamped to row 0
    out, expected = jax.jit(lambda b, z: (_zero_rows(b, z), _zero_rows_reference(b, z)))(
        buf, zero_fill)
    out, expected = np.asarray(out), np.asarray(expected)
    assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))
    assert (out[:2] == 0).all()  # the clamped (-5, 2) range
    assert np.count_nonzero(out != buf) > 0  # the kernel did something


def test_zero_rows_in_place_inside_donating_jit(seed):
    rng = np.random.default_rng(seed)
    buf = jnp.asarray(rng.standard_normal((256, 512)).astype(jnp.bfloat16))
    zero_fill = jnp.asarray([[10, 3], [0, 0], [255, 1]], jnp.int32)
    expected = np.asarray(_zero_rows_reference(buf, zero_fill))
    out = jax.jit(_zero_rows, donate_argnums=0)(buf, zero_fill)
    assert np.array_equal(np.asarray(out).view(np.uint16), expected.view(np.uint16))

"""The two implementations are two modules with the same backend functions (docs/CONTRACT.md)."""

import inspect

import pytest

import moonep_jax
from moonep_jax import _checks, _xla
from moonep_jax._cuda import ops as cuda_ops  # importable without the extension

BACKEND_FUNCTIONS = {"plan", "dispatch", "combine", "combine_weights", "prefetch", "reduce_grad",
                     "grouped_matmul", "grouped_matmul_dx", "grouped_matmul_dw"}


def test_both_modules_define_every_backend_function_with_one_signature():
    assert set(_xla.__all__) == set(cuda_ops.__all__) == BACKEND_FUNCTIONS
    for name in BACKEND_FUNCTIONS:
        xla, cuda = getattr(_xla, name), getattr(cuda_ops, name)
        assert list(inspect.signature(xla).parameters) == list(inspect.signature(cuda).parameters), name


@pytest.mark.parametrize("implementation, module", [("xla", _xla), ("cuda", cuda_ops)])
def test_the_config_picks_the_module(implementation, module, monkeypatch):
    cfg = moonep_jax.EPConfig(num_experts=8, top_k=2, tokens_per_rank=4, hidden=16,
                              ffn_hidden=16, num_ranks=2, implementation=implementation)
    monkeypatch.setattr(_checks, "resolved_implementation", lambda c: c.implementation)
    assert _checks.implementation(cfg) is module

"""build_aot.py --override: a tuning variant sets integer constants of a kernel module, and
refuses what would not take effect as asked (a constant other constants are computed from at
import, a non-integer, a name no module has)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

CUTEDSL_DIR = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "cutedsl"
sys.path.insert(0, str(CUTEDSL_DIR))
import build_aot  # noqa: E402

MODULE = '''
TILE = 128
STAGES = 6
HALF = TILE // 2
NAME = "gemm"


def stages_used():
    return STAGES
'''


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "kernel_constants.py"
    path.write_text(MODULE)
    spec = importlib.util.spec_from_file_location("kernel_constants", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_override_sets_the_constant_the_kernel_code_reads(module):
    assert build_aot.apply_overrides([module], ["STAGES=4"]) == {"STAGES": 4}
    assert module.STAGES == 4 and module.stages_used() == 4


@pytest.mark.parametrize("override,rule", [
    ("TILE=64", "computes other constants from TILE"),
    ("NAME=1", "must be an integer constant"),
    ("MISSING=1", "must be an integer constant"),
    ("STAGES=four", "expected NAME=INTEGER"),
    ("STAGES", "expected NAME=INTEGER"),
])
def test_override_refuses_what_would_not_take_effect(module, override, rule):
    with pytest.raises(SystemExit, match=rule):
        build_aot.apply_overrides([module], [override])
    assert (module.TILE, module.STAGES, module.NAME) == (128, 6, "gemm")

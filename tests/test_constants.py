"""The constants Python and C++ share are equal: the Python copies against the values the extension
exports from kernels/constants.h. Runs wherever the extension is built (no GPU needed)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from moonep_jax import _ffi, config

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not _ffi.available(),
                                reason=f"CUDA extension unavailable: {_ffi.unavailable_reason()}")


def module_constants(path: pathlib.Path) -> dict[str, int]:
    """Top-level `NAME = int` and `A, B = int, int` assignments of a Python file, without importing
    it (the CuTe DSL kernels import cutlass)."""
    constants = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        names = target.elts if isinstance(target, ast.Tuple) else [target]
        values = value.elts if isinstance(value, ast.Tuple) else [value]
        for name, v in zip(names, values):
            if isinstance(name, ast.Name) and isinstance(getattr(v, "value", None), int):
                constants[name.id] = v.value
    return constants


def test_config_constants_equal_the_extensions():
    lib = _ffi.lib()
    assert (lib.MAX_TOP_K, lib.DROPPED) == (config.MAX_TOP_K, config.DROPPED)


def test_cutedsl_tile_table_constants_equal_the_extensions():
    dsl = module_constants(REPO / "kernels" / "cutedsl" / "grouped_matmul.py")
    exported = dict(_ffi.lib().GROUPED_MATMUL_TABLE_CONSTANTS)
    assert exported.keys() == {"KIND_LOCAL", "KIND_SLOT", "KIND_ZERO", "TABLE_FIRST_ITEM",
                               "TABLE_ITEM_N_TILES", "TABLE_COLUMNS", "SCHEDULE_TILES",
                               "SCHEDULE_NEXT_ITEM", "SCHEDULE_ITEMS", "DW_SCHEDULE_MATS",
                               "DW_SCHEDULE_NEXT_ITEM", "DW_SCHEDULE_SLOTS"}
    assert {name: dsl[name] for name in exported} == exported
    lib = _ffi.lib()
    # The table kernel counts the tiles and decides which items are wide.
    assert (dsl["TILE_M"], dsl["TILE_N"], dsl["A_CHUNK_M"], dsl["WIDE_N_TILES"]) == (
        lib.GROUPED_MATMUL_TILE_M, lib.GROUPED_MATMUL_TILE_N, lib.GROUPED_MATMUL_CHUNK_M,
        lib.GROUPED_MATMUL_WIDE_N_TILES)


def test_benchmarks_fallback_tile_height_equals_the_kernels():
    """benchmarks/plan_groupings.py counts M tiles with DEFAULT_TILE_M when the extension cannot
    be loaded."""
    dsl = module_constants(REPO / "kernels" / "cutedsl" / "grouped_matmul.py")
    benchmarks = module_constants(REPO / "benchmarks" / "plan_groupings.py")
    assert benchmarks["DEFAULT_TILE_M"] == dsl["TILE_M"]


def test_no_kernel_or_handler_keeps_its_own_copy():
    """The C++ side spells these values once, in kernels/constants.h."""
    copy = re.compile(r"INT32_MIN|\b(K|top_k)\b[^\n]{0,12}[<>]=? *32\b|kKind\w+ = \d")
    copies = []
    for pattern in ("kernels/*.cu", "kernels/*.h", "kernels/*.cuh", "xla_ffi/*.cc", "xla_ffi/*.h"):
        for path in REPO.glob(pattern):
            if path.name != "constants.h":
                copies += [f"{path.name}: {m[0]}" for m in copy.finditer(path.read_text())]
    assert not copies

"""Compile the project's CuTe DSL kernels ahead of time into C-callable objects.

Usage: python build_aot.py --out DIR --arch sm_90a [--override NAME=VALUE ...]

For every entry of every kernel module's `EXPORTS` it writes `DIR/<prefix>.h` and `DIR/<prefix>.o`
(`export_to_c`): an x86-64 object embedding the cubin, linked into the CUDA extension together with
the DSL's static dialect runtime. No GPU is needed (reference/cutedsl_aot.md).

`--override NAME=VALUE` compiles the kernels with one of their modules' integer constants set to
VALUE (e.g. `DW_LAG_K_TILES=2`): the variants of a tuning sweep (`tools/gpu.sh build-variant`),
never the committed build.
"""

import argparse
import ast
import inspect
import os
import pathlib
import sys

# Modules whose EXPORTS are built, in this directory.
KERNEL_MODULES = ("grouped_matmul",)


def derived_from(module) -> set[str]:
    """Names that the module's top-level assignments compute other values from at import (an
    override of one would leave those values stale)."""
    tree = ast.parse(inspect.getsource(module))
    return {node.id for statement in tree.body if isinstance(statement, (ast.Assign, ast.AnnAssign))
            and statement.value is not None for node in ast.walk(statement.value)
            if isinstance(node, ast.Name)}


def apply_overrides(modules: list, overrides: list[str]) -> dict[str, int]:
    """Set each `NAME=VALUE` of `overrides` on the one module of `modules` that has NAME as an
    upper-case integer constant that no other top-level value is computed from; returns
    `{NAME: VALUE}`."""
    applied = {}
    for override in overrides:
        name, sep, value = override.partition("=")
        try:
            number = int(value)
        except ValueError:
            number = None
        if not sep or number is None:
            raise SystemExit(f"build_aot: --override {override!r}: expected NAME=INTEGER")
        owners = [m for m in modules if name.isupper() and type(getattr(m, name, None)) is int]
        if len(owners) != 1:
            raise SystemExit(f"build_aot: --override {override!r}: {name} must be an integer "
                             f"constant of exactly one of {[m.__name__ for m in modules]} "
                             f"({len(owners)} have it)")
        if name in derived_from(owners[0]):
            raise SystemExit(f"build_aot: --override {override!r}: {owners[0].__name__} computes "
                             f"other constants from {name} at import, which would keep its value")
        setattr(owners[0], name, number)
        applied[name] = number
    return applied


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path, help="output directory")
    parser.add_argument("--arch", default="sm_90a", help="GPU architecture, e.g. sm_90a")
    parser.add_argument("--override", action="append", default=[], metavar="NAME=VALUE",
                        help="an integer constant of a kernel module, for a tuning variant")
    args = parser.parse_args(argv)
    # The DSL's default target is sm_100a, and export_to_c fails unless CUTE_DSL_ARCH matches
    # --gpu-arch; both must be set before cutlass is imported.
    os.environ["CUTE_DSL_ARCH"] = args.arch
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import importlib
    args.out.mkdir(parents=True, exist_ok=True)
    options = f"--gpu-arch {args.arch}"
    modules = [importlib.import_module(name) for name in KERNEL_MODULES]
    for name, value in apply_overrides(modules, args.override).items():
        print(f"build_aot: {name} = {value} (--override)")
    for module in modules:
        for prefix, compile_fn in module.EXPORTS.items():
            compiled = compile_fn(options)
            compiled.export_to_c(str(args.out), prefix, function_prefix=prefix)
            print(f"build_aot: {args.out / prefix}.{{h,o}} ({args.arch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

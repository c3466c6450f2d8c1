"""Compile the project's CuTe DSL kernels ahead of time into C-callable objects.

Usage: python build_aot.py --out DIR --arch sm_90a

For every entry of every kernel module's `EXPORTS` it writes `DIR/<prefix>.h` and `DIR/<prefix>.o`
(`export_to_c`): an x86-64 object embedding the cubin, linked into the CUDA extension together with
the DSL's static dialect runtime. No GPU is needed (reference/cutedsl_aot.md).
"""

import argparse
import os
import pathlib
import sys

# Modules whose EXPORTS are built, in this directory.
KERNEL_MODULES = ("grouped_matmul",)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path, help="output directory")
    parser.add_argument("--arch", default="sm_90a", help="GPU architecture, e.g. sm_90a")
    args = parser.parse_args(argv)
    # The DSL's default target is sm_100a, and export_to_c fails unless CUTE_DSL_ARCH matches
    # --gpu-arch; both must be set before cutlass is imported.
    os.environ["CUTE_DSL_ARCH"] = args.arch
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import importlib
    args.out.mkdir(parents=True, exist_ok=True)
    options = f"--gpu-arch {args.arch}"
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for prefix, compile_fn in module.EXPORTS.items():
            compiled = compile_fn(options)
            compiled.export_to_c(str(args.out), prefix, function_prefix=prefix)
            print(f"build_aot: {args.out / prefix}.{{h,o}} ({args.arch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

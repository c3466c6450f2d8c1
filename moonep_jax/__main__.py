"""Command line: `python -m moonep_jax demo [--steps N] [--seed S]` and
`python -m moonep_jax bench [--quick] [args passed to every benchmark]`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"
SIMULATED_CPU_DEVICES = 8
BENCHMARKS = ("bench_dispatch.py", "bench_gemm.py", "bench_layer.py")
USAGE = __doc__


def simulate_cpu_devices() -> None:
    """Asks XLA for 8 CPU devices unless the user chose a count.

    XLA reads `XLA_FLAGS` when the first backend starts, so this must run before anything calls
    `jax.devices()` (importing jax is fine). The flag only changes the CPU platform: with a GPU,
    JAX's default backend is still the GPU and the flag has no effect on it.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_DEVICES_FLAG}={SIMULATED_CPU_DEVICES}".strip()


def benchmarks_dir() -> Path:
    """`benchmarks/` of the source checkout this package lives in."""
    return Path(__file__).resolve().parent.parent / "benchmarks"


def run_benchmarks(args: list[str]) -> int:
    """Runs every present `benchmarks/bench_*.py` in turn; returns the first non-zero exit code."""
    directory = benchmarks_dir()
    scripts = [directory / name for name in BENCHMARKS if (directory / name).is_file()]
    if not scripts:
        print(f"moonep_jax bench: no benchmark scripts ({', '.join(BENCHMARKS)}) in {directory}; "
              "the benchmarks ship with the source checkout, not the installed package.",
              file=sys.stderr)
        return 2
    status = 0
    for script in scripts:
        print(f"== {script.name} {' '.join(args)}", flush=True)
        code = subprocess.call([sys.executable, str(script), *args], cwd=directory.parent)
        if code:
            print(f"moonep_jax bench: {script.name} exited with {code}", file=sys.stderr)
            status = status or code
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m moonep_jax` and of the `moonep-jax` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        simulate_cpu_devices()
        try:
            from moonep_jax import demo  # imports the model stack only after the flag is set
        except ModuleNotFoundError as err:
            print(f"moonep_jax demo needs Flax and optax ({err}); install them with "
                  "`pip install flax optax`.", file=sys.stderr)
            return 2
        return demo.main(rest)
    if command == "bench":
        return run_benchmarks(rest)
    print(f"moonep_jax: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Command line: `python -m moonep_jax demo [--steps N] [--seed S] [--processes N]` and
`python -m moonep_jax bench [--quick] [args passed to every benchmark]`.

`demo --processes N` runs the demo in N local processes of one `jax.distributed` job
(moonep_jax.launch): on CPU (no GPU, or JAX_PLATFORMS=cpu) they share 8 simulated devices through
gloo; with GPUs each process drives one GPU (N <= the GPUs this host shows)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"
SIMULATED_CPU_DEVICES = 8
BENCHMARKS = ("bench_dispatch.py", "bench_gemm.py", "bench_layer.py")
DEMO_TIMEOUT_S = 3600
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


def demo_in_processes(num_processes: int, argv: list[str]) -> int:
    """Runs `demo argv` in `num_processes` local processes of one job; returns the exit code."""
    from moonep_jax import launch

    gpus = 0 if os.environ.get("JAX_PLATFORMS", "").lower() == "cpu" else launch.visible_gpu_count()
    if gpus == 0:
        if SIMULATED_CPU_DEVICES % num_processes:
            print(f"moonep_jax demo: --processes must divide {SIMULATED_CPU_DEVICES} on CPU (the "
                  f"simulated devices are split evenly); got {num_processes}.", file=sys.stderr)
            return 2
        where = dict(platform="cpu", cpu_devices=SIMULATED_CPU_DEVICES // num_processes)
    elif num_processes <= gpus:
        where = dict(platform="gpu", local_device_ids=[[i] for i in range(num_processes)])
    else:
        print(f"moonep_jax demo: --processes {num_processes} on {gpus} GPU(s): the demo's dense "
              "layers use XLA's GPU collectives, which refuse two processes on one GPU. Use "
              f"--processes <= {gpus} (one per GPU), or the CPU (JAX_PLATFORMS=cpu).",
              file=sys.stderr)
        return 2
    try:
        launch.run("moonep_jax.demo:main", num_processes, (argv,), stream_output=True,
                   timeout_s=DEMO_TIMEOUT_S, **where)
    except launch.LaunchError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m moonep_jax` and of the `moonep-jax` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--processes", type=int, default=1)
        known, rest = parser.parse_known_args(rest)
        if known.processes < 1:
            print(f"moonep_jax demo: --processes must be >= 1; got {known.processes}",
                  file=sys.stderr)
            return 2
        if known.processes > 1:
            return demo_in_processes(known.processes, rest)
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

"""Local multi-process launcher: N JAX processes on this host, one `jax.distributed` job.

`run(target, num_processes, ...)` spawns N Python processes, each running
`jax.distributed.initialize("127.0.0.1:<free port>", N, process_id)` and then `target(*args)`, and
returns the N return values (pickled through a file each). The CPU backend of every process has
`cpu_devices` devices and uses gloo for XLA's collectives across processes (on GPU it serves the
references of the tests); with `platform="gpu"` each process also sees the GPUs listed for it in
`visible_devices` (by default all processes share GPU 0, which is the one-GPU test setup; run it
under MPS, `moonep_jax.launch.mps`).

Every wait is bounded: a process that fails makes the launcher kill the others at once (their
own bounded waits would fire later anyway), and the whole job is killed after `timeout_s`.
`LaunchError` carries each process's exit code and the tail of its output.

`target` is "package.module:function" or "/path/to/file.py:function" (a test file, for example).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# Bound of jax.distributed.initialize in each process (the coordinator waits for every process).
INIT_TIMEOUT_S = 60
RELEASE_FILE = "release"  # created by the launcher when process 0 may exit


class LaunchError(RuntimeError):
    """A launched process failed or the job timed out; `.results` holds every process's outcome."""

    def __init__(self, message: str, results: list[ProcessResult]):
        super().__init__(message)
        self.results = results


@dataclasses.dataclass
class ProcessResult:
    """What one process left: exit code (None: killed by the launcher), output, return value."""

    process_id: int
    returncode: int | None
    output: str
    value: Any = None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the coordinator binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(target: str, num_processes: int, args: Sequence[Any] = (), *, platform: str = "cpu",
        cpu_devices: int = 1, visible_devices: Sequence[str] | None = None,
        local_device_ids: Sequence[Sequence[int]] | None = None,
        env: dict[str, str] | None = None, timeout_s: float = 300.0,
        expect_failure: bool = False, stop_on_failure: bool = True,
        stream_output: bool = False) -> list[ProcessResult]:
    """Runs `target(*args)` in `num_processes` local processes of one `jax.distributed` job.

    Args:
      target: "module:function" or "/path/file.py:function"; `args` must be picklable and so
        must its return value.
      num_processes: N >= 1.
      platform: "cpu" (the CPU backend only) or "gpu" (GPUs and the CPU backend).
      visible_devices: per process, its `CUDA_VISIBLE_DEVICES` (GPU only; default "0" for all,
        unless `local_device_ids` is given).
      local_device_ids: per process, the GPUs it drives (`jax.distributed.initialize`'s
        `local_device_ids`; every process still sees every GPU, so that peers' memory can be
        mapped): one process per GPU is `[[0], [1], ...]`.
      env: extra environment for every process.
      timeout_s: bound of the whole job.
      expect_failure: return the results instead of raising when a process fails (tests of
        failure handling); a timeout still raises.
      stop_on_failure: kill the other processes as soon as one fails (default); False lets each
        run to its own end (tests that check how the others' bounded waits end).
      stream_output: the processes write to this process's stdout/stderr instead of a file
        each (`ProcessResult.output` is then empty).

    Returns:
      One `ProcessResult` per process, in process order.

    Raises:
      LaunchError: a process exited non-zero (the others are then killed) or the job timed out.
    """
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"`platform` must be 'cpu' or 'gpu'; got {platform!r}.")
    for name, per_process in (("visible_devices", visible_devices),
                              ("local_device_ids", local_device_ids)):
        if per_process is not None and len(per_process) != num_processes:
            raise ValueError(f"`{name}` needs one entry per process ({num_processes}); got "
                             f"{len(per_process)}.")
    workdir = Path(tempfile.mkdtemp(prefix="moonep_launch_"))
    try:
        (workdir / "args.pkl").write_bytes(pickle.dumps(tuple(args)))
        port = free_port()
        procs, logs = [], []
        for pid in range(num_processes):
            child_env = dict(os.environ, **(env or {}))
            child_env["PYTHONUNBUFFERED"] = "1"
            flags = " ".join(f for f in child_env.get("XLA_FLAGS", "").split()
                             if not f.startswith(CPU_DEVICES_FLAG))
            child_env["XLA_FLAGS"] = f"{flags} {CPU_DEVICES_FLAG}={cpu_devices}".strip()
            if platform == "cpu":
                child_env["JAX_PLATFORMS"] = "cpu"
            else:
                child_env.pop("JAX_PLATFORMS", None)  # GPU and CPU (the references) both
                if visible_devices is not None or local_device_ids is None:
                    child_env["CUDA_VISIBLE_DEVICES"] = (visible_devices
                                                         or ["0"] * num_processes)[pid]
            log = open(workdir / f"out{pid}.txt", "w+b")
            logs.append(log)
            cmd = [sys.executable, "-m", "moonep_jax.launch", "--target", target,
                   "--process-id", str(pid), "--num-processes", str(num_processes),
                   "--port", str(port), "--workdir", str(workdir)]
            if local_device_ids is not None:
                cmd += ["--local-device-ids", ",".join(str(i) for i in local_device_ids[pid])]
            procs.append(subprocess.Popen(
                cmd, env=child_env, stdout=None if stream_output else log,
                stderr=None if stream_output else subprocess.STDOUT, start_new_session=True))
        codes = _wait_all(procs, timeout_s, stop_on_failure, workdir / RELEASE_FILE)
        results = []
        for pid, (log, code) in enumerate(zip(logs, codes)):
            log.seek(0)
            out = log.read().decode(errors="replace")
            log.close()
            value_file = workdir / f"value{pid}.pkl"
            value = pickle.loads(value_file.read_bytes()) if value_file.exists() else None
            results.append(ProcessResult(pid, code, out, value))
        timed_out = any(c is None for c in codes) and all(c in (0, None) for c in codes)
        if timed_out or (not expect_failure and any(c != 0 for c in codes)):
            what = (f"timed out after {timeout_s:.0f} s" if timed_out else
                    "failed: exit codes " + str([r.returncode for r in results]))
            report = "\n".join(f"--- process {r.process_id} (exit {r.returncode}) ---\n{r.tail()}"
                               for r in results)
            raise LaunchError(f"moonep_jax.launch: {num_processes} processes running {target} "
                              f"{what}\n{report}", results)
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float, stop_on_failure: bool,
              release: Path) -> list[int | None]:
    """Waits for every process; at the deadline (or, with `stop_on_failure`, the first failure)
    kills the rest (their whole process group). Process 0 hosts the coordination service, whose
    end makes the others' jax runtimes abort: it is released (the file `release`) only once the
    others have exited. Returns exit codes, None for a process the launcher killed."""
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = [None] * len(procs)
    while any(p.poll() is None for p in procs):
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes[1:]) and not release.exists():
            release.touch()
        failed = stop_on_failure and any(c not in (None, 0) for c in codes)
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for i, p in enumerate(procs):
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            codes[i] = None
        else:
            codes[i] = p.returncode
    return codes


def load_target(target: str) -> Callable:
    """The function named by "module:function" or "/path/file.py:function"."""
    module_name, _, function = target.rpartition(":")
    if not module_name or not function:
        raise ValueError(f"target must be 'module:function' or 'file.py:function'; got {target!r}")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        sys.path.insert(0, str(path.parent))  # the file's own helpers (tests/_routings.py)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, function)


def initialize(process_id: int, num_processes: int, port: int,
               local_device_ids: list[int] | None = None) -> None:
    """`jax.distributed.initialize` on 127.0.0.1, gloo for the CPU backend's collectives."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                               local_device_ids=local_device_ids,
                               initialization_timeout=INIT_TIMEOUT_S)


def visible_gpu_count() -> int:
    """GPUs CUDA would show a process started here, without touching CUDA in this process: those
    `nvidia-smi -L` lists (the /dev/nvidiaN nodes where it is not installed; a device node alone
    can outnumber the GPUs a container may use), narrowed by CUDA_VISIBLE_DEVICES as CUDA reads
    it: indices or UUIDs up to the first invalid entry, which hides itself and all after it."""
    listed = _listed_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < listed)):
            break
        count += 1
    return count


def _listed_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return sum(1 for name in os.listdir("/dev") if name[6:].isdigit()
                   and name.startswith("nvidia")) if os.path.isdir("/dev") else 0
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if listing.returncode != 0:  # no driver, or no GPU it can reach
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


@contextlib.contextmanager
def mps(root: str | None = None) -> Iterator[dict[str, str]]:
    """Runs the block under an NVIDIA MPS daemon, started here unless one already runs.

    Yields the environment (`CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY`) the clients must
    share; stops the daemon afterwards if this call started it. Without MPS, kernels of
    different processes on one GPU are time-sliced and a cross-process wait costs ~5 ms.
    """
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")  # MPS's default
    if Path(pipe, "control").exists():  # a daemon runs already: share it
        yield {"CUDA_MPS_PIPE_DIRECTORY": pipe,
               "CUDA_MPS_LOG_DIRECTORY": os.environ.get("CUDA_MPS_LOG_DIRECTORY", pipe)}
        return
    if shutil.which("nvidia-cuda-mps-control") is None:
        raise RuntimeError("moonep_jax.launch.mps: nvidia-cuda-mps-control is not on PATH.")
    root = root or tempfile.mkdtemp(prefix="moonep_mps_")
    env = {"CUDA_MPS_PIPE_DIRECTORY": f"{root}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{root}/log"}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    full = dict(os.environ, **env)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=full, check=True, timeout=30)
    time.sleep(1.0)
    try:
        yield env
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=full, timeout=30,
                       check=False)
        time.sleep(1.0)


def exit_now(code: int) -> None:
    """Exits at once, skipping `jax.distributed.shutdown`'s barrier (a dead peer would hold it
    up), after flushing Python's and C's output buffers (device printf goes through C's)."""
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)
    os._exit(code)


def _child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m moonep_jax.launch")
    parser.add_argument("--target", required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--local-device-ids", default=None)
    a = parser.parse_args(argv)
    workdir = Path(a.workdir)
    local = None if a.local_device_ids is None else [int(i) for i in a.local_device_ids.split(",")]
    initialize(a.process_id, a.num_processes, a.port, local)
    try:
        fn = load_target(a.target)
        value = fn(*pickle.loads((workdir / "args.pkl").read_bytes()))
    except BaseException:  # noqa: BLE001 - report, then exit without jax's shutdown barrier
        traceback.print_exc()
        exit_now(1)
    tmp = workdir / f"value{a.process_id}.tmp"
    tmp.write_bytes(pickle.dumps(value))
    tmp.rename(workdir / f"value{a.process_id}.pkl")
    sys.stdout.flush()
    # Every process stays up until all have their value (process 0 hosts the coordination
    # service), then exits without jax.distributed.shutdown: a failed peer gets its job killed by
    # the launcher instead of holding the others in a shutdown barrier.
    from moonep_jax import _distributed

    _distributed.barrier("moonep_jax.launch/done", INIT_TIMEOUT_S)
    if a.process_id == 0:  # the coordination service lives here: outlast the others
        deadline = time.monotonic() + INIT_TIMEOUT_S
        while not (workdir / RELEASE_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    exit_now(0)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))

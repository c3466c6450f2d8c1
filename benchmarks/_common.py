"""Pieces the benchmark scripts share: timing, the run's provenance, record and plot writing."""

from __future__ import annotations

import atexit
import contextlib
import csv
import datetime
import glob
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jaxlib
import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
# The skew sweep of every benchmark (MoonEP's bench_vs_deepep).
MAXVIOS = (0.2, 1.0, 10.0, 20.0)


def time_calls(fn, args, reps: int, before_each=None) -> list[float]:
    """Wall times in ms of `reps` calls of `fn(*args)` (each until ready), after one warm-up.
    `before_each()` runs untimed before every call (the ranks' barrier of `--processes`)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        if before_each is not None:
            before_each()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_round_robin(fn, arg_sets: list, reps: int, warmups: int = 1) -> list[dict]:
    """`fn(*args)` for every `args` of `arg_sets`, timed in rounds: `warmups` untimed calls of each,
    then call i of every set (in order) before call i + 1 of any, so that a GPU's drift over the
    run (clocks, temperature) spreads over all sets instead of favouring the first. Returns, per
    set, `{"status": "ok", "times_ms", "median_ms"}`, or `{"status": "failed: ..."}` for a set
    whose call raised (that set is then left out of the later rounds)."""
    results = [{"status": "ok", "times_ms": []} for _ in arg_sets]

    def call(i, timed: bool):
        try:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*arg_sets[i]))
            if timed:
                results[i]["times_ms"].append((time.perf_counter() - t0) * 1e3)
        except Exception as e:  # noqa: BLE001  (recorded; the other sets go on)
            results[i] = {"status": f"failed: {type(e).__name__}: {str(e)[:400]}"}

    for i in range(len(arg_sets)):
        for _ in range(warmups):
            if results[i]["status"] == "ok":
                call(i, timed=False)
    for _ in range(reps):
        for i in range(len(arg_sets)):
            if results[i]["status"] == "ok":
                call(i, timed=True)
    for r in results:
        if r["status"] == "ok":
            r["median_ms"] = float(np.median(r["times_ms"]))
    return results


class ClockSampler:
    """The GPU's SM clock, power draw and temperature, sampled by `nvidia-smi -lms` in the
    background, so that a record says at which clocks its points ran: the drift of the same
    binary between calls and within one (±5-10 % of a GEMM's time) is the records' largest
    uncertainty. `command` replaces the nvidia-smi command line (tests); its output lines are
    `sm MHz, W, °C`, one per sample."""

    FIELDS = {"sm_clock_mhz": "clocks.sm", "power_w": "power.draw", "temperature_c":
              "temperature.gpu"}

    def __init__(self, gpu_index: int = 0, interval_ms: int = 50, command=None):
        self.samples: list[tuple[float, tuple[float, ...]]] = []
        self.error: str | None = None
        self.message = ""  # the last output line that is not a sample (an error, say)
        command = command or ["nvidia-smi", f"--id={gpu_index}", "--format=csv,noheader,nounits",
                              f"--query-gpu={','.join(self.FIELDS.values())}",
                              f"--loop-ms={interval_ms}"]
        try:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            self.process, self.error = None, f"not sampled: {e}"
            return
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)

    def _read(self):
        for line in self.process.stdout:
            try:
                values = tuple(float(v) for v in line.split(","))
            except ValueError:  # "[N/A]" or a message: not a sample
                values = ()
            if len(values) == len(self.FIELDS):
                self.samples.append((time.monotonic(), values))
            else:
                self.message = line.strip()[:200]

    def close(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait()

    def summary(self, t0: float, t1: float) -> dict:
        """min / median / max of each field over the samples taken between t0 and t1
        (time.monotonic()), or a status saying why there are none."""
        if self.error:
            return {"status": self.error}
        window = np.array([v for t, v in list(self.samples) if t0 <= t <= t1])
        if window.size == 0:
            if self.process.poll() is not None:
                return {"status": f"nvidia-smi exited ({self.process.returncode}): {self.message}"}
            return {"status": "no sample in the window"}
        out = {"status": "ok", "samples": len(window)}
        for i, name in enumerate(self.FIELDS):
            column = window[:, i]
            out[name] = {"min": float(column.min()), "median": float(np.median(column)),
                         "max": float(column.max())}
        return out


_sampler: ClockSampler | None = None
# What a record's `gpu_clocks` fields hold.
CLOCKS_METHOD = ("per timed block: min / median / max of the SM clock (MHz), power draw (W) and "
                 "temperature (°C) over nvidia-smi's samples, every 50 ms (_common.gpu_clocks)")


@contextlib.contextmanager
def gpu_clocks():
    """Yields a dict that, when the block ends, holds the GPU's clocks over it
    (ClockSampler.summary; one sampler, started on first use, for the first GPU that
    CUDA_VISIBLE_DEVICES names, in JAX process 0 only: the ranks of `--processes` share its GPU);
    off a GPU it says so."""
    global _sampler
    clocks: dict = {}
    if jax.default_backend() != "gpu" or jax.process_index() != 0:
        clocks["status"] = "not on a GPU" if jax.default_backend() != "gpu" else (
            "sampled by process 0 only")
        yield clocks
        return
    if _sampler is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        _sampler = ClockSampler(int(visible) if visible.isdigit() else 0)
    t0 = time.monotonic()
    try:
        yield clocks
    finally:
        clocks.update(_sampler.summary(t0, time.monotonic()))


def git_commit() -> str | None:
    """The commit the code comes from: `$MOONEP_GIT_COMMIT` (tools/gpu.sh run sets it from
    `.gpu/COMMIT`, written when the binary was built: the GPU machine's copy of the tree may hold
    a stale `.git`), else `git rev-parse HEAD`, else `.gpu/COMMIT`."""
    if os.environ.get("MOONEP_GIT_COMMIT"):
        return os.environ["MOONEP_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=REPO, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        recorded = REPO / ".gpu" / "COMMIT"
        return recorded.read_text().strip() if recorded.is_file() else None


def provenance() -> dict:
    """Device model and count, versions, commit and time of this run."""
    devices = jax.devices()
    return {"device_kind": devices[0].device_kind, "num_devices": len(devices),
            "platform": jax.default_backend(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "git_commit": git_commit(),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def comm_ctas(cfg) -> int | None:
    """CTAs the communication kernels get under `cfg`: `CudaOptions.num_sms`, or one per SM of
    this process's first device (the default, None; None on a backend that reports no SMs)."""
    return cfg.cuda.num_sms or getattr(jax.local_devices()[0], "core_count", None)


def device_tag(count: int | None = None) -> str:
    """`<gpu model>x<count>` for file names (`cpu` when not on a GPU); `count` defaults to the
    devices jax sees (N processes sharing one GPU see N devices of one GPU: they pass 1)."""
    devices = jax.devices()
    count = len(devices) if count is None else count
    if jax.default_backend() != "gpu":
        return f"cpux{count}"
    kind = "".join(c if c.isalnum() else "_" for c in devices[0].device_kind)
    return f"{kind}x{count}"


def write_json(path: pathlib.Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=_jsonable))


def _jsonable(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (and a message) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return None
    return plt


def plot_vs_maxvio(ax, points: list[dict], keep, ylabel: str, title: str) -> None:
    """On `ax`, one line per method: the median ms of the results `keep(result)` selects, against
    the point's maxvio target, both axes logarithmic."""
    by_method: dict[str, list] = {}
    for point in points:
        for r in point["results"]:
            if r["status"] == "ok" and keep(r):
                by_method.setdefault(r["method"], []).append((point["maxvio_target"],
                                                              r["median_ms"]))
    for method, values in sorted(by_method.items()):
        ax.plot(*zip(*values), marker="o", label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("maxvio")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend()


def find_ncu() -> str | None:
    """Nsight Compute's `ncu`: on PATH, else where CUDA installs put it."""
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu",
                    "/usr/local/cuda-*/bin/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


# The one metric the benchmarks take from ncu: a kernel's GPU time, measured without replay (one
# pass), with the clocks left as the GPU sets them (`--clock-control none`: ncu would otherwise
# lock them at base, slower than the clocks of every timed run).
NCU_TIME_ARGS = ("--metrics", "gpu__time_duration.sum", "--csv", "--clock-control", "none")
_NCU_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
           "s": 1e3, "second": 1e3}


def ncu_command(ncu_args: list[str], argv: list[str]) -> list[str]:
    """`ncu NCU_TIME_ARGS ncu_args python argv`; FileNotFoundError where there is no ncu."""
    ncu = find_ncu()
    if ncu is None:
        raise FileNotFoundError("ncu not found (PATH, /usr/local/cuda/bin, "
                                "/opt/nvidia/nsight-compute)")
    return [ncu, *NCU_TIME_ARGS, *ncu_args, sys.executable, *argv]


def run_under_ncu(command: list[str], csv_path: pathlib.Path,
                  timeout: float) -> tuple[int | None, str]:
    """Runs `command` (`ncu_command`) with its stdout (ncu's CSV, among what the profiled python
    prints) into `csv_path`; returns (exit code, or None past `timeout`; stderr). ncu gets its own
    process group, which is killed once ncu returns, whatever it returned: the profiled python can
    outlive ncu (ncu's launcher hands it to init; an ab_gemm run that failed on an out-of-memory
    error held 73 GB of an H100 until killed), and a timeout or this process ending must not
    leave it on the GPU either."""
    # Files, not pipes: a process left behind holding a pipe would keep it open past ncu's exit.
    with open(csv_path, "w") as stdout, tempfile.TemporaryFile("w+") as stderr:
        child = subprocess.Popen(command, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, ""
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        stderr.seek(0)
        return child.returncode, stderr.read()


def ncu_kernel_times(csv_path: pathlib.Path) -> list[tuple[str, float]]:
    """(kernel name, ms) of every launch in the CSV that `run_under_ncu` wrote, in launch order;
    the child's own output lines in it are not CSV rows of ncu's header and are skipped."""
    with open(csv_path) as f:
        rows = [r for r in csv.reader(f) if len(r) > 10]
    if not rows:
        return []
    header = rows[0]
    name_i, value_i, unit_i = (header.index(c) for c in ("Kernel Name", "Metric Value",
                                                          "Metric Unit"))
    return [(r[name_i], float(r[value_i].replace(",", "")) * _NCU_MS[r[unit_i]])
            for r in rows[1:] if r != header]


def watchdog(seconds: float, on_expire) -> threading.Timer:
    """A started daemon timer calling `on_expire` after `seconds` unless cancelled: a hung
    collective cannot be cancelled, so the callback records the hang and exits the process."""
    timer = threading.Timer(seconds, on_expire)
    timer.daemon = True
    timer.start()
    return timer

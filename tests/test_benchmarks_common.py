"""benchmarks/_common.py: the round-robin timing (the order of the calls, a failing set), the GPU
clock sampler, and the ncu runner's cleanup."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _common  # noqa: E402


def test_round_robin_times_call_i_of_every_set_before_call_i_plus_1_and_drops_a_failing_set():
    calls = []
    fail_after = np.random.default_rng().integers(1, 4)  # set 2 raises on this call of its own

    def fn(name, x):
        calls.append(name)
        if name == "c" and calls.count("c") > fail_after:
            raise RuntimeError("out of memory")
        return x * 2

    sets = [("a", jnp.ones(3)), ("b", jnp.ones(3)), ("c", jnp.ones(3))]
    results = _common.time_round_robin(fn, sets, reps=5, warmups=1)
    timed_c = fail_after - 1  # its warm-up, then fail_after - 1 timed calls before the failure
    assert calls[:3] == ["a", "b", "c"]  # the warm-ups
    expected = [n for i in range(5) for n in "abc" if n != "c" or i <= timed_c]
    assert calls[3:] == expected
    for r in results[:2]:
        assert r["status"] == "ok" and len(r["times_ms"]) == 5
        assert r["median_ms"] == np.median(r["times_ms"]) and min(r["times_ms"]) > 0
    assert results[2]["status"] == "failed: RuntimeError: out of memory"
    assert "times_ms" not in results[2]


def _fake_nvidia_smi(lines: list[str], pause_s: float) -> list[str]:
    """A command that prints `lines` like `nvidia-smi --loop-ms`, one every `pause_s`, then waits
    to be terminated."""
    script = ("import sys, time\n"
              f"for line in {lines!r}:\n"
              "    print(line, flush=True)\n"
              f"    time.sleep({pause_s})\n"
              "time.sleep(60)\n")
    return [sys.executable, "-c", script]


def test_clock_sampler_summarises_the_samples_of_a_window_and_skips_lines_that_are_not_samples():
    import time

    rng = np.random.default_rng()
    clocks = rng.integers(1200, 1980, 6)
    lines = [f"{c}, {p:.2f}, {t}" for c, p, t in
             zip(clocks, rng.uniform(300, 700, 6), rng.integers(40, 80, 6))]
    lines.insert(3, "[N/A], [N/A], 55")  # a field the driver cannot read: not a sample
    sampler = _common.ClockSampler(command=_fake_nvidia_smi(lines, 0.05))
    try:
        t0 = time.monotonic()
        deadline = t0 + 20
        while len(sampler.samples) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        t1 = time.monotonic()
        summary = sampler.summary(t0 - 1, t1)
        assert summary["status"] == "ok" and summary["samples"] == 6
        assert summary["sm_clock_mhz"] == {"min": clocks.min(), "median": np.median(clocks),
                                           "max": clocks.max()}
        power = [float(line.split(",")[1]) for i, line in enumerate(lines) if i != 3]
        assert summary["power_w"]["max"] == max(power)
        # A window that holds only the last samples summarises only those.
        last = sampler.samples[-2][0]
        assert sampler.summary(last, t1)["samples"] == 2
        assert sampler.summary(t1 + 1, t1 + 2) == {"status": "no sample in the window"}
    finally:
        sampler.close()
    assert sampler.process.poll() is not None


def test_clock_sampler_without_nvidia_smi_or_with_one_that_fails_says_so():
    import time

    sampler = _common.ClockSampler(command=["/nonexistent/nvidia-smi"])
    summary = sampler.summary(0.0, 1e12)
    assert summary["status"].startswith("not sampled:") and "nvidia-smi" in summary["status"]
    failing = [sys.executable, "-c", "import sys; print('Invalid combination of input "
               "arguments.'); sys.exit(3)"]
    sampler = _common.ClockSampler(command=failing)
    sampler.process.wait()
    for _ in range(100):  # the reader thread takes the line
        if sampler.message:
            break
        time.sleep(0.01)
    assert sampler.summary(0.0, 1e12) == {
        "status": "nvidia-smi exited (3): Invalid combination of input arguments."}


def test_gpu_clocks_off_a_gpu_says_so():
    with _common.gpu_clocks() as clocks:
        pass
    assert clocks == {"status": "not on a GPU"}


def test_run_under_ncu_kills_the_profiled_process_that_outlives_ncu(tmp_path, monkeypatch):
    """A stand-in `ncu` that starts its "profiled" process in the background and exits at once,
    as ncu can when its launcher hands the application to init: the process is gone when
    `run_under_ncu` returns, and ncu's stdout (the CSV) and exit code come back."""
    pid_file = tmp_path / "profiled.pid"
    fake = tmp_path / "ncu"
    fake.write_text(f"#!/bin/bash\nsleep 300 &\necho $! > {pid_file}\n"
                    'echo \'"ID","Kernel Name"\'\nexit 3\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert _common.find_ncu() == str(fake)
    csv_path = tmp_path / "out.csv"
    command = _common.ncu_command([], ["-c", "pass"])
    assert command[0] == str(fake) and command[-3:] == [sys.executable, "-c", "pass"]
    returncode, _ = _common.run_under_ncu(command, csv_path, timeout=60)
    assert returncode == 3 and '"Kernel Name"' in csv_path.read_text()
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(pid):
        os.kill(pid, 9)
        raise AssertionError("the profiled process outlived run_under_ncu")


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (killed, not yet reaped by init)."""
    stat = pathlib.Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

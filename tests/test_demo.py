"""The demo language model and the `python -m moonep_jax` command line."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from moonep_jax import __main__ as cli
from moonep_jax import demo


@pytest.fixture
def standard_promotion():
    # optax's Adam bias correction raises `float ** int32` under the suite's strict promotion;
    # the demo runs with JAX's default (standard) promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def test_corpus_ships_with_the_package():
    corpus = demo.load_corpus()
    assert corpus.dtype == np.uint8 and corpus.size > 4096
    assert b"lighthouse" in corpus.tobytes()


def test_sample_batch_windows_are_corpus_slices(seed):
    corpus = demo.load_corpus()
    batch = demo.sample_batch(corpus, np.random.default_rng(seed), batch=4, seq_len=32)
    assert batch.shape == (4, 33) and batch.dtype == np.int32
    text = corpus.tobytes()
    for row in batch:
        assert bytes(row.astype(np.uint8)) in text


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_demo_trains_and_every_rank_receives_the_same_slots(seed, standard_promotion):
    out = io.StringIO()  # not a terminal: one progress line per `log_every` steps, no \r
    summary = demo.run(demo.DemoConfig(steps=20, seed=seed % 1000, log_every=8), out=out)
    text = out.getvalue()

    assert "\r" not in text
    lines = text.split("\n")
    progress, summary_lines = lines[:4], lines[4:]
    assert [line.split()[1] for line in progress] == ["1/20", "8/20", "16/20", "20/20"]
    # 16 sequences x 64 bytes over 8 ranks = 128 tokens per rank, top-2: 256 slots everywhere.
    assert all("recv/rank [256 256 256 256 256 256 256 256]" in line for line in progress)
    assert progress[0].endswith("(first step: compiled)") and progress[-1].endswith(" tok/s")
    assert ("  every rank received exactly 256 slots (S*K) in every layer and step"
            in summary_lines)
    assert summary["slots_per_rank"] == [256] and summary["devices"] == 8

    losses = summary["losses"]
    assert len(losses) == 20 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.75 * losses[0], losses


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_one_line_on_a_terminal_and_prints_lines_elsewhere(seed):
    steps = 5 + seed % 20
    every = 1 + seed % 4
    lines = [f"step {s}/{steps} of the run" for s in range(1, steps + 1)]
    for out in (_Terminal(), io.StringIO()):
        progress = demo.Progress(out, steps, every)
        for step, line in enumerate(lines, 1):
            progress.update(step, line)
        progress.close()
        if out.isatty():
            assert out.getvalue() == "".join("\r" + line for line in lines) + "\n"
        else:
            shown = [s for s in range(1, steps + 1) if s == 1 or s % every == 0 or s == steps]
            assert out.getvalue() == "".join(lines[s - 1] + "\n" for s in shown)


def test_demo_rejects_nonpositive_steps(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--log-every", "0"])
    assert "--log-every must be >= 1" in capsys.readouterr().err


def test_scaled_config_rounds_batch_and_experts_to_devices():
    cfg = demo.scaled_config(demo.DemoConfig(batch=16, num_experts=16), num_devices=6)
    assert (cfg.batch, cfg.num_experts) == (18, 18)


# ---- the command line ----------------------------------------------------------------------------


def test_simulate_cpu_devices_sets_the_flag_once(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    cli.simulate_cpu_devices()
    assert os.environ["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    cli.simulate_cpu_devices()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.delenv("XLA_FLAGS")
    cli.simulate_cpu_devices()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def write_fake_benchmark(directory: Path, name: str, exit_code: int) -> None:
    (directory / name).write_text(
        "import sys, pathlib\n"
        f"pathlib.Path(__file__).with_suffix('.args').write_text(' '.join(sys.argv[1:]))\n"
        f"sys.exit({exit_code})\n")


def test_bench_runs_present_scripts_and_passes_arguments(tmp_path, monkeypatch, capsys):
    benchmarks = tmp_path / "benchmarks"
    benchmarks.mkdir()
    write_fake_benchmark(benchmarks, "bench_dispatch.py", 0)
    write_fake_benchmark(benchmarks, "bench_layer.py", 3)  # bench_gemm.py is absent
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: benchmarks)

    assert cli.main(["bench", "--quick"]) == 3
    assert (benchmarks / "bench_dispatch.args").read_text() == "--quick"
    assert (benchmarks / "bench_layer.args").read_text() == "--quick"
    assert not (benchmarks / "bench_gemm.args").exists()
    assert "bench_layer.py exited with 3" in capsys.readouterr().err


def test_bench_without_scripts_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: tmp_path)
    assert cli.main(["bench"]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_cli_usage_and_unknown_command():
    run = [sys.executable, "-m", "moonep_jax"]
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "python -m moonep_jax demo" in helped.stdout
    unknown = subprocess.run([*run, "train"], capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "unknown command 'train'" in unknown.stderr


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the simulated CPU devices")
def test_cli_demo_simulates_eight_cpu_devices():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-m", "moonep_jax", "demo", "--steps", "2"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "for 2 steps on 8 cpu devices (EP=8)" in done.stdout
    assert "every rank received exactly 256 slots" in done.stdout
    # stdout is a pipe, not a terminal: whole progress lines, no \r redraws.
    assert "\r" not in done.stdout
    assert [line.split()[1] for line in done.stdout.splitlines()[:2]] == ["1/2", "2/2"]


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the simulated CPU devices")
def test_cli_demo_in_two_processes():
    """`--processes 2`: two jax.distributed processes (gloo) of 4 simulated devices each."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-m", "moonep_jax", "demo", "--processes", "2",
                           "--steps", "2"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "for 2 steps on 8 cpu devices in 2 processes (EP=8)" in done.stdout
    assert "every rank received exactly 256 slots" in done.stdout
    assert done.stdout.count("trained 2-layer MoE LM") == 1  # process 0 reports for the job


def test_cli_demo_rejects_more_processes_than_it_can_place(capsys):
    assert cli.main(["demo", "--processes", "0"]) == 2
    assert "--processes must be >= 1" in capsys.readouterr().err

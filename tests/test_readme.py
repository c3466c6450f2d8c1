"""The README's functional example is examples/functional_api.py, and it runs."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_readme_embeds_the_example_verbatim():
    readme = (REPO / "README.md").read_text()
    example = (REPO / "examples" / "functional_api.py").read_text()
    assert f"```python\n{example}```" in readme


def test_functional_example_runs_and_balances_exactly():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, str(REPO / "examples" / "functional_api.py")],
                            capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "slots received per rank: [512, 512, 512, 512, 512, 512, 512, 512]" in result.stdout
    assert "'w_gate_up': (32, 64, 256)" in result.stdout


def _readme_commands(needle: str) -> list[str]:
    """The README's bash lines that contain `needle`."""
    blocks = (REPO / "README.md").read_text().split("```bash\n")[1:]
    lines = [line for block in blocks for line in block.split("```")[0].splitlines()]
    return [line for line in lines if needle in line]


def test_readme_multi_process_command_runs_verbatim():
    """The README's two-process CPU command: ("data", "ep") mesh, data across the processes."""
    (command,) = _readme_commands("examples/multi_process.py")
    if not (REPO / ".venv" / "bin" / "python").exists():
        command = command.replace(".venv/bin/python", sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                            timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("process "))
    assert len(lines) == 2, result.stdout + result.stderr[-3000:]
    assert all("mesh {'data': 2, 'ep': 4}" in line and "per local rank [64]" in line
               for line in lines)
    assert lines[0].split("loss")[1] == lines[1].split("loss")[1]  # one job, one loss


def test_readme_demo_command_is_the_tested_one():
    (command,) = _readme_commands("demo --processes")
    assert command == ".venv/bin/python -m moonep_jax demo --processes 2 --steps 20"

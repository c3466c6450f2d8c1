"""Every ```python snippet of the README runs verbatim, in a fresh interpreter, and says what the
README claims. The first one is also examples/functional_api.py, byte for byte."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SNIPPETS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def run_snippet(code: str) -> str:
    """Runs `code` as a script from the repository root, as a user pasting it would; returns stdout.

    XLA_FLAGS is cleared so that the snippet's own device setting is what runs."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_readme_has_the_snippets_this_file_checks():
    assert len(SNIPPETS) == 3, [s.splitlines()[-1] for s in SNIPPETS]
    for code in SNIPPETS:
        ast.parse(code)  # a syntax error names the snippet before a subprocess runs


def test_readme_embeds_the_functional_example_verbatim():
    example = (REPO / "examples" / "functional_api.py").read_text()
    assert SNIPPETS[0] == example


def test_functional_snippet_runs_and_balances_exactly():
    stdout = run_snippet(SNIPPETS[0])
    assert "slots received per rank: [512, 512, 512, 512, 512, 512, 512, 512]" in stdout
    assert "'w_gate_up': (32, 64, 256)" in stdout


@pytest.mark.parametrize("index, module", [(1, "moonep_jax.flax"), (2, "moonep_jax.equinox")])
def test_module_snippet_runs_and_balances_exactly(index, module):
    code = SNIPPETS[index]
    assert module in code
    # 64 tokens per rank, top-4: 256 slots on each of the 8 simulated devices.
    assert "recv_slots per rank: [256, 256, 256, 256, 256, 256, 256, 256]" in run_snippet(code)


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

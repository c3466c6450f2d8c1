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

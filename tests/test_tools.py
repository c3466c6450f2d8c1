"""tools/setup.sh picks the GPU machine's Python (3.12) and tools/gpu.sh build refuses what would
not load there: another Python, or a cmake older than CMakeLists.txt's minimum.

Interpreters are stand-ins: shell scripts that run this Python with `sys.version_info` set to the
version they pretend to be (all the scripts ask of them), so no particular install is needed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def fake_python(path: pathlib.Path, version: tuple[int, int, int]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = -c ] || exec "{sys.executable}" "$@"\n'
        f'exec "{sys.executable}" -c "import sys; sys.version_info = {version!r}; '
        'exec(sys.argv[1])" "$2"\n')
    path.chmod(0o755)
    return path


def fake_pyenv(home: pathlib.Path, versions: list[str]) -> None:
    root = home / ".pyenv"
    for v in versions:
        fake_python(root / "versions" / v / "bin" / "python3", tuple(int(p) for p in v.split(".")))
    pyenv = root / "bin" / "pyenv"
    pyenv.parent.mkdir(parents=True, exist_ok=True)
    pyenv.write_text("#!/bin/sh\n"
                     f'[ "$1" = root ] && {{ echo "{root}"; exit 0; }}\n'
                     f"printf '%s\\n' {' '.join(versions)}\n")
    pyenv.chmod(0o755)


def which_python(tmp_path, on_path: dict[str, tuple[int, int, int]], pyenv: list[str]):
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    for name, version in on_path.items():
        fake_python(bin_dir / name, version)
    fake_pyenv(home, pyenv)
    # A PATH of the stand-ins and the few tools setup.sh runs, so that no interpreter of the
    # machine running the test can be picked.
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("dirname", "grep", "sort", "tail"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {"PATH": f"{bin_dir}:{tools}", "HOME": str(home)}
    setup = [shutil.which("bash"), str(REPO / "tools" / "setup.sh"), "--which-python"]
    return subprocess.run(setup, capture_output=True, text=True, env=env, timeout=60)


def test_setup_prefers_pyenvs_3_12_over_a_newer_python(tmp_path):
    done = which_python(tmp_path, {"python3": (3, 13, 0), "python3.13": (3, 13, 0)},
                        ["3.11.7", "3.12.1", "3.13.0"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "home/.pyenv/versions/3.12.1/bin/python3")
    assert done.stderr == ""


def test_setup_warns_when_only_a_newer_python_exists(tmp_path):
    done = which_python(tmp_path, {"python3": (3, 13, 0)}, ["3.11.7"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "python3"
    assert "no Python 3.12 found" in done.stderr and "tools/gpu.sh build needs 3.12" in done.stderr


def run_gpu_build(python: pathlib.Path):
    env = dict(os.environ, PYTHON=str(python))
    return subprocess.run(["bash", str(REPO / "tools" / "gpu.sh"), "build"], capture_output=True,
                          text=True, env=env, timeout=60, cwd=REPO)


def test_gpu_build_refuses_a_python_other_than_3_12(tmp_path):
    done = run_gpu_build(fake_python(tmp_path / "venv/bin/python", (3, 13, 0)))
    assert done.returncode != 0
    assert "the GPU machine runs Python 3.12" in done.stderr and "is Python 3.13" in done.stderr


def test_gpu_build_uses_the_cmake_next_to_the_python_and_checks_its_version(tmp_path):
    python = fake_python(tmp_path / "venv/bin/python", (3, 12, 1))
    cmake = tmp_path / "venv/bin/cmake"
    cmake.write_text("#!/bin/sh\necho 'cmake version 3.25.1'\n")
    cmake.chmod(0o755)
    done = run_gpu_build(python)
    assert done.returncode != 0
    assert f"{cmake} is cmake 3.25.1; CMakeLists.txt needs >= 3.26" in done.stderr


def test_gpu_run_passes_a_k_expression_whole(tmp_path):
    """GPU_TEST_K reaches both pytest runs as one -k argument, spaces and all."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls"
    # python3 and nvidia-smi stand-ins: each call appends its arguments, one per line, and a
    # separator.
    for name in ("python3", "nvidia-smi"):
        (stubs / name).write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" ---- >> "{calls}"\n')
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               GPU_TEST_K="grouped or not moe_ffn")
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu.sh"), "run"], capture_output=True,
                          text=True, env=env, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    runs = [c.splitlines() for c in calls.read_text().split("----\n") if "pytest" in c]
    assert len(runs) == 2  # single-process and multi-process
    for args in runs:
        assert args[args.index("-k") + 1] == "grouped or not moe_ffn"

"""Checks behind tools/bazel_check.sh that Bazel cannot make itself (standard library only).

  python bazel/check.py files BAZEL      BUILD.bazel builds what CMakeLists.txt builds, with its flags
  python bazel/check.py module SO_PATH   the built library loads and registers every FFI target

Each prints what it compared and exits 1 with the difference when something does not match.
"""

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Flags BUILD.bazel spells out that CMake adds implicitly: CMAKE_CUDA_STANDARD 17, the Release
# build type, and pybind11_add_module's hidden visibility.
IMPLICIT_CMAKE_FLAGS = {"-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fvisibility=hidden"}
# Files under the header directories that are neither sources nor headers of the library.
NOT_HEADERS = {".cc", ".cu", ".py", ".pyc", ".md"}


def _query(bazel, *args):
    result = subprocess.run([bazel, "query", *args], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"bazel query {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout


def _labels(bazel, expression):
    return {line.removeprefix("//:") for line in _query(bazel, expression).split()}


def _compare(what, expected, actual):
    """Reports `what`; returns False (after printing both differences) when the sets differ."""
    missing, extra = sorted(expected - actual), sorted(actual - expected)
    if missing or extra:
        print(f"FAIL {what}: missing {missing}, unexpected {extra}")
        return False
    print(f"ok   {what} ({len(expected)})")
    return True


def _cmake_cuda_flags():
    """The nvcc flags CMakeLists.txt gives every source: the gencode variable plus the flags of
    the `$<$<COMPILE_LANGUAGE:CUDA>:...>` compile options."""
    text = (ROOT / "CMakeLists.txt").read_text()
    gencode = re.search(r'set\(MOONEP_CUDA_GENCODE\s+"([^"]+)"\)', text)
    options = re.search(r"\$<\$<COMPILE_LANGUAGE:CUDA>:(.*?)>\)", text, re.S)
    if not gencode or not options:
        sys.exit("CMakeLists.txt: cannot find MOONEP_CUDA_GENCODE or the CUDA compile options; "
                 "update bazel/check.py together with it")
    flags = set(options.group(1).split())
    flags.discard("${MOONEP_CUDA_GENCODE}")
    return flags | set(gencode.group(1).split())


def _bazel_copts(bazel):
    rule = _query(bazel, "--output=build", "//:moonep_objects")
    copts = re.search(r"^\s*copts = (\[.*\]),$", rule, re.M)
    return set(ast.literal_eval(copts.group(1))) if copts else set()


def check_files(bazel):
    """BUILD.bazel vs CMakeLists.txt: sources (CMake's globs), headers, CuTe DSL, nvcc flags."""
    cmake_sources = {p.relative_to(ROOT).as_posix()
                     for pattern in ("xla_ffi/*.cc", "kernels/*.cu") for p in ROOT.glob(pattern)}
    ok = _compare("sources = CMake's globs xla_ffi/*.cc kernels/*.cu", cmake_sources,
                  _labels(bazel, "labels(srcs, //:moonep_objects)"))
    # A file the sources include but Bazel does not declare fails only in Bazel's sandbox.
    header_like = {p.relative_to(ROOT).as_posix()
                   for directory in ("xla_ffi", "kernels") for p in (ROOT / directory).rglob("*")
                   if p.is_file() and p.suffix not in NOT_HEADERS and "__pycache__" not in p.parts}
    ok &= _compare("headers = every other file under xla_ffi/ and kernels/", header_like,
                   _labels(bazel, "labels(hdrs, //:moonep_objects)"))
    has_generator = (ROOT / "kernels/cutedsl/build_aot.py").exists()
    has_rule = "cutedsl_kernels" in _labels(bazel, "//:all")
    ok &= _compare("CuTe DSL kernels built iff kernels/cutedsl/build_aot.py exists",
                   {has_generator}, {has_rule})
    cmake_flags = _cmake_cuda_flags()
    ok &= _compare("nvcc flags = CMakeLists.txt's", cmake_flags | IMPLICIT_CMAKE_FLAGS,
                   _bazel_copts(bazel))
    return ok


def check_module(so_path):
    """Loads the library by path (an installed or editable copy must not answer instead) and
    compares its PyInit name and registrations() with module.cc and targets.inc."""
    module_cc = (ROOT / "xla_ffi/module.cc").read_text()
    name = re.search(r"PYBIND11_MODULE\((\w+)", module_cc).group(1)
    ok = _compare("library file name = PYBIND11_MODULE name", {name},
                  {pathlib.Path(so_path).name.split(".")[0]})
    spec = importlib.util.spec_from_file_location(name, so_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    targets_inc = (ROOT / "xla_ffi/targets.inc").read_text()
    declared = set(re.findall(r'^MOONEP_TARGET\("(\w+)"', targets_inc, re.M))
    ok &= _compare("registrations() = xla_ffi/targets.inc", declared, set(module.registrations()))
    return ok


def main(argv):
    commands = {"files": check_files, "module": check_module}
    if len(argv) != 2 or argv[0] not in commands:
        sys.exit(__doc__)
    return 0 if commands[argv[0]](argv[1]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

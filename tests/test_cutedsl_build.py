"""The CuTe DSL kernels compile ahead of time, on this GPU-less host, into sm_90a objects.

Runs kernels/cutedsl/build_aot.py into a temporary directory, then reads the embedded cubins out
of the exported x86-64 objects and checks their target (ELF e_machine EM_CUDA, e_flags sm_90a).
Also checks that CMake's list of exported prefixes matches build_aot.py's, and, where `cuobjdump`
is installed, that the GEMM's SASS uses HGMMA and TMA loads (UTMALDG).
"""

import importlib
import pathlib
import re
import shutil
import struct
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CUTEDSL_DIR = REPO / "kernels" / "cutedsl"
EM_X86_64, EM_CUDA = 62, 190
SM_90A_FLAGS_ARCH = 0x5A  # e_flags bits 8..15 of a CUDA ELF hold the SM version (90 = 0x5a)

pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) is not installed")


def _exported_prefixes():
    sys.path.insert(0, str(CUTEDSL_DIR))
    try:
        build_aot = importlib.import_module("build_aot")
        prefixes = []
        for module_name in build_aot.KERNEL_MODULES:
            prefixes += list(importlib.import_module(module_name).EXPORTS)
        return prefixes
    finally:
        sys.path.remove(str(CUTEDSL_DIR))


def _elf_header(blob: bytes, offset: int = 0):
    """(e_machine, e_flags) of the 64-bit little-endian ELF starting at `offset`."""
    assert blob[offset:offset + 4] == b"\x7fELF" and blob[offset + 4] == 2
    e_machine = struct.unpack_from("<H", blob, offset + 18)[0]
    e_flags = struct.unpack_from("<I", blob, offset + 48)[0]
    return e_machine, e_flags


def _embedded_cubins(blob: bytes):
    """Offsets of the CUDA ELF images embedded in an object file."""
    return [m.start() for m in re.finditer(b"\x7fELF\x02", blob)
            if m.start() > 0 and _elf_header(blob, m.start())[0] == EM_CUDA]


@pytest.fixture(scope="module")
def aot_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cutedsl_aot")
    subprocess.run([sys.executable, str(CUTEDSL_DIR / "build_aot.py"), "--out", str(out),
                    "--arch", "sm_90a"], check=True, capture_output=True, text=True, timeout=600)
    return out


def test_cmake_builds_every_exported_kernel():
    cmake = (REPO / "cmake" / "cutedsl.cmake").read_text()
    listed = re.search(r"set\(MOONEP_CUTEDSL_PREFIXES\s+([^)]*)\)", cmake).group(1).split()
    assert listed == _exported_prefixes()


def test_aot_objects_are_x86_64_with_sm_90a_cubins(aot_dir):
    for prefix in _exported_prefixes():
        blob = (aot_dir / f"{prefix}.o").read_bytes()
        assert _elf_header(blob)[0] == EM_X86_64, prefix
        cubins = _embedded_cubins(blob)
        assert cubins, f"{prefix}.o embeds no CUDA ELF"
        for offset in cubins:
            e_flags = _elf_header(blob, offset)[1]
            assert (e_flags >> 8) & 0xFF == SM_90A_FLAGS_ARCH, f"{prefix}: e_flags {e_flags:#x}"
        header = (aot_dir / f"{prefix}.h").read_text()
        assert f"cute_dsl_{prefix}_wrapper" in header


def _cuda_binutils_dir() -> pathlib.Path | None:
    """Where cuobjdump lives: PATH, or the nvidia-cuda-cuobjdump wheel tools/setup.sh installs."""
    on_path = shutil.which("cuobjdump")
    if on_path:
        return pathlib.Path(on_path).parent
    import nvidia  # namespace package of NVIDIA's CUDA wheels

    for root in map(pathlib.Path, nvidia.__path__):
        if (root / "cu13" / "bin" / "cuobjdump").exists():
            return root / "cu13" / "bin"
    return None


def _sass(path: pathlib.Path) -> str:
    bin_dir = _cuda_binutils_dir()
    if bin_dir is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump "
                    "nvidia-cuda-nvdisasm, as tools/setup.sh does)")
    # cuobjdump runs nvdisasm for SASS; the wheels put both in the same folder.
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "NVDISASM_PATH": str(bin_dir)}
    return subprocess.run([str(bin_dir / "cuobjdump"), "--dump-sass", str(path)], check=True,
                          capture_output=True, text=True, env=env).stdout


def test_gemm_sass_uses_hgmma_and_tma(aot_dir):
    for prefix in (p for p in _exported_prefixes() if p.startswith("moonep_grouped_matmul")):
        blob = (aot_dir / f"{prefix}.o").read_bytes()
        cubin = aot_dir / f"{prefix}.cubin"
        # The first embedded CUDA ELF runs to the end of its section; cuobjdump tolerates the tail.
        cubin.write_bytes(blob[_embedded_cubins(blob)[0]:])
        sass = _sass(cubin)
        assert sass.count("HGMMA") > 0, prefix
        assert sass.count("UTMALDG") > 0, prefix
        assert "LDL" not in sass and "STL" not in sass, f"{prefix} spills to local memory"
        # In every K loop (one per number of 64-row blocks a warp group multiplies), a K tile's
        # WGMMAs issue back to back; then the loop waits until one K tile of them is left in
        # flight, and once the loop ends, for all. Single WGMMAs each followed by a wait mean
        # ptxas serialised them (C7514/C7518/C7520: an accumulator read while one was in flight,
        # or a WGMMA under a branch it cannot prove uniform); a second wait for all means it
        # injected one into every K tile (C7517), so no K tile overlaps the next.
        loops = []  # (WGMMAs of a K tile, the waits after them)
        for line in sass.splitlines():
            if "HGMMA" in line:
                if not loops or loops[-1][1]:
                    loops.append([0, []])
                loops[-1][0] += 1
            elif "WARPGROUP.DEPBAR" in line and loops:
                loops[-1][1].append(line.split("DEPBAR.LE")[1].split(";")[0].strip())
        assert loops, prefix
        for wgmmas, waits in loops:
            assert wgmmas >= 4, f"{prefix}: WGMMAs serialised ({wgmmas} between waits)"
            assert waits == ["gsb0, 0x1", "gsb0, 0x0"], f"{prefix}: K-loop waits {waits}"


def test_an_override_recompiles_only_the_kernels_that_read_it(aot_dir, tmp_path):
    """`--override DW_LAG_K_TILES=2` (a dW-only constant) changes the dW object and leaves the
    forward and dX objects byte for byte as the plain build writes them."""
    proc = subprocess.run([sys.executable, str(CUTEDSL_DIR / "build_aot.py"), "--out",
                           str(tmp_path), "--arch", "sm_90a", "--override", "DW_LAG_K_TILES=2"],
                          check=True, capture_output=True, text=True, timeout=600)
    assert "DW_LAG_K_TILES = 2 (--override)" in proc.stdout
    for prefix in _exported_prefixes():
        same = (tmp_path / f"{prefix}.o").read_bytes() == (aot_dir / f"{prefix}.o").read_bytes()
        assert same == (prefix != "moonep_grouped_matmul_dw"), prefix


def test_a_register_split_the_cta_cannot_give_fails_the_build(tmp_path):
    """setmaxnreg moves registers within one CTA's pool: consumers asking for more than the
    producer warp group gives back would wait forever on the GPU (32 / 240 did), so the build
    refuses such a split and names the constants."""
    proc = subprocess.run([sys.executable, str(CUTEDSL_DIR / "build_aot.py"), "--out",
                           str(tmp_path), "--arch", "sm_90a", "--override", "CONSUMER_REGS=240"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "PRODUCER_REGS / CONSUMER_REGS" in proc.stderr and "168 a thread" in proc.stderr

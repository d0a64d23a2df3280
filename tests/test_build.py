"""nvcc compile check of every forward specialization (issue 3/4): no spills, shared memory within limits.

Runs `python -m cuflash.build --check` once per session when nvcc is present (~15 s on 2 cores);
skips with the reason otherwise. The unit tests of the table and the ptxas parser need nothing.
"""
import subprocess
import sys

import pytest

from cuflash import build, kernels


def test_every_native_head_dim_has_a_tile_and_fits():
    for dtype in kernels.SUPPORTED_DTYPES:
        for d in range(1, 257):
            for cc, limit in kernels.SMEM_LIMIT.items():
                spec = kernels.select_spec(dtype, d, limit)
                assert spec.head_dim >= d and spec.smem_bytes <= limit, (dtype, d, cc, spec)


def test_name_expression_and_unsupported_inputs():
    spec = kernels.select_spec("bfloat16", 40)
    assert spec.name_expression == "cuflash::flash_fwd_kernel<__nv_bfloat16, 64, 128, 64, 4>"
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        kernels.select_spec("float32", 64)
    with pytest.raises(ValueError, match="at most 256"):
        kernels.select_spec("float16", 320)


def test_parse_ptxas():
    text = (
        "ptxas info    : Compiling entry function '_ZN7cuflash16flash_fwd_kernelI6__halfLi64ELi128ELi64ELi4EEEvPKT_' "
        "for 'sm_80'\n"
        "ptxas info    : Function properties for _ZN7cuflash16flash_fwd_kernelI6__half\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 16 bytes smem, 628 bytes cmem[0]\n")
    rep = build.parse_ptxas(text)
    assert rep == {(("float16", 64, 128, 64, 4), 80): {"registers": 255, "stack": 8, "spill": 8, "static_smem": 16}}


@pytest.mark.slow
def test_compile_check_all_specializations():
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found (CUDA_PATH, /usr/local/cuda or PATH): compile check not run")
    res = subprocess.run([sys.executable, "-m", "cuflash.build", "--check"], capture_output=True, text=True,
                         timeout=900)
    print(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    assert " 0 failing" in res.stdout


def test_nvrtc_compiles_every_specialization():
    """CuPy compiles with NVRTC, which has no host headers: nvcc accepting the source proves nothing
    about it (an INFINITY from <math.h> once passed nvcc and the emulator and failed here)."""
    from cuflash import nvrtc

    lib, why = nvrtc.load()
    if lib is None:
        pytest.skip(f"NVRTC check not run: {why}")
    if nvrtc.cuda_include() is None:
        pytest.skip("NVRTC check not run: CUDA headers (cuda_fp16.h) not found")
    results = nvrtc.compile_all(lib, nvrtc.cuda_include())
    assert {(fam, arch) for fam, arch, _, _ in results} == {(f, a) for f in ("forward", "backward") for a in (80, 90)}
    failures = [f"{fam} sm_{arch}:\n{log}" for fam, arch, _, log in results if log is not None]
    assert not failures, "\n".join(failures)


def test_nvrtc_reports_a_compile_error():
    """Guard against a check that passes vacuously: a source NVRTC must reject is rejected."""
    from cuflash import nvrtc

    lib, why = nvrtc.load()
    if lib is None or nvrtc.cuda_include() is None:
        pytest.skip(f"NVRTC check not run: {why or 'no CUDA headers'}")
    log = nvrtc.compile_source(lib, '__global__ void k(float* x) { x[0] = INFINITY; }', [], 80,
                               nvrtc.cuda_include())
    assert log is not None and "INFINITY" in log

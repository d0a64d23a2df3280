"""The compile check (cuflash.cuda.compile): every specialization, compiled as CuPy compiles it on a GPU machine.

The table tests need nothing; the compile tests need CuPy with NVRTC (the test extra installs cupy-cuda12x and the
CUDA 12 NVRTC and runtime headers on Linux x86-64) and skip with the reason elsewhere. None needs a GPU.
"""
import io
import subprocess
import sys

import numpy as np
import pytest

from cuflash.cuda import compile as cc
from cuflash.cuda import params, specs
from cuflash.cuda.source import kernel_source


def _need_cupy():
    try:
        return cc.cupy_compiler()
    except ImportError as exc:
        pytest.skip(str(exc))


# ------------------------------------------------------------------------------------------------ the tables
def test_every_head_dim_has_a_tile_that_fits():
    for family in specs.TILES:
        for dtype in specs.CTYPES:
            for d in range(1, 257):
                for cc_, limit in specs.SMEM_LIMIT.items():
                    try:
                        spec = specs.select(family, dtype, d, limit, cc=cc_)
                    except ValueError as exc:  # the one hole of the table, said in the message
                        assert (family, limit, d > 192) == ("bwd", 99 * 1024, True), exc
                        assert "needs an A100/H100-class GPU" in str(exc)
                        continue
                    assert spec.head_dim >= d and spec.smem_bytes <= limit, (family, dtype, d, limit, spec)


def test_arch_rows_run_on_their_gpu_only():
    """specs.ARCH_TILES: the Hopper rows for head_dim 128 (measured faster there) are what an sm_90 GPU selects,
    plain and, unless ARCH_PLAIN_ONLY, with a modifier, and what the compile check holds to sm_90; A100 and the 99 KB
    GPUs keep the table's rows."""
    assert specs.ARCH_TILES and specs.ARCH_PLAIN_ONLY <= set(specs.ARCH_TILES), "no per-GPU rows, or stray flags"
    for (family, d, arch), tile in specs.ARCH_TILES.items():
        want = (tile.block_m, tile.block_n, tile.warps)
        plain_only = (family, d, arch) in specs.ARCH_PLAIN_ONLY
        table = specs.TILES[family][d][0]
        for head_dim in (d - 1, d):  # a padded head dim runs the native row too
            # no modifier; a score modifier; mask code only (a mask modifier, a BlockMask)
            for modified, plain in ((False, True), (True, False), (False, False)):
                got = specs.select(family, "float16", head_dim, specs.SMEM_LIMIT[arch], modified=modified,
                                   plain=plain, cc=arch)
                expected = (table.block_m, table.block_n, table.warps) if plain_only and not plain else want
                assert (got.block_m, got.block_n, got.warps) == expected
        for other, limit in specs.SMEM_LIMIT.items():
            if other != arch:
                got = specs.select(family, "float16", d, limit, cc=other)
                assert (got.block_m, got.block_n, got.warps) != want
        on_arch = specs.specs_by_arch()[arch]
        assert any((s.family, s.head_dim, s.block_m, s.block_n, s.warps) == (family, d, *want) for s in on_arch)
        assert any((s.family, s.head_dim, s.block_m, s.block_n, s.warps) == (family, d, *want)
                   for s in specs.all_specs((family,)))
        modded = [s for _, _, chosen, _ in cc._jobs((arch,), sources=(specs.SOURCES[family],))
                  for s in chosen if s.mods != "cuflash::NoMods"]
        assert any((s.family, s.head_dim, s.block_m, s.block_n, s.warps) == (family, d, *want)
                   for s in modded) is not plain_only


def test_name_expression_and_limits():
    spec = specs.select("fwd", "bfloat16", 40)
    assert spec.name_expression == "cuflash::flash_fwd_kernel<__nv_bfloat16, 64, 128, 64, 4, cuflash::NoMods>"
    with pytest.raises(ValueError, match="at most 256"):
        specs.select("fwd", "float16", 320)
    with pytest.raises(ValueError, match="invalid kernel specialization"):
        specs.KernelSpec("fwd", "float16", 64, 128, 64, 3)


def test_parse_ptxas():
    text = ("ptxas info    : Compiling entry function '_ZN7cuflash16flash_fwd_kernelI6__halfE' for 'sm_80'\n"
            "ptxas info    : Function properties for _ZN7cuflash16flash_fwd_kernelI6__halfE\n"
            "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 16 bytes smem, 628 bytes cmem[0]\n")
    assert cc.parse_ptxas(text) == {("_ZN7cuflash16flash_fwd_kernelI6__halfE", 80):
                                    {"registers": 255, "stack": 8, "spill": 8, "static_smem": 16}}


def test_row_judgement():
    spec = specs.select("fwd", "float16", 64)
    assert cc.Row(spec, 80, 99 * 1024, registers=200).judge().problems == []
    bad = cc.Row(spec, 80, 1024, registers=250, spill=8, stack=16).judge().problems
    assert len(bad) == 4 and any("spare" in p for p in bad) and any("shared" in p for p in bad)


# ------------------------------------------------------------------------------------------------ the params struct
def test_host_layout_check_passes_and_catches_a_drifted_dtype(monkeypatch):
    try:
        assert cc.check_host_layout() is None
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    names = list(params.PARAMS.names)
    i, j = names.index("seqlen_q"), names.index("seqlen_k")
    names[i], names[j] = names[j], names[i]  # the same fields, two of them swapped
    drifted = np.dtype([(n, params.PARAMS.fields[n][0]) for n in names], align=True,
                       metadata={"ctype": "cuflash::Params"})
    monkeypatch.setattr(params, "PARAMS", drifted)
    monkeypatch.setattr(params.layout_asserts, "__defaults__", (drifted,))
    log = cc.check_host_layout()
    assert log is not None and "seqlen_q: offset differs" in log


# ------------------------------------------------------------------------------------------------ NVRTC
def test_runtime_options_are_what_cupy_passes_to_nvrtc(monkeypatch):
    """CuPy's own RawModule path (compile_with_cache), with its two device queries stubbed, records the options it
    hands to NVRTC: they must be runtime_options (the check adds only ptxas' -v; --pch only caches parsing)."""
    compiler, core = _need_cupy()
    seen = []

    class Recorder(compiler._NVRTCProgram):
        def compile(self, options=(), log_stream=None):
            seen.append((self.src, tuple(options)))
            if self.src == "":  # CuPy's version probe of an empty file
                return super().compile(options, log_stream)
            raise KeyboardInterrupt  # stop before loading a module (no GPU)

    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")  # no disk cache hit: always compile
    monkeypatch.setattr(compiler, "_NVRTCProgram", Recorder)
    monkeypatch.setattr(compiler, "_get_arch", lambda: "90")
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    source = kernel_source("flash_fwd.cu")
    with pytest.raises(KeyboardInterrupt):
        core.compile_with_cache(source, cc.KERNEL_OPTIONS, prepend_cupy_headers=False,
                                name_expressions=[specs.select("fwd", "float16", 64).name_expression])
    options = [o for src, o in seen if src == source]
    assert len(options) == 1
    assert tuple(o for o in options[0] if o != "--pch") == cc.runtime_options(90)


def test_nvrtc_reports_a_compile_error():
    """Guard against a check that passes vacuously: a source NVRTC must reject is rejected (NVRTC has no
    <math.h>: an INFINITY once passed nvcc and the emulator and would have failed on the first GPU)."""
    compiler, _ = _need_cupy()
    with pytest.raises(compiler.CompileException, match="INFINITY"):
        cc.compile_names("__global__ void k(float* x) { x[0] = INFINITY; }", ["k"], 80)


def test_shared_memory_assert_catches_a_drifted_formula():
    compiler, _ = _need_cupy()

    class Drifted(specs.KernelSpec):
        smem_bytes = property(lambda self: specs.KernelSpec.smem_bytes.fget(self) + 16)

    spec = specs.select("fwd", "float16", 64)
    drifted = Drifted(*(getattr(spec, f) for f in ("family", "dtype", "head_dim", "block_m", "block_n", "warps")))
    source = kernel_source(spec.source)
    cc.compile_names(cc.translation_unit(source, [spec]), [spec.name_expression], 80)
    with pytest.raises(compiler.CompileException, match="shared memory differs"):
        cc.compile_names(cc.translation_unit(source, [drifted]), [spec.name_expression], 80)


def test_compile_check_all_specializations():
    """`python -m cuflash build`: every specialization for sm_80 and sm_90, plain and with a modifier
    compiled in, 0 spills, register headroom, shared memory within limits and equal in C++ and Python
    (~70 s on 2 cores)."""
    _need_cupy()
    res = subprocess.run([sys.executable, "-m", "cuflash", "build"], capture_output=True, text=True,
                         timeout=900)
    print(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    plain = len(specs.specs_by_arch()[80]) + len(specs.specs_by_arch()[90])
    import re

    counted = int(re.search(r"(\d+) specializations, 0 failing", res.stdout).group(1))
    assert counted > plain and "params layout (host compiler, every offset): ok" in res.stdout
    assert res.stdout.count("cuflash::Mods_") == counted - plain  # the float16 ones again, with a modifier compiled in


def test_check_reports_missing_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy._core", None)
    out = io.StringIO()
    assert cc.check(out=out) == -1 and "compile check not run: CuPy with NVRTC is needed" in out.getvalue()


def test_check_without_a_host_compiler_is_not_run(monkeypatch):
    """The params layout is checked with g++: without one the check is "not run" (exit 2), not a traceback."""
    import shutil

    _need_cupy()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = io.StringIO()
    assert cc.check(out=out) == -1 and "compile check not run: no host C++ compiler" in out.getvalue()


def test_benchmark_tile_candidates_pass_the_compile_check():
    """benchmarks/cases.py's TILE_CANDIDATES (the CUDA tile sweep times them beside the table's rows): each compiles
    for sm_80 and sm_90 as the table's rows must, so that a GPU run spends its minutes timing, not failing."""
    _need_cupy()
    from dataclasses import replace

    from benchmarks.cases import TILE_CANDIDATES

    chosen: dict = {}
    for op, d, tiles in TILE_CANDIDATES:
        table = specs.select(op, "float16", d)
        assert tuple(tiles[0]) == (table.block_m, table.block_n, table.warps)  # the table's row first
        for bm, bn, w in tiles:
            chosen.setdefault(table.source, {})[replace(table, block_m=bm, block_n=bn, warps=w)] = None
    for source_name, family in chosen.items():
        source = cc.translation_unit(kernel_source(source_name), family)
        for arch in (80, 90):
            mapping, log = cc.compile_names(source, [s.name_expression for s in family], arch)
            report = cc.parse_ptxas(log)
            for spec in family:
                row = cc.Row(spec, arch, specs.SMEM_LIMIT[arch], **report.get((mapping[spec.name_expression], arch),
                                                                              {}))
                assert row.judge().problems == [], (spec.name_expression, arch, row.problems)


def test_modifier_helpers_compile_for_nvrtc(tmp_path):
    """floor_div/floor_mod (a zero divisor gives 0) and the NaN-propagating nan_min/nan_max of kernels/mods.cuh,
    which the representative modifier of the compile check does not reach, compile with CuPy's options."""
    _need_cupy()
    from cuflash.cuda.source import KERNELS_DIR, inline_includes

    probe = tmp_path / "probe.cu"
    probe.write_text(f'#include "{KERNELS_DIR / "mods.cuh"}"\n'
                     'extern "C" __global__ void k(int* i, float* f, double* d) {\n'
                     '  i[0] = cuflash::floor_div(i[1], i[2]) + cuflash::floor_mod(i[1], i[2]);\n'
                     '  f[0] = cuflash::nan_max(f[1], f[2]) + cuflash::nan_min(f[1], 2.0f);\n'
                     '  d[0] = cuflash::nan_max(d[1], d[2]) + cuflash::nan_min(d[1], 1.0);\n'
                     '}\n')
    for arch in (80, 90):
        mapping, _ = cc.compile_names(inline_includes(probe), ["k"], arch)
        assert "k" in mapping


@pytest.mark.parametrize("real, text", [
    ("float", "score * 1e-50 + score / 1e25 / 1e25 + score * 1e-40 + score * 1.0000000596046448"),
    ("double", "score * 5e-324 + score * 1e-310 + score * 1e300"),
])
def test_float_literals_past_the_real_types_range_compile_for_nvrtc(real, text, tmp_path):
    """A float literal is written as the value the kernels compute with (the float32 nearest, for float kernels):
    the double's digits with an f were an NVRTC error ("floating constant is out of range") for 1e-50, and for
    1e-25 ** 2, which the derivative folds (dscore is in every modifier's struct: the forward failed too)."""
    _need_cupy()
    from cuflash import mods
    from cuflash.cuda import modcode
    from cuflash.cuda.source import KERNELS_DIR, inline_includes

    _, code = modcode.render(mods.Modifiers(mods.parse(text, kind="score"), None, {}), real=real)
    probe = tmp_path / "probe.cu"
    headers = ("mods.cuh", "wide_math.cuh") if real == "double" else ("mods.cuh",)
    probe.write_text("".join(f'#include "{KERNELS_DIR / h}"\n' for h in headers) + code +
                     '\nextern "C" __global__ void k() {}\n')
    source = inline_includes(probe)
    for arch in (80, 90):
        mapping, _ = cc.compile_names(source, ["k"], arch)
        assert "k" in mapping

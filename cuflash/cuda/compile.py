"""The compile check: every specialization, compiled as CuPy will compile it on the GPU machine.

``python -m cuflash build`` compiles each kernel family for sm_80 and sm_90 with CuPy's own
NVRTC program wrapper, CuPy's include paths and options (:func:`runtime_options`), so a check that
passes here means the run-time compile passes there. It needs CuPy and NVRTC, not a GPU: the test
extra installs ``cupy-cuda12x`` with the CUDA 12 NVRTC and runtime headers. From ``ptxas -v`` it
fails on any spill or local stack frame, on fewer than :data:`~cuflash.cuda.specs.REGISTER_HEADROOM`
spare registers, and on shared memory above what the GPUs that select the specialization allow; the
translation unit also asserts that each specialization's shared memory in C++ (``kSmemBytes``)
equals :attr:`~cuflash.cuda.specs.KernelSpec.smem_bytes`, the figure the launch requests.
"""
from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import params, specs
from .source import KERNELS_DIR, kernel_source

#: what cuflash passes to ``cupy.RawModule(options=...)`` (backends/cuda.py).
KERNEL_OPTIONS = ("--std=c++17",)
MAX_REGISTERS = 255

_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for 'sm_(?P<arch>\d+)'")
_STACK = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads")
_REGS = re.compile(r"Used (?P<regs>\d+) registers(?:.*?(?P<smem>\d+) bytes smem)?")


def cupy_compiler():
    """``(cupy.cuda.compiler, cupy._core.core)`` or raise ImportError with the reason."""
    try:
        from cupy._core import core
        from cupy.cuda import compiler, nvrtc

        nvrtc.getVersion()  # loads libnvrtc: fails here, with its reason, when no NVRTC is installed
    except Exception as exc:  # ImportError, or cuda.pathfinder's DynamicLibNotFoundError
        raise ImportError(f"CuPy with NVRTC is needed ({type(exc).__name__}: {exc}); "
                          f"pip install -e '.[test]' installs cupy-cuda12x and the CUDA 12 NVRTC") from None
    return compiler, core


def runtime_options(arch: int) -> tuple:
    """The NVRTC options CuPy's ``RawModule(code, options=KERNEL_OPTIONS)`` compiles with for ``sm_<arch>``.

    ``cupy._core.core.compile_with_cache`` → ``assemble_cupy_compiler_options`` (C++ standard, CCCL,
    CuPy and CUDA include paths) → ``cupy.cuda.compiler._compile_with_cache_cuda`` (``-ftz=true``)
    → ``_compile_using_nvrtc_no_warning`` (``-arch=sm_XX`` for a cubin, and
    ``--device-as-default-execution-space``). ``--pch`` (NVRTC >= 12.8) only caches parsing.
    ``tests/test_compile.py`` holds this tuple equal to what CuPy's own path passes to NVRTC.
    """
    _, core = cupy_compiler()
    return core.assemble_cupy_compiler_options(KERNEL_OPTIONS) + ("-ftz=true", f"-arch=sm_{arch}",
                                                                   "--device-as-default-execution-space")


def compile_names(source: str, names, arch: int, extra: tuple = ()) -> tuple[dict, str]:
    """Compile ``source`` for ``sm_<arch>`` with :func:`runtime_options` and ptxas' report; return
    ``(name expression → mangled name, log)``. Raises ``cupy.cuda.compiler.CompileException``."""
    compiler, _ = cupy_compiler()
    log = io.StringIO()
    prog = compiler._NVRTCProgram(source, "cuflash.cu", name_expressions=list(names), method="cubin")
    _, mapping = prog.compile(runtime_options(arch) + ("--ptxas-options=-v",) + extra, log)
    return dict(mapping), log.getvalue()


def parse_ptxas(text: str) -> dict[tuple[str, int], dict]:
    """``{(mangled name, arch): {registers, stack, spill, static_smem}}`` from ``ptxas -v``."""
    found, current = {}, None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = found.setdefault((m.group("name"), int(m.group("arch"))),
                                       {"registers": -1, "stack": 0, "spill": 0, "static_smem": 0})
            continue
        if current is None:
            continue
        m = _STACK.search(line)
        if m:
            current["stack"] = int(m.group("stack"))
            current["spill"] = int(m.group("st")) + int(m.group("ld"))
            continue
        m = _REGS.search(line)
        if m:
            current["registers"] = int(m.group("regs"))
            current["static_smem"] = int(m.group("smem") or 0)
    return found


@dataclass
class Row:
    spec: specs.KernelSpec
    arch: int
    smem_limit: int
    registers: int = -1
    stack: int = 0
    spill: int = 0
    static_smem: int = 0
    problems: list = field(default_factory=list)

    def judge(self):
        shared = self.static_smem + self.spec.smem_bytes
        if self.registers < 0:
            self.problems.append("no ptxas report")
        if self.spill:
            self.problems.append(f"{self.spill} spill bytes")
        if self.stack:
            self.problems.append(f"{self.stack} bytes stack frame")
        if self.registers > MAX_REGISTERS - specs.REGISTER_HEADROOM and self.spec.mods == "cuflash::NoMods":
            self.problems.append(f"{self.registers} registers leave less than {specs.REGISTER_HEADROOM} spare")
        if shared > self.smem_limit:
            self.problems.append(f"shared {shared} > {self.smem_limit}")
        return self


def translation_unit(family_source: str, family_specs) -> str:
    """The family's source plus, per specialization, the assert that C++ and Python agree on its shared memory."""
    checks = "".join(f'static_assert({s.traits}::kSmemBytes == {s.smem_bytes}, "{s.name_expression}: shared '
                     f'memory differs from cuflash/cuda/specs.py");\n' for s in family_specs)
    return family_source + "\n" + checks


def check_host_layout(cxx: str | None = None) -> str | None:
    """Compile ``kernels/params.cuh`` with the host C++ compiler and every offset assert
    (:func:`~cuflash.cuda.params.layout_asserts`; NVRTC can only check sizes). None when it passes, else
    the compiler's message; raises ``FileNotFoundError`` without a C++ compiler."""
    cxx = cxx or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise FileNotFoundError("no host C++ compiler (g++/c++) for the params layout check")
    text = f'#include "{KERNELS_DIR / "params.cuh"}"\n{params.layout_asserts()}'
    proc = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-D__device__=", "-D__forceinline__=inline", "-x",
                           "c++", "-"], input=text, capture_output=True, text=True)
    return None if proc.returncode == 0 else proc.stderr


def representative_modifier(real: str = "float") -> tuple[str, str]:
    """``(struct name, C++)`` of a modifier that exercises every path (softcap, bias with dbias, ALiBi, a mask
    modifier reading an array, a BlockMask with an element rule): its specializations are held to no spills
    (headroom is the plain kernels' rule). ``real="double"``: the same in float64, as the float64 kernels take it."""
    import numpy as np

    from ..problem import make_problem
    from . import modcode

    from ..blockmask import BlockMask

    q = np.zeros((1, 8, 2, 32), np.float16)
    mask = BlockMask.document(np.arange(8) // 3, block=(4, 4)) & BlockMask.causal(8, block=(4, 4))
    p = make_problem(q, q, q, bias=np.zeros((2, 8, 8), np.float32), softcap=30.0, alibi_slopes=np.ones(2, np.float32),
                     mask_mod="keep[kv_idx]", mod_arrays={"keep": np.ones(8, bool)}, block_mask=mask)
    return modcode.render(p.mods, p.block_mask, dbias=True, real=real)


def _jobs(archs, sources=None):
    """One compilation per (source file, arch, modifier): every specialization of that file some GPU of the arch
    selects, plain and with the representative modifier (float16; the float32/float64 kernels with it rendered in
    their own float type: float32 and float64 in one translation unit). ``sources``: only these files."""
    from dataclasses import replace

    plan = specs.specs_by_arch()
    mods = {real: representative_modifier(real) for real in ("float", "double")}
    for arch in archs:
        by_source: dict[str, dict] = {}
        for spec, limit in plan[arch].items():
            if sources is None or spec.source in sources:
                by_source.setdefault(spec.source, {})[spec] = limit
        for source_name, chosen in by_source.items():
            helpers = specs.source_helpers(source_name)
            yield arch, translation_unit(kernel_source(source_name), chosen), chosen, \
                [s.name_expression for s in chosen] + helpers
            modded, code = {}, ""
            for real in ("float", "double"):
                dtypes = ("float16",) if real == "float" else ()
                dtypes += ("float32",) if real == "float" else ("float64",)
                picked = {replace(specs.select(s.family, s.dtype, s.head_dim, limit, modified=True, math=s.math,
                                               cc=arch),
                                  mods=mods[real][0]): limit for s, limit in chosen.items() if s.dtype in dtypes}
                if picked:
                    modded.update(picked)
                    code += mods[real][1]
            yield arch, kernel_source(source_name) + code, modded, [s.name_expression for s in modded] + helpers


def check(archs=(80, 90), out=sys.stdout, sources=None) -> int:
    """Compile every specialization for every arch (of ``sources`` only, when given); print a table; return the
    number of failing rows."""
    try:
        cupy_compiler()
    except ImportError as exc:
        print(f"compile check not run: {exc}", file=out)
        return -1
    t0 = time.time()
    try:
        layout = check_host_layout()
    except FileNotFoundError as exc:  # "not run" (-1), not a failing row: the check needs a host C++ compiler too
        print(f"compile check not run: {exc}; install g++ (the params layout is checked with it)", file=out)
        return -1
    print(f"params layout (host compiler, every offset): {'ok' if layout is None else 'FAILED'}", file=out)
    if layout is not None:
        print(layout, file=out)
    jobs = list(_jobs(archs, sources))

    def run(job):
        arch, source, chosen, names = job
        return compile_names(source, names, arch)

    with ThreadPoolExecutor(len(jobs)) as pool:  # NVRTC releases the GIL while it compiles
        results = list(pool.map(run, jobs))
    rows, helpers = [], {}
    for (arch, _, chosen, names), (mapping, log) in zip(jobs, results):
        report = parse_ptxas(log)
        for spec, limit in chosen.items():
            row = Row(spec, arch, limit, **report.get((mapping[spec.name_expression], arch), {}))
            rows.append(row.judge())
        for name in names[len(chosen):]:  # the helper kernels (combine, preprocess, convert): held to no spills too
            found = report.get((mapping[name], arch))
            helpers[(name, arch)] = "not in the ptxas report" if found is None else \
                (f"{found['spill']} bytes spilled" if found["spill"] else None)
    rows.sort(key=lambda r: (r.arch, r.spec.mods, r.spec.family, r.spec.dtype, r.spec.head_dim))
    head = f"{'kernel':<62} {'arch':>5} {'regs':>5} {'spill':>6} {'shared':>8} {'limit':>8}  status"
    print(head + "\n" + "-" * len(head), file=out)
    for r in rows:
        name = r.spec.name_expression.replace(", cuflash::NoMods>", ">")
        print(f"{name:<62} {'sm_' + str(r.arch):>5} {r.registers:>5} {r.spill:>6} "
              f"{r.static_smem + r.spec.smem_bytes:>8} {r.smem_limit:>8}  {'; '.join(r.problems) or 'ok'}", file=out)
    for (name, arch), problem in sorted(helpers.items(), key=lambda x: (x[0][1], x[0][0])):
        if problem:
            print(f"{name} sm_{arch}: {problem}", file=out)
    bad_helpers = sum(bool(p) for p in helpers.values())
    bad = sum(bool(r.problems) for r in rows) + (layout is not None) + bad_helpers
    print(f"{len(helpers)} helper kernels (split-KV combine, backward preprocess/convert): {bad_helpers} failing",
          file=out)
    print(f"{len(rows)} specializations, {bad} failing, {time.time() - t0:.1f} s", file=out)
    return bad

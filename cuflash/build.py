"""Compile check of every kernel specialization the dispatcher can select.

``python -m cuflash.build --check`` compiles, with nvcc to cubin for sm_80 and sm_90, all the
forward specializations of :mod:`cuflash.kernels` and the backward ones of :mod:`cuflash.kernels_bwd`
(one translation unit per kernel family and architecture holding every instantiation; they compile
concurrently), parses ``ptxas -v`` and prints
a table (kernel, arch, registers, spill bytes, shared bytes). It exits non-zero on any spill, any
local-memory stack frame, or shared memory (static + dynamic) above what the GPUs that select the
specialization allow. Needs only nvcc (no GPU, no CuPy). ``--nvrtc`` adds the NVRTC compile of
:mod:`cuflash.nvrtc` (what CuPy will run on the GPU machine).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import kernels, kernels_bwd

#: compile targets → the compute capabilities whose GPUs run that cubin family (8.x runs sm_80 code).
ARCH_FAMILIES = {80: (80, 86, 89), 90: (90,)}

_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for 'sm_(?P<arch>\d+)'")
_STACK = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads")
_REGS = re.compile(r"Used (?P<regs>\d+) registers(?:.*?(?P<smem>\d+) bytes smem)?")
_FWD = re.compile(r"(?P<fam>flash_fwd_kernel|flash_bwd_kernel|flash_bwd_dq_kernel)I(?P<t>6__half|13__nv_bfloat16)"
                  r"Li(?P<d>\d+)ELi(?P<m>\d+)ELi(?P<n>\d+)ELi(?P<w>\d+)E")
#: kernel family → its complete source (the backward family also holds its preprocess/convert kernels)
FAMILIES = {"flash_fwd_kernel": kernels.fwd_source, "flash_bwd_kernel": kernels_bwd.bwd_source,
            "flash_bwd_dq_kernel": kernels_bwd.bwd_source}


def family(spec) -> str:
    """``flash_fwd_kernel``, ``flash_bwd_kernel`` or ``flash_bwd_dq_kernel``."""
    return spec.name_expression.split("<")[0].split("::")[-1]


def _key(fam, dtype, d, m, n, w) -> tuple:
    """Report key of a specialization: ``(dtype, d, m, n, w)`` for the forward, prefixed by the family otherwise."""
    return (dtype, d, m, n, w) if fam == "flash_fwd_kernel" else (fam, dtype, d, m, n, w)


@dataclass
class Row:
    spec: kernels.KernelSpec
    arch: int
    registers: int = -1
    stack: int = 0
    spill: int = 0
    static_smem: int = 0
    smem_limit: int = 0

    @property
    def shared(self) -> int:
        return self.static_smem + self.spec.smem_bytes

    def problems(self) -> list[str]:
        out = []
        if self.registers < 0:
            out.append("no ptxas report")
        if self.spill:
            out.append(f"{self.spill} spill bytes")
        if self.stack:
            out.append(f"{self.stack} bytes stack frame")
        if self.shared > self.smem_limit:
            out.append(f"shared {self.shared} > {self.smem_limit}")
        return out


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").is_file():
            return str(Path(cand) / "bin" / "nvcc")
    return shutil.which("nvcc")


def specs_by_arch() -> dict[int, dict[kernels.KernelSpec, int]]:
    """Per compile target, each specialization some GPU of its family selects, with the smallest
    shared-memory limit among those GPUs."""
    out: dict[int, dict[kernels.KernelSpec, int]] = {}
    for arch, family in ARCH_FAMILIES.items():
        chosen: dict[kernels.KernelSpec, int] = {}
        for cc in family:
            limit = kernels.SMEM_LIMIT[cc]
            for dtype in kernels.SUPPORTED_DTYPES:
                for d in kernels.NATIVE_HEAD_DIMS:
                    spec = kernels.select_spec(dtype, d, limit)
                    chosen[spec] = min(chosen.get(spec, limit), limit)
                    try:
                        bwd = kernels_bwd.select_specs(dtype, d, limit)
                    except ValueError:  # head_dim 256 backward needs more than 99 KB of shared memory
                        bwd = ()
                    for spec in bwd:
                        chosen[spec] = min(chosen.get(spec, limit), limit)
        out[arch] = chosen
    return out


def translation_unit(specs, source=None, extra=()) -> str:
    """The kernel source (includes inlined, as CuPy compiles it; default the forward's) plus one
    reference per instantiation (and per name in ``extra``), which makes nvcc compile each of them."""
    refs = ",\n  ".join(f"(void*)&{n}" for n in [s.name_expression for s in specs] + list(extra))
    return (source or kernels.fwd_source()) + f"\n\nvoid* cuflash_instances[] = {{\n  {refs}\n}};\n"


def parse_ptxas(text: str) -> dict[tuple[tuple, int], dict]:
    """``{((dtype, d, m, n, w), arch): {registers, stack, spill, static_smem}}`` from ``ptxas -v``."""
    found, current = {}, None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            f = _FWD.search(m.group("name"))
            current = None
            if f:
                dtype = "float16" if f.group("t") == "6__half" else "bfloat16"
                key = (_key(f.group("fam"), dtype, int(f.group("d")), int(f.group("m")), int(f.group("n")),
                            int(f.group("w"))), int(m.group("arch")))
                current = found.setdefault(key, {"registers": -1, "stack": 0, "spill": 0, "static_smem": 0})
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


def check(nvcc: str | None = None, verbose: bool = False, out=sys.stdout) -> int:
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        print("cuflash.build: nvcc not found (set CUDA_PATH or put nvcc on PATH); nothing checked", file=out)
        return 2
    plan = specs_by_arch()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="cuflash_build_") as tmp:
        procs = {}
        for arch, chosen in plan.items():
            for name, source in (("flash_fwd", kernels.fwd_source), ("flash_bwd", kernels_bwd.bwd_source)):
                specs = [s for s in chosen if FAMILIES[family(s)] is source]
                extra = kernels_bwd.helper_names() if name == "flash_bwd" else ()
                src = Path(tmp) / f"{name}_sm{arch}.cu"
                src.write_text(translation_unit(specs, source(), extra))
                cmd = [nvcc, "-cubin", f"-arch=sm_{arch}", "-std=c++17", "-Xptxas", "-v", "-o",
                       str(Path(tmp) / f"{name}_sm{arch}.cubin"), str(src)]
                procs[(arch, name)] = (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                             text=True))
        reports, failed = {}, False
        for (arch, name), (cmd, proc) in procs.items():
            text, _ = proc.communicate()
            if proc.returncode != 0:
                print(f"cuflash.build: nvcc failed for {name} sm_{arch}:\n  {' '.join(cmd)}\n{text}", file=out)
                failed = True
            elif verbose:
                print(text, file=out)
            reports.update(parse_ptxas(text))
    if failed:
        return 1

    rows = []
    for arch, chosen in plan.items():
        for spec, limit in chosen.items():
            r = Row(spec, arch, smem_limit=limit)
            key = (_key(family(spec), spec.dtype, spec.head_dim, spec.block_m, spec.block_n, spec.warps), arch)
            r.__dict__.update(reports.get(key, {}))
            rows.append(r)
    rows.sort(key=lambda r: (r.arch, family(r.spec), r.spec.dtype, r.spec.head_dim, r.spec.block_m))
    head = f"{'kernel':<58} {'arch':>5} {'regs':>5} {'spill':>6} {'shared':>8} {'limit':>8}  status"
    print(head, file=out)
    print("-" * len(head), file=out)
    bad = 0
    for r in rows:
        issues = r.problems()
        bad += bool(issues)
        print(f"{r.spec.name_expression:<58} {'sm_' + str(r.arch):>5} {r.registers:>5} {r.spill:>6} "
              f"{r.shared:>8} {r.smem_limit:>8}  {'; '.join(issues) or 'ok'}", file=out)
    print(f"{len(rows)} specializations, {bad} failing, {time.time() - t0:.1f} s", file=out)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuflash.build", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compile every specialization; fail on spills/smem")
    ap.add_argument("--nvcc", default=None, help="path to nvcc (default: CUDA_PATH, /usr/local/cuda, PATH)")
    ap.add_argument("--nvrtc", action="store_true",
                    help="also compile every specialization with NVRTC and CuPy's options (cuflash.nvrtc)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the raw ptxas output")
    args = ap.parse_args(argv)
    if not (args.check or args.nvrtc):
        ap.print_help()
        return 0
    rc = check(args.nvcc, args.verbose) if args.check else 0
    if args.nvrtc:
        from . import nvrtc

        rc |= 1 if nvrtc.check() else 0
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""NVRTC compile check: the kernels as CuPy will compile them, without a GPU and without CuPy.

nvcc (``cuflash.build --check``) proves the kernels compile and fit; it does not prove that NVRTC,
which CuPy's ``RawModule`` uses, accepts the same source: NVRTC has no host headers (no
``<math.h>``, so no ``INFINITY``; no ``<cstdint>``). This module loads ``libnvrtc`` with ctypes —
from the ``nvidia-cuda-nvrtc`` wheel (a test extra on Linux x86-64), ``CUDA_PATH`` or
``/usr/local/cuda`` — and compiles every specialization's name expression with CuPy's options.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: what CuPy's RawModule passes on CUDA (besides its own -I): see cupy/cuda/compiler.py
CUPY_OPTIONS = ("-std=c++17", "--device-as-default-execution-space", "-ftz=true")


def _candidates():
    for entry in sys.path:
        yield from sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnvrtc.so*")))
        yield from sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
    for root in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            yield from sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")))


def load():
    """``(libnvrtc, None)`` or ``(None, reason)``."""
    for path in _candidates():
        if "builtins" in path:
            continue
        try:
            return ctypes.CDLL(path), None
        except OSError:
            continue
    return None, "libnvrtc not found (pip install nvidia-cuda-nvrtc, or a CUDA toolkit with NVRTC)"


def cuda_include():
    """The CUDA headers CuPy would add with -I (cuda_fp16.h lives there), or None."""
    for root in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return str(Path(root) / "include")
    for entry in sys.path:
        for inc in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "include", "cuda_fp16.h"))):
            return os.path.dirname(inc)
    return None


def compile_source(lib, source: str, name_expressions, arch: int, include: str) -> str | None:
    """Compile with NVRTC for ``sm_<arch>``; return None on success, else the compiler's log."""
    prog = ctypes.c_void_p()
    _ok(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), lib)
    try:
        for name in name_expressions:
            _ok(lib.nvrtcAddNameExpression(prog, name.encode()), lib)
        opts = [o.encode() for o in CUPY_OPTIONS + (f"-arch=sm_{arch}", f"-I{include}")]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        if lib.nvrtcCompileProgram(prog, len(opts), argv) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            return log.value.decode(errors="replace")
        for name in name_expressions:  # every template instantiation must have been emitted
            lowered = ctypes.c_char_p()
            _ok(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)), lib)
        return None
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _ok(status, lib):
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {status}: {lib.nvrtcGetErrorString(status).decode()}")


def jobs():
    """``(family, source, name expressions)`` for every kernel family the dispatcher can select."""
    from . import kernels, kernels_bwd

    fwd = sorted({s.name_expression for s in kernels.all_specs()})
    bwd = sorted({s.name_expression for s in kernels_bwd.all_specs()}) + kernels_bwd.helper_names()
    return [("forward", kernels.fwd_source(), fwd), ("backward", kernels_bwd.bwd_source(), bwd)]


def compile_all(lib, include, archs=(80, 90)):
    """``[(family, arch, n_kernels, log or None)]`` for every family and arch, compiled in parallel
    (ctypes releases the GIL during each NVRTC call)."""
    work = [(fam, src, names, arch) for fam, src, names in jobs() for arch in archs]
    with ThreadPoolExecutor(max(1, min(len(work), os.cpu_count() or 1))) as pool:
        logs = list(pool.map(lambda w: compile_source(lib, w[1], w[2], w[3], include), work))
    return [(fam, arch, len(names), log) for (fam, _, names, arch), log in zip(work, logs)]


def check(archs=(80, 90), out=sys.stdout) -> int:
    """Compile every family for every arch; print one line each; return the number of failures."""
    lib, why = load()
    include = cuda_include()
    if lib is None or include is None:
        print(f"NVRTC check not run: {why or 'CUDA headers (cuda_fp16.h) not found'}", file=out)
        return 0
    failures = 0
    for fam, arch, n, log in compile_all(lib, include, archs):
        print(f"NVRTC {fam:8s} sm_{arch}: {n} kernels {'ok' if log is None else 'FAILED'}", file=out)
        if log is not None:
            failures += 1
            print(log, file=out)
    return failures

"""Finding what the emulator needs on this machine: a GNU C++ compiler and the CUDA headers."""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import _env


@dataclass(frozen=True)
class Toolchain:
    cxx: str
    cxx_version: str
    cuda_includes: tuple[str, ...]
    #: SHA-256 of the CUDA headers the kernels compile against (paths resolved, contents read): part of every
    #: cache key, so a toolkit switched behind the same path (/usr/local/cuda relinked) rebuilds
    cuda_headers: str = ""


def _cuda_include_candidates() -> list[Path]:
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    found = [Path(r) / "include" for r in roots if r]
    # pip's NVIDIA runtime wheels: nvidia/cuda_runtime/include (CUDA 12) or nvidia/cu13/include (CUDA 13).
    for entry in sys.path:
        found += [Path(p).parent for p in glob.glob(os.path.join(entry, "nvidia", "*", "include", "cuda_fp16.h"))]
    return found


def _nv_target_dirs() -> list[Path]:
    """Where <nv/target> (CCCL, included by recent cuda_fp16.h) may live besides the main include dir."""
    dirs = []
    for entry in sys.path:
        dirs += [Path(p).parents[1] for p in glob.glob(os.path.join(entry, "nvidia", "*", "include", "nv", "target"))]
    return dirs


def _cuda_includes() -> tuple[str, ...] | None:
    for inc in _cuda_include_candidates():
        if (inc / "cuda_fp16.h").is_file() and (inc / "vector_types.h").is_file():
            # CUDA 13 keeps <nv/target> under include/cccl; with pip wheels it is in nvidia-cuda-cccl.
            extra = [inc / "cccl"] if (inc / "cccl").is_dir() else []
            if not (inc / "nv" / "target").exists() and not extra:
                extra = _nv_target_dirs()[:1]
            return tuple(str(p) for p in [inc, *extra])
    return None


_PROBE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
# A C++ exception needs the C++ runtime (``gcc`` alone leaves its symbols undefined: the library does not load), as
# the emulator's libraries do.
_PROBE_LIBRARY = _PROBE + """#include <stdexcept>
extern "C" __attribute__((visibility("default"))) float cuflash_probe(float x) {
    try {
        if (x < 0) throw std::domain_error("negative");
        return __half2float(__float2half_rn(x));
    } catch (const std::domain_error&) {
        return -1.0f;
    }
}
"""


def _library_builds(cxx: str, includes: tuple[str, ...]) -> str | None:
    """None if this compiler builds, with the CUDA fp16/bf16 headers, a C++ shared library that loads and computes,
    else why not. Parsing the headers was not enough: ``/bin/true`` and ``gcc`` passed, ``python -m cuflash``
    listed the emulator as available, and every launch then failed.

    Only the toolkit is probed, not the emulator's own headers: a bug there must fail the tests, not skip them. The
    library is built in a private temporary folder and loaded from there once, never from a cache.
    """
    with tempfile.TemporaryDirectory(prefix="cuflash-probe-") as tmp:
        library = os.path.join(tmp, "probe.so")
        try:
            proc = subprocess.run([cxx, "-std=c++17", "-fPIC", "-shared", "-x", "c++", "-", "-o", library,
                                   *[f"-I{d}" for d in includes]],
                                  input=_PROBE_LIBRARY, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "error" in line]
            return (errors or proc.stderr.splitlines() or ["unknown error"])[0]
        try:
            probe = ctypes.CDLL(library, mode=ctypes.RTLD_LOCAL).cuflash_probe
        except (OSError, AttributeError) as exc:
            return f"it exits 0 but builds no loadable C++ library ({str(exc).replace(library, 'probe.so')})"
        probe.restype, probe.argtypes = ctypes.c_float, [ctypes.c_float]
        # not the throwing branch: under a preloaded libasan (emulate.sanitizer_env) a throw from a library loaded
        # before libstdc++ aborts in ASan's __cxa_throw interceptor; linking it is what the probe asks
        if probe(1.5) != 1.5:
            return "its probe library computes wrong results"
    return None


def _headers_digest(cxx: str, includes: tuple[str, ...]) -> str | None:
    """SHA-256 over the CUDA headers the probe includes, as the compiler resolves them (``-M``): each file's
    path below its include directory and its bytes. None if the compiler cannot list them."""
    try:
        proc = subprocess.run([cxx, "-std=c++17", "-M", "-x", "c++", "-", *[f"-I{d}" for d in includes]],
                              input=_PROBE + "#include <vector_types.h>\n", capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    roots = [os.path.realpath(d) for d in includes]
    h = hashlib.sha256()
    for dep in sorted({os.path.realpath(t) for t in proc.stdout.replace("\\\n", " ").split()[1:]}):
        root = next((r for r in roots if dep.startswith(r + os.sep)), None)
        if root is not None:
            h.update(os.path.relpath(dep, root).encode() + b"\0" + Path(dep).read_bytes() + b"\0")
    return h.hexdigest()


def _compiler(configured: str | None) -> tuple[str, str] | str:
    """(command, version line), or why there is no usable compiler."""
    cxx = configured or shutil.which("g++")
    if not cxx:
        return "no g++ found (set CUFLASH_EMULATE_CXX or install g++)"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"CUFLASH_EMULATE_CXX={cxx!r} does not run: {exc}" if configured else f"{cxx} does not run: {exc}"
    return cxx, out.splitlines()[0] if out else cxx


def find() -> tuple[Toolchain | None, str]:
    """The toolchain, or None and the reason it cannot be used. A malformed CUFLASH_EMULATE_CXX is a ValueError."""
    return _find(_env.get("CUFLASH_EMULATE_CXX"))


_FOUND: dict[str | None, tuple[Toolchain, str]] = {}  # per configured compiler; only toolchains that work


def _find(cxx: str | None) -> tuple[Toolchain | None, str]:
    """Cached when found. A failure is not cached: a probe that timed out on a loaded machine must not make every
    later emulated launch of the process fail."""
    if cxx not in _FOUND:
        found = _probe(cxx)
        if found[0] is None:
            return found
        _FOUND[cxx] = found  # type: ignore[assignment]
    return _FOUND[cxx]


def _probe(cxx: str | None) -> tuple[Toolchain | None, str]:
    if not sys.platform.startswith("linux"):
        return None, f"the CPU emulator needs Linux (this is {sys.platform})"
    compiler = _compiler(cxx)
    if isinstance(compiler, str):
        return None, compiler
    includes = _cuda_includes()
    if includes is None:
        return None, ("no CUDA headers (cuda_fp16.h) found in CUDA_PATH, CUDA_HOME, /usr/local/cuda "
                      "or the nvidia runtime wheels")
    problem = _library_builds(compiler[0], includes)
    if problem is not None:
        hint = "; CUFLASH_EMULATE_CXX must name a C++ compiler such as g++" if cxx else ""
        return None, f"{compiler[1]} with the CUDA headers in {includes[0]}: {problem}{hint}"
    digest = _headers_digest(compiler[0], includes)
    if digest is None:
        return None, f"{compiler[1]} cannot list the CUDA headers in {includes[0]} (g++ -M)"
    return Toolchain(compiler[0], compiler[1], includes, digest), f"{compiler[1]}; CUDA headers in {includes[0]}"

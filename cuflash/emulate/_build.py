"""Compiling a kernel source for the CPU: source preparation, the launch wrapper, and the library cache."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..cuda.source import KERNELS_DIR, inline_includes, kernel_source
from ._toolchain import Toolchain

RUNTIME_DIR = KERNELS_DIR / "emulate"
SHIM = RUNTIME_DIR / "shim.h"

# -O1: -O2 runs an emulated forward ~30% faster but costs ~40% more compile time per specialization, and tests
# compile many specializations to run each a few times (measurements in kernels/emulate/README.md). The hot
# spot, the emulated mma, asks for O3 itself.
# -fstack-clash-protection: a frame bigger than a page probes each page, so a fiber overflowing its stack faults in
# the guard page below it instead of silently writing into the neighbouring fiber's stack.
BASE_FLAGS = ("-std=c++17", "-O1", "-fno-strict-aliasing", "-fvisibility=hidden", "-fno-gnu-unique", "-fPIC",
              "-fstack-clash-protection", "-shared", "-w", "-DCUFLASH_EMULATE=1")
DEBUG_FLAGS = ("-O0", "-g")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g")

_INCLUDE_LINE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.M)
# `extern __shared__ <type> name[];` -> a reference to the runtime's per-launch dynamic shared pointer.
_EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\s+([^;\[\]{}()]*(?:\([^)]*\)[^;\[\]{}()]*)*?)\s*\b([A-Za-z_]\w*)"
                            r"\s*\[\s*\]\s*;")
# `__shared__ <type> name[dims];` on one line (not `extern`, which the pattern above handles first).
_STATIC_SHARED = re.compile(r"\b__shared__[ \t]+([^;{}=\n]*?)[ \t]*\b([A-Za-z_]\w*)[ \t]*((?:\[[^\];\n]*\][ \t]*)*);")
_ATTRIBUTES = re.compile(r"__align__\s*\([^)]*\)|alignas\s*\([^)]*\)|__attribute__\s*\(\(.*?\)\)")


compile_log: list[tuple[str, float]] = []  # (library, seconds) of every compilation in this process


class CompileError(RuntimeError):
    """g++ rejected the kernel source (the message carries the compiler's diagnostics)."""


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(KERNELS_DIR.parent))
    except ValueError:
        return str(path)


def _expand_with_lines(path: Path, seen: set[str]) -> list[str]:
    """Same text as :func:`cuflash.cuda.source.inline_includes` plus #line directives naming the original files."""
    out = [f'#line 1 "{_rel(path)}"']
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _INCLUDE_LINE.match(line)
        if not match:
            out.append(line)
            continue
        inc = (path.parent / match.group(1)).resolve()
        if str(inc) not in seen:
            seen.add(str(inc))
            out += _expand_with_lines(inc, seen)
        out.append(f'#line {number + 1} "{_rel(path)}"')
    return out


def _with_line_directives(source: str) -> str:
    """``source`` annotated with original file names and lines, when it is an unchanged kernels/*.cu."""
    for candidate in sorted(KERNELS_DIR.glob("*.cu")):
        try:
            if kernel_source(candidate.name) == source:  # the inlined file, then the params layout checks
                tail = source[len(inline_includes(candidate)):]
                return "\n".join(_expand_with_lines(candidate, set())) + "\n" + tail
        except OSError:
            continue
    return '#line 1 "<kernel source>"\n' + source


def _rewrite_extern_shared(source: str) -> str:
    def repl(match: re.Match) -> str:
        type_ = _ATTRIBUTES.sub(" ", match.group(1)).strip()
        newlines = "\n" * match.group(0).count("\n")  # keep line numbers
        return (f"{type_}* const& {match.group(2)} = "
                f"*reinterpret_cast<{type_}* const*>(&::cuflash_emu::g_dyn_smem);{newlines}")

    return _EXTERN_SHARED.sub(repl, source)


def _top_level_comma(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += ch in "<(["
        depth -= ch in ">)]"
        if ch == "," and depth == 0:
            return True
    return False


def _rewrite_static_shared(source: str) -> str:
    """Single-declarator ``__shared__`` variables -> registered, NaN-filled storage (runtime.h: shared_var)."""
    def repl(match: re.Match) -> str:
        type_, name, dims = _ATTRIBUTES.sub(" ", match.group(1)).strip(), match.group(2), match.group(3).strip()
        if not type_ or _top_level_comma(type_) or type_.endswith(("::", ",")):
            return match.group(0)  # not a form we understand: shim.h's fallback `static` applies
        return f"auto& {name} = ::cuflash_emu::shared_var<{type_}{dims}>([] {{}});"

    return _STATIC_SHARED.sub(repl, source)


def _wrapper(name_expression: str) -> str:
    return f"""
namespace cuflash_emu_wrap {{
using Kernel = decltype(&{name_expression});
static Kernel const kernel = &{name_expression};
void thunk(void* args) {{ ::cuflash_emu::Signature<Kernel>::call(kernel, static_cast<void**>(args)); }}
}}  // namespace cuflash_emu_wrap
extern "C" __attribute__((visibility("default"))) int cuflash_emu_signature(int* desc, const char** names, int max) {{
  return ::cuflash_emu::Signature<cuflash_emu_wrap::Kernel>::describe(desc, names, max);
}}
extern "C" __attribute__((visibility("default"))) int cuflash_emu_launch(void** args, const unsigned* grid,
    const unsigned* block, unsigned long long shared_bytes, int schedule, unsigned long long seed,
    unsigned long long stack_bytes, char* err, unsigned long long err_len, int* where) {{
  return ::cuflash_emu::launch_entry(args, grid, block, shared_bytes, schedule, seed, stack_bytes,
                                     &cuflash_emu_wrap::thunk, err, err_len, where);
}}
extern "C" __attribute__((visibility("default"))) void cuflash_emu_bank_stats(unsigned long long* out) {{
  for (int kind = 0; kind < 2; ++kind)
    out[2 * kind] = ::cuflash_emu::g_banks.requests[kind], out[2 * kind + 1] = ::cuflash_emu::g_banks.wavefronts[kind];
}}
"""


def translation_unit(source: str, name_expression: str) -> str:
    body = _rewrite_extern_shared(_PRAGMA_ONCE.sub("", _with_line_directives(source)))
    body = _rewrite_static_shared(body)
    return body + '\n#line 1 "<cuflash.emulate wrapper>"\n#include "wrapper.h"\n' + _wrapper(name_expression)


def _runtime_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(RUNTIME_DIR.glob("*.h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _includes_digest(source: str, seen: set[Path] | None = None) -> str:
    """Contents of the local headers a (not pre-inlined) source includes from kernels/, recursively."""
    seen = set() if seen is None else seen
    h = hashlib.sha256()
    for line in source.splitlines():
        match = _INCLUDE_LINE.match(line)
        if not match:
            continue
        path = (KERNELS_DIR / match.group(1)).resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        text = path.read_text()
        h.update(text.encode())
        h.update(_includes_digest(text, seen).encode())
    return h.hexdigest()


def _user_options(options) -> list[str]:
    """Preprocessor options only: the rest (-arch, --use_fast_math, ...) are NVRTC's and mean nothing to g++."""
    keep, it = [], iter(options)
    for opt in it:
        if opt in ("-D", "-U", "-I"):
            keep += [opt, next(it, "")]
        elif opt.startswith(("-D", "-U", "-I")):
            keep.append(opt)
    return keep


def cache_dir() -> Path:
    path = Path(os.environ.get("CUFLASH_EMULATE_CACHE") or Path.home() / ".cache" / "cuflash" / "emulate")
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:  # read-only home (some CI sandboxes)
        fallback = Path(tempfile.gettempdir()) / "cuflash-emulate"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _flags(sanitize: bool, debug: bool) -> list[str]:
    return [*BASE_FLAGS, *(DEBUG_FLAGS if debug else ()), *(SANITIZE_FLAGS if sanitize else ())]


def _includes(tc: Toolchain) -> list[str]:
    return [f"-I{RUNTIME_DIR}", f"-I{KERNELS_DIR}"] + [f"-I{d}" for d in tc.cuda_includes]


def command(tc: Toolchain, src: Path, out: Path, options, *, sanitize: bool, debug: bool,
            shim: Path = SHIM) -> list[str]:
    return [tc.cxx, *_flags(sanitize, debug), "-include", str(shim), *_includes(tc), *_user_options(options),
            str(src), "-o", str(out)]


def precompiled_shim(tc: Toolchain) -> Path | None:
    """A copy of shim.h with its precompiled header (.gch) beside it, built once per toolchain and runtime.

    Parsing the CUDA fp16/bf16 headers and the runtime is ~0.4 s of every kernel compilation. g++ uses the .gch
    when the flags match and silently falls back to the copied text otherwise (e.g. a -D that the shim reads).
    """
    if os.environ.get("CUFLASH_EMULATE_PCH", "1") == "0":
        return None
    key = hashlib.sha256("\0".join([tc.cxx, tc.cxx_version, *tc.cuda_includes, _runtime_digest(),
                                     *BASE_FLAGS]).encode()).hexdigest()[:24]
    final = cache_dir() / f"pch-{key}"
    if not (final / "shim.h.gch").exists():
        tmp = Path(tempfile.mkdtemp(prefix="pch-tmp-", dir=cache_dir()))
        for header in RUNTIME_DIR.glob("*.h"):
            shutil.copyfile(header, tmp / header.name)
        flags = [f for f in BASE_FLAGS if f != "-shared"]
        proc = subprocess.run([tc.cxx, *flags, *_includes(tc), "-x", "c++-header", str(tmp / "shim.h"), "-o",
                               str(tmp / "shim.h.gch")], capture_output=True)
        try:
            if proc.returncode == 0:
                os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "shim.h" if (final / "shim.h.gch").exists() else None


def build(tc: Toolchain, source: str, name_expression: str, options=(), *, sanitize=False, debug=False) -> Path:
    """Path of the shared library for this kernel, compiling it on a cache miss."""
    key = hashlib.sha256("\0".join([
        source, _includes_digest(source), name_expression, *options, tc.cxx, tc.cxx_version, *tc.cuda_includes,
        _runtime_digest(),
        *BASE_FLAGS, f"sanitize={sanitize}", f"debug={debug}",
    ]).encode()).hexdigest()[:32]
    target = cache_dir() / f"{key}.so"
    if target.exists():
        return target
    return _compile(tc, target, translation_unit(source, name_expression), options, sanitize, debug)


def _compile(tc: Toolchain, target: Path, text: str, options, sanitize: bool, debug: bool) -> Path:
    # Unique temporaries + atomic rename: parallel test processes may build the same library at once.
    fd, tmp_src = tempfile.mkstemp(suffix=".cpp", prefix=target.stem + ".", dir=target.parent)
    tmp_out = Path(tmp_src).with_suffix(".so.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        pch = None if sanitize or debug else precompiled_shim(tc)
        cmd = command(tc, Path(tmp_src), tmp_out, options, sanitize=sanitize, debug=debug, shim=pch or SHIM)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"g++ failed to compile the kernel for emulation (kept at {tmp_src}.failed):\n"
                               f"{proc.stderr[-8000:]}\ncommand: {' '.join(cmd)}")
        os.replace(tmp_out, target)
        compile_log.append((target.name, time.perf_counter() - start))
        return target
    except CompileError:
        os.replace(tmp_src, tmp_src + ".failed")
        raise
    finally:
        for leftover in (Path(tmp_src), tmp_out):
            leftover.unlink(missing_ok=True)

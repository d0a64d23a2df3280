"""Compiling a kernel source for the CPU: source preparation, the launch wrapper, and the library cache."""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .. import _env
from ..cuda.source import KERNELS_DIR, inline_includes, kernel_source
from . import _cache, _trim
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
PCH_MANIFEST = "manifest.json"  # in each precompiled-shim directory: the SHA-256 of every other file there
_pch_seen: set[tuple] = set()  # identities of precompiled-shim files verified in this process


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
    unsigned long long stack_bytes, const int* cancel, int hw_math, char* err, unsigned long long err_len,
    int* where) {{
  return ::cuflash_emu::launch_entry(args, grid, block, shared_bytes, schedule, seed, stack_bytes, cancel, hw_math,
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


def _flags(sanitize: bool, debug: bool) -> list[str]:
    return [*BASE_FLAGS, *(DEBUG_FLAGS if debug else ()), *(SANITIZE_FLAGS if sanitize else ())]


def _includes(tc: Toolchain) -> list[str]:
    return [f"-I{RUNTIME_DIR}", f"-I{KERNELS_DIR}"] + [f"-I{d}" for d in tc.cuda_includes]


def command(tc: Toolchain, src: Path, out: Path, options, *, sanitize: bool, debug: bool,
            shim: Path = SHIM) -> list[str]:
    return [tc.cxx, *_flags(sanitize, debug), "-include", str(shim), *_includes(tc), *_user_options(options),
            str(src), "-o", str(out)]


def _pch_key(tc: Toolchain) -> str:
    return hashlib.sha256("\0".join([tc.cxx, tc.cxx_version, *tc.cuda_includes, tc.cuda_headers, _runtime_digest(),
                                     *BASE_FLAGS]).encode()).hexdigest()[:24]


def _pch_verified(directory: Path) -> bool:
    """True when ``directory`` holds exactly the files its manifest lists, each with the recorded digest.

    Hashing the ~50 MB .gch costs ~0.2 s, so a file whose identity (inode, size, mtime, ctime) has not changed
    since it was verified in this process is not hashed again: ctime cannot be set back by anyone but root.
    """
    manifest = None if _cache.unsafe_reason(directory) else _cache.read_record(directory / PCH_MANIFEST)
    files = manifest.get("files") if manifest else None
    try:
        present = sorted(p.name for p in directory.iterdir() if p.name != PCH_MANIFEST)
    except OSError:  # removed meanwhile by a process that found it broken
        return False
    if not isinstance(files, dict) or sorted(files) != present:
        return False
    return all(_pch_file_ok(directory / name, digest) for name, digest in files.items())


def _pch_file_ok(path: Path, digest) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    identity = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest)
    if identity in _pch_seen:
        return True
    actual = _cache.file_digest(path)  # None for anything but a private regular file: never a match
    if actual is None or actual != digest:
        return False
    _pch_seen.add(identity)
    return True


def _build_pch(tc: Toolchain, directory: Path, final: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pch-tmp-", dir=directory))  # mode 0700
    try:
        for header in RUNTIME_DIR.glob("*.h"):
            shutil.copyfile(header, tmp / header.name)
        flags = [f for f in BASE_FLAGS if f != "-shared"]
        proc = subprocess.run([tc.cxx, *flags, *_includes(tc), "-x", "c++-header", str(tmp / "shim.h"), "-o",
                               str(tmp / "shim.h.gch")], capture_output=True)
        if proc.returncode != 0:
            return
        for path in tmp.iterdir():
            os.chmod(path, 0o600)  # whatever the umask: nobody else may change what every kernel includes
        digests = {p.name: _cache.file_digest(p) for p in tmp.iterdir()}
        _cache.write_record(tmp / PCH_MANIFEST, {"files": digests})
        try:
            os.rename(tmp, final)  # atomic, manifest included; fails if another process got there first
        except OSError:
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard_dir(path: Path) -> None:
    """Move a tampered or broken directory out of the way (atomically), then delete it."""
    trash = Path(tempfile.mkdtemp(prefix="trash-", dir=path.parent))
    try:
        os.rename(path, trash / path.name)
    except OSError:
        pass
    shutil.rmtree(trash, ignore_errors=True)


def precompiled_shim(tc: Toolchain, directory: Path) -> Path | None:
    """A copy of shim.h with its precompiled header (.gch) beside it, built once per toolchain and runtime.

    Parsing the CUDA fp16/bf16 headers and the runtime is ~0.4 s of every kernel compilation. g++ uses the .gch
    when the flags match and silently falls back to the copied text otherwise (e.g. a -D that the shim reads).
    Every file of the directory is checked against the manifest written when it was built (its headers become
    part of every kernel): a directory that does not match is deleted and built again.
    """
    if not _env.get("CUFLASH_EMULATE_PCH"):
        return None
    final = directory / f"pch-{_pch_key(tc)}"
    if os.path.lexists(final) and not _pch_verified(final):
        _discard_dir(final)
    if not os.path.lexists(final):
        _build_pch(tc, directory, final)
    if not _pch_verified(final):
        return None
    _trim.touch(final)  # in use: another toolchain's trim leaves it alone
    return final / "shim.h"


def _library_key(tc: Toolchain, source: str, text: str, name_expression: str, options, sanitize: bool,
                 debug: bool) -> str:
    """``text``: the translation unit g++ compiles (the source as this module rewrites it, wrapper included)."""
    return hashlib.sha256("\0".join([
        text, _includes_digest(source), _user_headers_digest(tc, text, options, sanitize, debug), name_expression,
        *options, tc.cxx, tc.cxx_version, *tc.cuda_includes, tc.cuda_headers, _runtime_digest(), *BASE_FLAGS,
        f"sanitize={sanitize}", f"debug={debug}",
    ]).encode()).hexdigest()[:32]


def _user_headers_digest(tc: Toolchain, text: str, options, sanitize: bool, debug: bool) -> str:
    """With include folders among the caller's options (``-I``, a RawModule's), SHA-256 over every file the
    translation unit reads as g++ resolves them (``-M``: paths and bytes); "" without any. Only the option's text was
    in the key, and a library built against an older header in such a folder was loaded after the header changed
    (the kernel wrote the old value). cuflash's own kernels are inlined (:func:`_includes_digest`) and pass none."""
    user = _user_options(options)
    if not any(opt.startswith("-I") for opt in user):
        return ""
    cmd = [tc.cxx, *_flags(sanitize, debug), "-include", str(SHIM), *_includes(tc), *user, "-M", "-x", "c++", "-"]
    proc = subprocess.run(cmd, input=text, capture_output=True, text=True)
    if proc.returncode != 0:  # the compilation itself will fail and say why; a key that matches nothing cached
        return f"unlisted: {proc.returncode}"
    h = hashlib.sha256()
    for dep in sorted({os.path.realpath(t) for t in proc.stdout.replace("\\\n", " ").split()[1:]}):
        if os.path.isfile(dep):
            h.update(dep.encode() + b"\0" + Path(dep).read_bytes() + b"\0")
    return h.hexdigest()


def _recorded_library(directory: Path, key: str) -> Path | None:
    """The library the record ``<key>.json`` names, if its bytes have the recorded digest; else None.

    A library that does not match (truncated, replaced, foreign) is deleted: it must never be loaded.
    """
    record = _cache.read_record(directory / f"{key}.json")
    name, digest = (record.get("library"), record.get("sha256")) if record else (None, None)
    if not isinstance(name, str) or not re.fullmatch(rf"{key}-[0-9a-f]{{16}}\.so", name):
        return None
    path = directory / name
    actual = _cache.file_digest(path)  # None for anything but a private regular file: never a match
    if actual is None or actual != digest:
        _cache.discard(path)
        return None
    _trim.touch(directory / f"{key}.json")  # used now: the cache's trim removes the least recently used first
    return path


def build(tc: Toolchain, source: str, name_expression: str, options=(), *, sanitize=False, debug=False) -> Path:
    """Path of the verified shared library for this kernel, compiling it when the cache has no valid copy.

    The cache holds ``<key>.json`` = {"library": "<key>-<digest[:16]>.so", "sha256": digest} per kernel: the
    library is written under its own name first, then the record is replaced atomically, so a reader always
    finds a library and digest that belong together, even while parallel processes build the same kernel.
    """
    directory = _cache.cache_dir()
    text = translation_unit(source, name_expression)
    key = _library_key(tc, source, text, name_expression, options, sanitize, debug)
    found = _recorded_library(directory, key)
    if found is not None:
        return found
    return _compile(tc, directory, key, text, options, sanitize, debug)


def _check_loads(library: Path, cmd) -> None:
    """Raise CompileError unless the compiler's output is a library that loads, before it is recorded: the toolchain
    probe builds and loads a small library (refusing ``/bin/true`` and ``gcc``), but a compiler command may still
    write nothing, or a library that cannot load, for a kernel; recorded, it would fail every later load from the
    cache too."""
    try:
        ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
    except OSError as exc:
        raise CompileError(f"the compiler ran without an error but its library does not load ({exc}); "
                           f"CUFLASH_EMULATE_CXX must name a C++ compiler such as g++\ncommand: {' '.join(cmd)}") \
            from None


def _compile(tc: Toolchain, directory: Path, key: str, text: str, options, sanitize: bool, debug: bool) -> Path:
    # Unique temporaries, then renames: parallel test processes may build the same library at once. The source goes
    # into a folder of its own (mode 0700, empty): a quoted include is looked for first beside the source, and a
    # wrapper.h lying in the cache folder was compiled into every kernel, then recorded under the clean key.
    work = Path(tempfile.mkdtemp(prefix=key + ".", dir=directory))
    tmp_src, tmp_out = work / "kernel.cpp", work / "kernel.so.tmp"
    try:
        tmp_src.write_text(text)
        pch = None if sanitize or debug else precompiled_shim(tc, directory)
        cmd = command(tc, tmp_src, tmp_out, options, sanitize=sanitize, debug=debug, shim=pch or SHIM)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            failed = directory / f"{work.name}.cpp.failed"
            os.replace(tmp_src, failed)
            raise CompileError(f"g++ failed to compile the kernel for emulation (kept at {failed}):\n"
                               f"{proc.stderr[-8000:]}\ncommand: {' '.join(cmd)}")
        _check_loads(tmp_out, cmd)
        os.chmod(tmp_out, 0o700)  # whatever the umask: nobody else may change code we load
        digest = _cache.file_digest(tmp_out)
        target = directory / f"{key}-{digest[:16]}.so"
        _cache.discard_folder(target)
        os.replace(tmp_out, target)
        _cache.write_record(directory / f"{key}.json", {"library": target.name, "sha256": digest})
        compile_log.append((target.name, time.perf_counter() - start))
        _trim.after_build(directory, keep={f"pch-{_pch_key(tc)}"})
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)

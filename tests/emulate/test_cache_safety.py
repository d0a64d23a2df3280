"""The emulator's cache holds code it runs: only what it built itself is loaded, from a private directory.

Each case that loads from a tampered cache runs the launch in a subprocess (a fresh process: ``dlopen`` would
otherwise hand back the library already loaded here, and a truncated library may kill the process with SIGBUS).
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import cuflash.emulate as emu
from emu_helpers import spec

TESTS = Path(__file__).parent
ROOT = Path(emu.__file__).parents[2]

# A launch of copy_kernel from a fresh process; `options` makes its own cache key.
VICTIM = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
import cuflash.emulate as emu
from emu_helpers import spec
out = np.zeros(4, np.float32)
emu.launch(spec("runtime_tests.cu", "copy_kernel", (np.arange(1, 5, dtype=np.float32), out, np.int32(4)),
                options={options!r}))
print("result", out.tolist())
"""

# A library whose constructor leaves a marker file: what an attacker would plant.
FOREIGN = r"""
#include <cstdio>
__attribute__((constructor)) static void planted() {
  if (FILE* f = fopen("%s", "w")) fclose(f);
}
"""
MARKER_INITIALIZER = '\nstatic int cuflash_tampered = [] { if (FILE* f = fopen("%s", "w")) fclose(f); return 0; }();\n'


def _run(cache: Path, options=(), pch=False, **env_vars):
    env = dict(os.environ, CUFLASH_EMULATE_CACHE=str(cache), CUFLASH_EMULATE_PCH="1" if pch else "0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env_vars)
    code = VICTIM.format(tests=str(TESTS), options=tuple(options))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def _assert_correct(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "result [1.0, 2.0, 3.0, 4.0]" in proc.stdout


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache holding copy_kernel's library and the precompiled shim, built once; tests tamper with copies."""
    cache = tmp_path_factory.mktemp("template") / "cache"
    _assert_correct(_run(cache, pch=True))
    return cache


def _copy(built_cache, tmp_path, with_pch=False):
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache, symlinks=True, ignore=None if with_pch else shutil.ignore_patterns("pch-*"))
    return cache


def _libraries(cache: Path):
    found = sorted(cache.glob("*.so"))
    assert found, f"no library in {cache}"
    return found


def _foreign_library(tmp_path: Path, marker: Path) -> Path:
    src = tmp_path / "foreign.cpp"
    src.write_text(FOREIGN % marker)
    out = tmp_path / "foreign.so"
    subprocess.run(["g++", "-shared", "-fPIC", str(src), "-o", str(out)], check=True, capture_output=True)
    return out


# ------------------------------------------------------------------------------------------------ artefacts

def test_a_planted_library_is_not_loaded(built_cache, tmp_path):
    cache, marker = _copy(built_cache, tmp_path), tmp_path / "marker"
    foreign = _foreign_library(tmp_path, marker)
    for library in _libraries(cache):  # under the very names the emulator would load
        shutil.copyfile(foreign, library)
    proc = _run(cache)
    _assert_correct(proc)
    assert not marker.exists(), "the planted library's constructor ran"


def test_a_header_lying_in_the_cache_is_not_compiled_in(built_cache, tmp_path):
    """The translation unit ends with a quoted ``#include "wrapper.h"``, looked for first beside the source: a
    wrapper.h in the cache folder (CUFLASH_EMULATE_CACHE may name any private folder) was compiled into every kernel
    built there, and the library recorded under the clean key. The source now compiles in an empty folder."""
    cache, marker = _copy(built_cache, tmp_path, with_pch=True), tmp_path / "marker"
    runtime = ROOT / "kernels" / "emulate" / "wrapper.h"
    (cache / "wrapper.h").write_text(runtime.read_text() + MARKER_INITIALIZER % marker)
    proc = _run(cache, options=("-DCUFLASH_PLANTED_HEADER_TEST",), pch=True)  # a key of its own: compiled now
    _assert_correct(proc)
    assert not marker.exists(), "the header planted in the cache was compiled in"


@pytest.mark.parametrize("what", ["record", "library"])
def test_a_folder_where_a_cache_file_belongs_is_removed_and_the_file_rebuilt(built_cache, tmp_path, what):
    """A folder at a record's or a library's path opened like a file (O_RDONLY), and fdopen raised IsADirectoryError
    naming a descriptor, not a path, leaking it on every launch, which never rebuilt: now it is no cache file (the
    checks on the descriptor come first) and makes way for the rebuilt one."""
    cache = _copy(built_cache, tmp_path)
    victim = sorted(cache.glob("*.json" if what == "record" else "*.so"))[0]
    victim.unlink()
    victim.mkdir()
    (victim / "inside").write_text("x")
    for _ in range(2):
        _assert_correct(_run(cache))
    assert victim.is_file()


def test_a_relative_cache_is_the_folder_it_names_at_the_call(built_cache, tmp_path):
    """CUFLASH_EMULATE_CACHE=. gave library paths without a slash, which dlopen looks for on the library search path
    (LD_LIBRARY_PATH, the system folders), not in the checked cache: the library built there was not found, and one of
    that predictable name planted on LD_LIBRARY_PATH ran instead."""
    cache, marker, planted = _copy(built_cache, tmp_path), tmp_path / "marker", tmp_path / "planted"
    planted.mkdir()
    foreign = _foreign_library(tmp_path, marker)
    for library in _libraries(cache):
        shutil.copyfile(foreign, planted / library.name)
    env = dict(os.environ, CUFLASH_EMULATE_CACHE=".", CUFLASH_EMULATE_PCH="0", LD_LIBRARY_PATH=str(planted),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", VICTIM.format(tests=str(TESTS), options=())], env=env, cwd=cache,
                          capture_output=True, text=True, timeout=300)
    _assert_correct(proc)
    assert not marker.exists(), "the library planted on LD_LIBRARY_PATH ran"


def test_a_header_in_an_include_folder_of_the_options_is_in_the_key(tmp_path):
    """-I folders of a RawModule's options reach g++, but only the option's text was in the cache key: after the
    header changed, the library built against the old one was loaded (the kernel wrote the old value)."""
    include, cache = tmp_path / "inc", tmp_path / "cache"
    include.mkdir()
    source = tmp_path / "src"
    source.mkdir()
    (source / "val_kernel.cu").write_text('#include "val.h"\nextern "C" __global__ void val_kernel(float* out) '
                                          '{ out[threadIdx.x] = VAL; }\n')
    code = f"""
import sys
import numpy as np
sys.path.insert(0, {str(TESTS)!r})
import cuflash.emulate as emu
from emu_helpers import spec
from cuflash.emulate import LaunchSpec
out = np.zeros(4, np.float32)
source = open({str(source / "val_kernel.cu")!r}).read()
emu.launch(LaunchSpec(source, "val_kernel", (1, 1, 1), (4, 1, 1), 0, (out,), ("-I{include}",)))
print("result", out.tolist())
"""
    env = dict(os.environ, CUFLASH_EMULATE_CACHE=str(cache), CUFLASH_EMULATE_PCH="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for value in (1, 2):
        (include / "val.h").write_text(f"#define VAL {value}.0f\n")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert f"result {[float(value)] * 4}" in proc.stdout, proc.stdout


def test_a_build_trims_the_cache_to_its_size_least_recently_used_first(built_cache, tmp_path):
    """CUFLASH_EMULATE_CACHE_MIB: the process that builds a library removes the entries unused for longest (here a
    stale 3 MiB one of an old kernel) down to the size; the library just built, and the one just loaded, stay."""
    cache = _copy(built_cache, tmp_path)
    before = {p.name for p in cache.iterdir()}
    stale = ["f" * 32 + ".json", "f" * 32 + "-" + "0" * 16 + ".so"]
    (cache / stale[0]).write_text("{}")
    with open(cache / stale[1], "wb") as f:
        f.truncate(3 << 20)
    for name in stale:
        os.utime(cache / name, (1e9, 1e9))
    _assert_correct(_run(cache, options=("-DCUFLASH_TRIM_TEST=1",), CUFLASH_EMULATE_CACHE_MIB="2"))
    after = {p.name for p in cache.iterdir()}
    assert not set(stale) & after
    assert before <= after and len(after - before) == 2, sorted(after)  # the new record and library


def test_a_truncated_library_is_rebuilt(built_cache, tmp_path):
    cache = _copy(built_cache, tmp_path)
    for library in _libraries(cache):
        size = library.stat().st_size
        with open(library, "r+b") as f:
            f.truncate(size // 2)  # headers intact: the loader would map pages past the end (SIGBUS)
    _assert_correct(_run(cache))
    assert all(lib.stat().st_size > 1000 and lib.read_bytes()[:4] == b"\x7fELF" for lib in _libraries(cache))


def test_a_library_without_its_record_is_rebuilt(built_cache, tmp_path):
    cache = _copy(built_cache, tmp_path)
    records = sorted(cache.glob("*.json"))
    assert records
    for record in records:
        record.unlink()
    _assert_correct(_run(cache))
    assert sorted(cache.glob("*.json")) == records


def test_a_record_without_a_digest_matches_nothing(built_cache, tmp_path):
    """A null digest equalled the None that file_digest gives for a symlink, a foreign or a missing file: the
    planted library behind a link was loaded, a missing one was dlopen'ed instead of rebuilt."""
    import json

    cache, marker = _copy(built_cache, tmp_path), tmp_path / "marker"
    foreign = _foreign_library(tmp_path, marker)
    for record in sorted(cache.glob("*.json")):
        entry = json.loads(record.read_text())
        entry["sha256"] = None
        record.write_text(json.dumps(entry))
        library = cache / entry["library"]
        library.unlink()
        library.symlink_to(foreign)
    _assert_correct(_run(cache))
    assert not marker.exists(), "the library behind a record without digest was loaded"
    for record in sorted(cache.glob("*.json")):  # and once more with the libraries gone: rebuilt
        entry = json.loads(record.read_text())
        (cache / entry["library"]).unlink()
        entry["sha256"] = None
        record.write_text(json.dumps(entry))
    _assert_correct(_run(cache))


def test_the_keys_hold_the_cuda_headers_bytes_and_the_compiled_text(tmp_path):
    """A toolkit switched behind the same include path, or a change of the emulator's own rewrite of a source,
    reused libraries built from the old ones: the keys now hold the headers' bytes and the translation unit."""
    from dataclasses import replace

    from cuflash.emulate import _build, _toolchain

    tc, why = _toolchain.find()
    assert tc is not None, why
    real = Path(tc.cuda_includes[0])
    other = tmp_path / "include"  # the same headers, cuda_fp16.h one comment longer
    other.mkdir()
    for entry in real.iterdir():
        (other / entry.name).symlink_to(entry)
    (other / "cuda_fp16.h").unlink()
    (other / "cuda_fp16.h").write_bytes((real / "cuda_fp16.h").read_bytes() + b"\n// another toolkit\n")
    digest = _toolchain._headers_digest(tc.cxx, (str(other),) + tc.cuda_includes[1:])
    assert digest not in (None, tc.cuda_headers)
    assert _build._pch_key(replace(tc, cuda_headers=digest)) != _build._pch_key(tc)
    source = "__global__ void k(int* out) { out[0] = 1; }"
    text = _build.translation_unit(source, "k")
    key = _build._library_key(tc, source, text, "k", (), False, False)
    assert _build._library_key(replace(tc, cuda_headers=digest), source, text, "k", (), False, False) != key
    assert _build._library_key(tc, source, text + "\n// rewritten", "k", (), False, False) != key


def test_a_tampered_precompiled_shim_is_not_used(built_cache, tmp_path):
    cache, marker = _copy(built_cache, tmp_path, with_pch=True), tmp_path / "marker"
    pch_dirs = sorted(cache.glob("pch-*"))
    assert pch_dirs, "the template cache has no precompiled shim"
    for pch in pch_dirs:
        shim = pch / "shim.h"
        shim.write_text(shim.read_text() + MARKER_INITIALIZER % marker)
        (pch / "shim.h.gch").write_bytes(b"not a precompiled header")  # g++ then reads the text beside it
    proc = _run(cache, options=("-DCUFLASH_TEST_NEW_KERNEL=1",), pch=True)  # a new kernel: compiled now
    _assert_correct(proc)
    assert not marker.exists(), "code planted in the precompiled shim's directory was compiled in"
    assert all(b"cuflash_tampered" not in (pch / "shim.h").read_bytes() for pch in cache.glob("pch-*"))


# ------------------------------------------------------------------------------------------------ directories

@pytest.mark.parametrize("plant", ["fifo", "nested"])
def test_a_record_that_is_a_fifo_or_nested_past_the_parser_is_rebuilt(built_cache, tmp_path, plant):
    """A FIFO in a record's place blocked the open forever; JSON nested past the parser's depth raised
    RecursionError: both are a malformed record, rebuilt."""
    cache = _copy(built_cache, tmp_path)
    for record in sorted(cache.glob("*.json")):
        record.unlink()
        if plant == "fifo":
            os.mkfifo(record, 0o600)
        else:
            record.write_text("[" * 100_000 + "]" * 100_000)
            record.chmod(0o600)
    _assert_correct(_run(cache))


@pytest.mark.parametrize("cxx,why", [("/bin/true", "cannot open shared object file"), ("gcc", "undefined symbol")])
def test_a_compiler_whose_library_does_not_load_is_named_and_nothing_is_recorded(tmp_path, cxx, why):
    """Both passed the toolchain probe when it only parsed the CUDA headers: /bin/true wrote no library (a
    FileNotFoundError from chmod), gcc one that cannot load, recorded in the cache and loaded again by every later
    run. Now the probe builds and loads a C++ library: the launch is refused naming CUFLASH_EMULATE_CXX, and
    nothing is recorded."""
    if shutil.which(cxx) is None:
        pytest.skip(f"no {cxx} here")
    cache = tmp_path / "cache"
    proc = _run(cache, CUFLASH_EMULATE_CXX=cxx)
    assert proc.returncode != 0 and "builds no loadable C++ library" in proc.stderr and why in proc.stderr, \
        proc.stderr[-3000:]
    assert "CUFLASH_EMULATE_CXX must name a C++ compiler" in proc.stderr
    assert not list(cache.glob("*.json")) and not list(cache.glob("*.so"))


def test_a_compiler_that_passes_the_probe_but_writes_no_kernel_library_is_named(tmp_path):
    """The launch checks its library loads before recording it, whatever the probe found: a wrapper that runs g++
    for the probe (its source on stdin) and writes nothing for a kernel."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ here")
    wrapper = tmp_path / "half-a-compiler"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -|--version) exec {gxx} "$@";; esac; done\n'
                       'exit 0\n')
    wrapper.chmod(0o700)
    cache = tmp_path / "cache"
    proc = _run(cache, CUFLASH_EMULATE_CXX=str(wrapper))
    assert proc.returncode != 0 and "CompileError" in proc.stderr and "does not load" in proc.stderr, \
        proc.stderr[-3000:]
    assert not list(cache.glob("*.json")) and not list(cache.glob("*.so"))


def test_the_command_line_reports_errors_on_stderr(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    env = dict(os.environ, CUFLASH_EMULATE_CACHE=str(not_a_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "cuflash", "emulate"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr and "error" not in proc.stdout


@pytest.fixture
def private_env(monkeypatch, tmp_path):
    """HOME and the temporary directory inside tmp_path, no configured cache."""
    monkeypatch.delenv("CUFLASH_EMULATE_CACHE", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return home, tmp


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _launch():
    out = np.zeros(4, np.float32)
    emu.launch(spec("runtime_tests.cu", "copy_kernel", (np.arange(4, dtype=np.float32), out, np.int32(4))))
    return out


def test_default_cache_is_created_private(private_env):
    home, _ = private_env
    path = emu.cache_dir()
    assert path == home / ".cache" / "cuflash" / "emulate"
    assert _mode(path) == 0o700 and _mode(path.parent) == 0o700


def test_unwritable_home_falls_back_to_a_private_per_user_directory(private_env, monkeypatch):
    home, tmp = private_env
    blocker = home / "file"
    blocker.write_text("")
    monkeypatch.setenv("HOME", str(blocker))  # ~/.cache cannot be created under a file
    path = emu.cache_dir()
    assert path == tmp / f"cuflash-emulate-{os.getuid()}"
    assert _mode(path) == 0o700


def test_a_read_only_cache_falls_back_or_is_named(private_env, monkeypatch, tmp_path):
    """A private cache made 0500 passed every check, and the first compile died with a bare PermissionError
    naming neither the variable nor a fix. (``os.access`` is consulted: root may write anywhere, so the test
    makes the directories unwritable through it.)"""
    home, tmp = private_env
    default = home / ".cache" / "cuflash" / "emulate"
    configured = tmp_path / "configured"
    configured.mkdir(mode=0o700)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real_access(p, mode) and Path(p) not in (default, configured))
    assert emu.cache_dir() == tmp / f"cuflash-emulate-{os.getuid()}"  # the default falls back
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(configured))
    with pytest.raises(ValueError, match=r"CUFLASH_EMULATE_CACHE=.* is not writable by this user"):
        emu.cache_dir()


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_squatted_fallback_directory_is_refused(private_env, monkeypatch, mode):
    home, tmp = private_env
    (home / "file").write_text("")
    monkeypatch.setenv("HOME", str(home / "file"))
    squatted = tmp / f"cuflash-emulate-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(mode)
    with pytest.raises(ValueError, match="CUFLASH_EMULATE_CACHE"):
        emu.cache_dir()


def test_a_world_writable_cache_is_an_error(monkeypatch, tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(cache))
    with pytest.raises(ValueError, match=r"CUFLASH_EMULATE_CACHE=.*writable by other users"):
        _launch()
    # and the backend is reported unavailable, with that reason (python -m cuflash listed it as available)
    ok, why = emu.available()
    assert not ok and "writable by other users" in why


def test_a_cache_below_a_directory_others_can_write_is_an_error(private_env, monkeypatch, tmp_path):
    """From a directory above the cache that others can write, they can rename the checked cache away and put
    theirs in its place between the digest check and the load: refused, unless its sticky bit forbids renaming
    what they do not own (as /tmp's does). For the configured cache and for the default one under HOME."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(shared / "cache"))
    with pytest.raises(ValueError, match=r"CUFLASH_EMULATE_CACHE=.*shared above it is writable by other users "
                                         r"without the sticky bit"):
        _launch()
    shared.chmod(0o1777)
    assert emu.cache_dir() == shared / "cache"
    shared.chmod(0o777)
    monkeypatch.delenv("CUFLASH_EMULATE_CACHE")
    monkeypatch.setenv("HOME", str(shared / "home"))
    with pytest.raises(ValueError, match=r"emulator's cache .* is not a safe place .*shared above it is writable"):
        emu.cache_dir()


def test_a_cache_under_an_unknown_users_home_is_named(monkeypatch):
    """~nosuchuser/x: Path.expanduser raised a bare RuntimeError ("Could not determine home directory")."""
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", "~cuflash-no-such-user-x9/cache")
    with pytest.raises(ValueError, match=r"CUFLASH_EMULATE_CACHE=.*cannot be expanded"):
        emu.cache_dir()


def test_a_cache_owned_by_another_user_is_an_error(monkeypatch, tmp_path):
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(cache))
    monkeypatch.setattr(os, "getuid", lambda: os.stat(cache).st_uid + 4242)  # as if we were someone else
    with pytest.raises(ValueError, match=r"CUFLASH_EMULATE_CACHE=.*owned by uid"):
        _launch()


def test_a_cache_that_is_a_file_or_cannot_be_created_is_an_error(monkeypatch, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for configured, why in [(not_a_dir, "is not a directory"), (not_a_dir / "sub", "cannot be created")]:
        monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(configured))
        with pytest.raises(ValueError, match=rf"CUFLASH_EMULATE_CACHE=.*{why}"):
            _launch()


def test_a_symlinked_cache_is_an_error(monkeypatch, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(tmp_path / "link"))
    with pytest.raises(ValueError, match=r"CUFLASH_EMULATE_CACHE=.*symbolic link"):
        _launch()


def test_a_configured_cache_is_created_private(monkeypatch, tmp_path):
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(tmp_path / "a" / "b"))
    assert emu.cache_dir() == tmp_path / "a" / "b"
    assert _mode(tmp_path / "a") == 0o700 and _mode(tmp_path / "a" / "b") == 0o700


def test_unsafe_reason_accepts_only_private_directories(tmp_path):
    from cuflash.emulate import _cache

    private = tmp_path / "private"
    private.mkdir(mode=0o755)  # readable by others is fine: only writing matters
    assert _cache.unsafe_reason(private) is None
    private.chmod(0o720)
    assert "writable by other users" in _cache.unsafe_reason(private)

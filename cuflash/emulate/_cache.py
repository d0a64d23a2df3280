"""Where the emulator keeps compiled code, and the checks that make it load only what it built itself.

Everything the emulator loads (kernel libraries with ``dlopen``, the precompiled shim through g++) runs with the
user's rights, so the cache is treated like code:

* it is a directory owned by the current user, writable by nobody else, and not a symbolic link; the
  components cuflash creates are made with mode 0700, and the directory is checked again before every load;
* every artefact is verified against the SHA-256 digest recorded when it was built (a JSON record written
  through a temporary file and ``os.replace``, inside the checked directory); a missing, truncated, foreign or
  altered artefact is discarded and rebuilt, never loaded.

The digest is computed from the file, then the file is loaded by name: the window between the two is closed by
the ownership checks, not by the digest: nobody else can write into the directory or the file, nor into any
directory above it (:func:`ancestors_problem`), where they could move the cache aside and put their own in its
place between the check and the load.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from .. import _env
from . import _trim

VARIABLE = "CUFLASH_EMULATE_CACHE"
_CHUNK = 1 << 20


# ------------------------------------------------------------------------------------------------ directories

def unsafe_reason(path: Path) -> str | None:
    """Why ``path`` cannot hold code this process will run, or None when it can."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return _ownership_problem(st)


def _ownership_problem(st: os.stat_result) -> str | None:
    uid = os.getuid()
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def ancestors_problem(path: Path) -> str | None:
    """Why a directory above ``path`` (as written, and as it resolves) lets another user replace ``path``, or None.

    Each must be owned by this user or root and writable by nobody else, unless its sticky bit keeps others from
    renaming what they do not own (``/tmp``): from one writable by others, the cache could be renamed away and a
    directory of theirs put in its place between a check and a load."""
    uid = os.getuid()
    above = [*Path(os.path.abspath(path)).parents, *Path(os.path.realpath(path)).parents]
    for parent in dict.fromkeys(above):
        try:
            st = os.stat(parent)  # a link among them: its own parent is checked too, and its target's parents
        except OSError as exc:
            return f"{parent} cannot be examined ({exc.strerror or exc})"
        if st.st_uid not in (0, uid):
            return f"{parent} above it is owned by uid {st.st_uid}, neither this user (uid {uid}) nor root"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return (f"{parent} above it is writable by other users without the sticky bit (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}): they could put another directory in its place")
    return None


def _make_private(path: Path) -> list[Path]:
    """``mkdir -p`` with mode 0700 for every component created; returns the components this call created."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for component in reversed(missing):
        try:
            os.mkdir(component, 0o700)
        except FileExistsError:  # a parallel process made it first: checked like our own
            pass
    return missing


def _writable(path: Path) -> bool:
    """Whether this process can create files in ``path`` (a private directory may still be 0500)."""
    return os.access(path, os.W_OK | os.X_OK)


def _configured(raw: str) -> Path:
    accepted = _env.VARIABLES[VARIABLE].accepted
    try:
        # absolute: a library path without a slash ("." gave "K-D.so") is looked for by dlopen on the library search
        # path (LD_LIBRARY_PATH, the system folders), not in the cache that was checked; and a relative one would
        # follow a chdir between the check and the load
        path = Path(os.path.abspath(Path(raw).expanduser()))
    except RuntimeError as exc:  # ~nosuchuser/x: "Could not determine home directory", naming nothing
        raise ValueError(f"environment variable {VARIABLE}={raw!r} cannot be expanded ({exc}): expected "
                         f"{accepted}") from None
    try:
        created = _make_private(path)
    except OSError as exc:
        raise ValueError(f"environment variable {VARIABLE}={raw!r} cannot be created "
                         f"({exc.strerror or exc}): expected {accepted}") from None
    for component in [path, *created]:
        problem = unsafe_reason(component)
        if problem:
            raise ValueError(f"environment variable {VARIABLE}={raw!r} is not a safe place for compiled code: "
                             f"{component} {problem}; expected {accepted}")
    problem = ancestors_problem(path)
    if problem:
        raise ValueError(f"environment variable {VARIABLE}={raw!r} is not a safe place for compiled code: "
                         f"{problem}; expected {accepted}")
    if not _writable(path):
        raise ValueError(f"environment variable {VARIABLE}={raw!r} is not writable by this user: expected {accepted}")
    with os.scandir(path) as entries:
        empty = next(entries, None) is None
    if path in created or empty:  # the emulator's own folder, trimmed (a user's is not)
        _trim.mark(path)
    return path


def _checked(path: Path, components: list[Path]) -> Path:
    for component in components:
        problem = unsafe_reason(component)
        if problem:
            problem = f"{component} {problem}"
            break
    else:
        problem = ancestors_problem(components[0])
    if problem:
        raise ValueError(f"the emulator's cache {path} is not a safe place for compiled code: {problem}. Fix it, or "
                         f"set {VARIABLE} to a directory owned by you and writable only by you")
    return path


def _fallback() -> Path:
    """A per-user directory in the temporary directory, for when HOME cannot hold the cache (read-only CI homes).

    The name is predictable, so it is checked like any other: a directory planted there by someone else is an
    error, never used.
    """
    path = Path(tempfile.gettempdir()) / f"cuflash-emulate-{os.getuid()}"
    try:
        _make_private(path)
    except OSError as exc:
        raise ValueError(f"the emulator has no usable cache: HOME is not writable and {path} cannot be created "
                         f"({exc.strerror or exc}); set {VARIABLE} to a directory owned by you and writable only "
                         f"by you") from None
    _checked(path, [path])
    if not _writable(path):
        raise ValueError(f"the emulator has no usable cache: HOME is not writable and neither is {path}; set "
                         f"{VARIABLE} to a directory owned by you and writable only by you")
    _trim.mark(path)  # a name of cuflash's: its own folder
    return path


def cache_dir() -> Path:
    """The library cache, created (0700) and checked: ``CUFLASH_EMULATE_CACHE``, else ~/.cache/cuflash/emulate,
    else (HOME not writable) ``<tempdir>/cuflash-emulate-<uid>``. Raises ValueError when it is not private."""
    configured = _env.get(VARIABLE)
    if configured is not None:
        return _configured(configured)
    try:
        path = Path.home() / ".cache" / "cuflash" / "emulate"
        _make_private(path)
    except (OSError, RuntimeError):  # no HOME, or one we cannot write (some CI sandboxes)
        return _fallback()
    _checked(path, [path.parent, path])  # ~/.cache/cuflash and its emulate/: the components cuflash owns
    if not _writable(path):
        return _fallback()  # made read-only since (a 0500 cache in a read-only home)
    _trim.mark(path)
    return path


# ------------------------------------------------------------------------------------------------ files

def _read_private(path: Path, read):
    """``read(file)`` of a regular file that this user owns and nobody else can write (opened without following
    a link, the checks made on the open file); None for anything else."""
    try:
        # O_NONBLOCK: a FIFO put in a file's place would block the open forever (refused below, as not regular)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:  # checked on the descriptor before fdopen: a folder opens too, and fdopen raised IsADirectoryError for it
        st = os.fstat(fd)
        private = stat.S_ISREG(st.st_mode) and not _ownership_problem(st)
    except BaseException:
        os.close(fd)
        raise
    if not private:
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        return read(f)


def file_digest(path: Path) -> str | None:
    """SHA-256 of a private regular file (:func:`_read_private`); None for anything else."""
    def digest(f):
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
        return h.hexdigest()
    return _read_private(path, digest)


def write_record(path: Path, record: dict) -> None:
    """Atomically replace ``path`` with ``record`` as JSON (readers see the old or the new record, whole)."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        discard_folder(path)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_record(path: Path) -> dict | None:
    """The JSON object at ``path`` when it is a private regular file and well formed, else None."""
    def parse(f):
        try:
            return json.loads(f.read(1 << 20))
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth ('[' * 10**5)
            return None
    record = _read_private(path, parse)
    return record if isinstance(record, dict) else None


def discard_folder(path: Path) -> None:
    """Remove a folder standing where a file of the cache belongs: os.replace cannot put a file in its place, and the
    file's rebuild failed for good (IsADirectoryError, naming no path)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
    except OSError:
        pass


def discard(path: Path) -> None:
    """Remove a corrupt or foreign artefact so that nothing loads it by mistake later: a file, or a folder standing
    where a file of the cache belongs (which would block its rebuild for good)."""
    discard_folder(path)
    try:
        path.unlink()
    except OSError:
        pass

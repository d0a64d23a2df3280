"""The emulator's cache kept to a size: the least recently used kernel libraries go first.

Every kernel change, option and toolchain makes new keys, and nothing removed the old ones (a development machine's
cache held 4842 libraries, 320 MB, after a few weeks). As ccache does, the cache has a largest size
(``CUFLASH_EMULATE_CACHE_MIB``, 0: none); after a process has built libraries it removes whole entries (a record and
its libraries), least recently used first, down to 90% of it. "Used" is the record's mtime, set on each load
(:func:`touch`). Leftovers of builds that did not finish (a killed compiler's work folder, a record's temporary, a
failed source, a precompiled shim of another toolchain) go once they are older than :data:`GRACE_S`, and no entry
used within that time is removed: another process may be about to load it.

Only a folder the emulator made for itself is trimmed: one it created, found empty, or named itself (the default
cache), which it marks with a ``CACHEDIR.TAG`` (the Cache Directory Tagging convention, which backup tools honour
too). A folder of the user's that ``CUFLASH_EMULATE_CACHE`` points at grows unbounded: names alone could not tell the
emulator's files from the user's (``trash-old/`` or a file named by its MD5 looked like its own), and a trim there
deleted them. Within a marked folder, only names the emulator makes are touched.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from .. import _env

#: seconds a leftover or an entry must lie unused before it may go (a concurrent process may be using it)
GRACE_S = 3600.0
#: a trim removes entries down to this fraction of the largest size (not one entry per build)
LOW_WATER = 0.9
#: a process trims at most once per this many seconds of builds
EVERY_S = 60.0

_KEY = "[0-9a-f]{32}"
_RANDOM = "[a-z0-9_]+"  # tempfile's random names
RECORD = re.compile(rf"({_KEY})\.json")
LIBRARY = re.compile(rf"({_KEY})-[0-9a-f]{{16}}\.so")
PCH = re.compile(r"pch-[0-9a-f]{24}")
#: what a build leaves only when it is killed midway (its work folder, a record's temporary, a failed source,
#: a shim's folder being built, a discarded one being deleted)
LEFTOVER = re.compile(rf"{_KEY}\.{_RANDOM}|{_KEY}\.json\.{_RANDOM}\.tmp|{_KEY}\.{_RANDOM}\.cpp\.failed|"
                      rf"pch-tmp-{_RANDOM}|trash-{_RANDOM}|CACHEDIR\.TAG\.{_RANDOM}\.tmp")

_next = [0.0]  # monotonic time of this process's next trim

#: the mark of a folder the emulator owns (https://bford.info/cachedir/): only such a folder is trimmed
TAG = "CACHEDIR.TAG"
_TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
             "# cuflash's emulator cache: kernel libraries, trimmed to CUFLASH_EMULATE_CACHE_MIB.\n")


def mark(directory: Path) -> None:
    """Mark ``directory`` as the emulator's own: its :data:`TAG`, written whole (a temporary renamed into place: a
    tag cut short by a kill would leave the folder unmarked for good)."""
    if marked(directory):
        return
    fd, tmp = tempfile.mkstemp(prefix=f"{TAG}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_TAG_TEXT)
        os.replace(tmp, directory / TAG)
    except BaseException:
        _remove(Path(tmp))
        raise


def marked(directory: Path) -> bool:
    """Whether ``directory`` holds the emulator's :data:`TAG`: a regular file of its own text (opened without
    following a link or blocking on a FIFO, and checked before a byte is read)."""
    try:
        fd = os.open(directory / TAG, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read(len(_TAG_TEXT) + 1) == _TAG_TEXT.encode()


def touch(record: Path) -> None:
    """Mark the entry of ``record`` as used now (its mtime orders the entries for :func:`trim`)."""
    try:
        os.utime(record)
    except OSError:
        pass


def after_build(directory: Path, keep=()) -> None:
    """Trim ``directory`` (:func:`trim`) to ``CUFLASH_EMULATE_CACHE_MIB``, at most once per :data:`EVERY_S`; only a
    folder the emulator :func:`marked` as its own."""
    if not marked(directory):
        return
    now = time.monotonic()
    if now < _next[0]:
        return
    _next[0] = now + EVERY_S
    mib = _env.get("CUFLASH_EMULATE_CACHE_MIB")
    if mib:
        try:
            trim(directory, mib << 20, keep=keep)
        except OSError:  # a cache that cannot be listed now: the build stands, the next one tries again
            pass


def _size(path: Path, st: os.stat_result) -> int:
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _remove(path: Path) -> None:
    """Remove a file or folder; one another process removed first is fine."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except OSError:
        pass


def _scan(directory: Path, keep):
    """``(entries, leftovers, total)``: per key ``[last use, bytes, paths]``; the leftovers and unkept shims as
    ``(mtime, bytes, path)``; the bytes of everything the emulator made here."""
    entries: dict[str, list] = {}
    leftovers, total = [], 0
    for name in os.listdir(directory):
        path = directory / name
        match = RECORD.fullmatch(name) or LIBRARY.fullmatch(name)
        if not match and not PCH.fullmatch(name) and not LEFTOVER.fullmatch(name):
            continue  # not the emulator's
        try:
            st = os.lstat(path)
        except OSError:  # removed meanwhile
            continue
        size = _size(path, st)
        total += size
        if match:
            entry = entries.setdefault(match.group(1), [0.0, 0, []])
            # the record's mtime is the last use; a library without a record counts from its own
            if name.endswith(".json") or not entry[2]:
                entry[0] = st.st_mtime if name.endswith(".json") else max(entry[0], st.st_mtime)
            entry[1] += size
            entry[2].append(path)
        elif name not in keep:
            leftovers.append((st.st_mtime, size, path))
    return entries, leftovers, total


def trim(directory: Path, limit: int, *, keep=(), now=None) -> int:
    """Remove from ``directory`` the leftovers and unkept shims unused for :data:`GRACE_S`, then, while it holds
    more than ``limit`` bytes, the least recently used entries (not those used within :data:`GRACE_S`) down to
    :data:`LOW_WATER` of it. ``keep``: names never removed (the current toolchain's shim). Returns the bytes
    left."""
    now = time.time() if now is None else now
    entries, leftovers, total = _scan(directory, keep)
    for mtime, size, path in leftovers:
        if now - mtime > GRACE_S:
            _remove(path)
            total -= size
    if total <= limit:
        return total
    for used, size, paths in sorted(entries.values(), key=lambda e: e[0]):
        if total <= LOW_WATER * limit or now - used <= GRACE_S:
            break
        for path in sorted(paths, key=lambda p: p.suffix != ".json"):  # the record first: no reader finds it then
            _remove(path)
        total -= size
    return total

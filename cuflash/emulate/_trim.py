"""The emulator's cache kept to a size: the least recently used kernel libraries go first.

Every kernel change, option and toolchain makes new keys, and nothing removed the old ones (a development machine's
cache held 4842 libraries, 320 MB, after a few weeks). As ccache does, the cache has a largest size
(``CUFLASH_EMULATE_CACHE_MIB``, 0: none); after a process has built libraries it removes whole entries (a record and
its libraries), least recently used first, down to 90% of it. "Used" is the record's mtime, set on each load
(:func:`touch`). Leftovers of builds that did not finish (a killed compiler's work folder, a record's temporary, a
failed source, a precompiled shim of another toolchain) go once they are older than :data:`GRACE_S`, and no entry
used within that time is removed: another process may be about to load it.

Only names the emulator makes are touched: a cache that the user pointed at a folder holding other files keeps them.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
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
                      rf"pch-tmp-{_RANDOM}|trash-{_RANDOM}")

_next = [0.0]  # monotonic time of this process's next trim


def touch(record: Path) -> None:
    """Mark the entry of ``record`` as used now (its mtime orders the entries for :func:`trim`)."""
    try:
        os.utime(record)
    except OSError:
        pass


def after_build(directory: Path, keep=()) -> None:
    """Trim ``directory`` (:func:`trim`) to ``CUFLASH_EMULATE_CACHE_MIB``, at most once per :data:`EVERY_S`."""
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

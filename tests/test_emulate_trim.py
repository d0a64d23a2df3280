"""The emulator's cache kept to a size (cuflash/emulate/_trim.py), on a folder of stand-in files: the least recently
used entries go first, down to the low-water mark; nothing used within the grace period, nothing the emulator did not
make, and not the current toolchain's shim."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cuflash import _env
from cuflash.emulate import _trim

MIB = 1 << 20
NOW = 1_000_000_000.0
HOUR = 3600.0


def _entry(cache: Path, n: int, used: float, size=MIB) -> str:
    """A record and its library (``size`` bytes, sparse), last used at ``used``; returns the key."""
    key = f"{n:032x}"
    record, library = cache / f"{key}.json", cache / f"{key}-{n:016x}.so"
    record.write_text("{}")
    with open(library, "wb") as f:
        f.truncate(size)
    for path in (library, record):
        os.utime(path, (used, used))
    return key


def _keys(cache: Path) -> set:
    return {p.name[:32] for p in cache.glob("*.json") if _trim.RECORD.fullmatch(p.name)}


def _aged(path: Path, when: float) -> Path:
    os.utime(path, (when, when))
    return path


def test_the_least_recently_used_entries_go_first_down_to_the_low_water_mark(tmp_path):
    ages = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1.5]  # hours since the last use: entry 0 is the oldest
    keys = [_entry(tmp_path, n, NOW - h * HOUR) for n, h in enumerate(ages)]
    left = _trim.trim(tmp_path, 6 * MIB + 100, now=NOW)
    # 10 MiB and 10 records: above 6 MiB; down to 90% of it, the oldest first
    assert _keys(tmp_path) == set(keys[5:]), sorted(_keys(tmp_path))
    assert left <= _trim.LOW_WATER * (6 * MIB + 100)
    assert not list(tmp_path.glob(f"{keys[0]}*"))  # record and library both


def test_entries_used_within_the_grace_period_stay_whatever_the_size(tmp_path):
    old = _entry(tmp_path, 1, NOW - 5 * HOUR)
    recent = [_entry(tmp_path, n, NOW - 0.5 * HOUR) for n in range(2, 6)]
    _trim.trim(tmp_path, MIB, now=NOW)
    assert _keys(tmp_path) == set(recent)  # over the limit still: a concurrent process may be loading them
    assert old not in _keys(tmp_path)


def test_under_the_limit_only_old_leftovers_go(tmp_path):
    keys = [_entry(tmp_path, n, NOW - 100 * HOUR) for n in range(3)]
    key = keys[0]
    folders = [f"{key}.abc_12x9", "pch-tmp-a1b2c3d4", "trash-x1y2z3w4", "pch-" + "a" * 24]  # another toolchain's shim
    files = [f"{key}.json.q1w2e3r4.tmp", f"{key}.zz9_ab12.cpp.failed"]
    for name in folders:
        (tmp_path / name).mkdir()
        (tmp_path / name / "inside").write_text("x")
    for name in files:
        (tmp_path / name).write_text("x")
    old = [_aged(tmp_path / name, NOW - 2 * HOUR) for name in folders + files]
    young = tmp_path / f"{key}.young123"  # a build running now
    young.mkdir()
    _aged(young, NOW - 60)
    kept_shim = tmp_path / ("pch-" + "b" * 24)  # the current toolchain's
    kept_shim.mkdir()
    _aged(kept_shim, NOW - 50 * HOUR)
    _trim.trim(tmp_path, 1 << 40, keep={kept_shim.name}, now=NOW)
    assert _keys(tmp_path) == set(keys)  # under the limit: every entry stays, however old
    assert [p.name for p in old if p.exists()] == []
    assert young.exists() and kept_shim.exists()


def test_files_the_emulator_did_not_make_are_never_touched(tmp_path):
    _entry(tmp_path, 1, NOW - 10 * HOUR)
    mine = [tmp_path / "notes.txt", tmp_path / "model.json", tmp_path / ("0" * 31 + ".json"), tmp_path / "lib.so"]
    for path in mine:
        with open(path, "wb") as f:
            f.truncate(4 * MIB)
        _aged(path, NOW - 100 * HOUR)
    (tmp_path / "data").mkdir()
    _trim.trim(tmp_path, MIB, now=NOW)
    assert _keys(tmp_path) == set()
    assert all(p.exists() for p in mine) and (tmp_path / "data").is_dir()


def test_a_library_without_its_record_counts_from_its_own_mtime(tmp_path):
    key = _entry(tmp_path, 1, NOW - 10 * HOUR)
    (tmp_path / f"{key}.json").unlink()
    fresh = _entry(tmp_path, 2, NOW - 2 * HOUR)
    _trim.trim(tmp_path, 6 * MIB // 5, now=NOW)  # 2 MiB, down to 90% of 1.2 MiB: one entry goes
    assert not list(tmp_path.glob(f"{key}*")) and _keys(tmp_path) == {fresh}


def test_a_load_marks_the_entry_used(tmp_path):
    key = _entry(tmp_path, 1, NOW - 10 * HOUR)
    _trim.touch(tmp_path / f"{key}.json")
    assert (tmp_path / f"{key}.json").stat().st_mtime > NOW


def test_after_build_trims_to_the_variable_at_most_once_a_minute(tmp_path, monkeypatch):
    import time

    for n in range(4):
        _entry(tmp_path, n, time.time() - 10 * HOUR - n)
    _trim.mark(tmp_path)
    monkeypatch.setattr(_trim, "_next", [0.0])
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE_MIB", "0")  # no limit
    _trim.after_build(tmp_path)
    assert len(_keys(tmp_path)) == 4
    monkeypatch.setattr(_trim, "_next", [0.0])
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE_MIB", "2")
    _trim.after_build(tmp_path)
    assert len(_keys(tmp_path)) == 1  # 4 MiB, down to 90% of 2 MiB
    _entry(tmp_path, 9, time.time() - 10 * HOUR)
    _trim.after_build(tmp_path)  # within the minute: not again
    assert len(_keys(tmp_path)) == 2


@pytest.mark.parametrize("raw", ["-1", "1.5", "lots", str(1 << 31)])
def test_the_size_variable_is_checked(monkeypatch, raw):
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE_MIB", raw)
    with pytest.raises(ValueError, match="CUFLASH_EMULATE_CACHE_MIB"):
        _env.get("CUFLASH_EMULATE_CACHE_MIB")


def test_a_folder_of_the_users_is_never_trimmed(tmp_path, monkeypatch):
    """CUFLASH_EMULATE_CACHE at a folder of the user's that holds files: names alone cannot tell the emulator's from
    the user's (a trim deleted a folder trash-old/ with a thesis in it, a file named by its MD5, another <md5>.json),
    so only a folder the emulator created, found empty or named itself is marked (CACHEDIR.TAG) and trimmed."""
    import time

    from cuflash.emulate import _cache

    user = tmp_path / "home"
    (user / "trash-old").mkdir(parents=True)
    (user / "trash-old" / "thesis.tex").write_text("years of work")
    md5s = [user / "d41d8cd98f00b204e9800998ecf8427e.txt", user / "9e107d9d372bb6826bd81d3542a419d6.json"]
    for path in md5s:
        path.write_text("{}")
    old = time.time() - 10 * HOUR
    for path in [user / "trash-old", *md5s]:
        os.utime(path, (old, old))
    user.chmod(0o700)
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(user))
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE_MIB", "1")
    monkeypatch.setattr(_trim, "_next", [0.0])
    assert _cache.cache_dir() == user and not _trim.marked(user)
    _trim.after_build(user)
    assert (user / "trash-old" / "thesis.tex").read_text() == "years of work"
    assert all(path.exists() for path in md5s)

    fresh = tmp_path / "new" / "cache"  # made by the emulator: its own, marked and trimmed
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(fresh))
    assert _cache.cache_dir() == fresh and _trim.marked(fresh)
    for n in range(4):
        _entry(fresh, n, old - n)
    monkeypatch.setattr(_trim, "_next", [0.0])
    _trim.after_build(fresh)
    assert len(_keys(fresh)) == 0  # 4 MiB of entries unused for hours, over a limit of 1 MiB


@pytest.mark.parametrize("raw", [" /tmp/cuflash-cache", "/tmp/cuflash-cache\t"])
def test_the_cache_variable_refuses_whitespace_at_either_end(monkeypatch, raw):
    """A leading space made the emulator create and use a folder named " " in the working directory (a trailing tab,
    a folder ending in one): an editing slip, refused naming the variable (every other variable strips it)."""
    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", raw)
    with pytest.raises(ValueError, match="CUFLASH_EMULATE_CACHE=.*no whitespace at either end"):
        _env.get("CUFLASH_EMULATE_CACHE")


def test_the_tag_is_read_without_blocking_and_written_whole(tmp_path):
    """A FIFO named CACHEDIR.TAG hung the check (a read waiting for a writer); a tag cut short (a killed write) was
    never written again, leaving the cache untrimmed for good."""
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / _trim.TAG)
    assert not _trim.marked(fifo)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / _trim.TAG).write_text("Signature: 8a477f")
    assert not _trim.marked(cut)
    _trim.mark(cut)
    assert _trim.marked(cut) and sorted(os.listdir(cut)) == [_trim.TAG]

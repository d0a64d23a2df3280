"""Reading back a JSON file the benchmarks wrote (figure files, a session's probe): a regular file of bounded size,
read without following a link or blocking, refused with one line naming it otherwise. The standard library only:
``benchmarks.session`` reads its probe with it where NumPy may be missing."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Optional

#: the largest figure JSON read back (a run's figure JSON is at most a few MiB): a file of 1 TiB at a figure's name
#: was read whole, a MemoryError traceback in --replot and in a run's look at its --out
MAX_JSON_BYTES = 256 * 2**20


def not_regular(mode: int) -> Optional[str]:
    """What a file of ``st_mode`` ``mode`` is, in words, where it is not a regular file (None where it is): a figure
    file is a regular file, read back (:func:`read_json`) or removed (``--replace``) as one."""
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    return next((words for test, words in kinds if test(mode)), "not a regular file")


def read_json(path: Path, parse_constant=None):
    """The JSON value held by the regular file ``path``; anything else is a ValueError naming it. Every JSON file the
    benchmarks read back goes through here (--replot, the other runs a run's --out holds, a session's probe; its
    ``parse_constant`` as json.loads's). The file is opened without
    blocking (a FIFO would hang the open, then the read) and without following a symbolic link, and is checked to be
    a regular file before a byte is read, and no larger than :data:`MAX_JSON_BYTES`; JSON nested deeper than the
    parser recurses is malformed like any other."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:  # a file this user cannot read, a symbolic link (ELOOP under O_NOFOLLOW)
        why = "a symbolic link, not a regular file" if exc.errno == errno.ELOOP else exc.strerror or exc
        raise ValueError(f"{path}: cannot be read ({why})") from None
    try:
        st = os.fstat(fd)
        kind = not_regular(st.st_mode)
        if kind:  # a folder opens read-only on Linux; fdopen would raise, a FIFO's read would wait for a writer
            raise ValueError(f"{path}: cannot be read ({kind}, not a regular file)")
        if st.st_size > MAX_JSON_BYTES:  # read whole, it would exhaust the memory before the parser saw a byte
            raise ValueError(f"{path}: cannot be read ({st.st_size} bytes, more than the {MAX_JSON_BYTES >> 20} MiB "
                             f"a figure JSON may hold)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_JSON_BYTES + 1)  # a file grown since the fstat is read no further than the bound
        if len(data) > MAX_JSON_BYTES:
            raise ValueError(f"{path}: cannot be read (more than the {MAX_JSON_BYTES >> 20} MiB a figure JSON may "
                             f"hold)")
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    try:
        return json.loads(data.decode("utf-8"), parse_constant=parse_constant)
    except RecursionError:  # e.g. 200000 nested arrays: the parser's recursion limit, not a defect of ours
        raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError (e.g. a file cut short by a kill), UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({exc})") from None

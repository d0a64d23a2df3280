"""The Python half of ``benchmarks/gpu_session.sh``: probes that fail loudly, the JUnit check, ``session.json``.

``python3 -m benchmarks.session probe --json FILE [--need-pytest]``
    Print the versions of python, numpy, CuPy, NVRTC, the CUDA driver and runtime, torch, pytest and
    pytest-xdist, the device and cuflash's cuda backend; write them to FILE. Exit 1 with one
    ``gpu_session: FAIL: ...`` line (also stored as ``failed`` in FILE) when CuPy is missing, no GPU is
    visible, NVRTC cannot be loaded, or (``--need-pytest``) pytest is missing.
``python3 -m benchmarks.session junit XML [--require-golden]``
    Summarize a pytest JUnit XML; exit 1 when no test ran, or (``--require-golden``) no golden case ran.
``python3 -m benchmarks.session warm [--quick]``
    Compile every kernel specialization the current GPU selects (cuflash.warmup: float16, bfloat16, float32 in
    each precision, float64; forward and backward), one thread per core, before the tests, so that 16 pytest
    workers do not each compile what their tests meet first, several the same module at once (a module takes
    0.5-1 s of NVRTC: the compile check). ``--quick``: float16 at head_dim 64 only (the dry run).
``python3 -m benchmarks.session finish --out FILE [--probe FILE] [--junit XML] [--set KEY=VALUE ...]``
    Write ``session.json``: the probe's facts, the JUnit summary, every ``KEY=VALUE`` (VALUE a number or null
    where KEY is one of :data:`NUMBER_FIELDS` or ends in ``_rc`` and VALUE is one, else kept as text: a commit such
    as ``0e12345`` stays a commit; NaN and infinities are refused) and the files of FILE's folder, which must exist.
``python3 -m benchmarks.session tree-hash [ROOT]``
    The SHA-256 of the tree's source files (:func:`tree_hash`; also the probe's ``tree_sha256``): the device's
    copy has no ``.git``, so this is what proves which code ran. Compare it with the same command here. A ROOT that
    is not a folder holding ``cuflash/`` is an error (status 2), not the hash of no files.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional


class SessionError(Exception):
    """A precondition of a GPU session does not hold; the message is the one line to show."""


class UsageError(Exception):
    """A bad argument; :func:`main` shows it as argparse does (one ``error:`` line, status 2)."""


def _version(module: str) -> Optional[str]:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except ImportError:
        return None


def probe(*, need_pytest: bool) -> dict:
    """The facts of this machine that a GPU result depends on; raises :class:`SessionError`."""
    import numpy as np

    facts = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import cupy
    except ImportError as exc:
        raise SessionError(f"CuPy is not importable ({exc}): install cupy-cuda12x or cupy-cuda13x") from None
    facts["cupy"] = cupy.__version__
    try:
        facts["gpus"] = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 -- CUDARuntimeError: no driver, no device
        raise SessionError(f"no GPU visible to CuPy ({type(exc).__name__}: {exc})") from None
    if facts["gpus"] < 1:
        raise SessionError("no GPU visible to CuPy (getDeviceCount() == 0)")
    from . import environment

    facts.update(environment.cuda_versions())
    if facts["nvrtc"].startswith("unavailable"):
        raise SessionError(f"NVRTC {facts['nvrtc']}: the kernels cannot be compiled")
    facts["device"] = environment.gpu_info()
    ok, why = environment.cuflash_backend_status("cuda")
    facts["cuflash_cuda_backend"] = why if ok else f"unavailable: {why}"
    facts["tree_sha256"] = tree_hash(Path(__file__).resolve().parent.parent)
    if not ok:  # every GPU test would skip and the benchmark refuse: a call spent on nothing
        raise SessionError(f"cuflash's CUDA backend is unusable here: {why}")
    facts.update(torch=_version("torch"), pytest=_version("pytest"), xdist=_version("xdist"))
    if need_pytest and facts["pytest"] is None:
        raise SessionError("pytest is not importable: the GPU tests cannot run")
    return facts


#: what tree_hash reads: the package, the kernels, the tests and benchmarks (not results, caches or venvs)
_TREE_DIRS = ("cuflash", "kernels", "tests", "benchmarks")
_TREE_SUFFIXES = (".py", ".cu", ".cuh", ".h", ".sh", ".toml", ".cfg")


def tree_hash(root: Path) -> str:
    """SHA-256 over the relative path and bytes of every source file under :data:`_TREE_DIRS` of ``root`` (and its
    top-level ``pyproject.toml``), in sorted order; ``benchmarks/results`` and ``__pycache__`` left out."""
    files = [root / "pyproject.toml"] if (root / "pyproject.toml").is_file() else []
    for top in _TREE_DIRS:
        files += [p for p in (root / top).rglob("*") if p.is_file() and p.suffix in _TREE_SUFFIXES
                  and "__pycache__" not in p.parts and not p.relative_to(root).as_posix().startswith(
                      "benchmarks/results/")]
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _print_facts(facts: dict):
    for key, value in facts.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        print(f"{key:22s} {'not installed' if value is None else value}")


def junit_summary(path: Path) -> dict:
    """``{"tests", "failures", "errors", "skipped", "run", "golden_run"}`` of a JUnit XML (every
    ``testsuite`` summed); ``run`` counts cases neither skipped nor errored at collection, ``golden_run``
    those whose name says ``golden``."""
    unreadable = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "run": 0, "golden_run": 0}
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:  # a report cut short (the run killed while pytest wrote it), a folder
        return {"unreadable": f"{exc}", **unreadable}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    try:
        out = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    except ValueError as exc:  # a count that is no integer: not pytest's report
        return {"unreadable": f"a testsuite count is not an integer ({exc})", **unreadable}
    # named cases only: an interrupted xdist run leaves <testcase time="0.000"/> entries of tests that never ran
    ran = [c for s in suites for c in s.iter("testcase") if c.get("name") and c.find("skipped") is None]
    out["run"] = len(ran)
    out["golden_run"] = sum("golden" in c.get("name", "") for c in ran)
    return out


def _junit(args) -> int:
    path = Path(args.xml)
    if not path.exists():
        print(f"gpu_session: FAIL: {path} was not written (pytest died before its report)")
        return 1
    s = junit_summary(path)
    if "unreadable" in s:
        print(f"gpu_session: FAIL: {path} is not a complete JUnit report ({s['unreadable']})")
        return 1
    print(f"tests: {s['run']} run ({s['failures']} failed, {s['errors']} errors), {s['skipped']} skipped; "
          f"golden cases run: {s['golden_run']}")
    if s["run"] == 0:
        print("gpu_session: FAIL: no test ran (all skipped or none collected)")
        return 1
    if args.require_golden and s["golden_run"] == 0:
        print("gpu_session: FAIL: no golden case ran (are the golden vectors where the tests look?)")
        return 1
    return 0


#: the fields gpu_session.sh sets that are numbers (or null) where their text is one, besides those ending in _rc:
#: ``sanitize`` holds ``null`` where the step did not run, else each tool's status as text ("memcheck:0,..."), and
#: was recorded as the string "null"; ``budget_s`` (the script's whole seconds) as a string
NUMBER_FIELDS = ("status", "golden_files", "dry_run", "sanitize", "budget_s")


def _parse_value(key: str, text: str):
    """A number for the status and step fields where ``text`` is one (``null``: a step that did not run); text
    otherwise, whatever it looks like. NaN and infinities are refused (:class:`UsageError`): json.loads takes them,
    and session.json would not be strict JSON."""
    if key in NUMBER_FIELDS or key.endswith("_rc"):
        try:
            value = json.loads(text)
        except ValueError:
            return text
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--set {key}={text}: not a finite number (session.json is strict JSON)")
        return value
    return text


def _not_json(constant: str):
    """json.loads's parse_constant: NaN and Infinity are no JSON, and session.json could not be written with them."""
    raise ValueError(f"{constant} is not JSON")


def _json_path(option: str, text: str, example: str) -> Path:
    """``text`` as the JSON file ``option`` names, refused (:class:`UsageError`) before anything is done where it
    names a folder or its folder is missing: both were tracebacks (IsADirectoryError, FileNotFoundError)."""
    # the text, not the Path: Path("adir/") and Path("adir/.") drop what says they are folders
    if os.path.basename(text) in ("", os.curdir, os.pardir) or os.path.isdir(text):
        raise UsageError(f"{option} {text}: names a folder; name the JSON file to write (e.g. {example})")
    folder = os.path.dirname(text) or os.curdir
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {text}: the folder {folder} does not exist (or is not a folder)")
    return Path(text)


def _write_json(option: str, path: Path, data, **dumps) -> None:
    """``data`` as strict JSON (no NaN, no Infinity) at ``path``; a failure is a :class:`UsageError` naming
    ``option``."""
    text = json.dumps(data, allow_nan=False, **dumps) + "\n"
    try:
        path.write_text(text)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None


def _finish(args) -> int:
    out = _json_path("--out", args.out, "out/session.json")
    session = {}
    if args.probe and os.path.lexists(args.probe):
        from .jsonfile import read_json

        try:  # this script's own file, but a kill can leave it cut short: checked before it is taken up (read_json:
            # a regular file of bounded size, JSON nested no deeper than the parser goes)
            facts = read_json(Path(args.probe), parse_constant=_not_json)
            if not isinstance(facts, dict):
                raise ValueError(f"{args.probe}: not a JSON object")
            session.update(facts)
        except ValueError as exc:  # read_json's name the file
            session["probe_unreadable"] = str(exc)
    if args.junit and Path(args.junit).exists():
        session["tests"] = junit_summary(Path(args.junit))
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set takes KEY=VALUE, got {item!r}")
        session[key] = _parse_value(key, value)
    session["dry_run"] = session.get("dry_run") in (1, True, "1")
    session["files"] = sorted({p.name for p in out.parent.iterdir() if p.is_file()} | {out.name})
    _write_json("--out", out, session, indent=1, sort_keys=True)
    return 0


def _probe(args) -> int:
    path = _json_path("--json", args.json, "out/probe.json")  # before probing: a FAIL found is written there
    try:
        facts = probe(need_pytest=args.need_pytest)
    except SessionError as exc:
        print(f"gpu_session: FAIL: {exc}")
        _write_json("--json", path, {"failed": str(exc)})
        return 1
    _print_facts(facts)
    _write_json("--json", path, facts)
    return 0


def _tree_hash(args) -> int:
    root = Path(args.root)
    # the hash of no files is a hash all the same: a wrong ROOT printed one, status 0
    if not root.is_dir():
        raise UsageError(f"ROOT {args.root}: not a folder (name a cuflash checkout)")
    if not (root / "cuflash").is_dir():
        raise UsageError(f"ROOT {args.root}: not a cuflash checkout (it has no cuflash/ folder)")
    print(tree_hash(root))
    return 0


def _warm(args) -> int:
    import os
    import time

    import cuflash
    from cuflash import _env
    from cuflash.backends import cuda

    try:  # refused in one line, as every other entry point refuses (a bad variable, no GPU), not a traceback
        _env.check_all()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    ok, why = cuda.available()
    if not ok:
        raise UsageError(f"warm compiles the CUDA kernels into CuPy's cache, which needs a usable GPU: {why}")
    t0, workers = time.perf_counter(), os.cpu_count() or 1
    runs = [(("float16", "bfloat16", "float64"), "ieee")] + [(("float32",), p) for p in ("ieee", "3xtf32", "tf32")]
    dims = {"head_dims": (64,)} if args.quick else {}  # else every native head dim
    n = 0
    for dtypes, precision in runs[:1] if args.quick else runs:
        n += len(cuflash.warmup(dtypes[:1] if args.quick else dtypes, backward=True, precision=precision,
                                progress=False, workers=workers, **dims))
    print(f"warm: {n} kernel modules compiled or found in CuPy's cache in {time.perf_counter() - t0:.0f} s "
          f"({workers} threads)")
    return 0


def main(argv=None) -> int:
    """Entry point of ``python3 -m benchmarks.session``; returns the exit status."""
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.session", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--json", required=True)
    pr.add_argument("--need-pytest", action="store_true")
    ju = sub.add_parser("junit")
    ju.add_argument("xml")
    ju.add_argument("--require-golden", action="store_true")
    wa = sub.add_parser("warm")
    wa.add_argument("--quick", action="store_true")
    fi = sub.add_parser("finish")
    fi.add_argument("--out", required=True)
    fi.add_argument("--probe", default=None)
    fi.add_argument("--junit", default=None)
    fi.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE")  # every --set, not the last
    th = sub.add_parser("tree-hash")
    th.add_argument("root", nargs="?", metavar="ROOT", default=str(Path(__file__).resolve().parent.parent))
    args = p.parse_args(argv)
    commands = {"probe": (_probe, pr), "junit": (_junit, ju), "warm": (_warm, wa), "finish": (_finish, fi),
                "tree-hash": (_tree_hash, th)}
    command, parser = commands[args.command]
    try:
        return command(args)
    except UsageError as exc:
        parser.error(str(exc))  # exits 2


if __name__ == "__main__":
    sys.exit(main())

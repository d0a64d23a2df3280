"""Records, the JSON files (one per figure, one schema) and the text table of a run."""
from __future__ import annotations

import json
import math
import os
import tempfile
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from .cases import FIGURE_FILES, FIGURE_TITLES, FIGURES, Case
from .impls import NA
from .jsonfile import MAX_JSON_BYTES, not_regular, read_json  # noqa: F401  (this module's names too)
from .timing import Timer


@dataclass
class Record:
    """One measurement; fields as in the benchmarks issue's schema, null where not applicable."""

    impl: str
    op: str
    dtype: str
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    batch: int
    heads: int
    causal: bool
    density: Optional[float]
    ms: Optional[float]
    tflops: Optional[float]
    peak_bytes: Optional[int]
    gbps: Optional[float] = None
    io_bytes: Optional[int] = None
    block_k: Optional[int] = None
    tile: Optional[list] = None
    device: str = "cpu"
    repeats: int = 0
    calls_per_sample: int = 1
    host_ms: Optional[float] = None  # CUDA: the host's time per call before the sync (benchmarks/timing.py)

    @classmethod
    def of(cls, case: Case, impl: str, timer: Timer, peak: Optional[int], io_bytes: Optional[int]) -> "Record":
        """The record of ``impl`` on ``case`` from its timer, observed peak and modelled bytes."""
        ms = timer.median_ms
        # the float32 precision rides on the dtype label ("float32:tf32"), so that records stay in one schema and
        # "x cuflash" compares each precision with its own baselines
        dtype = case.dtype if case.precision == "ieee" else f"{case.dtype}:{case.precision}"
        return cls(impl=impl, op=case.op, dtype=dtype, head_dim=case.head_dim, seqlen_q=case.seqlen_q,
                   seqlen_k=case.seqlen_k, batch=case.batch, heads=case.heads, causal=case.causal,
                   density=case.density, ms=round(ms, 6), tflops=round(case.flops / (ms * 1e-3) / 1e12, 4),
                   peak_bytes=peak, gbps=round(case.bytes / (ms * 1e-3) / 1e9, 3), io_bytes=io_bytes,
                   block_k=case.block_k, tile=list(case.tile) if case.tile else None, device=case.device,
                   repeats=len(timer.samples), calls_per_sample=timer.calls,
                   host_ms=round(timer.host_median_ms, 6) if case.device == "cuda" else None)


RECORD_FIELDS = tuple(f.name for f in fields(Record))
#: fields added after results were first committed, with the value an older record means (2026-11-26: tile;
#: 2026-11-27: host_ms)
LATER_FIELDS = {"tile": None, "host_ms": None}
#: the types each record field may hold, from Record's annotations (Optional: null too; see _fits)
RECORD_TYPES = {name: typing.get_args(hint) or (hint,) for name, hint in typing.get_type_hints(Record).items()}
#: the file-level fields every figure JSON holds, with their JSON types
FILE_FIELDS = {"figure": str, "title": str, "commit": str, "date": str, "device": dict, "mode": str, "records": list,
               "skipped": list, "failed": list}
#: file-level fields added later, with the value an older file means (2026-11-26: failed)
LATER_FILE_FIELDS = {"failed": []}
#: the bound of an integer field (a magnitude below it): a JSON integer has none, and 10**400 passed the type check
#: and was an OverflowError in --replot's plots (a float cannot hold it); every count and byte size fits in int64
INT_LIMIT = 2**63
#: the record fields that hold a measurement: a finite number >= 0 where not null (json.loads takes NaN and
#: Infinity, and a negative time or rate is no measurement; either drew a plot and a table of nonsense)
MEASURED_FIELDS = ("ms", "tflops", "gbps", "host_ms")


@dataclass
class RunResult:
    records: list = field(default_factory=list)   # (figure, Record)
    skipped: list = field(default_factory=list)   # (figure, dict with the case's fields and "reason")
    failures: list = field(default_factory=list)  # (figure, the same): cuflash raised (no Skip, no out of memory)
    interrupted: bool = False                     # stopped by SIGINT/Ctrl-C before every pair was tried


# ------------------------------------------------------------------------------------------------ JSON
def payloads(result: RunResult, *, meta: dict) -> dict:
    """``{figure: JSON object}``: every figure that has a record, in the issue's schema."""
    out = {}
    for fig in FIGURES:
        recs = [asdict(r) for f, r in result.records if f == fig]
        failed = [e for f, e in result.failures if f == fig]
        if not recs and not failed:
            continue
        skipped = [e for f, e in result.skipped if f == fig]
        out[fig] = {"figure": fig, "title": FIGURE_TITLES[fig], **meta, "records": recs, "skipped": skipped,
                    "failed": failed}
    return out


def write_results(payload_by_fig: dict, out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Write ``<figure>.json`` (and ``.png`` when matplotlib is importable) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fig, payload in payload_by_fig.items():
        path = out_dir / f"{FIGURE_FILES[fig]}.json"
        _write_whole(path, json.dumps(payload, indent=1) + "\n")
        written.append(path)
    if plots:
        from .plots import write_plots

        written += write_plots(payload_by_fig, out_dir)
    return written


def _write_whole(path: Path, text: str):
    """``text`` into ``path`` through a temporary file beside it: a run killed while writing a checkpoint leaves
    the previous file whole, never a truncated JSON (os.replace is atomic within one file system). The temporary
    file is created new (mkstemp: a symlink planted at a predictable name was written through, its target
    overwritten)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # as a plain write would leave it (mkstemp's files are 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_of(payload: dict) -> tuple:
    """What makes figures one run: ``(commit, device name, mode, dirty, partial)``; a results folder holds one run.
    An interrupted run's figures (``partial``, written as checkpoints) are not a later complete run's, nor are a dirty
    tree's those of its commit: a later run into the same folder took them up as its own."""
    return (payload["commit"], payload["device"]["name"], payload["mode"], payload.get("dirty") is True,
            payload.get("partial") is True)


def describe_run(run: tuple) -> str:
    """A :func:`run_of` key as words, for messages."""
    commit, device, mode, dirty, partial = run
    return (f"commit {commit[:12]}{' (dirty tree)' if dirty else ''} on {device!r}, {mode}"
            f"{', interrupted (partial results)' if partial else ''}")




def load_figure(path: Path, fig: str) -> dict:
    """The JSON object of figure ``fig`` at ``path``, checked against the schema: the file-level fields and
    every record's fields and their types (a ValueError names the file and what does not fit)."""
    payload = read_json(path)
    if not isinstance(payload, dict):
        raise ValueError(f"{path}: not a JSON object")
    for name, value in LATER_FILE_FIELDS.items():  # a file written before the field existed
        payload.setdefault(name, list(value))
    bad = sorted(name for name, kind in FILE_FIELDS.items() if not isinstance(payload.get(name), kind))
    if not bad and not isinstance(payload["device"].get("name"), str):
        bad = ["device.name"]
    if bad:
        raise ValueError(f"{path}: the fields {bad} are missing or not of their type")
    if payload["figure"] != fig:
        raise ValueError(f"{path}: holds figure {payload['figure']!r}, not {fig!r}")
    for name in ("skipped", "failed"):
        if not all(isinstance(e, dict) and isinstance(e.get("reason"), str) for e in payload[name]):
            raise ValueError(f"{path}: a '{name}' entry is not an object with a 'reason' string")
    for rec in payload["records"]:
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: a record is not a JSON object")
        for name in set(LATER_FIELDS) - set(rec):  # a record written before the field existed
            rec[name] = LATER_FIELDS[name]
        if set(rec) != set(RECORD_FIELDS):
            raise ValueError(f"{path}: a record's fields {sorted(set(rec) ^ set(RECORD_FIELDS))} do not fit "
                             f"the schema")
        wrong = sorted(name for name, value in rec.items() if not _fits(value, RECORD_TYPES[name]))
        if wrong:
            raise ValueError(f"{path}: a record's fields {wrong} are not of their type "
                             f"({', '.join(f'{n}={_shown(rec[n])}' for n in wrong)})")
        unmeasured = [name for name in MEASURED_FIELDS if rec[name] is not None and not rec[name] >= 0]
        if unmeasured:  # NaN fails ">= 0" too
            raise ValueError(f"{path}: a record's fields {unmeasured} are no measurement (a finite number >= 0 or "
                             f"null) ({', '.join(f'{n}={_shown(rec[n])}' for n in unmeasured)})")
    return payload


def _fits(value, types: tuple) -> bool:
    """Whether a JSON value fits a field annotated with ``types``: bool, a subclass of int in Python, is no number
    here; a float field takes a JSON integer too (a hand-written 1 for 1.0). A number fits only where finite and of
    a magnitude below :data:`INT_LIMIT` (an integer; a float field's integer too): what the table and the plots
    compute with it must not overflow."""
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int):
        return (int in types or float in types) and abs(value) < INT_LIMIT
    if isinstance(value, float):
        return float in types and math.isfinite(value)
    return isinstance(value, types)


def _shown(value) -> str:
    """``repr(value)`` cut to 40 characters, for messages: an integer of 4000 digits is refused, not quoted whole."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def load_results(folder: "Path | str") -> dict:
    """``{figure: JSON object}`` of every figure JSON in ``folder`` (a path or its text), each checked by
    :func:`load_figure`; a folder whose figures come from more than one run (:func:`run_of`) is a ValueError naming
    it."""
    folder = Path(folder)  # the README's `load_results(folder)`: a str raised "unsupported operand type(s) for /"
    by_fig = {}
    for fig, stem in FIGURE_FILES.items():
        path = folder / f"{stem}.json"
        if os.path.lexists(path):  # a dangling symbolic link too: refused by read_json, not taken for no file
            by_fig[fig] = load_figure(path, fig)
    runs = sorted({run_of(p) for p in by_fig.values()})
    if len(runs) > 1:  # figures of different runs, side by side, would read as one measurement
        raise ValueError(f"{folder}: holds the figures of {len(runs)} runs "
                         f"({'; '.join(map(describe_run, runs))}); a results folder holds one run")
    return by_fig


def other_runs(folder: Path, run: tuple) -> dict:
    """``{figure JSON: what it is}`` for every figure file in ``folder`` that is not of ``run``: another run's, or
    unreadable (no run can be told from it)."""
    others = {}
    for fig, stem in FIGURE_FILES.items():
        path = folder / f"{stem}.json"
        if not os.path.lexists(path):
            continue
        try:
            theirs = run_of(load_figure(path, fig))
        except (OSError, ValueError) as exc:
            others[path] = f"unreadable: {exc}"
            continue
        if theirs != run:
            others[path] = describe_run(theirs)
    return others


# ------------------------------------------------------------------------------------------------ table
_COLUMNS = (("impl", 15, "{}"), ("op", 7, "{}"), ("dtype", 7, "{}"), ("B", 3, "{}"), ("H", 3, "{}"),
            ("Sq", 6, "{}"), ("Sk", 6, "{}"), ("d", 4, "{}"), ("causal", 6, "{}"), ("mask/bk", 9, "{}"),
            ("ms", 10, "{:.3f}"), ("TFLOP/s", 8, "{:.3g}"), ("GB/s", 8, "{:.3g}"), ("peak MB", 9, "{:.1f}"),
            ("x cuflash", 9, "{:.2f}"), ("host ms", 8, "{:.3f}"))


def table(result: RunResult) -> str:
    """The run as text: one block per figure; ``x cuflash`` is ms / cuflash's ms on the same case; ``host ms`` (CUDA)
    the host's time per call before the synchronization, ``-`` on the CPU."""
    ref = {_rkey(fig, r): r.ms for fig, r in result.records if r.impl == "cuflash"}
    head = " ".join(f"{name:>{w}}" for name, w, _ in _COLUMNS)
    out = []
    for fig in FIGURES:
        rows = [r for f, r in result.records if f == fig]
        if rows:
            out += ["", f"== {fig}: {FIGURE_TITLES[fig]}", head]
            out += [_row(r, ref.get(_rkey(fig, r))) for r in rows]
    out += product_targets(result)
    out += wide_targets(result)
    reasons = sorted({e["reason"] for _, e in result.skipped if not e["reason"].startswith(NA)})
    if reasons:
        out += ["", f"{len(result.skipped)} (case, impl) pairs not measured (see 'skipped' in the JSON); "
                    f"reasons besides an impl lacking the op, device, mask or tile option:"]
        out += [f"  - {r}" for r in reasons[:20]]
    if result.failures:
        out += ["", f"{len(result.failures)} cuflash cases FAILED (see 'failed' in the JSON):"]
        out += [f"  - {e['reason']}" for e in sorted({e["reason"]: e for _, e in result.failures}.values(),
                                                     key=lambda e: e["reason"])[:20]]
    return "\n".join(out)


def _row(r: Record, cuflash_ms: Optional[float]) -> str:
    mask = r.density if r.density is not None else r.block_k
    mask = "x".join(map(str, r.tile)) if r.tile else ("-" if mask is None else f"{mask:g}")  # a whole tile: bm x bn x w
    vals = (r.impl, r.op, r.dtype, r.batch, r.heads, r.seqlen_q, r.seqlen_k, r.head_dim,
            "yes" if r.causal else "no", mask, r.ms, r.tflops, r.gbps,
            None if r.peak_bytes is None else r.peak_bytes / 2**20, r.ms / cuflash_ms if cuflash_ms else None,
            r.host_ms)
    return " ".join(f"{'-' if v is None else fmt.format(v):>{w}}" for (_, w, fmt), v in zip(_COLUMNS, vals))


def product_targets(result: RunResult) -> list[str]:
    """The NumPy backend's targets, as measured in this run: naive NumPy / cuflash (>= 4) and
    cuflash / PyTorch CPU SDPA (<= 3)."""
    ms = {r.impl: r.ms for f, r in result.records if f == "product"}
    if "cuflash" not in ms or not {"numpy", "torch-flash"} & set(ms):
        return []
    lines = ["", "product targets (this run):"]
    if "numpy" in ms:
        x = ms["numpy"] / ms["cuflash"]
        lines.append(f"  naive numpy / cuflash = {x:.2f}x (target >= 4x: {'met' if x >= 4 else 'not met'})")
    if "torch-flash" in ms:
        x = ms["cuflash"] / ms["torch-flash"]
        lines.append(f"  cuflash / torch SDPA  = {x:.2f}x (target <= 3x: {'met' if x <= 3 else 'not met'})")
    return lines


def wide_targets(result: RunResult) -> list[str]:
    """The float32/float64 targets, as measured in this run (GPU): float64 cuflash at >= 50% of an H100's DMMA peak
    at the longest seqlen, and each float32 precision faster than the naive cuBLAS attention of its accuracy class
    (cupy-naive) at every seqlen >= 1024."""
    from .cases import H100_FP64_TENSOR_PEAK, OPS

    recs = [r for f, r in result.records if f == "wide" and r.device == "cuda"]
    if not recs:
        return []
    lines = ["", "float32/float64 targets (this run; the DMMA peak is an H100 SXM's):"]
    for op in OPS:
        f64 = [r for r in recs if r.impl == "cuflash" and r.op == op and r.dtype == "float64"]
        if f64:
            r = max(f64, key=lambda r: r.seqlen_q)
            share = r.tflops / H100_FP64_TENSOR_PEAK
            lines.append(f"  float64 {op} at seqlen {r.seqlen_q}: {r.tflops:.1f} TFLOP/s = {share:.0%} of "
                         f"{H100_FP64_TENSOR_PEAK:g} (target >= 50%: {'met' if share >= 0.5 else 'not met'})")
        for dtype in sorted({r.dtype for r in recs if r.dtype.startswith("float32")}):
            mine = {r.seqlen_q: r.ms for r in recs if r.impl == "cuflash" and r.op == op and r.dtype == dtype}
            naive = {r.seqlen_q: r.ms for r in recs if r.impl == "cupy-naive" and r.op == op and r.dtype == dtype}
            both = sorted(n for n in mine if n in naive and n >= 1024)
            if both:
                ok = all(mine[n] < naive[n] for n in both)
                worst = max(mine[n] / naive[n] for n in both)
                lines.append(f"  {dtype} {op}: cuflash / cupy-naive <= {worst:.2f}x over seqlens {both} "
                             f"(target < 1 at every seqlen: {'met' if ok else 'not met'})")
    return lines


def _rkey(fig: str, r: Record) -> tuple:
    return (fig, r.device, r.op, r.dtype, r.batch, r.heads, r.seqlen_q, r.seqlen_k, r.head_dim, r.causal,
            r.density, r.block_k, tuple(r.tile) if r.tile else None)

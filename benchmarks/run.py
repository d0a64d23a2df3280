"""The runner and its command line: ``python -m benchmarks.run --quick|--full|--smoke [--out DIR] ...``.

Measures every applicable (case, impl) pair of a suite (:func:`benchmarks.cases.suite`), prints a
table and writes one JSON per figure (+ PNG with matplotlib); see ``benchmarks/README.md``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from cuflash import _env as cuflash_env
from cuflash._cli import exit_with

from . import environment
from .cases import FIGURES, Case, suite
from .impls import IMPLS, Impl, Skip, applicable, model_io_bytes
from .inputs import Inputs, make_inputs
from .report import (Record, RunResult, describe_run, load_results, not_regular, other_runs, payloads, table,
                     write_results)
from .timing import TIMINGS, Timing, first_call_peak, is_oom, release_memory, time_it

#: Seconds of measuring after which the remaining pairs are skipped: a quick CPU run must end within a
#: minute, a full GPU run within one 10-minute device call (imports, compilation and plots included).
DEFAULT_TIME_LIMIT = {"smoke": None, "quick": 50.0, "full": 500.0}


class Progress:
    """A progress bar on stderr without dependencies (one line per 10% when stderr is no terminal)."""

    def __init__(self, total: int, *, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last_decile = -1

    def step(self, label: str):
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        line = f"[{'#' * int(frac * 24):<24}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.0f}s {label}"
        if self.tty:
            self.stream.write("\r" + line[:119].ljust(119))
        elif int(frac * 10) != self._last_decile or self.done == self.total:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self):
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def plan_work(cases: list[Case], *, impl_filter: Optional[set] = None) -> list[tuple[Case, str]]:
    """(case, impl) pairs in run order: JAX last, so its allocator cannot starve the others."""
    work = [(c, name) for c in cases for name in c.impls if impl_filter is None or name in impl_filter]
    return sorted(work, key=lambda w: w[1].startswith("jax"))  # stable: keeps the suite order otherwise


def run_cases(cases: list[Case], *, timing: Timing, deadline: Optional[float] = None,
              impl_filter: Optional[set] = None, progress: bool = True,
              checkpoint: Optional[Callable] = None, checkpoint_s: float = 60.0) -> RunResult:
    """Measure every applicable (case, impl) pair; failures become ``skipped`` entries with the reason.

    ``deadline`` (``time.monotonic()`` value): pairs not started by then are skipped. Once an impl
    runs out of memory on a figure, its larger cases on that figure are skipped. ``checkpoint(result)``
    is called every ``checkpoint_s`` seconds, so a run killed from outside still leaves its results;
    an interrupt (SIGINT) ends the loop with ``result.interrupted`` set and the records kept.
    """
    result = RunResult()
    last_checkpoint = time.monotonic()
    work = plan_work(cases, impl_filter=impl_filter)
    bar = Progress(len(work), enabled=progress)
    unusable: dict[str, str] = {}      # impl@device -> why not ("" when usable)
    oom_at: dict[tuple, int] = {}      # (figure, impl) -> smallest seqlen that ran out of memory
    inputs_key, inputs = None, None
    try:
        for case, name in work:
            bar.step(f"{name} {case.label()}")
            why = _why_not(case, name, unusable, oom_at, deadline)
            if why is not None:
                result.skipped.append((case.figure, skip_entry(case, name, why)))
                continue
            if inputs_key != case.inputs_key:
                inputs = None
                release_memory(case.device)
                inputs, inputs_key = make_inputs(case), case.inputs_key
            failed = _measure_into(result, case, name, inputs, timing, oom_at)
            # after a failure the traceback's frames (holding the big temporaries) sit in a cycle
            release_memory(case.device, collect=failed)
            if checkpoint is not None and time.monotonic() - last_checkpoint > checkpoint_s:
                checkpoint(result)
                last_checkpoint = time.monotonic()
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured, so the caller can still write it
        result.interrupted = True
    bar.close()
    return result


def _measure_into(result: RunResult, case: Case, name: str, inputs: Inputs, timing: Timing, oom_at: dict) -> bool:
    """Measure one pair into ``result``; returns whether it failed: a ``skipped`` entry, or for cuflash raising
    anything but :class:`Skip` or out of memory a ``failures`` one (the run then ends with status 3: its tile
    candidates all pass the compile check, so an error there is a defect, never a case to pass over)."""
    try:
        result.records.append((case.figure, measure(case, IMPLS[name], inputs, timing=timing)))
        return False
    except Exception as exc:  # noqa: BLE001 -- a baseline failing must not end the run
        oom = is_oom(exc)
        if oom:
            oom_at[(case.figure, name)] = min(oom_at.get((case.figure, name), 1 << 62), case.seqlen_k)
        # every cuflash impl (cuflash-kvcache too: its error was recorded as a skipped baseline's, status 0)
        failed = name.split("-")[0] == "cuflash" and not oom and not isinstance(exc, Skip)
        (result.failures if failed else result.skipped).append((case.figure, skip_entry(case, name, _reason(exc))))
        return True


def _why_not(case, name, unusable, oom_at, deadline) -> Optional[str]:
    impl = IMPLS[name]
    why = applicable(impl, case)
    if why:
        return why
    if deadline is not None and time.monotonic() > deadline:
        return "time limit of the run reached"
    if (case.figure, name) in oom_at and case.seqlen_k >= oom_at[(case.figure, name)]:
        return f"out of memory (ran out at seqlen {oom_at[(case.figure, name)]})"
    key = f"{name}@{case.device}"
    if key not in unusable:
        try:
            impl.check(case.device)
            unusable[key] = ""
        except Skip as exc:
            unusable[key] = str(exc)
    return unusable[key] or None


def measure(case: Case, impl: Impl, inputs: Inputs, *, timing: Timing) -> Record:
    """Time one impl on one case and observe its peak memory; returns the Record."""
    run, sync = impl.build(case, inputs)
    peak = first_call_peak(run, sync, device=case.device, memory=impl.memory)
    timer = time_it(run, sync, device=case.device, timing=timing)
    return Record.of(case, impl.name, timer, peak, model_io_bytes(case, impl))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, Skip):
        return str(exc)
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


def skip_entry(case: Case, impl: str, reason: str) -> dict:
    """The JSON ``skipped`` entry of a pair not measured: the case's fields and the reason."""
    dtype = case.dtype if case.precision == "ieee" else f"{case.dtype}:{case.precision}"  # as Record.of
    return {"impl": impl, "op": case.op, "dtype": dtype, "head_dim": case.head_dim,
            "seqlen_q": case.seqlen_q, "seqlen_k": case.seqlen_k, "batch": case.batch, "heads": case.heads,
            "causal": case.causal, "density": case.density, "block_k": case.block_k,
            "tile": list(case.tile) if case.tile else None, "device": case.device,
            "reason": reason}


# ================================================================================================
# Command line
# ================================================================================================
def replot(folder: Path) -> int:
    """Redraw the PNG of every figure JSON in ``folder``; 1 when there is none."""
    from .plots import write_plots

    try:
        by_fig = load_results(folder)
    except ValueError as exc:  # a file that does not fit, figures of two runs: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not by_fig:
        print(f"no result JSON in {folder}", file=sys.stderr)
        return 1
    if any(p.get("partial") is True for p in by_fig.values()):  # the whole folder is one run (load_results)
        print(f"note: {folder} holds an interrupted run's results (partial): the plots show what it measured",
              file=sys.stderr)
    try:
        written = write_plots(by_fig, folder)
    # values the schema lets through, and whatever matplotlib raises on them (ZeroDivisionError, OverflowError where
    # it turns a number of a skipped entry or of the device into a float, a RuntimeError of a broken install)
    except Exception as exc:  # noqa: BLE001 -- one line naming the folder, no traceback
        print(f"error: {folder}: its results cannot be plotted ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    if not written:  # no matplotlib, or no figure with records: --replot's only job is undone
        print(f"error: no plot written to {folder}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} plots to {folder}")
    return 0


def _folder(text: str) -> Path:
    """A folder argument: Path("") is ".", so an empty one would write the results into the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a folder, got an empty string")
    return Path(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                description="Benchmark cuflash against the baselines importable here; "
                                            "prints a table, writes JSON (+ PNG with matplotlib).")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="a small case list (default; under a minute on the NumPy backend)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="every figure at full size (on a GPU: fits one 10-minute call)")
    mode.add_argument("--smoke", dest="mode", action="store_const", const="smoke",
                      help="the quick code paths at toy sizes (tests, CI, a dry run of gpu_session.sh)")
    p.add_argument("--out", type=_folder, default=None,
                   help="result folder (default: the checkout's benchmarks/results/<device>/)")
    p.add_argument("--replace", action="store_true",
                   help="remove the figures of another run (commit, device, mode) from --out first (without it, "
                        "such figures are an error: a results folder holds one run)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: CuPy + GPU (an error without them); cpu: the NumPy backend (default: cuda when "
                        "available)")
    p.add_argument("--require-device", choices=("cpu", "cuda"), default=None,
                   help="refuse to run unless the run's device is this one and cuflash's backend for it is "
                        "available; exit 1 when no cuflash case was measured (gpu_session.sh: cuda)")
    p.add_argument("--only", default=None, help=f"comma-separated figures from {', '.join(FIGURES)}")
    p.add_argument("--impl", default=None, help="comma-separated impls to run (default: all importable)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which remaining cases are skipped (quick 50, full 500)")
    p.add_argument("--commit", default=None,
                   help="commit to record when this tree is no git checkout (a device machine's copy; 7 to 40 hex "
                        "digits); in a checkout git's HEAD is recorded, and --commit must be a prefix of it")
    p.add_argument("--no-plot", action="store_true", help="write JSON only")
    p.add_argument("--replot", type=_folder, default=None, metavar="DIR",
                   help="only redraw the PNGs of the result JSON files in DIR, measuring nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(mode="quick")
    return p


def _names(text: Optional[str], known, what: str, parser: argparse.ArgumentParser) -> Optional[set]:
    """The comma-separated names of ``text`` (None: no filter); an unknown name is a usage error."""
    if text is None:
        return None
    names = {s.strip() for s in text.split(",") if s.strip()}
    if not names:  # an empty filter would measure nothing and still exit 0
        parser.error(f"no {what} named in {text!r}; choose from {', '.join(known)}")
    if names - set(known):
        parser.error(f"unknown {what} {sorted(names - set(known))}; choose from {', '.join(known)}")
    return names


def _device(args, parser: argparse.ArgumentParser) -> str:
    """The run's device; a usage error where it cannot be what the arguments ask for. Never a silent
    fallback: numbers of the NumPy backend must not pass for GPU numbers."""
    device = environment.best_device() if args.device == "auto" else args.device
    if device == "cuda" and not environment.gpu_available():
        parser.error("--device cuda needs CuPy and a visible GPU")
    if args.require_device is not None:
        if device != args.require_device:
            parser.error(f"--require-device {args.require_device}: this run would measure on {device!r} "
                         f"(CuPy with a visible GPU: {environment.gpu_available()}); refusing")
        ok, why = environment.cuflash_backend_status(device)
        if not ok:
            parser.error(f"--require-device {device}: cuflash's {device} backend is unavailable ({why}); refusing")
    return device


def _commit(args, parser: argparse.ArgumentParser) -> tuple[str, Optional[bool]]:
    """``(commit, dirty)`` to record (:func:`environment.git_commit`); a --commit git contradicts or that does not
    look like a commit is a usage error."""
    try:
        return environment.git_commit(given=args.commit)
    except ValueError as exc:
        parser.error(str(exc))


def _out_folder(out_dir: Path, run: tuple, replace: bool, parser: argparse.ArgumentParser):
    """Make sure, before measuring, that the results can be written to ``out_dir`` and that it then holds this run
    alone: another run's figure files (JSON and PNG) are a usage error, or removed with ``--replace``. The run's
    own checkpoints are written later, into a folder that holds this run only."""
    if out_dir.exists() and not out_dir.is_dir():
        parser.error(f"--out {out_dir}: not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test.{os.getpid()}"
        probe.touch()  # root ignores mode bits (os.access would say yes); a file made and removed tells
        probe.unlink()
    except OSError as exc:
        parser.error(f"--out {out_dir}: cannot write results there ({exc.strerror or exc})")
    others = other_runs(out_dir, run)
    if others and not replace:
        by_run = {}
        for path, what in others.items():
            by_run.setdefault(what, []).append(path.name)
        listed = "; ".join(f"{what} ({', '.join(names)})" for what, names in by_run.items())
        parser.error(f"--out {out_dir} holds figures of another run than this one ({describe_run(run)}): "
                     f"{listed}; a results folder holds one run: choose another --out, or --replace to remove them")
    doomed = [p for path in others for p in (path, path.with_suffix(".png"))]
    odd = []  # checked before anything is removed: a refusal half-way would leave the folder half cleaned
    for path in doomed:
        try:
            kind = not_regular(os.lstat(path).st_mode)
        except FileNotFoundError:  # a figure without its PNG (--no-plot, no matplotlib)
            continue
        except OSError as exc:
            kind = f"cannot be inspected: {exc.strerror or exc}"
        if kind:
            odd.append(f"{path.name} ({kind})")
    if odd:  # unlink cannot remove a folder, and a symbolic link or a FIFO is no figure this runner wrote
        parser.error(f"--out {out_dir}: --replace removes only figure files, and these are not regular files: "
                     f"{', '.join(odd)}; nothing was removed: remove them yourself, or choose another --out")
    for path in doomed:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            parser.error(f"--out {out_dir}: --replace cannot remove {path.name} ({exc.strerror or exc})")


def main(argv=None) -> int:
    """Entry point of ``python -m benchmarks.run``; returns the exit status (2: usage error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.replot is not None:
        defaults, given = vars(parser.parse_args([])), []
        for action in parser._actions:  # the options given, from the parser itself (none forgotten)
            value = getattr(args, action.dest, None)
            if action.dest in ("help", "replot", "no_progress") or value == defaults[action.dest]:
                continue
            if action.nargs == 0 and action.const is not None and action.const != value:
                continue  # another flag of the same dest was given (--full, not --smoke): name that one alone
            given.append("/".join(action.option_strings))
        if given:  # each would be silently ignored: --replot measures nothing and redraws DIR's figures
            parser.error(f"--replot DIR redraws DIR's figures and takes no other options, got {', '.join(given)}")
        return replot(args.replot)
    try:  # as `python -m cuflash` does: a bad CUFLASH_* value made every cuflash pair a failure, written as results
        cuflash_env.check_all()
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    device = _device(args, parser)
    figures = _names(args.only, FIGURES, "figure(s)", parser)
    impls = _names(args.impl, tuple(IMPLS), "impl(s)", parser)
    if args.require_device and impls is not None and "cuflash" not in impls:  # it would measure all, then fail
        parser.error(f"--require-device {args.require_device} needs cuflash's own records, which --impl {args.impl} "
                     f"leaves out")
    if args.time_limit is not None and not args.time_limit > 0:  # NaN too: every pair would be skipped
        parser.error(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    info = environment.gpu_info() if device == "cuda" else environment.cpu_info()
    cases = [c for c in suite(device, args.mode) if figures is None or c.figure in figures]
    if not cases:
        print(f"error: no case of --{args.mode} {'--only ' + args.only + ' ' if args.only else ''}runs on {device}; "
              f"nothing measured", file=sys.stderr)
        return 1
    limit = DEFAULT_TIME_LIMIT[args.mode] if args.time_limit is None else args.time_limit
    # the checkout's own results folder, whatever the working folder: the commit recorded is the checkout's
    out_dir = args.out or environment.REPO / "benchmarks" / "results" / environment.device_slug(info)
    commit, dirty = _commit(args, parser)
    _out_folder(out_dir, (commit, info["name"], args.mode, dirty is True, False), args.replace, parser)
    print(f"benchmarks.run --{args.mode} on {info['name']} ({device}); {len(cases)} cases", file=sys.stderr)
    t0 = time.monotonic()

    def meta(**more):
        return {"mode": args.mode, "device": info, "host": environment.cpu_info(), "commit": commit,
                "dirty": dirty, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "versions": environment.versions(device), "seconds": round(time.monotonic() - t0, 1), **more}

    result = run_cases(cases, timing=TIMINGS[args.mode], impl_filter=impls, progress=not args.no_progress,
                       deadline=None if limit is None else t0 + limit,
                       checkpoint=lambda r: write_results(payloads(r, meta=meta(partial=True)), out_dir, plots=False))
    final = meta(partial=True) if result.interrupted else meta()
    if not (result.records or result.failures or result.interrupted):  # no JSON to point at: say why here, fail
        reasons = sorted({e["reason"] for _, e in result.skipped})
        print(f"error: nothing was measured ({len(result.skipped)} pairs skipped: {'; '.join(reasons[:5]) or '-'}"
              f"{'; ...' if len(reasons) > 5 else ''}); nothing written to {out_dir}", file=sys.stderr)
        return 1
    by_fig = payloads(result, meta=final)
    written = write_results(by_fig, out_dir, plots=False)  # before any printing: a reader gone (| head) ends it
    print(table(result))
    unplotted = None
    if not args.no_plot:  # after the JSON, and apart from it: a plot that fails was a traceback and status 1,
        from .plots import write_plots  # which hid the run's own status (3: cuflash failed; 130: interrupted)

        try:
            written += write_plots(by_fig, out_dir)
        except Exception as exc:  # noqa: BLE001 -- whatever matplotlib raises, the run's status still comes out
            unplotted = f"{type(exc).__name__}: {exc}"
    print(f"\n{len(result.records)} records in {final['seconds']} s; wrote {len(written)} files to {out_dir}")
    if unplotted:
        print(f"error: the plots could not be drawn ({unplotted}); the JSON is written", file=sys.stderr)
    if result.interrupted:
        print("error: interrupted; the results written are partial", file=sys.stderr)
        return 130
    if result.failures:
        print(f"error: cuflash failed in {len(result.failures)} cases (see 'failed' in the JSON)", file=sys.stderr)
        return 3
    if args.require_device and not any(r.impl == "cuflash" and r.device == device for _, r in result.records):
        print(f"error: no cuflash case was measured on {device} (see 'skipped')", file=sys.stderr)
        return 1
    return 1 if unplotted else 0  # the plots asked for are missing: no success, though the numbers are all there


if __name__ == "__main__":
    exit_with(main)

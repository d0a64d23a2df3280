"""The host's cost per call of cuflash's CUDA path, beside the device's, and where the host's time goes.

    python -m benchmarks.host_cost [--calls 40] [--top 12] [--only NAME,...]

The H200 benchmark (benchmarks/results/gpu-nvidia-h200) measured 0.15-0.9 ms of host time per call (``host ms``),
against 0.05 for PyTorch's flash backend: where a call's kernels take less than that, the GPU waits for Python.
For each case this prints the host's ms per call (``perf_counter`` over ``calls`` back-to-back calls, before the
synchronization), the ms per call between CUDA events around those calls (the kernels' time once the host runs
ahead of them; the host's where it does not) and cProfile's functions with the most time of their own over the
same calls. Runs on a GPU, or on the fake GPU of the tests (``PYTHONPATH=tests/fake_gpu:tests``, kernels not run:
``--no-kernels``), where only the Python side's share means anything. Without a CUDA device (CuPy and a visible GPU)
it refuses to start (status 2), as it does on a bad option or ``CUFLASH_*`` variable, before measuring anything.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Callable, Optional

import numpy as np

from cuflash import _env

from .cases import Case
from .inputs import density_mask


def _arrays(xp, b: int, n: int, h: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return tuple(xp.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32).astype(np.float16))
                 for _ in range(4))


def cases(xp) -> dict[str, Callable[[], Callable[[], object]]]:
    """name -> a builder of the call to time (inputs made once, outside the timed calls)."""
    import cuflash

    def fwd(**opts):
        q, k, v, _ = _arrays(xp, 32, 512, 32, 64)
        return lambda: cuflash.attention(q, k, v, **opts)

    def bwd(**opts):
        q, k, v, dout = _arrays(xp, 32, 512, 32, 64)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
        return lambda: cuflash.attention_backward(dout, q, k, v, out, lse, **opts)

    def vjp():  # attention_vjp: the residual's fingerprints (cuflash.residual) at the forward and the backward
        q, k, v, dout = _arrays(xp, 32, 512, 32, 64)

        def call():
            out, f_vjp = cuflash.attention_vjp(q, k, v, causal=True)
            return f_vjp(dout)
        return call

    def sparse(op):  # the backward at density 1/16 measured slower than at 1/8, its host time 1.05 ms (sixth run)
        case = Case("blocksparse", "cuda", op, "float16", 4, 32, 4096, 4096, 64, density=1 / 16,
                    mask_block=(128, 128))
        q, k, v, dout = _arrays(xp, 4, 4096, 32, 64)
        mask = density_mask(case, seed=0)
        if op == "fwd":
            return lambda: cuflash.attention(q, k, v, block_mask=mask)
        out, lse = cuflash.attention(q, k, v, block_mask=mask, return_lse=True)
        return lambda: cuflash.attention_backward(dout, q, k, v, out, lse, block_mask=mask)

    return {"fwd-n512-b32": fwd, "fwd-n512-b32-causal": lambda: fwd(causal=True),
            "bwd-n512-b32-causal": lambda: bwd(causal=True), "fwd_bwd-vjp-n512-b32-causal": vjp,
            "fwd-n4096-sparse16": lambda: sparse("fwd"), "bwd-n4096-sparse16": lambda: sparse("bwd")}


def _no_kernels() -> None:
    """Every launch of cuflash's CUDA backend does all its host work but the kernel's call, which does nothing: the
    compiled function is swapped for a no-op where the backend looks it up (real CuPy's RawKernel is an immutable
    type: setting its ``__call__``, as this did, was a TypeError on a GPU)."""
    from cuflash.backends import cuda

    device, function, probe = cuda._memoized()

    def no_op(*key):
        function(*key)  # compiled as before (its cost is the first call's, outside the timed ones)
        return lambda grid, block, args, shared_mem=0: None

    cuda._memoized = lambda: (device, no_op, probe)


def measure(xp, call: Callable[[], object], calls: int, top: int) -> tuple[float, float, str]:
    """``(host ms per call, device-event ms per call, cProfile's table)``."""
    sync = xp.cuda.get_current_stream().synchronize
    call(), call()
    sync()
    start, end = xp.cuda.Event(), xp.cuda.Event()
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t0) * 1e3 / calls
    end.record()
    end.synchronize()
    device = xp.cuda.get_elapsed_time(start, end) / calls
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top or None]  # top 0: every row
    text = [f"    {'own us':>8s} {'total us':>9s} {'n':>5s}  function (per timed call)"]
    for (path, line, name), (_, n, own, total, _) in rows:
        where = f"{'/'.join(path.split('/')[-2:])}:{line}({name})" if line else name
        text.append(f"    {own / calls * 1e6:8.1f} {total / calls * 1e6:9.1f} {n / calls:5.1f}  {where}")
    return host, device, "\n".join(text)


def _count(lo: int, meaning: str) -> Callable[[str], int]:
    """argparse type of an integer option of at least ``lo``: --calls 0 divided by zero after the first case's calls,
    -3 printed negative milliseconds, and --top -1 (a slice's end) silently left out the last row."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}{meaning}, got {value}")
        return value
    return parse


def _names(text: Optional[str], known: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The case names of --only (all of ``known`` where none is given), every one checked before the first runs: an
    unknown name was a KeyError after the names before it had been measured."""
    if text is None:
        return known
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))  # in order, each once
    if not names:  # an empty --only would measure nothing and print an empty table
        parser.error(f"--only names no case in {text!r}; choose from {', '.join(known)}")
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--only: unknown case(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def _no_cuda_device() -> Optional[str]:
    """Why CuPy cannot run here (None where it can): without a GPU the first case ended in a CUDARuntimeError
    traceback. The fake GPU of the tests (``PYTHONPATH=tests/fake_gpu:tests``) counts as one device."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy cannot be imported ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 -- CUDARuntimeError (no driver, too old a driver), whatever CuPy raises
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}"
    return None if count > 0 else "no CUDA device is visible"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_cost", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=_count(1, ""), default=40, help="timed calls per case (at least 1)")
    p.add_argument("--top", type=_count(0, " (0: every row)"), default=12, help="cProfile's rows per case (0: all)")
    p.add_argument("--only", default=None, help=f"comma-separated case names, from {', '.join(cases(None))}")
    p.add_argument("--no-kernels", action="store_true", help="launches do nothing (the fake GPU: host cost only)")
    args = p.parse_args(argv)
    # every refusal before the first case runs: the names, the environment (as `python -m cuflash` checks it: a bad
    # CUFLASH_* value is one line, not a traceback from inside a call) and the device
    names = _names(args.only, list(cases(None)), p)  # the builders use xp only when called: the names need no GPU
    try:
        _env.check_all()
    except ValueError as exc:
        p.exit(2, f"{p.prog}: error: {exc}\n")
    why = _no_cuda_device()
    if why is not None:
        p.exit(2, f"{p.prog}: error: needs a CUDA device (CuPy and a visible GPU): {why}\n")
    import cupy as xp

    if args.no_kernels:
        _no_kernels()
    table = cases(xp)
    rows = []
    for name in names:
        host, device, profile = measure(xp, table[name](), args.calls, args.top)
        rows.append(f"{name:28s} {host:9.3f} {device:10.3f}")
        print(f"==== {name}: host {host:.3f} ms/call, events {device:.3f} ms/call\n{profile}", flush=True)
    print(f"{'case':28s} {'host ms':>9s} {'events ms':>10s}\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

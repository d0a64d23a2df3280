"""The host's cost per call of cuflash's CUDA path, beside the device's, and where the host's time goes.

    python -m benchmarks.host_cost [--calls 40] [--top 12] [--only NAME,...]

The H200 benchmark (benchmarks/results/gpu-nvidia-h200) measured 0.15-0.9 ms of host time per call (``host ms``),
against 0.05 for PyTorch's flash backend: where a call's kernels take less than that, the GPU waits for Python.
For each case this prints the host's ms per call (``perf_counter`` over ``calls`` back-to-back calls, before the
synchronization), the ms per call between CUDA events around those calls (the kernels' time once the host runs
ahead of them; the host's where it does not) and cProfile's functions with the most time of their own over the
same calls. Runs on a GPU, or on the fake GPU of the tests (``PYTHONPATH=tests/fake_gpu:tests``, kernels not run:
``--no-kernels``), where only the Python side's share means anything.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Callable

import numpy as np

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

    def sparse():
        case = Case("blocksparse", "cuda", "fwd", "float16", 4, 32, 4096, 4096, 64, density=1 / 16,
                    mask_block=(128, 128))
        q, k, v, _ = _arrays(xp, 4, 4096, 32, 64)
        mask = density_mask(case, seed=0)
        return lambda: cuflash.attention(q, k, v, block_mask=mask)

    return {"fwd-n512-b32": fwd, "fwd-n512-b32-causal": lambda: fwd(causal=True),
            "bwd-n512-b32-causal": lambda: bwd(causal=True), "fwd_bwd-vjp-n512-b32-causal": vjp,
            "fwd-n4096-sparse16": sparse}


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
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    text = [f"    {'own us':>8s} {'total us':>9s} {'n':>5s}  function (per timed call)"]
    for (path, line, name), (_, n, own, total, _) in rows:
        where = f"{'/'.join(path.split('/')[-2:])}:{line}({name})" if line else name
        text.append(f"    {own / calls * 1e6:8.1f} {total / calls * 1e6:9.1f} {n / calls:5.1f}  {where}")
    return host, device, "\n".join(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--top", type=int, default=12, help="cProfile's rows per case")
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--no-kernels", action="store_true", help="launches do nothing (the fake GPU: host cost only)")
    args = p.parse_args(argv)
    import cupy as xp

    if args.no_kernels:
        xp.RawKernel.__call__ = lambda self, *a, **k: None
    table = cases(xp)
    names = args.only.split(",") if args.only else list(table)
    rows = []
    for name in names:
        host, device, profile = measure(xp, table[name](), args.calls, args.top)
        rows.append(f"{name:28s} {host:9.3f} {device:10.3f}")
        print(f"==== {name}: host {host:.3f} ms/call, events {device:.3f} ms/call\n{profile}", flush=True)
    print(f"{'case':28s} {'host ms':>9s} {'events ms':>10s}\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

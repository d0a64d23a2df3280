"""``python -m cuflash [demo|build|emulate|bench]``: the command line (``--help`` lists each subcommand)."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cuflash
from cuflash import _env, backends
from cuflash._cli import exit_with


def demo(seqlen=16384, heads=4, head_dim=64):
    """Version, backends (and why one is unavailable), and a long causal attention on the best backend."""
    print(f"cuflash {cuflash.__version__}")
    print("backends:")
    status = backends.status()
    for name, (ok, why) in status.items():
        print(f"  {name:8s} {'available' if ok else 'unavailable'}: {why}")
    name = "cuda" if status["cuda"][0] else "numpy"
    rng = np.random.default_rng(0)
    shape = (1, seqlen, heads, head_dim)
    if name == "cuda":
        import cupy as xp
        dtype = np.float16
    else:
        xp, dtype = np, np.float32
    q, k, v = (xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype)) for _ in range(3))
    cuflash.attention(q[:, :256], k[:, :256], v[:, :256], causal=True)  # warm-up / compile
    if name == "cuda":
        xp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    out = cuflash.attention(q, k, v, causal=True)
    if name == "cuda":
        xp.cuda.Device().synchronize()
    dt = time.perf_counter() - t0
    dense = heads * seqlen * seqlen * np.dtype(np.float32).itemsize
    print(f"\ncausal attention, {name} backend, {np.dtype(dtype).name}: batch 1, seqlen {seqlen}, "
          f"{heads} heads, head_dim {head_dim}")
    print(f"  time: {dt * 1e3:.0f} ms   out: {tuple(out.shape)} {out.dtype}")
    print(f"  a materialized score matrix would need {dense / 2**30:.1f} GiB (float32, all heads); "
          f"cuflash keeps one tile at a time")
    return 0


def build(args) -> int:
    """The compile check of every kernel specialization (cuflash.cuda.compile)."""
    from .cuda import compile as cc

    bad = cc.check(archs=tuple(args.arch))
    return 2 if bad < 0 else (1 if bad else 0)


def emulate(args) -> int:
    from .emulate.__main__ import main

    return main(["--bench"] if args.bench else [])


BENCH_POINTER = "the benchmarks live outside the package: from a checkout, run `python -m benchmarks.run --help`"


def bench(args) -> int:
    print(BENCH_POINTER, file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.add_parser("demo", help="version, backends, and a 16k-token causal attention (the default)")
    p = sub.add_parser("build", help="compile every CUDA kernel specialization as CuPy will (no GPU needed) and "
                                     "fail on spills, register headroom, shared memory")
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=[80, 90], help="compile targets")
    p = sub.add_parser("emulate", help="is the CPU kernel emulator usable here, and where is its cache")
    p.add_argument("--bench", action="store_true", help="also measure the per-barrier cost")
    p = sub.add_parser("bench", help="where the benchmarks are (benchmarks/ in a checkout)",
                       description=BENCH_POINTER, usage="%(prog)s [-h]")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # whatever options follow were meant for the benchmark runner
        if {"-h", "--help"} & set(argv[1:]):  # help asked for and given (the pointer) is a success, not status 2
            p.print_help()
            return 0
        return bench(None)
    args = parser.parse_args(argv)
    try:
        _env.check_all()
    except ValueError as exc:  # a bad CUFLASH_* value: said once, before anything runs
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    run = {None: lambda a: demo(), "demo": lambda a: demo(), "build": build, "emulate": emulate, "bench": bench}
    return run[args.command](args)


if __name__ == "__main__":
    exit_with(main)

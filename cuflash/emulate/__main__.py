"""``python -m cuflash.emulate``: is the emulator usable here, where is its cache, and how fast is it."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .. import _env
from ..cuda.launch import LaunchSpec
from . import CompileError, EmulationError, available, cache_dir, compile_log, launch

BARRIER_LOOP = r"""
extern "C" __global__ void barrier_loop(int iters, int* out) {
  int acc = 0;
  for (int i = 0; i < iters; ++i) {
    acc += i;
    __syncthreads();
  }
  out[threadIdx.x] = acc;
}
"""


def barrier_cost(threads: int = 128, iters: int = 2000, repeats: int = 10) -> float:
    """Seconds per __syncthreads of a block of `threads` threads (best of `repeats`)."""
    out = np.zeros(threads, np.int32)

    def run(n):
        launch(LaunchSpec(BARRIER_LOOP, "barrier_loop", (1, 1, 1), (threads, 1, 1), 0, (np.int32(n), out)))

    run(1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(iters)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash.emulate", description=__doc__)
    parser.add_argument("--bench", action="store_true", help="measure the per-barrier cost")
    args = parser.parse_args(argv)
    try:  # every setting the emulator reads, and its cache, before saying it is usable
        _env.check_all()
        cache = cache_dir()
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    ok, reason = available()
    print(f"available: {ok} ({reason})")
    print(f"cache: {cache}")
    if ok:  # a real launch (compiled once, then cached): what available() alone cannot promise
        start = time.perf_counter()
        try:
            launch(LaunchSpec(BARRIER_LOOP, "barrier_loop", (1, 1, 1), (32, 1, 1), 0,
                              (np.int32(1), np.zeros(32, np.int32))))
        except (CompileError, EmulationError, ValueError) as exc:  # the compiler, the kernel, or the cache since
            print(f"{parser.prog}: error: the test launch failed: {exc}", file=sys.stderr)
            return 1
        print(f"launch: ok ({time.perf_counter() - start:.2f} s)")
    if ok and args.bench:
        for threads in (32, 128, 256):
            print(f"__syncthreads, {threads:3d} threads: {barrier_cost(threads) * 1e6:.2f} us")
        for name, seconds in compile_log:
            print(f"compiled {name} in {seconds:.2f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m cuflash``: version, backends, and a long-sequence demo. The benchmarks live outside the
package: ``python -m benchmarks.run`` from a checkout."""
from __future__ import annotations

import sys
import time

import numpy as np

import cuflash
from cuflash import backends


def _best_backend():
    status = backends.status()
    return "cuda" if status["cuda"][0] else "numpy"


def demo(seqlen=16384, heads=4, head_dim=64):
    print(f"cuflash {cuflash.__version__}")
    print("backends:")
    for name, (ok, why) in backends.status().items():
        print(f"  {name:8s} {'available' if ok else 'unavailable'}: {why}")
    name = _best_backend()
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":  # the benchmark runner moved out of the package (benchmarks/)
        print("the benchmarks are not part of the cuflash package: run `python -m benchmarks.run --quick|--full` "
              "from a cuflash checkout (see benchmarks/README.md)", file=sys.stderr)
        return 2
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m cuflash    (benchmarks: python -m benchmarks.run, from a checkout)")
        return 0
    demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())

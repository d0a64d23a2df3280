"""Ragged batches and decode on the NumPy backend: what packing saves against padding, and decode time against the
cache length.

    python -m benchmarks.varlen --out benchmarks/results/cpu-amd-epyc-2c/varlen.json
    python -m benchmarks.varlen --quick          # fewer rounds, shorter caches

Varlen against padded: a batch of sequences whose lengths follow a log-normal law (median 256, clipped to
[1, 2048]: the spread of protein and document lengths), causal, float32, 4 heads, head_dim 64. The same attention is
computed twice, by :func:`cuflash.attention_varlen` on the packed ``(total, heads, d)`` arrays and by
:func:`cuflash.attention` on the padded ``(batch, max_len, heads, d)`` batch with ``seqlens_q``/``seqlens_k`` (the
only way before varlen); rounds alternate the two, and the ratio is taken round by round (median reported). Memory:
the inputs each needs (packed against padded) and tracemalloc's peak of the call itself.

Decode: one query token per sequence (batch 4, 8 query heads on 2 kv heads, head_dim 128, float32) against caches of
1k to 64k tokens through :func:`cuflash.attention_with_kvcache`; the time per call should grow linearly with the
cache (a least-squares line and its R² are reported), since decode reads each cached key and value once.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import cuflash
from cuflash import _env

from .numpy_backend import _meta, _out_file, _peak, check_out, write_json


def lengths(batch, rng, median=256, sigma=0.8, longest=2048):
    """Log-normal sequence lengths, clipped to [1, longest]."""
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, batch)), 1, longest).astype(np.int32)


def varlen_case(batch, rounds, heads=4, d=64, seed=0):
    rng = np.random.default_rng(seed)
    lens = lengths(batch, rng)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total, longest = int(cu[-1]), int(lens.max())
    q, k, v = (rng.standard_normal((total, heads, d)).astype(np.float32) for _ in range(3))
    padded = []
    for a in (q, k, v):
        p = np.zeros((batch, longest, heads, d), np.float32)
        for b in range(batch):
            p[b, :lens[b]] = a[cu[b]:cu[b + 1]]
        padded.append(p)
    calls = {"varlen": lambda: cuflash.attention_varlen(q, k, v, cu, cu, causal=True),
             "padded": lambda: cuflash.attention(*padded, causal=True, seqlens_q=lens, seqlens_k=lens)}
    out_v, out_p = calls["varlen"](), calls["padded"]()
    diff = max(float(np.abs(out_v[cu[b]:cu[b + 1]] - out_p[b, :lens[b]]).max()) for b in range(batch))
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["varlen"], times["padded"])]
    peaks = {name: _peak(fn)[1] for name, fn in calls.items()}
    return dict(batch=batch, heads=heads, head_dim=d, dtype="float32", causal=True, total_tokens=total,
                padded_tokens=batch * longest, longest=longest, median_length=float(np.median(lens)),
                max_abs_diff=diff,
                ms={name: 1e3 * statistics.median(t) for name, t in times.items()},
                varlen_over_padded=statistics.median(ratios),
                input_bytes={"varlen": 3 * q.nbytes, "padded": 3 * padded[0].nbytes},
                peak_bytes=peaks)


def decode_case(cache_len, rounds, batch=4, heads=8, heads_kv=2, d=128, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, 1, heads, d)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((batch, cache_len, heads_kv, d)).astype(np.float32) for _ in range(2))
    seqlens = np.full(batch, cache_len, np.int32)
    fn = lambda: cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)  # noqa: E731
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    cache_bytes = 2 * k_cache.nbytes
    return dict(cache_len=cache_len, batch=batch, heads=heads, heads_kv=heads_kv, head_dim=d, dtype="float32",
                ms=ms, cache_bytes=cache_bytes, gb_per_s=cache_bytes / (ms * 1e-3) / 1e9)


def linear_fit(xs, ys):
    """Least-squares ``y = a + b x`` and its R²."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    r2 = 1 - np.sum((y - (a + b * x)) ** 2) / np.sum((y - y.mean()) ** 2)
    return float(a), float(b), float(r2)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.varlen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=_out_file,
                    help="write the results as JSON to this file (folders made as needed; an existing file is an "
                         "error unless --replace)")
    ap.add_argument("--replace", action="store_true", help="overwrite the --out file if it exists")
    ap.add_argument("--quick", action="store_true", help="3 rounds, caches up to 16k")
    args = ap.parse_args(argv)
    # refused before the first measurement, as benchmarks.numpy_backend does: the environment as `python -m cuflash`
    # checks it (CUFLASH_BLAS=x was a traceback at the first case, under the table's header), then --out (an
    # existing file was overwritten)
    try:
        _env.check_all()
    except ValueError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    if args.replace and args.out is None:
        ap.error("--replace needs --out (there is no file to replace)")
    why = None if args.out is None else check_out(args.out, args.replace)
    if why:
        ap.error(f"--out {args.out}: {why}")
    rounds = 3 if args.quick else 7
    result = dict(_meta(None), varlen=[], decode=[])
    print(f"{'batch':>5s} {'tokens':>7s} {'padded':>7s} {'varlen ms':>10s} {'padded ms':>10s} {'ratio':>6s} "
          f"{'in MiB v/p':>12s} {'peak MiB v/p':>13s}", flush=True)
    for batch in (8, 32):
        rec = varlen_case(batch, rounds)
        result["varlen"].append(rec)
        mib = lambda x: x / 2**20  # noqa: E731
        print(f"{batch:5d} {rec['total_tokens']:7d} {rec['padded_tokens']:7d} {rec['ms']['varlen']:10.1f} "
              f"{rec['ms']['padded']:10.1f} {rec['varlen_over_padded']:6.2f} "
              f"{mib(rec['input_bytes']['varlen']):5.1f}/{mib(rec['input_bytes']['padded']):5.1f} "
              f"{mib(rec['peak_bytes']['varlen']):6.1f}/{mib(rec['peak_bytes']['padded']):6.1f}", flush=True)
    caches = (1024, 4096, 16384) if args.quick else (1024, 4096, 16384, 65536)
    print(f"\n{'cache':>6s} {'ms':>8s} {'GB/s':>6s}", flush=True)
    for n in caches:
        rec = decode_case(n, rounds)
        result["decode"].append(rec)
        print(f"{n:6d} {rec['ms']:8.2f} {rec['gb_per_s']:6.2f}", flush=True)
    a, b, r2 = linear_fit([r["cache_len"] for r in result["decode"]], [r["ms"] for r in result["decode"]])
    result["decode_fit"] = dict(intercept_ms=a, ms_per_1k_tokens=1e3 * b, r2=r2)
    print(f"decode time = {a:.2f} ms + {1e3 * b:.3f} ms per 1k cached tokens, R² = {r2:.4f}")
    if args.out:
        try:
            write_json(args.out, result, replace=args.replace)
        except OSError as exc:  # checked up front; what changed since (disk full, a file made there) is said, and
            # write_json's message names the temporary file that keeps the results
            print(f"{ap.prog}: error: cannot write --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The accuracy table of README "Precision": each float32/float64 arithmetic against its naive computation.

    python tests/wide_accuracy.py                 # the CUDA kernels on the CPU emulator (a few minutes on 2 cores)
    python tests/wide_accuracy.py --backend cuda  # the same on a GPU (CuPy)

For every mode (tests/wide_support.py) and a fixed set of problems (causal and not, GQA, windows, head dims 32-256,
sharp and flat softmax), forward and backward: the RMS error against the reference divided by the naive
computation's (the RMS rule's statistic), and the largest max-error ratio. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuflash  # noqa: E402
from cuflash import reference  # noqa: E402

import wide_support as ws  # noqa: E402
from cases import make_case  # noqa: E402

MODES = [("float32", "ieee", 80), ("float32", "3xtf32", 80), ("float32", "tf32", 80), ("float64", "ieee", 80),
         ("float64", "ieee", 86)]
PROBLEMS = [  # (sq, sk, heads, kv heads, head_dim, options)
    (160, 160, 2, 1, 64, dict(causal=True)),
    (96, 200, 2, 2, 32, dict(window=(60, 20), scale=0.4)),
    (128, 128, 2, 1, 128, dict(scale=0.25)),
    (64, 96, 2, 1, 256, dict(causal=True)),
    (200, 120, 4, 1, 96, dict(scale=1.0)),  # a sharp softmax
]


def measure(backend: str):
    import os

    rows = []
    for dtype, precision, cc in MODES:
        os.environ["CUFLASH_EMULATE_ARCH"] = str(cc)
        rule = ws.RULES[(dtype, precision)]
        if backend == "cuda":
            import cupy as cp

            def fwd(q, k, v, **o):
                out, lse = cuflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), return_lse=True, **o)
                return out.get(), lse.get()

            def bwd(do, q, k, v, out, lse, **o):
                return tuple(g.get() for g in cuflash.attention_backward(*(cp.asarray(a) for a in
                                                                           (do, q, k, v, out, lse)), **o))
        else:
            fwd = lambda q, k, v, **o: cuflash.attention(q, k, v, return_lse=True, backend="emulate", **o)  # noqa
            bwd = lambda *a, **o: cuflash.attention_backward(*a, backend="emulate", **o)  # noqa: E731
        ratios = {"out": [], "lse": [], "dq": [], "dk": [], "dv": []}
        for seed, (sq, sk, h, hkv, d, opts) in enumerate(PROBLEMS):
            case = make_case(1, sq, sk, h, hkv, d, np.dtype(dtype), seed=seed, **opts)
            case.dout = case.dout.astype(dtype)
            case.options["precision"] = precision
            for name, r in ws.check_rms(fwd, bwd, case, precision, strict=False).items():
                ratios[name].append(r)
        label = {"ieee": "ieee (FFMA)" if dtype == "float32" else ("DMMA" if cc == 80 else "DFMA")}.get(precision,
                                                                                                    precision)
        base = "naive TF32" if rule.baseline == reference.TF32 else f"naive {dtype}"
        rows.append((dtype, label, base, ratios))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("emulate", "cuda"), default="emulate")
    args = p.parse_args(argv)
    rows = measure(args.backend)
    print(f"| dtype | arithmetic | vs | RMS error / naive: out | lse | dQ | dK | dV |  ({args.backend}, "
          f"{len(PROBLEMS)} problems: min-max)")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, label, base, r in rows:
        cells = " | ".join(f"{min(v):.2f}-{max(v):.2f}" for v in r.values())
        print(f"| {dtype} | {label} | {base} | {cells} |")


if __name__ == "__main__":
    main()

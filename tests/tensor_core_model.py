"""Models of one TF32 tensor-core product ``D = A B + C`` (``mma.m16n8k8 .tf32``; A 16x8, B 8x8, C 16x8 float32), shared
by the emulator's test (tests/emulate/test_arch.py: its hw_math mode implements :func:`rz`) and the GPU's
(tests/test_gpu_arch.py: which model the hardware follows, bit for bit).

- :func:`rn`: the products (exact: two 11-bit significands) added to C one by one in k order, each sum rounded to
  nearest float32: the PTX ISA's reading, and the emulator's default.
- :func:`rz`: the tensor core as measured, after Fasi, Higham, Mikaitis and Pranesh ("Numerical behavior of NVIDIA
  tensor cores", 2021): all terms (C and the 8 exact products) aligned to the largest exponent E, truncated to
  multiples of 2^(E - frac_bits), summed exactly, and the sum rounded toward zero. The default is the model fitted
  to the H200's ``mma.m16n8k8 .tf32`` on 2026-11-27 (512 of 512 elements over the four seeds of :func:`operands`,
  which no variant below reaches): 25 fraction bits, and a product's exponent taken from its operands' exponents
  (ilogb(a) + ilogb(b), the product's significand unnormalized in [1, 4)) rather than from the product itself. The
  emulator's hw_math implements that default. The variants the GPU test scores the hardware against: other
  fraction widths, products normalized before alignment, terms truncated toward minus infinity (``floor``: a
  two's-complement alignment), the products in two chained groups of 4 (``block=4``), the products summed apart
  from C (``c_apart``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from cuflash.reference import round_tf32


def _terms(a, b, c):
    ta, tb = round_tf32(a).astype(np.float64), round_tf32(b).astype(np.float64)
    return ta, tb, np.asarray(c, np.float32)


def rn(a, b, c):
    ta, tb, acc = _terms(a, b, c)
    acc = acc.copy()
    for k in range(ta.shape[1]):
        acc = (acc + np.outer(ta[:, k], tb[k]).astype(np.float32)).astype(np.float32)  # the products are exact
    return acc


def _ilogb(x):
    return int(np.frexp(x)[1]) - 1


def dot_rz(c, terms, frac_bits=25, floor=False):
    """One element: ``c + sum(t for t, e in terms)``, ``terms`` (value, alignment exponent) pairs, every term
    truncated to multiples of 2^(E - frac_bits), E the largest exponent among C's and the terms' (toward zero, or
    toward minus infinity with ``floor``), the exact sum of those rounded toward zero to float32. Exact in float64
    for frac_bits <= 46: the 9 terms are below 2^(E + 2) (an unnormalized product's significand is below 4), each
    below 2^48 units, their sum below 2^52."""
    terms = [(float(c), _ilogb(float(c)) if c else None)] + [(float(t), e) for t, e in terms]
    exps = [e for t, e in terms if t]
    if not exps:
        return np.float32(c)
    e = max(exps)
    cut = np.floor if floor else np.trunc
    s = np.ldexp(sum(cut(np.ldexp(t, frac_bits - e)) for t, _ in terms), e - frac_bits)
    f = np.float32(s)
    return np.nextafter(f, np.float32(0)) if abs(float(f)) > abs(s) else f


def rz(a, b, c, frac_bits=25, unnormalized=True, block=8, floor=False, c_apart=False):
    """``unnormalized``: a product's alignment exponent is ilogb(a) + ilogb(b) (one below the product's own when its
    significand is in [2, 4)); else the product's own. ``block``: the products in chained groups of ``block``, each
    group's sum with the running C rounded so. ``c_apart``: each group's products summed among themselves first,
    that sum rounded toward zero to float32 and then added to C: a product tree with C joining at its root."""
    ta, tb, c = _terms(a, b, c)

    def product(x, y):
        p = x * y
        return p, (_ilogb(x) + _ilogb(y) if unnormalized else _ilogb(p)) if p else None

    def dot(i, j):
        acc, p = c[i, j], [product(x, y) for x, y in zip(ta[i], tb[:, j])]
        for k0 in range(0, len(p), block):
            part = p[k0:k0 + block]
            if c_apart:
                part = [(s, _ilogb(float(s)) if s else None) for s in [dot_rz(np.float32(0), part, frac_bits, floor)]]
            acc = dot_rz(acc, part, frac_bits, floor)
        return acc

    return np.array([[dot(i, j) for j in range(tb.shape[1])] for i in range(ta.shape[0])], np.float32)


#: the models the GPU test compares the hardware with: name -> D = model(A, B, C)
#: (H100, 2026-11-27: no model then listed matched all 128 elements, the closest 122-126 (26 bits of the normalized
#: largest term, i.e. 25 fraction bits); the H200 run of the same day printed D bit for bit, which the default fits.)
EMULATOR = "emulator (25 fraction bits, unnormalized products)"
MODELS = {"round to nearest": rn, EMULATOR: rz,
          **{f"{bits} fraction bits, {'unnormalized' if unnorm else 'normalized'} products"
             f"{f', {block} at a time' if block != 8 else ''}{', floor' if floor else ''}"
             f"{', C apart' if apart else ''}":
             (lambda a, b, c, bits=bits, unnorm=unnorm, block=block, floor=floor, apart=apart:
              rz(a, b, c, bits, unnorm, block, floor, apart))
             for bits in (22, 23, 24, 25, 26, 27) for unnorm in (True, False) for block in (8, 4)
             for floor in (False, True) for apart in (False, True)
             if (bits, unnorm, block, floor, apart) != (25, True, 8, False, False)}}


def operands(seed):
    """Random A, B, C, and in the last two rows C = +-1 plus one product of 0.75 ulp(1): round to nearest gives
    +-(1 + 2^-23) there, round toward zero +-1."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a[14:], b[0], c[14] = 0, 1, 1
    a[14, 0], c[15], a[15, 0] = 0.75 * 2.0 ** -23, -1, -0.75 * 2.0 ** -23
    return a, b, c


def measured(path=Path(__file__).parent / "data" / "tf32_mma_h200.json"):
    """``{seed: D}`` as a GPU computed it (tests/data: the H200 run of 2026-11-27, D bit for bit from the GPU test's
    log), each D checked to be 128 float32 bit patterns before use."""
    out = {}
    for seed, text in json.loads(Path(path).read_text())["D"].items():
        words = text.split()
        if len(words) != 128 or not all(re.fullmatch(r"[0-9a-f]{8}", w) for w in words):
            raise ValueError(f"{path}: seed {seed}: expected 128 words of 8 hex digits, got {len(words)} words")
        out[int(seed)] = np.array([int(w, 16) for w in words], np.uint32).view(np.float32).reshape(16, 8)
    return out

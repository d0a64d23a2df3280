"""Models of one TF32 tensor-core product ``D = A B + C`` (``mma.m16n8k8 .tf32``; A 16x8, B 8x8, C 16x8 float32), shared
by the emulator's test (tests/emulate/test_arch.py: its hw_math mode implements :func:`rz`) and the GPU's
(tests/test_gpu_arch.py: which model the hardware follows, bit for bit).

- :func:`rn`: the products (exact: two 11-bit significands) added to C one by one in k order, each sum rounded to
  nearest float32: the PTX ISA's reading, and the emulator's default.
- :func:`rz`: the tensor core as Fasi, Higham, Mikaitis and Pranesh measured it ("Numerical behavior of NVIDIA tensor
  cores", 2021): all terms (C and the 8 products) aligned to the largest, truncated to a grid of ``bits`` significant
  bits of it (24: no guard bit; later GPUs were reported with 25), summed exactly, and the sum rounded toward zero.
  The emulator's hw_math implements ``rz(bits=24, block=8)``. ``block=4``: the 8 products in two chained groups of
  4, each group's sum (with the running C) rounded so; ``floor=True``: terms truncated toward minus infinity (a
  two's-complement alignment) instead of toward zero. The GPU test reports which of these the hardware follows.
"""
from __future__ import annotations

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


def dot_rz(c, products, bits=24, floor=False):
    """One element: ``c + sum(products)`` with every term truncated to ``bits`` bits of the largest (toward zero, or
    toward minus infinity with ``floor``), the exact sum of those rounded toward zero to float32 (at most 9 terms
    below 2^bits grid units each: the sum fits a float64 exactly for bits <= 48)."""
    terms = [float(c)] + [float(p) for p in products]
    nonzero = [t for t in terms if t]
    if not nonzero:
        return np.float32(c)
    e = max(np.frexp(t)[1] for t in nonzero)
    cut = np.floor if floor else np.trunc
    s = np.ldexp(sum(cut(np.ldexp(t, bits - e)) for t in terms), e - bits)
    f = np.float32(s)
    return np.nextafter(f, np.float32(0)) if abs(float(f)) > abs(s) else f


def rz(a, b, c, bits=24, block=8, floor=False, c_apart=False):
    """``c_apart``: the products summed among themselves first (aligned to the largest product), that sum rounded
    toward zero to float32 and then added to C by :func:`dot_rz`: a product tree with C joining at its root."""
    ta, tb, c = _terms(a, b, c)

    def dot(i, j):
        acc, p = c[i, j], ta[i] * tb[:, j]
        for k0 in range(0, len(p), block):
            part = p[k0:k0 + block]
            if c_apart:
                part = [dot_rz(np.float32(0), part, bits, floor)]
            acc = dot_rz(acc, part, bits, floor)
        return acc

    return np.array([[dot(i, j) for j in range(tb.shape[1])] for i in range(ta.shape[0])], np.float32)


#: the models the GPU test compares the hardware with: name -> D = model(A, B, C)
#: (The first run of the GPU test, H100 2026-11-27, matched no model in all 128 elements; 26 and 27 bits over 8
#: products came closest, 119-123. Hence the wider grids and the products summed apart from C.)
MODELS = {"round to nearest": rn, "emulator (24 bits, 8 products)": rz,
          **{f"{bits} bits, {block} products{', floor' if floor else ''}{', C apart' if apart else ''}":
             (lambda a, b, c, bits=bits, block=block, floor=floor, apart=apart: rz(a, b, c, bits, block, floor, apart))
             for bits in (24, 25, 26, 27, 28, 29, 30) for block in (8, 4) for floor in (False, True)
             for apart in (False, True) if (bits, block, floor, apart) != (24, 8, False, False)}}


def operands(seed):
    """Random A, B, C, and in the last two rows C = +-1 plus one product of 0.75 ulp(1): round to nearest gives
    +-(1 + 2^-23) there, round toward zero +-1."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a[14:], b[0], c[14] = 0, 1, 1
    a[14, 0], c[15], a[15, 0] = 0.75 * 2.0 ** -23, -1, -0.75 * 2.0 ** -23
    return a, b, c

"""The NumPy backend's tile products through MKL (``CUFLASH_BLAS``, ``cuflash.backends._blas``).

``_mkl_matmul`` must compute ``np.matmul`` for every layout the backend hands it (row strides, transposed views,
broadcast and merged leading axes), send to MKL what BLAS can read in place, and fall back to NumPy for the rest;
the backend must actually use it when MKL is selected.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import cuflash
from cuflash.backends import _blas


@pytest.fixture
def mkl(monkeypatch):
    lib, why = _blas._load_mkl()
    if lib is None:  # the test extra installs mkl on Linux x86-64
        pytest.skip(f"MKL products: {why}")
    calls = []

    class Counting:
        def __init__(self, gemm):
            self.gemm = gemm

        def get(self, dtype):
            fn = self.gemm.get(dtype)
            if fn is None:
                return None
            return lambda *args: (calls.append(args[-1]), fn(*args))[1]

    counted = type("CountedMkl", (), {"gemm": Counting(lib.gemm), "local": lib.local, "vml": lib.vml})()
    monkeypatch.setattr(_blas, "_load_mkl", lambda: (counted, None))
    monkeypatch.setattr(_blas, "cpu_vendor", lambda: "GenuineIntel")  # CUFLASH_BLAS=auto takes MKL on any CPU here
    # a plan decides MKL or NumPy once per layout: plans made under a test's MKL_MIN_MACS stay with the test
    monkeypatch.setattr(_blas, "_plans", {})
    return counted, calls


def _transposed_storage(x):
    """The same values with the last two axes stored column-major (a transposed view)."""
    return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -1, -2)), -1, -2)


def _layouts(dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 1, 130, 70)).astype(dtype)
    b = rng.standard_normal((2, 3, 1, 70, 90)).astype(dtype)
    left = {"plain": a, "transposed": _transposed_storage(a), "every other row": a[..., ::2, :],
            "one head": a[:, :1], "2-D": a[1, 2, 0], "rows from the third": a[:, :, :, 2:, :]}
    right = {"plain": b, "transposed": _transposed_storage(b), "column slice": b[..., 5:75],
             "one head": b[:, :1], "2-D": b[0, 1, 0], "every other head": b[:, ::2]}
    for (na, x) in left.items():
        for (nb, y) in right.items():
            try:
                np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
            except ValueError:
                continue
            if x.shape[-1] == y.shape[-2]:
                yield f"{na} @ {nb}", x, y


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mkl_matmul_is_matmul_for_every_layout(mkl, monkeypatch, dtype):
    lib, calls = mkl
    monkeypatch.setattr(_blas, "MKL_MIN_MACS", 0)
    cases = list(_layouts(dtype))
    assert len(cases) >= 20
    calls_per_case = []
    for name, a, b in cases:
        exact = np.matmul(a.astype(np.longdouble), b.astype(np.longdouble))  # above float64's precision (x86)
        naive = np.abs(np.matmul(a, b) - exact).max()
        calls.clear()
        got = _blas._mkl_matmul(lib, a, b)
        assert got.shape == exact.shape and got.dtype == dtype, name
        assert np.abs(got - exact).max() <= 2 * naive + np.finfo(dtype).tiny, name
        assert sum(calls) == got[..., 0, 0].size, f"{name}: MKL computed {sum(calls)} matrices"
        calls_per_case.append(len(calls))
        out = np.full(exact.shape, np.nan, dtype=dtype)
        assert _blas._mkl_matmul(lib, a, b, out=out) is out
        assert np.array_equal(out, got), name
    # one batch call where the heads merge into one stride, a loop of them where they do not (a broadcast operand)
    assert min(calls_per_case) == 1 and max(calls_per_case) > 1, calls_per_case


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_product_accumulates_in_one_gemm(mkl, monkeypatch, dtype):
    """``add_product``: ``out += a @ b`` through MKL's beta = 1 (one call, no temporary) for every layout, as accurate
    as the product and a sum, and the same through NumPy's matmul and through MKL's fallbacks."""
    lib, calls = mkl
    monkeypatch.setattr(_blas, "MKL_MIN_MACS", 0)
    matmul = _blas.products()
    assert matmul is not np.matmul
    rng = np.random.default_rng(2)
    for name, a, b in _layouts(dtype):
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        out0 = rng.standard_normal(shape).astype(dtype)
        exact = out0.astype(np.longdouble) + np.matmul(a.astype(np.longdouble), b.astype(np.longdouble))
        naive = np.abs(out0 + np.matmul(a, b) - exact).max()
        calls.clear()
        out = out0.copy()
        assert _blas.add_product(matmul, a, b, out) is out
        assert sum(calls) == out[..., 0, 0].size, name
        assert np.abs(out - exact).max() <= 2 * naive + np.finfo(dtype).tiny, name
        ref = out0.copy()
        assert np.array_equal(_blas.add_product(np.matmul, a, b, ref), out0 + np.matmul(a, b)), name
    x, y = rng.standard_normal((3, 8, 5)).astype(dtype), rng.standard_normal((3, 5, 4)).astype(dtype)
    out = np.ones((3, 8, 4), dtype)
    calls.clear()
    _blas._mkl_matmul(lib, x, y.astype(np.float16), out=out, beta=1.0)  # mixed dtypes: NumPy's product, then a sum
    assert not calls and np.array_equal(out, 1 + np.matmul(x, y.astype(np.float16)))


@pytest.mark.parametrize("zeros", ["a", "b"])
def test_guarded_added_product_keeps_the_unguarded_bits(mkl, zeros):
    """The forward and backward add ``P V`` (``dS K``, ...) into their accumulators: where a row meets no infinity
    or NaN, its bits are those of the call without one (a row must not learn of keys it does not see), and where
    it does, the sum takes what the term makes of it (NaN where the sum so far is -inf). ``zeros="b"``: the same
    product transposed, the zeros in the right operand (the backward's ``dV^T += dO^T P`` and ``dK^T += Q^T dS``)."""
    from cuflash.backends.numpy import _seen_product

    matmul = _blas.products()
    t = functools.partial(np.swapaxes, axis1=-1, axis2=-2)

    def product(a, b, guarded, acc, matmul, add):  # _seen_product in the orientation asked for
        if zeros == "a":
            return _seen_product(a, b, guarded, acc, matmul, add=add)
        out = np.ascontiguousarray(t(acc))  # MKL writes only a row-major accumulator
        return t(_seen_product(t(b), t(a), guarded, out, matmul, add=add, zeros="b"))

    rng = np.random.default_rng(3)
    a = rng.random((2, 300, 260)).astype(np.float32)
    a[:, :100, :3] = 0  # rows 0-99 do not see keys 0-2
    b = rng.standard_normal((2, 260, 40)).astype(np.float32)
    acc0 = rng.standard_normal((2, 300, 40)).astype(np.float32)
    acc0[:, 150, :] = -np.inf
    clean = product(a, b, False, acc0.copy(), matmul, add=True)
    bad = b.copy()
    bad[:, 0, :5], bad[:, 1, 5:10], bad[:, 2, 10] = np.inf, -np.inf, np.nan
    with np.errstate(invalid="ignore"):  # as the backend calls it
        got = product(a, bad, True, acc0.copy(), matmul, add=True)
    assert np.array_equal(got[:, :100], clean[:, :100])
    assert np.isnan(got[:, 100:, 10]).all() and np.array_equal(got[:, 100:, 11:], clean[:, 100:, 11:])
    seen = np.r_[100:150, 151:300]
    assert (got[:, seen, :5] == np.inf).all() and (got[:, seen, 5:10] == -np.inf).all()
    assert np.isnan(got[:, 150, :10]).sum() == 2 * 5  # -inf + inf; -inf + -inf stays -inf
    assert (got[:, 150, 5:10] == -np.inf).all()


@pytest.mark.parametrize("dtype, base", [(np.float32, 2), (np.float64, 0)])
def test_normal_exp_is_exact_to_an_ulp_and_the_same_at_every_offset(mkl, monkeypatch, dtype, base):
    """VML's exp2/exp for the backend's arguments with normal results: within 1 ulp of the exact value (NumPy's own
    bound), each element's bits independent of where it sits in the array (the same scores in another tile or
    strip give the same P), NumPy's where CUFLASH_BLAS=numpy."""
    fn = _blas.normal_exp(dtype, base)
    assert fn is not None
    rng = np.random.default_rng(4)
    x = (rng.random(20011) * (-120.0 if base == 2 else -700.0)).astype(dtype)
    got = fn(x.copy())
    exact = (np.exp2 if base == 2 else np.exp)(x.astype(np.longdouble))
    assert (np.abs(got - exact) <= np.spacing(got).astype(np.longdouble)).all()
    for offset in range(0, 33, 3):
        for n in (1, 7, 16, 17, 63, 64, 65, 1001):
            assert np.array_equal(fn(x[offset:offset + n].copy()), got[offset:offset + n]), (offset, n)
    out = np.empty_like(x)
    assert fn(x, out=out) is out and np.array_equal(out, got)
    strided = x[::2]  # not contiguous: NumPy's
    assert np.array_equal(fn(strided, out=np.empty_like(strided)),
                          (np.exp2 if base == 2 else np.exp)(strided))
    monkeypatch.setenv("CUFLASH_BLAS", "numpy")
    assert _blas.normal_exp(dtype, base) is None


def test_mkl_matmul_copies_what_blas_cannot_read_in_place(mkl, monkeypatch):
    """Operands with no unit-stride axis, or heads in reverse (a negative batch stride), went to NumPy's matmul: its
    BLAS rounds otherwise than MKL, so a call's bits hung on the layout of the caller's arrays (a strided V changed
    a third of the output). They are copied and multiplied by MKL, with the bits of their contiguous copies."""
    lib, calls = mkl
    monkeypatch.setattr(_blas, "MKL_MIN_MACS", 0)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 40, 30)).astype(np.float32)
    b = rng.standard_normal((4, 30, 20)).astype(np.float32)
    for name, (x, y) in {"no contiguous axis": (a[:, ::2, ::2], b[:, ::2, :]), "heads in reverse": (a, b[::-1])}.items():
        calls.clear()
        got = _blas._mkl_matmul(lib, x, y)
        assert calls, name
        calls.clear()
        assert np.array_equal(got, _blas._mkl_matmul(lib, x.copy(), y.copy())) and calls, name


def test_mkl_matmul_hands_numpy_what_blas_cannot_take(mkl, monkeypatch):
    lib, calls = mkl
    monkeypatch.setattr(_blas, "MKL_MIN_MACS", 0)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 40, 30)).astype(np.float32)
    b = rng.standard_normal((4, 30, 20)).astype(np.float32)
    cases = {
        "mixed dtypes": (a, b.astype(np.float64)),
        "float16": (a.astype(np.float16), b.astype(np.float16)),
        "out overlaps a": (a, b),
        "out's matrices interleave": (a, b),  # batch stride < ldc * m: MKL refused it and wrote nothing
    }
    for name, (x, y) in cases.items():
        calls.clear()
        out = None
        if name == "out's matrices interleave":
            out = np.zeros((40, 4, 20), np.float32).transpose(1, 0, 2)
        if name == "out overlaps a":
            x = np.zeros((4, 40, 40), np.float32)
            x[..., :30] = a
            out, x = x[..., 20:40], x[..., :30]
            y = rng.standard_normal((4, 30, 20)).astype(np.float32)
        expect = np.matmul(x.copy(), y.copy())
        got = _blas._mkl_matmul(lib, x, y, out=out)
        assert not calls, name
        assert np.array_equal(got, expect), name


@pytest.mark.parametrize("choice, vendor, says", [
    ("auto", "GenuineIntel", "in Intel MKL (CUFLASH_BLAS=auto)"),
    ("auto", "AuthenticAMD",
     "in NumPy's BLAS (CUFLASH_BLAS=auto, MKL taken on Intel's CPUs only, this one: AuthenticAMD)"),
    ("auto", "", "this one: unknown"), ("numpy", "GenuineIntel", "in NumPy's BLAS (CUFLASH_BLAS=numpy)"),
    ("mkl", "AuthenticAMD", "in Intel MKL (CUFLASH_BLAS=mkl)"),
    ("openblas", "", "CUFLASH_BLAS='openblas' is not valid")])
def test_backend_list_says_which_blas_runs_the_products(mkl, monkeypatch, choice, vendor, says):
    """``python -m cuflash`` lists the NumPy backend with the BLAS of its products and why; a malformed variable is
    said there, not raised (the list also goes into error messages)."""
    from cuflash import backends

    monkeypatch.setenv("CUFLASH_BLAS", choice)
    monkeypatch.setattr(_blas, "cpu_vendor", lambda: vendor)
    ok, why = backends.status()["numpy"]
    assert ok and says in why


def test_backend_list_without_mkl_says_it_is_not_installed(monkeypatch):
    from cuflash import backends

    monkeypatch.setenv("CUFLASH_BLAS", "auto")
    monkeypatch.setattr(_blas, "_load_mkl", lambda: (None, "the mkl package is not installed"))
    monkeypatch.setattr(_blas, "cpu_vendor", lambda: "GenuineIntel")
    assert "NumPy's BLAS (CUFLASH_BLAS=auto, the mkl package not installed)" in backends.status()["numpy"][1]


def test_the_command_lines_environment_check_refuses_mkl_where_it_does_not_load(monkeypatch):
    """CUFLASH_BLAS=mkl without the mkl package: the entry points' first step (cuflash._env.check_all) let the
    well-formed value through, and `python -m cuflash` listed the NumPy backend, then failed in a traceback (the
    benchmarks recorded every case as failed). Now it is the one-line error naming the variable, up front."""
    from cuflash import _env

    monkeypatch.setattr(_blas, "_load_mkl", lambda: (None, "the mkl package is not installed"))
    monkeypatch.setenv("CUFLASH_BLAS", "mkl")
    with pytest.raises(ValueError, match="CUFLASH_BLAS=mkl, but the mkl package is not installed"):
        _env.check_all()
    monkeypatch.setenv("CUFLASH_BLAS", "auto")  # auto falls back to NumPy's BLAS: nothing to refuse
    _env.check_all()


def test_cpu_vendor_parses_cpuinfo(tmp_path):
    """The vendor string ``auto`` decides by: Linux's ``vendor_id`` line; "" (no MKL by default) where unreadable."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\nprocessor\t: 1\n"
                    "vendor_id\t: AuthenticAMD\n")
    assert _blas.cpu_vendor(str(info)) == "AuthenticAMD"
    other = tmp_path / "cpuinfo-arm"
    other.write_text("processor\t: 0\nmodel name\t: some ARM core\n")
    assert _blas.cpu_vendor(str(other)) == ""
    assert _blas.cpu_vendor(str(tmp_path / "absent")) == ""


@pytest.mark.parametrize("choice, vendor, used", [
    ("mkl", "GenuineIntel", True), ("mkl", "AuthenticAMD", True), ("numpy", "GenuineIntel", False),
    ("auto", "GenuineIntel", True), ("auto", "AuthenticAMD", False), ("auto", "", False)])
def test_backend_products_follow_cuflash_blas(mkl, monkeypatch, choice, vendor, used):
    """``auto`` takes MKL on Intel's CPUs only (slower than OpenBLAS on AMD's: ``_blas._mkl``); an explicit choice
    holds on every CPU."""
    lib, calls = mkl
    monkeypatch.setenv("CUFLASH_BLAS", choice)
    monkeypatch.setattr(_blas, "cpu_vendor", lambda: vendor)
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 700, 2, 64)).astype(np.float32) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend="numpy")
    cuflash.attention_backward(do, q, k, v, out, lse, causal=True, backend="numpy")
    assert bool(calls) == used


def _float64_case(name):
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 812, 2, 16)) for _ in range(4))
    # window: query 811 (the last) sees one key of its block's first tile, every other query of that block more,
    # so that block starts on the online max and switches to shift 0 after that tile
    options = {"causal": dict(causal=True), "window": dict(window=(300, 0))}.get(name, {})
    if name == "inf in v":  # the guarded product
        v[0, 600, 1, 3] = np.inf
    from cuflash.testing import Case

    return Case(q, k, v, do, options=options)


@pytest.mark.parametrize("name", ["plain", "causal", "window", "online max", "inf in v"])
def test_float64_forward_on_mkl_sums_rows_in_the_product(mkl, monkeypatch, name):
    """float64 on MKL takes l from P [V | 1] (``_rowsum_in_pv``): held to the rule in every path of the forward
    (shift 0, the online max, row strips of partial tiles, the guarded product), with dropout on the ``gemv``."""
    from cuflash.backends import numpy as nb
    from cuflash.testing import check_forward

    monkeypatch.setenv("CUFLASH_BLAS", "mkl")
    taken = []
    fold = nb._rowsum_in_pv
    monkeypatch.setattr(nb, "_rowsum_in_pv", lambda *a: taken.append(fold(*a)) or taken[-1])
    if name == "online max":  # as for scores past the bounds (_Bounds), without a softmax too peaked to tell
        monkeypatch.setattr(nb._Bounds, "applies", staticmethod(lambda problem: False))
    case = _float64_case(name)
    with np.errstate(invalid="ignore"):
        if name == "inf in v":  # IEEE: NaN and infinity exactly where the reference has them
            out = cuflash.attention(case.q, case.k, case.v, backend="numpy")
            ref = cuflash.reference.attention(case.q, case.k, case.v)
            np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
            np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
            assert np.isfinite(out).sum() == np.isfinite(ref).sum() > out.size // 2
        else:
            check_forward(lambda *a, **o: cuflash.attention(*a, **o, return_lse=True, backend="numpy"), case)
    assert taken == [True]
    cuflash.attention(case.q, case.k, case.v, dropout_p=0.1, seed=1, backend="numpy")
    assert taken == [True, False]


@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
def test_a_call_through_mkl_has_the_same_bits_whatever_the_inputs_layout(mkl, monkeypatch, which):
    """Under MKL an input whose head-dim axis is not unit-stride (every other column of a wider buffer) sent its
    products to NumPy's BLAS: a strided V changed 336,774 of 384,000 output elements, a strided Q dK, a strided K dQ,
    a strided dout dV. Forward and backward now have the contiguous inputs' bits."""
    import cuflash

    monkeypatch.setenv("CUFLASH_BLAS", "mkl")
    rng = np.random.default_rng(0)
    a = {n: rng.standard_normal((1, 300, 2, 48)).astype(np.float32) for n in ("q", "k", "v", "dout")}
    out, lse = cuflash.attention(a["q"], a["k"], a["v"], return_lse=True, backend="numpy")
    want = (out,) + cuflash.attention_backward(a["dout"], a["q"], a["k"], a["v"], out, lse, backend="numpy")
    wide = np.empty(a[which].shape[:-1] + (96,), np.float32)[..., ::2]
    wide[...] = a[which]
    b = dict(a, **{which: wide})
    out2, lse2 = cuflash.attention(b["q"], b["k"], b["v"], return_lse=True, backend="numpy")
    got = (out2,) + cuflash.attention_backward(b["dout"], b["q"], b["k"], b["v"], out, lse, backend="numpy")
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)

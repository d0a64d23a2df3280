"""What every GPU test module starts with: CuPy or a clean skip, a usable GPU or a clean skip,
and the dtypes this CuPy can hold (bfloat16 needs CuPy's ml_dtypes support)."""
import zlib

import numpy as np
import pytest


def _cupy_takes_bf16(cp) -> bool:
    try:
        import ml_dtypes

        cp.asarray(np.zeros(2, ml_dtypes.bfloat16))
        return True
    except Exception:
        return False


def setup():
    """``(cupy, pytestmark, dtypes)`` for a GPU test module (raises pytest's skip without CuPy)."""
    cp = pytest.importorskip("cupy", reason="CuPy is not installed: GPU tests skipped")
    from cuflash.backends import cuda

    ok, why = cuda.available()
    marks = [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=f"no usable GPU: {why}")]
    dtypes = ("float16", "bfloat16") if ok and _cupy_takes_bf16(cp) else ("float16",)
    return cp, marks, dtypes


def _derandomized() -> bool:
    from hypothesis import settings

    return bool(settings.default.derandomize)


def sharded(strategy, *, max_examples: int, shards: int):
    """``@given(strategy)`` as ``shards`` tests of ``max_examples / shards`` examples each, so that pytest-xdist spreads
    one long property over its workers: the GPU suite's wall time is no less than its longest test (the second H100
    run: 278 s, 222 of them one 200-example property). Under a derandomized profile (ci, what gpu_session.sh runs)
    shard n draws from a seed of its own, the test's name and n: the same examples on every run, other ones in
    every shard and every test; other profiles draw at random, as for any other property."""
    from hypothesis import HealthCheck, given, seed, settings

    def decorate(check):
        salt = zlib.crc32(f"{check.__module__}.{check.__qualname__}".encode()) * 1000

        @pytest.mark.parametrize("shard", range(shards))
        def test(shard):
            @settings(max_examples=-(-max_examples // shards), deadline=None, suppress_health_check=list(HealthCheck))
            @given(strategy)
            def run(case):
                check(case)

            (seed(salt + shard)(run) if _derandomized() else run)()

        test.__name__, test.__doc__, test.__module__ = check.__name__, check.__doc__, check.__module__
        return test

    return decorate

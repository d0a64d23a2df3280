"""What every GPU test module starts with: CuPy or a clean skip, a usable GPU or a clean skip,
and the dtypes this CuPy can hold (bfloat16 needs CuPy's ml_dtypes support)."""
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

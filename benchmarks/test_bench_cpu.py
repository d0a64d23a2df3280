"""CPU cases (NumPy backend and the CPU baselines); they run anywhere.

``test_product`` is the NumPy backend's target configuration: fp32, N = 4096, 4 heads,
head_dim 64, forward — at least 4x faster than naive NumPy (``numpy``) and within 3x of
PyTorch's CPU SDPA (``torch-flash``, SDPA's own choice for fp32 on the CPU).
"""
import pytest

from benchmarks.cases import OPS, PRODUCT_IMPLS, Case, fa_config, product_case
from benchmarks.conftest import run_case


@pytest.mark.parametrize("impl", PRODUCT_IMPLS)
def test_product(benchmark, impl):
    benchmark.group = "product: fp32 N=4096 H=4 d=64 fwd"
    run_case(benchmark, product_case(), impl, rounds=5)


@pytest.mark.parametrize("impl", ["cuflash", "numpy", "torch-flash", "torch-math"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_throughput(benchmark, impl, op, causal):
    n, d = 1024, 64
    b, h = fa_config(n, d, tokens=2048, hidden=256)
    benchmark.group = f"throughput {op} N={n} d={d} {'causal' if causal else 'full'}"
    run_case(benchmark, Case("throughput", "cpu", op, "float32", b, h, n, n, d, causal=causal), impl, rounds=5)


@pytest.mark.parametrize("density", [1.0, 0.5, 0.25])
def test_block_sparse(benchmark, density):
    from cuflash.backends.numpy import BLOCK_K, BLOCK_Q

    benchmark.group = "block-sparse fwd N=2048"
    case = Case("blocksparse", "cpu", "fwd", "float32", 1, 4, 2048, 2048, 64, density=density,
                      mask_block=(BLOCK_Q, BLOCK_K))
    run_case(benchmark, case, "cuflash", rounds=5)


@pytest.mark.parametrize("block_k", [128, 256, 512, 1024, 2048])
def test_tile_sweep(benchmark, block_k):
    benchmark.group = "tiles: numpy backend block_k, fwd N=2048"
    case = Case("tiles", "cpu", "fwd", "float32", 1, 4, 2048, 2048, 64, block_k=block_k)
    run_case(benchmark, case, "cuflash", rounds=5)


@pytest.mark.parametrize("impl", ["cuflash", "numpy", "torch-flash"])
@pytest.mark.parametrize("seqlen_q", [1, 16])
def test_decode(benchmark, impl, seqlen_q):
    benchmark.group = f"decode Sq={seqlen_q} Sk=16384"
    run_case(benchmark, Case("decode", "cpu", "fwd", "float32", 1, 8, seqlen_q, 16384, 64), impl, rounds=5)


@pytest.mark.parametrize("path", ["per-element", "column-run"])
def test_dropout_keep_mask(benchmark, path):
    """The keep-mask of one forward tile (2 heads x 512 x 512): the per-element rule (each column computes the whole
    Philox block of its four) against the column run the NumPy backend asks for (each block once)."""
    import numpy as np

    from cuflash.dropout import keep_mask

    benchmark.group = "dropout keep-mask of a 2 x 512 x 512 tile"
    b, h = np.zeros((1, 1, 1, 1), np.int64), np.arange(2).reshape(1, 2, 1, 1)
    i, j = np.arange(512).reshape(1, 1, -1, 1), np.arange(512).reshape(1, 1, 1, -1)
    if path == "per-element":  # the same columns, not recognisable as a run: the generic path
        j = j + np.zeros((1, 1, 512, 1), np.int64)
    benchmark.pedantic(keep_mask, args=(1234, 0.1, b, h, i, j), rounds=5, warmup_rounds=1)

"""GPU cases: cuflash's CUDA kernels beside PyTorch SDPA, JAX and CuPy standard attention.

The FA benchmark configuration (batch = 16384 / seqlen, heads = 2048 / head_dim, fp16). Marked
``gpu``: skipped without CuPy and a GPU. ``python -m benchmarks.run --full`` measures the same cases
(and the figures' sweeps) and writes the JSON and plots; this suite is for pytest-benchmark's
comparisons between runs (``--benchmark-autosave``, ``--benchmark-compare``).
"""
import pytest

from benchmarks.cases import GPU_IMPLS, OPS, Case, fa_config
from benchmarks.conftest import run_case

pytestmark = pytest.mark.gpu

SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
IMPLS = list(GPU_IMPLS)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("op", OPS)
def test_throughput(benchmark, op, causal, head_dim, seqlen, impl):
    b, h = fa_config(seqlen, head_dim, tokens=16384, hidden=2048)
    benchmark.group = f"{op} d={head_dim} {'causal' if causal else 'full'} N={seqlen}"
    case = Case("throughput", "cuda", op, "float16", b, h, seqlen, seqlen, head_dim, causal=causal)
    run_case(benchmark, case, impl, rounds=20, warmup=2)


@pytest.mark.parametrize("impl", ["cuflash", "cupy-standard", "torch-math", "torch-flash"])
@pytest.mark.parametrize("seqlen", [1024, 4096, 16384, 32768])
def test_memory(benchmark, seqlen, impl):
    b, h = fa_config(seqlen, 64, tokens=16384, hidden=2048)
    benchmark.group = f"memory fwd d=64 N={seqlen}"
    run_case(benchmark, Case("memory", "cuda", "fwd", "float16", b, h, seqlen, seqlen, 64), impl, rounds=10)


@pytest.mark.parametrize("op", ["fwd", "bwd"])
@pytest.mark.parametrize("density", [1.0, 0.5, 0.25, 0.125, 0.0625])
def test_block_sparse(benchmark, density, op):
    benchmark.group = f"block-sparse {op} N=4096"
    case = Case("blocksparse", "cuda", op, "float16", 4, 32, 4096, 4096, 64, density=density,
                      mask_block=(128, 128))
    run_case(benchmark, case, "cuflash", rounds=20, warmup=2)


@pytest.mark.parametrize("block_k", [32, 64, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tile_sweep(benchmark, head_dim, block_k):
    b, h = fa_config(4096, head_dim, tokens=16384, hidden=2048)
    benchmark.group = f"tiles fwd d={head_dim} N=4096"
    case = Case("tiles", "cuda", "fwd", "float16", b, h, 4096, 4096, head_dim, block_k=block_k)
    run_case(benchmark, case, "cuflash", rounds=20, warmup=2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seqlen_q", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("seqlen_k", [16384, 65536])
def test_decode(benchmark, seqlen_k, seqlen_q, impl):
    benchmark.group = f"decode Sk={seqlen_k} Sq={seqlen_q}"
    case = Case("decode", "cuda", "fwd", "float16", 4, 32, seqlen_q, seqlen_k, 128)
    run_case(benchmark, case, impl, rounds=20, warmup=2)

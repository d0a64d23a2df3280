"""GPU: the forward kernel with dropout beside the same call without (issue 7: dropout may cost at most 15% of
forward time). Marked ``gpu``: skipped without CuPy and a GPU.

Each pytest-benchmark group holds one shape (the FA configuration: 16384 tokens, hidden 2048, fp16) with
``dropout_p`` 0 and 0.1 (the cost does not depend on p: every tile generates its keep bits either way), so
``--benchmark-compare`` or the group table shows the overhead directly; ``extra_info`` carries
:class:`benchmarks.report.Record` (median ms from CUDA events, TFLOP/s) plus ``dropout_p``.
"""
from dataclasses import asdict

import pytest

from benchmarks.cases import Case, fa_config
from benchmarks.inputs import make_inputs
from benchmarks.report import Record
from benchmarks.timing import Timer, release_memory

pytestmark = pytest.mark.gpu

SEED = 0x9E3779B97F4A7C15


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("seqlen", [1024, 4096, 16384])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_dropout_overhead(benchmark, causal, head_dim, seqlen, dropout_p):
    import cupy

    import cuflash

    b, h = fa_config(seqlen, head_dim, tokens=16384, hidden=2048)
    benchmark.group = f"fwd dropout d={head_dim} {'causal' if causal else 'full'} N={seqlen}"
    case = Case("dropout", "cuda", "fwd", "float16", b, h, seqlen, seqlen, head_dim, causal=causal)
    x = make_inputs(case)
    opts = dict(causal=causal, dropout_p=dropout_p, seed=SEED if dropout_p else None)

    def run():
        return cuflash.attention(x.q, x.k, x.v, **opts)

    def sync(result=None):
        cupy.cuda.get_current_stream().synchronize()

    for _ in range(3):  # compilation, caches
        sync(run())
    timer = Timer(run, sync, device="cuda")
    benchmark.pedantic(timer.sample, rounds=20, iterations=1, warmup_rounds=0)
    record = Record.of(case, "cuflash", timer, None, None)
    benchmark.extra_info.update(asdict(record))
    benchmark.extra_info.update(dropout_p=dropout_p, timer="cuda-events")
    release_memory("cuda")

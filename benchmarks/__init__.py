"""cuflash's benchmarks: its speed beside what users would pick instead, in one process.

Lives outside the package on purpose: ``cuflash`` never imports it. Run from a checkout::

    python -m benchmarks.run --quick|--full [--out DIR] ...

Modules, one job each:

- :mod:`benchmarks.cases`        what is measured: :class:`~benchmarks.cases.Case`, the suites per device and mode
- :mod:`benchmarks.inputs`       the arrays of a case on its device
- :mod:`benchmarks.environment`  device, versions and commit probes
- :mod:`benchmarks.impls`        adapters: cuflash, standard attention (NumPy/CuPy), PyTorch SDPA, JAX
- :mod:`benchmarks.timing`       timer (CUDA events / ``perf_counter``) and peak-memory observation
- :mod:`benchmarks.report`       records, the JSON files and the text table
- :mod:`benchmarks.plots`        the PNG figures (matplotlib, optional)
- :mod:`benchmarks.run`          the runner and its command line
- :mod:`benchmarks.session`      the probes and ``session.json`` of ``gpu_session.sh``

Figures (the FlashAttention papers' headline plots), each written to ``--out`` as its own JSON and,
when matplotlib is importable, a PNG:

1. ``throughput``   forward, backward, forward+backward TFLOP/s vs seqlen, FA configuration
                    (batch = tokens/seqlen, heads = hidden/head_dim; 16384 and 2048 on a GPU)
2. ``memory``       speedup and peak memory vs standard attention as N grows, until it runs out
3. ``blocksparse``  runtime vs BlockMask density (FA Figure 2, right)
4. ``tiles``        forward runtime vs key-block size (FA Figure 2, middle)
5. ``decode``       seqlen_q 1..16 against a long KV: GB/s

plus ``product``: the NumPy backend's target case (fp32, N = 4096, 4 heads, head_dim 64, forward)
against naive NumPy and PyTorch's CPU SDPA.

Timing: on a GPU, CUDA events around a timed function that ends by synchronizing the device
(each library its own way), after warm-up; on the CPU ``time.perf_counter``. Each sample runs
``calls`` back-to-back calls (enough for about a millisecond, so one synchronization does not
dominate a small case); a record's ``ms`` is the median over samples, per call.

FLOPs (FA convention): ``4·B·H·Sq·Sk·d``, halved for causal when ``Sq == Sk``, times the
BlockMask density, ×2.5 for ``bwd`` and ×3.5 for ``fwd_bwd``. ``gbps`` divides the compulsory
bytes (every input read once, every output written once) by the time; in a decode case that is
almost all K/V. ``io_bytes`` is :func:`cuflash.io_cost`'s model of the bytes the impl's algorithm
moves (the tiled ledger for cuflash's CUDA kernel, Algorithm 0's for standard attention), null
where no model applies. ``peak_bytes``: extra memory one call allocates beyond its inputs — the
CuPy memory pool's high-water mark (``torch.cuda.max_memory_allocated`` for PyTorch) on a GPU,
``tracemalloc``'s peak on the CPU; null where it cannot be observed (JAX, PyTorch on the CPU).
"""

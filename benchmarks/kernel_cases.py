"""Every CUDA kernel family, run once, for compute-sanitizer and ncu (``benchmarks/gpu_session.sh sanitize|profile``).

    python -m benchmarks.kernel_cases              # small shapes, every family (what the sanitizer tools run)
    python -m benchmarks.kernel_cases --profile    # the main kernels at the benchmark's shapes (what ncu profiles)
    python -m benchmarks.kernel_cases --list       # the case names
    options: --only NAME[,NAME...]   --no-pool (CuPy allocates each array apart: memcheck then sees the bounds of
             every allocation, not of the memory pool's blocks)   --backend emulate (the CPU emulator; slow)

Small shapes have lengths that are not multiples of any tile (partial tiles, masked rows), and each family's every
native head dim where the family has a table row per head dim, so each specialization the tables select for these
shapes runs at least once. Each case prints one line; an exception ends the run non-zero (so the sanitizer's exit
status and the script's say the same).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from typing import Callable, Optional

import numpy as np

from cuflash import _env

from .inputs import numpy_dtype

HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def _inputs(xp, b, sq, sk, h, hkv, d, dtype, seed=0):
    rng = np.random.default_rng(seed)

    def arr(s, heads):
        return xp.asarray(rng.standard_normal((b, s, heads, d)).astype(np.float32).astype(dtype))

    return arr(sq, h), arr(sk, hkv), arr(sk, hkv), arr(sq, h)


def _fwd_bwd(xp, backend, *, b=1, sq=100, sk=100, h=2, hkv=1, d=64, dtype="float16", deterministic=False,
             **options):
    """Forward with the lse, then the backward (``deterministic``: its dQ pass instead of atomic adds)."""
    import cuflash

    q, k, v, do = _inputs(xp, b, sq, sk, h, hkv, d, numpy_dtype(dtype))
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend, **options)
    cuflash.attention_backward(do, q, k, v, out, lse, backend=backend, deterministic=deterministic, **options)


def _decode(xp, backend):
    import cuflash

    q, _, _, _ = _inputs(xp, 2, 1, 1, 4, 2, 64, np.float16)
    _, k, v, _ = _inputs(xp, 2, 1, 1000, 4, 2, 64, np.float16, seed=1)
    lens = xp.asarray(np.array([1000, 517], np.int32))
    cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lens, backend=backend)


def _varlen(xp, backend):
    import cuflash

    rng = np.random.default_rng(2)
    cu = np.array([0, 37, 137, 140], np.int32)
    q, k, v = (xp.asarray(rng.standard_normal((140, 2, 64)).astype(np.float16)) for _ in range(3))
    cu = xp.asarray(cu)
    cuflash.attention_varlen(q, k, v, cu, cu, causal=True, backend=backend)


def _block_mask(xp, backend):
    from cuflash import BlockMask

    # whole blocks skipped, partial ones with an element rule (document x causal, as the compile check's modifier)
    mask = BlockMask.document(np.arange(200) // 70, block=(64, 64)) & BlockMask.causal(200, block=(64, 64))
    _fwd_bwd(xp, backend, sq=200, sk=200, block_mask=mask)


def small_cases() -> dict[str, Callable]:
    """name -> case(xp, backend): every kernel family at small shapes."""
    cases: dict[str, Callable] = {}
    for d in HEAD_DIMS:  # the 16-bit forward, backward and dq kernels: one table row per head dim
        cases[f"f16-d{d}-causal"] = lambda xp, be, d=d: _fwd_bwd(xp, be, d=d, causal=True)
    # bfloat16 where NumPy can hold it (ml_dtypes: the test extra, and the GPU machines), else float16
    name, dtype = ("bf16", "bfloat16") if importlib.util.find_spec("ml_dtypes") else ("f16", "float16")
    cases[f"{name}-d64-gqa-window"] = lambda xp, be: _fwd_bwd(xp, be, sq=90, sk=130, h=4, hkv=2, dtype=dtype,
                                                              window=(40, 7))
    cases["f16-d64-deterministic"] = lambda xp, be: _fwd_bwd(xp, be, causal=True, deterministic=True)
    cases["f16-d64-dropout"] = lambda xp, be: _fwd_bwd(xp, be, dropout_p=0.1, seed=3)
    cases["f16-d64-mods"] = lambda xp, be: _fwd_bwd(xp, be, softcap=30.0, mask_mod="keep[kv_idx]",
                                                    mod_arrays={"keep": xp.asarray(np.arange(100) % 3 != 1)})
    cases["f16-d64-blockmask"] = _block_mask
    cases["f16-d64-seqlens"] = lambda xp, be: _fwd_bwd(xp, be, b=2, seqlens_q=xp.asarray(np.array([100, 31], np.int32)),
                                                       seqlens_k=xp.asarray(np.array([57, 100], np.int32)))
    cases["f16-varlen"] = _varlen
    cases["f16-decode-split-kv"] = _decode
    for dtype, precision in (("float32", "ieee"), ("float32", "3xtf32"), ("float32", "tf32"), ("float64", "ieee")):
        for d in (64, 128):  # the float32/float64 kernels; head_dim 128 with the deterministic backward
            cases[f"{dtype}-{precision}-d{d}"] = lambda xp, be, dt=dtype, p=precision, d=d: _fwd_bwd(
                xp, be, d=d, dtype=dt, precision=p, causal=True, deterministic=d == 128)
    return cases


def _sparse(xp, backend, *, density=1 / 16):
    """The benchmark's block-sparse case (fig3_blocksparse): B 4, H 32, N 4096, d 64, 128 x 128 blocks, the same
    number of kept blocks in every row (benchmarks.inputs.density_mask)."""
    from .cases import Case
    from .inputs import density_mask

    case = Case("blocksparse", "cuda", "fwd", "float16", 4, 32, 4096, 4096, 64, density=density, mask_block=(128, 128))
    _fwd_bwd(xp, backend, b=4, sq=4096, sk=4096, h=32, hkv=32, block_mask=density_mask(case, seed=0))


def profile_cases() -> dict[str, Callable]:
    """The main kernels at the FlashAttention papers' benchmark shape (16k tokens: batch 4 x 4096, 16 heads),
    float16: forward and backward, head_dim 64 and 128, causal and not (ncu takes the launches it is told to); then
    the two shapes where the H200 run's times held a fixed 0.67-0.90 ms a call at 4096 thread blocks (N = 512 at
    batch 32, and block-sparse at density 1/16): ncu's kernel durations beside the benchmark's times say how much
    of it is the kernels' own."""
    cases: dict[str, Callable] = {}
    for d in (64, 128):
        for causal in (False, True):
            cases[f"f16-d{d}-n4096{'-causal' if causal else ''}"] = lambda xp, be, d=d, c=causal: _fwd_bwd(
                xp, be, b=4, sq=4096, sk=4096, h=2048 // d, hkv=2048 // d, d=d, causal=c)
    cases["f16-d64-n512-b32"] = lambda xp, be: _fwd_bwd(xp, be, b=32, sq=512, sk=512, h=32, hkv=32)
    cases["f16-d64-n4096-sparse16"] = _sparse
    return cases


def _backend_unusable(name: str) -> Optional[str]:
    """Why cuflash's backend ``name`` cannot run here (None where it can), in one line: what its first call would
    raise (no GPU: a CUDARuntimeError traceback from the first array)."""
    try:
        ok, why = importlib.import_module(f"cuflash.backends.{name}").available()
    except ImportError as exc:
        ok, why = False, f"cannot be imported ({exc})"
    return None if ok else (str(why).strip().splitlines() or [""])[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_cases", description=__doc__.splitlines()[0])
    p.add_argument("--profile", action="store_true", help="the main kernels at the benchmark's shapes")
    p.add_argument("--list", action="store_true", help="print the case names and stop")
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--no-pool", action="store_true", help="no CuPy memory pool")
    p.add_argument("--backend", choices=("cuda", "emulate"), default="cuda")
    args = p.parse_args(argv)
    if args.no_pool and args.backend != "cuda":  # the emulator has no CuPy pool: the option would do nothing
        p.error("--no-pool is CuPy's (backend cuda); the emulated kernels allocate no pool")
    cases = profile_cases() if args.profile else small_cases()
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]  # "a," names a alone
        if not wanted:
            p.error(f"--only names no case in {args.only!r}; the cases are {', '.join(cases)}")
        unknown = sorted(set(wanted) - set(cases))
        if unknown:
            p.error(f"--only: unknown case(s) {', '.join(unknown)}; the cases are {', '.join(cases)}")
        cases = {name: cases[name] for name in wanted}
    if args.list:
        print("\n".join(cases))
        return 0
    # refused in one line before the first case, as benchmarks.host_cost does: the environment as `python -m cuflash`
    # checks it (CUFLASH_EMULATE_ARCH=75 was a ValueError traceback), then the backend (no GPU: CUDARuntimeError)
    try:
        _env.check_all()
    except ValueError as exc:
        p.exit(2, f"{p.prog}: error: {exc}\n")
    why = _backend_unusable(args.backend)
    if why is not None:
        p.exit(2, f"{p.prog}: error: --backend {args.backend} cannot run here: {why}\n")
    if args.backend == "cuda":
        import cupy as xp

        if args.no_pool:
            xp.cuda.set_allocator(None)
            xp.cuda.set_pinned_memory_allocator(None)
    else:
        xp = np
    for name, case in cases.items():
        t0 = time.perf_counter()
        case(xp, args.backend)
        if xp is not np:
            xp.cuda.Device().synchronize()
        print(f"{name}: ok ({time.perf_counter() - t0:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The NumPy backend against PyTorch's CPU SDPA and naive NumPy, in one process, and its memory.

    python -m benchmarks.numpy_backend --out benchmarks/results/cpu-amd-epyc-2c/numpy_backend.json
    python -m benchmarks.numpy_backend --quick          # N = 4096 only, fewer rounds
    python -m benchmarks.numpy_backend --quick --threads 1 --no-memory --out .../numpy_backend_1thread.json
    python -m benchmarks.numpy_backend --quick --backward --no-memory --out .../numpy_backend_fwd_bwd.json
    python -m benchmarks.numpy_backend --no-speed --out .../numpy_backend_memory.json   # the memory grid alone

An existing ``--out`` file is refused unless ``--replace`` is given (as ``benchmarks.run`` refuses another run's
figures), and the ``--out`` path, the options and the ``CUFLASH_*`` environment are checked before anything is measured.

Speed: forward, batch 1, 4 heads, head_dim 64 and 128, causal and not, float32 at N = 4096 and
16384 and float64 at N = 4096. Each case is timed in rounds, the implementations in turn within a
round (each implementation first in one round after another), so that a machine whose speed drifts (other
processes) slows all of them alike; the ratio cuflash / torch is taken round by round and its median reported, next
to each implementation's median and best wall time and every round's time (``ms_rounds``). PyTorch gets its own
layout, (B, H, S, D) contiguous, as cuflash gets its (B, S, H, D), both copied before any timing; no garbage
collection falls inside a timed call. Every implementation uses all cores: cuflash its
worker threads, PyTorch ``torch.set_num_threads``, naive NumPy its multithreaded BLAS. Each timed call
follows a pause of :data:`IDLE_S` and an untimed call of the same implementation: OpenBLAS's and OpenMP's
worker threads keep spinning for a while after a parallel call (OpenBLAS's for about 2^28 cycles), and on 2
cores the threads of the implementation timed just before took a core from the next one (measured: cuflash
132 ms alone against torch, 166 ms right after the naive multithreaded GEMMs; with an untimed call between
them still 60.4 ms alone against 67.1 ms for a causal float32 forward at N = 4096, d = 64, and 57.4 ms after
a pause of 0.3 s).

With ``--threads 1`` every implementation runs on one core and two float32 yardsticks join them: the ``floor``
loop (the products, ``exp2`` and row sums of cuflash's tiles and nothing else: see :func:`floor_loop`) and
``products`` (the two products of those tiles alone), so that the distance of cuflash from what NumPy's
separate passes must cost, of that floor from PyTorch's fused kernel, and the share that BLAS alone takes,
are measured apart from the scheduling of two threads on a shared machine.

Memory: the peak extra memory of the forward and the backward over a grid of B·H and N, next to the naive score
matrix (B·H·N² floats) and one (B, N, H, d) array, two ways: tracemalloc's peak (NumPy registers its buffers: what
cuflash allocates, to the byte) and the growth of the resident set in a fresh process (:func:`rss_case`: what
the operating system sees, the BLAS's own buffers and the threads' stacks included).

PyTorch is optional (``pip install torch``); without it the torch columns are skipped.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import stat
import statistics
import subprocess
import sys
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

import cuflash
from cuflash import _env
from cuflash.backends import numpy as nb

from . import environment


#: Seconds of idle time before each implementation's calls in a round (see the module docstring).
IDLE_S = 0.3


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _torch(threads):
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 -- ImportError, or a broken install's OSError: no torch column
        print(f"torch not importable ({type(exc).__name__}: {exc}): no torch column", file=sys.stderr)
        return None
    torch.set_num_threads(threads)
    return torch


def naive(q, k, v, causal):
    """softmax(q kᵀ·scale) v as written: S and P materialized, same dtype, multithreaded BLAS."""
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = (qh @ kh.transpose(0, 1, 3, 2)) * q.dtype.type(1 / math.sqrt(q.shape[-1]))
    if causal:
        np.copyto(s, -np.inf, where=np.triu(np.ones(s.shape[-2:], dtype=bool), 1))
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return (s @ vh).transpose(0, 2, 1, 3)


def floor_loop(q, k, v, causal, block=512, softmax=True):
    """What any NumPy implementation of the algorithm on cuflash's tiles must spend at least: the two products, the
    ``exp2`` and the row sums of each tile (base 2, scale folded into Q), and nothing else: no row max, no
    bookkeeping, a causal diagonal tile computed whole and its hidden part zeroed after ``exp2`` (cuflash cuts
    that tile into row strips: 3/8 fewer products there). One thread; float32; its output is attention only
    where no score overflows (a yardstick for time, not an implementation). ``softmax=False`` leaves out the
    ``exp2``, the mask and the row sums: the two products alone, BLAS's share of any such implementation."""
    n, heads, d = q.shape[1], q.shape[2], q.shape[3]
    kt = np.ascontiguousarray(k.transpose(0, 2, 3, 1))  # (B, H, d, N)
    ones = np.ones(block, dtype=q.dtype)
    upper = np.triu(np.ones((block, block), dtype=bool), 1)
    out = np.empty_like(q)
    for h in range(heads):
        for i0 in range(0, n, block):
            q_i = q[0, i0:i0 + block, h] * q.dtype.type(1 / math.sqrt(d) / math.log(2))
            l_i, acc = np.zeros(len(q_i), q.dtype), np.zeros((len(q_i), d), q.dtype)
            for k0 in range(0, min(i0 + block, n) if causal else n, block):
                s = q_i @ kt[0, h, :, k0:k0 + block]
                if softmax:
                    np.exp2(s, out=s)
                    if causal and k0 == i0:  # the diagonal tile: keys past the row are hidden
                        np.copyto(s, 0, where=upper[:s.shape[0], :s.shape[1]])
                    l_i += s @ ones[:s.shape[1]]
                acc += s @ v[0, k0:k0 + block, h]
            out[0, i0:i0 + block, h] = acc / l_i[:, None] if softmax else acc
    return out


def _blas_choice(choice, fn):
    """``fn`` run with ``CUFLASH_BLAS=choice`` (read by each backend call), the variable restored after."""
    def run():
        before = os.environ.get("CUFLASH_BLAS")
        os.environ["CUFLASH_BLAS"] = choice
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["CUFLASH_BLAS"]
            else:
                os.environ["CUFLASH_BLAS"] = before
    return run


def _products():
    """Which BLAS cuflash's tile products use here by default: "mkl" or "numpy" (NumPy's OpenBLAS)."""
    from cuflash.backends import _blas

    return "numpy" if _blas._mkl() is None else "mkl"


#: The implementation name of cuflash on each BLAS that is not the default one, timed beside it.
OTHER_BLAS = {"numpy": "cuflash_openblas", "mkl": "cuflash_mkl"}


def _other_blas():
    """The ``CUFLASH_BLAS`` choice that is not this machine's default, where it can run: MKL's products beside
    OpenBLAS's on a CPU where ``auto`` leaves MKL out (AMD's), OpenBLAS's beside MKL's; None without MKL."""
    from cuflash.backends import _blas

    if _products() == "mkl":
        return "numpy"
    return "mkl" if _blas._load_mkl()[0] is not None else None


def _with_other_blas(impls):
    """``impls`` with cuflash on the other BLAS (:func:`_other_blas`) beside cuflash, the same code side by side."""
    other = _other_blas()
    if other is not None:
        impls[OTHER_BLAS[other]] = _blas_choice(other, impls["cuflash"])
    return impls


def _torch_layout(torch, x):
    """``x`` (B, S, H, D) as the contiguous (B, H, S, D) tensor SDPA reads best, copied before any timing: each side
    gets its own layout, contiguous (a transposed view of cuflash's arrays cost PyTorch 2-3% on one thread)."""
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))


def _fwd_bwd_impls(torch, q, k, v, causal):
    """Forward and backward: cuflash's attention (with the lse) then attention_backward, PyTorch's SDPA then
    ``torch.autograd.grad`` of the same output gradient (PyTorch has no backward alone to call)."""
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(q.dtype)

    def ours():
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)

    impls = _with_other_blas({"cuflash": ours})
    if torch is not None:
        tq, tk, tv = (_torch_layout(torch, x).requires_grad_() for x in (q, k, v))
        tdo = _torch_layout(torch, dout)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        impls["torch"] = lambda: torch.autograd.grad(sdpa(tq, tk, tv, is_causal=causal), (tq, tk, tv), tdo)
    return impls


def _impls(torch, q, k, v, causal, with_naive, threads):
    impls = _with_other_blas({"cuflash": lambda: cuflash.attention(q, k, v, causal=causal)})
    if threads == 1 and q.dtype == np.float32:
        impls["floor"] = lambda: floor_loop(q, k, v, causal)
        impls["products"] = lambda: floor_loop(q, k, v, causal, softmax=False)
    if torch is not None:
        tq, tk, tv = (_torch_layout(torch, x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        impls["torch"] = lambda: sdpa(tq, tk, tv, is_causal=causal)
    if with_naive:
        impls["naive"] = lambda: naive(q, k, v, causal)
    return impls


def time_case(torch, dtype, n, d, causal, rounds, heads=4, threads=None, backward=False):
    """One case's timings; ``backward``: forward and backward (:func:`_fwd_bwd_impls`), else the forward."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, heads, d)).astype(dtype) for _ in range(3))
    with_naive = n <= 8192 and not backward  # 16384: the naive S of 4 heads would be 4 GiB
    impls = _fwd_bwd_impls(torch, q, k, v, causal) if backward else _impls(torch, q, k, v, causal, with_naive, threads)
    samples = {name: [] for name in impls}
    for f in impls.values():  # warm-up: caches, thread pools, first-touch pages
        f()
    names = list(impls)
    for r in range(rounds):
        gc.collect()  # a full collection (~0.1 s in this process) never falls inside a timed call
        for name in names[r % len(names):] + names[:r % len(names)]:  # each implementation first in turn
            time.sleep(IDLE_S)  # the previous implementation's BLAS threads stop spinning (see the module docstring)
            impls[name]()  # settle: caches, and this implementation's own thread pools
            gc.disable()
            try:
                t0 = time.perf_counter()
                impls[name]()
                samples[name].append(time.perf_counter() - t0)
            finally:
                gc.enable()
    rec = dict(dtype=np.dtype(dtype).name, seqlen=n, heads=heads, head_dim=d, causal=causal, rounds=rounds,
               passes="forward+backward" if backward else "forward",
               ms={name: round(1e3 * statistics.median(s), 2) for name, s in samples.items()},
               ms_best={name: round(1e3 * min(s), 2) for name, s in samples.items()},
               ms_rounds={name: [round(1e3 * t, 2) for t in s] for name, s in samples.items()})
    for other in ("torch", "naive", "floor", "products", *OTHER_BLAS.values()):
        if other in samples:
            rec[f"cuflash_over_{other}"] = round(statistics.median(
                a / b for a, b in zip(samples["cuflash"], samples[other])), 3)
    if not with_naive:
        rec["skipped"] = {"naive": "no backward" if backward else "its score matrix would need 4 GiB"}
    return rec


def _peak(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_rss_growth(fn):
    """``(fn(), bytes)``: how far the process's resident set rose above where it stood when ``fn`` began (Linux: the
    high-water mark ``VmHWM`` is reset through ``/proc/self/clear_refs`` first). Unlike tracemalloc, this sees every
    allocation (BLAS packing buffers, thread stacks, allocator slack) as the operating system does."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _status_kib("VmRSS")
    result = fn()
    return result, (_status_kib("VmHWM") - base) * 1024


def _inputs(batch, heads, n, d, dtype):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((batch, n, heads, d)).astype(dtype) for _ in range(4))


def rss_in_this_process(batch, heads, n, d=64, dtype="float32", causal=True):
    """Peak RSS growth of the forward and of the backward of one problem, measured in this process after a toy
    call of each (so that what a first call sets up once, the BLAS's buffers and the pool's threads among it, is
    not counted to the problem). Run it in a fresh process (:func:`rss_case`): a process that held larger arrays
    before may reuse freed pages without the resident set growing."""
    toy = _inputs(1, 1, 64, d, dtype)
    cuflash.attention_backward(toy[3], *toy[:3], *cuflash.attention(*toy[:3], causal=causal, return_lse=True),
                               causal=causal)
    q, k, v, do = _inputs(batch, heads, n, d, dtype)
    (out, lse), fwd = peak_rss_growth(lambda: cuflash.attention(q, k, v, causal=causal, return_lse=True))
    _, bwd = peak_rss_growth(lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal))
    return dict(fwd_rss_bytes=fwd, bwd_rss_bytes=bwd)


def rss_case(batch, heads, n, d=64, dtype="float32", causal=True):
    """:func:`rss_in_this_process` in a fresh Python process (this process's environment, CUFLASH_NUM_THREADS
    included); None where ``/proc/self/clear_refs`` is missing (not Linux)."""
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    code = ("import json, benchmarks.numpy_backend as b; "
            f"print(json.dumps(b.rss_in_this_process({batch}, {heads}, {n}, {d}, {dtype!r}, {causal})))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # glibc's fixed mmap threshold (its default, made static): every large buffer is then mapped when allocated and
    # unmapped when freed, so the high-water mark counts the buffers live together, not what the allocator keeps
    # of freed ones (its dynamic threshold would move later buffers of a few MiB onto a heap that never shrinks)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env)
    return json.loads(run.stdout.strip().splitlines()[-1])


def memory_case(batch, heads, n, d=64, dtype=np.float32, causal=True, rss=True):
    q, k, v, do = _inputs(batch, heads, n, d, dtype)
    (out, lse), fwd = _peak(lambda: cuflash.attention(q, k, v, causal=causal, return_lse=True))
    _, bwd = _peak(lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal))
    rec = dict(batch=batch, heads=heads, seqlen=n, head_dim=d, dtype=np.dtype(dtype).name, causal=causal,
               fwd_peak_bytes=fwd, bwd_peak_bytes=bwd, array_bytes=q.nbytes,
               naive_scores_bytes=batch * heads * n * n * np.dtype(dtype).itemsize)
    measured = rss_case(batch, heads, n, d, np.dtype(dtype).name, causal) if rss else None
    rec.update(measured or dict(fwd_rss_bytes=None, bwd_rss_bytes=None))
    return rec


def _meta(torch):
    # this checkout's commit and whether its tree differs from it, as benchmarks.run records them: `git rev-parse
    # HEAD` in the current folder recorded another repository's HEAD (or null) when run from outside the checkout,
    # and never that the code measured had uncommitted changes
    commit, dirty = environment.git_commit()
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from threadpoolctl import threadpool_info

    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit,
                dirty=dirty, cpu=cpu, cpu_flags=_cpu_flags(), cores=_cores(), argv=sys.argv[1:], idle_s=IDLE_S,
                environment={k: v for k, v in sorted(os.environ.items())
                             if k.startswith(("CUFLASH_", "OMP_", "MKL_", "OPENBLAS_", "MALLOC_"))},
                versions=dict(python=platform.python_version(), numpy=np.__version__, cuflash=cuflash.__version__,
                              torch=None if torch is None else torch.__version__, mkl=_version("mkl")),
                blas=[{k: pool.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                                 "threading_layer")} for pool in threadpool_info()],
                torch=None if torch is None else dict(threads=torch.get_num_threads(),
                                                      mkl=torch.backends.mkl.is_available(),
                                                      mkldnn=torch.backends.mkldnn.is_available()),
                products=_products(),
                tiles=dict(block_q=nb.BLOCK_Q, block_k=nb.BLOCK_K, tile_elements=nb.TILE_ELEMENTS,
                           backward_tile_elements=nb.BACKWARD_TILE_ELEMENTS))


def _cpu_flags():
    """The vector extensions that decide these kernels' speed, as /proc/cpuinfo lists them (None elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return sorted(f for f in flags if f.startswith(("avx", "fma", "amx")))


def _version(dist):
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_json(path, result, *, replace=True):
    """``result`` as indented JSON at ``path`` (folders made as needed). The file is written whole beside ``path``
    first and then put in its place, so that a failure (disk full, a kill) leaves no half-written JSON; with
    ``replace=False`` an existing ``path`` is never overwritten: a file that appeared there since :func:`check_out`
    is an OSError naming the temporary file that keeps the results."""
    os.makedirs(_folder(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}-{time.monotonic_ns()}.tmp"  # a name of this call's own: a kept one stays kept
    with open(tmp, "x") as f:  # "x": a file of that name is none of this call's, and stays untouched
        try:
            json.dump(result, f, indent=1)
            f.write("\n")
            f.flush()
        except BaseException:  # a half-written temporary file is no result: removed, the error goes on
            os.unlink(tmp)
            raise
    try:
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # unlike a rename, fails where path exists: nothing is overwritten unasked
            except FileExistsError:
                raise
            except OSError:  # a file system without hard links: an exclusive create, which also never overwrites
                with open(tmp) as src, open(path, "x") as dst:
                    dst.write(src.read())
            os.unlink(tmp)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror or exc}; the results are kept in {tmp}", path) from None
    print(f"wrote {path}")


def _out_file(text):
    """argparse type of --out: an empty name wrote nothing and exited 0 (``if args.out`` read it as no --out)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a file, got an empty string")
    return text


def _folder(path):
    """The folder ``path`` is written into, as the OS resolves it: not normalised (abspath read ``nodir/sub/../x`` as
    ``nodir/x``, so the check made and probed another folder than the write then needed)."""
    return os.path.dirname(path) or os.curdir


def check_out(path, replace):
    """Why the results cannot be written to ``path`` (None where they can), asked before anything is measured: a
    folder there ended in IsADirectoryError after all the measuring, and an existing file was overwritten silently.
    Makes the folders ``path`` needs, as :func:`write_json` would at the end, and writes a probe file there (root
    ignores mode bits, so ``os.access`` would say yes where a write then fails)."""
    # "newdir/." and "x/sub/.." name folders too, existing or not: they passed, and the write failed after measuring
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)) or os.path.isdir(path) \
            or os.path.basename(path) in (os.curdir, os.pardir):
        return "names a folder; name the JSON file to write (e.g. newdir/results.json)"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        return "cannot be written (a part of its folder path is a file, not a folder)"
    except OSError as exc:
        return f"cannot be inspected ({exc.strerror or exc})"
    if st is not None:
        if not stat.S_ISREG(st.st_mode):  # a link, a FIFO, a device: no results file this script wrote
            return "exists and is not a regular file; choose another --out"
        if not replace:
            return "exists; choose another --out, or --replace to overwrite it"
    folder = _folder(path)
    probe = os.path.join(folder, f".numpy_backend.write-test.{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "x"):
            pass
        os.unlink(probe)
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"
    return None


def _at_least_one(text):
    """argparse type of --rounds and --threads: 0 is no count (it read as "the default"), below it a crash later."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _threads(text):
    """argparse type of --threads: main() hands it to cuflash as CUFLASH_NUM_THREADS, so it takes what that variable
    takes (cuflash/_env.py), parsed by its own rule (int() also took "+4", "0_2" and other scripts' digits); 2000
    was a ValueError traceback at the first call, 50000 a segfault in torch."""
    _at_least_one(text)  # its message for 0 and negative counts, as the other counts'
    variable = _env.VARIABLES["CUFLASH_NUM_THREADS"]
    try:
        return variable.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {variable.accepted} (what CUFLASH_NUM_THREADS takes), "
                                         f"got {text!r}") from None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.numpy_backend", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=_out_file,
                    help="write the results as JSON to this file (folders made as needed; an existing file is an "
                         "error unless --replace)")
    ap.add_argument("--replace", action="store_true", help="overwrite the --out file if it exists")
    ap.add_argument("--quick", action="store_true", help="N = 4096 only, 3 rounds, a small memory grid")
    ap.add_argument("--rounds", type=_at_least_one, default=None, help="timed rounds per case (default 5, quick 3)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--threads", type=_threads, default=None,
                    help="threads for every implementation (default: all cores); "
                         "1 adds the float32 floor and products loops")
    ap.add_argument("--backward", action="store_true",
                    help="time forward + backward (cuflash against PyTorch's SDPA with autograd; no naive, no floor)")
    args = ap.parse_args(argv)
    # everything that can be refused is, before the first measurement (which takes minutes): the environment as
    # `python -m cuflash` checks it (a bad CUFLASH_BLAS was a traceback at the first call), then --out
    try:
        _env.check_all()
    except ValueError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    if args.replace and args.out is None:
        ap.error("--replace needs --out (there is no file to replace)")
    if args.no_speed and args.no_memory:  # measured nothing, wrote a result without results and exited 0
        ap.error("--no-speed and --no-memory together leave nothing to measure; give at most one of them")
    why = None if args.out is None else check_out(args.out, args.replace)
    if why:
        ap.error(f"--out {args.out}: {why}")
    threads = args.threads if args.threads is not None else _cores()
    os.environ["CUFLASH_NUM_THREADS"] = str(threads)  # before cuflash's first call reads it
    torch = _torch(threads)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 5)
    result = dict(_meta(torch), threads=threads, speed=[], memory=[])
    if not args.no_speed:
        cases = [(np.float32, n, d, c) for n in ((4096,) if args.quick else (4096, 16384))
                 for d in (64, 128) for c in (False, True)]
        cases += [(np.float64, 4096, d, c) for d in (64, 128) for c in (False, True)]
        print(f"{'dtype':8s} {'N':>6s} {'d':>4s} {'causal':6s} {'cuflash':>9s} {'torch':>9s} {'naive':>9s} "
              f"{'cuflash/torch':>13s} {'cuflash/naive':>13s}   (median ms)", flush=True)
        for dtype, n, d, causal in cases:
            with threadpool_limits(threads):  # the naive computation's BLAS
                rec = time_case(torch, dtype, n, d, causal, rounds if n <= 4096 else max(2, rounds - 2),
                                threads=threads, backward=args.backward)
            result["speed"].append(rec)
            ms, nan = rec["ms"], float("nan")
            other = _other_blas()
            openblas = "" if other is None else \
                f"   cuflash with {'OpenBLAS' if other == 'numpy' else 'MKL'} {ms[OTHER_BLAS[other]]:.1f} " \
                f"(cuflash/that {rec['cuflash_over_' + OTHER_BLAS[other]]:.2f})"
            floor = "" if "floor" not in ms else \
                f"   floor {ms['floor']:.1f} (cuflash/floor {rec['cuflash_over_floor']:.2f})" \
                f"   products {ms['products']:.1f} (cuflash/products {rec['cuflash_over_products']:.2f})"
            print(f"{rec['dtype']:8s} {n:6d} {d:4d} {str(causal):6s} {ms['cuflash']:9.1f} "
                  f"{ms.get('torch', nan):9.1f} {ms.get('naive', nan):9.1f} "
                  f"{rec.get('cuflash_over_torch', nan):13.2f} {rec.get('cuflash_over_naive', nan):13.2f}{floor}"
                  f"{openblas}",
                  flush=True)
    if not args.no_memory:
        grid = [(1, 4, 4096), (8, 32, 512), (64, 32, 256)] if args.quick else \
            [(1, 1, 16384), (1, 4, 4096), (1, 32, 2048), (8, 32, 512), (32, 32, 512), (64, 32, 256)]
        print(f"\n{'B':>3s} {'H':>3s} {'N':>6s}  {'fwd MiB':>8s} {'bwd MiB':>8s} {'fwd RSS':>8s} {'bwd RSS':>8s} "
              f"{'one array':>9s} {'naive S':>9s}  (peak extra: tracemalloc; RSS growth in a fresh process)")
        mib = lambda x: float("nan") if x is None else x / 2**20  # noqa: E731
        for b, h, n in grid:
            rec = memory_case(b, h, n)
            result["memory"].append(rec)
            print(f"{b:3d} {h:3d} {n:6d}  {mib(rec['fwd_peak_bytes']):8.1f} {mib(rec['bwd_peak_bytes']):8.1f} "
                  f"{mib(rec['fwd_rss_bytes']):8.1f} {mib(rec['bwd_rss_bytes']):8.1f} "
                  f"{mib(rec['array_bytes']):9.1f} {mib(rec['naive_scores_bytes']):9.1f}", flush=True)
    if args.out is not None:
        try:
            write_json(args.out, result, replace=args.replace)
        except OSError as exc:  # checked up front; what changed since (disk full, a file made there) is said, kept
            print(f"{ap.prog}: error: cannot write --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

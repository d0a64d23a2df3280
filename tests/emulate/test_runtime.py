"""The emulator's own semantics: warp collectives, barriers and schedules, shared memory, atomics, errors."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cuflash.emulate as emu
from cuflash.emulate import EmulationError
from emu_helpers import spec
from forked import child_exit_code  # tests/forked.py

SCHEDULES = ["forward", "reverse", "random"]


def run(name, args, schedule=None, seed=None, **kw):
    emu.launch(spec("runtime_tests.cu", name, args, **kw), schedule=schedule, seed=seed)


# ------------------------------------------------------------------------------------------ warp collectives

def _shuffle_expected(values, kind, arg, width):
    """CUDA programming guide: lanes form segments of `width`; up/down keep their own value past the segment
    edge; xor may read earlier segments but not later ones; idx wraps within the segment."""
    out = values.copy()
    for i in range(values.size):
        lane, base = i % 32, i - i % 32
        seg = lane - lane % width
        src = {0: seg + arg % width,
               1: lane - arg if lane - arg >= seg else lane,
               2: lane + arg if lane + arg < seg + width else lane,
               3: lane ^ arg if (lane ^ arg) < seg + width else lane}[kind]
        out[i] = values[base + src]
    return out


@pytest.mark.parametrize("kind,arg,width", [(0, 5, 32), (0, 37, 32), (0, 3, 8), (1, 3, 32), (1, 2, 8),
                                            (2, 1, 32), (2, 5, 16), (3, 1, 32), (3, 16, 32), (3, 2, 4)])
def test_shuffles(kind, arg, width):
    values = np.random.default_rng(kind).integers(-1000, 1000, 64).astype(np.int32)
    out = np.zeros(64, np.int32)
    run("shuffle_kernel", (values, out, np.int32(kind), np.int32(arg), np.int32(width)), block=(64, 1, 1))
    np.testing.assert_array_equal(out, _shuffle_expected(values, kind, arg, width))


def test_shuffle_other_types_bit_exact():
    d = np.random.default_rng(0).standard_normal(32)
    h = np.random.default_rng(1).standard_normal(64).astype(np.float16)
    d_out, h_out = np.zeros_like(d), np.zeros_like(h)
    run("shuffle_types", (d, d_out, h, h_out))
    np.testing.assert_array_equal(d_out, d.reshape(16, 2)[:, ::-1].ravel())
    np.testing.assert_array_equal(h_out.reshape(32, 2), h.reshape(32, 2)[::-1])


def test_votes_full_and_disjoint_half_masks():
    pred = (np.random.default_rng(3).random(32) < 0.5).astype(np.int32)
    pred[:16] = 1  # first half: all true
    out = np.zeros((32, 4), np.uint32)
    run("vote_kernel", (pred, out))
    ballot = int(sum(int(p) << i for i, p in enumerate(pred)))
    np.testing.assert_array_equal(out[:, 0], ballot)
    np.testing.assert_array_equal(out[:, 1], 1)
    np.testing.assert_array_equal(out[:, 2], int(pred.all()))
    np.testing.assert_array_equal(out[:16, 3], ballot & 0xFFFF)
    np.testing.assert_array_equal(out[16:, 3], ballot & 0xFFFF0000)


def test_partial_warp_collectives_ignore_missing_lanes():
    out = np.zeros(48, np.int32)
    run("partial_warp_kernel", (out,), block=(48, 1, 1))
    for group in range(3):
        np.testing.assert_array_equal(out[16 * group:16 * group + 16], sum(range(16 * group, 16 * group + 16)))


def test_exited_lanes_do_not_block_a_half_warp_mask():
    out = np.full(32, -7, np.int32)
    run("early_exit_kernel", (out,))
    np.testing.assert_array_equal(out[:16], sum(range(16)))
    np.testing.assert_array_equal(out[16:], -7)


# ------------------------------------------------------------------------------------------ schedules, barriers

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_run_order_follows_schedule(schedule):
    counter, order = np.zeros(1, np.int32), np.zeros(64, np.int32)
    run("order_kernel", (counter, order), schedule=schedule, seed=5, block=(64, 1, 1))
    assert sorted(order) == list(range(64))
    if schedule == "forward":
        np.testing.assert_array_equal(order, np.arange(64))
    elif schedule == "reverse":
        np.testing.assert_array_equal(order, np.arange(64)[::-1])
    else:
        assert not np.array_equal(order, np.arange(64)) and not np.array_equal(order, np.arange(64)[::-1])


def test_random_schedule_is_reproducible_per_seed():
    def order(seed):
        counter, out = np.zeros(1, np.int32), np.zeros(64, np.int32)
        run("order_kernel", (counter, out), schedule="random", seed=seed, block=(64, 1, 1))
        return out

    np.testing.assert_array_equal(order(11), order(11))
    assert not np.array_equal(order(11), order(12))


def test_schedule_from_environment(monkeypatch):
    monkeypatch.setenv("CUFLASH_EMULATE_SCHEDULE", "reverse")
    counter, out = np.zeros(1, np.int32), np.zeros(32, np.int32)
    run("order_kernel", (counter, out))
    np.testing.assert_array_equal(out, np.arange(32)[::-1])
    with pytest.raises(ValueError, match="schedule"):
        run("order_kernel", (counter, out), schedule="sideways")


def _neighbour(kernel, barrier, schedule, n):
    x = np.arange(1, n + 1, dtype=np.float32)
    out = np.zeros(n, np.float32)
    run(kernel, (x, out, np.int32(barrier)), schedule=schedule, seed=1, block=(n, 1, 1))
    return np.array_equal(out, np.concatenate([x[:1], x[:-1]]))


@pytest.mark.parametrize("kernel,n", [("neighbour_kernel", 128), ("warp_neighbour_kernel", 32)])
def test_missing_barrier_is_caught_by_some_schedule(kernel, n):
    assert all(_neighbour(kernel, 1, s, n) for s in SCHEDULES)
    results = {s: _neighbour(kernel, 0, s, n) for s in SCHEDULES}
    assert results["forward"]  # the forward order alone would hide the bug...
    assert not results["reverse"] and not results["random"]  # ...the others expose it


def test_syncthreads_reductions():
    pred = np.zeros(96, np.int32)
    pred[[3, 50, 95]] = 1
    out = np.zeros(3, np.int32)
    run("sync_reduce_kernel", (pred, out), block=(96, 1, 1))
    np.testing.assert_array_equal(out, [3, 0, 1])
    pred[:] = 1
    run("sync_reduce_kernel", (pred, out), block=(96, 1, 1))
    np.testing.assert_array_equal(out, [96, 1, 1])


def test_many_barriers():
    """128 threads through 2000 barriers, all arriving; prints the per-barrier cost (a figure, not a check: timings
    belong to `python -m cuflash emulate --bench`, kernels/emulate/README.md)."""
    out = np.zeros(128, np.int32)
    run("barrier_loop", (np.int32(1), out), block=(128, 1, 1))  # compile and warm up
    iters = 2000
    start = time.perf_counter()
    run("barrier_loop", (np.int32(iters), out), block=(128, 1, 1))
    per_barrier = (time.perf_counter() - start) / iters
    print(f"\nper 128-thread __syncthreads: {per_barrier * 1e6:.2f} us")
    np.testing.assert_array_equal(out, iters * (iters - 1) // 2)


# ------------------------------------------------------------------------------------------ memory, atomics

def test_shared_memory_is_nan_at_every_block_start():
    out = np.zeros(128, np.float32)
    run("stale_shared_kernel", (out,), grid=(2, 1, 1), block=(64, 1, 1), shared_bytes=64 * 4)
    assert np.isnan(out).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_atomics(schedule):
    x = np.random.default_rng(2).random(4 * 64).astype(np.float32)
    total, imax = np.zeros(1, np.float32), np.full(1, -1, np.int32)
    fmax_bits = np.zeros(1, np.uint32)
    run("atomics_kernel", (x, total, imax, fmax_bits), schedule=schedule, grid=(4, 1, 1), block=(64, 1, 1))
    np.testing.assert_allclose(total[0], x.sum(dtype=np.float64), rtol=1e-5)
    assert imax[0] == int((x * np.float32(1000)).astype(np.int32).max())
    assert fmax_bits.view(np.float32)[0] == x.max()


def test_indices_in_3d_grid_and_block():
    grid, block = (3, 2, 2), (4, 2, 3)
    nthreads = int(np.prod(grid) * np.prod(block))
    out = np.full((nthreads, 12), -1, np.int32)
    run("index_kernel", (out,), grid=grid, block=block, schedule="random")
    rows = [[tx, ty, tz, bx, by, bz, *block, *grid]
            for bz in range(2) for by in range(2) for bx in range(3)
            for tz in range(3) for ty in range(2) for tx in range(4)]
    np.testing.assert_array_equal(out, rows)


def test_views_pass_their_own_data_pointer():
    base = np.arange(16, dtype=np.float32)
    out = np.zeros(4, np.float32)
    run("copy_kernel", (base[3:], out, np.int32(4)))
    np.testing.assert_array_equal(out, [3, 4, 5, 6])
    run("copy_kernel", (base[::2], out, np.int32(4)))  # the device sees memory, not the view's strides
    np.testing.assert_array_equal(out, [0, 1, 2, 3])


def test_gccs_noinline_attribute_compiles():
    """libstdc++ writes __attribute__((__noinline__)) (bits/shared_ptr_base.h; more headers in g++ 13): the shim's
    CUDA-style macro for __noinline__ broke every kernel that included such a header."""
    out = np.zeros(32, np.int32)
    run("gcc_noinline_kernel", (out,))
    np.testing.assert_array_equal(out, 2 * np.arange(32) + 1)


def test_big_locals_need_and_get_a_bigger_stack():
    out = np.zeros(2, np.float32)
    emu.launch(spec("runtime_tests.cu", "big_stack_kernel", (out, np.int32(1000)), block=(2, 1, 1)),
               stack_kib=1024)
    np.testing.assert_array_equal(out, 999)


# ------------------------------------------------------------------------------------------ arguments

SCALARS = "testns::scalars_kernel<double, 7>"


def _scalar_args(**override):
    args = dict(out=np.zeros(7), a=np.int64(-5), b=np.float64(2.5), c=np.uint32(7), d=True, e=np.float32(0.25), p=None)
    args.update(override)
    return tuple(args.values())


def test_template_kernel_receives_every_scalar_kind():
    out = np.zeros(7)
    emu.launch(spec("runtime_tests.cu", SCALARS, _scalar_args(out=out), options=("-DOFFSET=100",)))
    np.testing.assert_array_equal(out, [95, 2.5, 7, 1, 0.25, 7, 1])


@pytest.mark.parametrize("override,position,expected,got", [
    (dict(a=np.int32(1)), 1, "long long", "int32"),
    (dict(b=np.float32(1)), 2, "double", "float32"),
    (dict(c=np.int32(1)), 3, "unsigned int", "int32"),
    (dict(e=1.0), 5, "float", "float"),
    (dict(out=np.zeros(7, np.float32)), 0, "double*", "float32"),
    (dict(out=np.float64(0)), 0, "double*", "float64"),
    (dict(a=np.zeros(1, np.int64)), 1, "long long", "int64"),
    (dict(a=None), 1, "long long", "NoneType"),
])
def test_argument_type_mismatch(override, position, expected, got):
    with pytest.raises(TypeError, match=rf"argument {position}: .*{expected}.*{got}"):
        emu.launch(spec("runtime_tests.cu", SCALARS, _scalar_args(**override)))


# struct Params { float* out; long long n; float scale; } as C lays it out (align=True: 4 bytes of tail padding).
PARAMS = np.dtype([("out", np.uintp), ("n", np.int64), ("scale", np.float32)], align=True)


def _params(out, n, scale, dtype=PARAMS):
    p = np.zeros(1, dtype)
    p["out"], p["n"], p["scale"] = out.ctypes.data, n, scale
    return p


def test_struct_argument_by_value():
    """How CuPy passes a struct by value: a size-1 NumPy array of a structured dtype, its bytes copied."""
    out = np.full(100, -1, np.float32)
    run_spec = spec("hardening_tests.cu", "struct_kernel", (_params(out, 90, 0.5),), block=(32, 1, 1))
    emu.launch(run_spec)
    np.testing.assert_array_equal(out[:90], 0.5 * np.arange(90, dtype=np.float32))
    np.testing.assert_array_equal(out[90:], -1)


@pytest.mark.parametrize("value,got", [
    (_params(np.zeros(1, np.float32), 1, 1.0, np.dtype(PARAMS.descr[:3])), "ndarray"),  # packed: 20 bytes
    (np.zeros(2, PARAMS), r"shape \(2,\)"),
    (np.zeros(1, "V24"), "V24"),
    (np.zeros(3, np.float64), "float64"),
    (np.int64(3), "np.int64"),
    (None, "NoneType"),
])
def test_struct_argument_mismatch(value, got):
    with pytest.raises(TypeError, match=rf"argument 0: kernel expects `Params` \(24 bytes\).*{got}"):
        emu.launch(spec("hardening_tests.cu", "struct_kernel", (value,)))


def test_argument_count_mismatch():
    with pytest.raises(TypeError, match="takes 7 arguments, got 6"):
        emu.launch(spec("runtime_tests.cu", SCALARS, _scalar_args()[:-1]))


def test_launch_configuration_is_validated():
    out = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="1024"):
        run("copy_kernel", (out, out, np.int32(0)), block=(1025, 1, 1))
    with pytest.raises(ValueError, match="grid"):
        run("copy_kernel", (out, out, np.int32(0)), grid=(0, 1, 1))


# ------------------------------------------------------------------------------------------ errors

def _faulty(mode, schedule=None, x=None, grid=(1, 1, 1)):
    x = np.ones(128 * grid[0], np.float32) if x is None else x
    out = np.zeros(128, np.float32)
    run("faulty_kernel", (x, out, np.int32(mode)), schedule=schedule, block=(128, 1, 1), grid=grid)
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_planted_deadlock_raises(schedule):
    with pytest.raises(EmulationError, match="deadlock"):
        _faulty(0, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_divergent_barriers_raise(schedule):
    with pytest.raises(EmulationError, match=r"divergent __syncthreads: .* at tests/emulate/kernels/runtime_tests"
                                             r"\.cu:\d+ while \d+ thread\(s\) wait at .*runtime_tests\.cu:\d+"):
        _faulty(1, schedule)


def test_device_assert_raises_with_block_and_thread():
    x = np.ones(256, np.float32)
    x[128 + 77] = -1
    with pytest.raises(EmulationError, match=r"device assert failed: in\[.*\] >= 0\.f") as info:
        _faulty(2, x=x, grid=(2, 1, 1))
    assert info.value.block == (1, 0, 0) and info.value.thread == (77, 0, 0)


def test_shuffle_mask_without_caller_raises():
    with pytest.raises(EmulationError, match="does not include the calling lane"):
        _faulty(3)


def test_mismatched_masks_are_reported_as_deadlock():
    with pytest.raises(EmulationError, match=r"deadlock.*__shfl_sync with mask 0x00000003"):
        _faulty(4)


def test_trap_raises_and_the_process_survives():
    with pytest.raises(EmulationError, match=r"__trap\(\)") as info:
        _faulty(5)
    assert info.value.thread == (3, 0, 0)
    np.testing.assert_array_equal(_faulty(6), 1)  # the same library launches fine afterwards


def test_stack_overflow_names_the_remedy():
    """A fiber overflowing its stack kills the process (it cannot be recovered), but says what to change."""
    code = (f"import sys, numpy as np; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import cuflash.emulate as emu\nfrom emu_helpers import spec\n"
            "emu.launch(spec('runtime_tests.cu', 'big_stack_kernel', (np.zeros(2, np.float32), np.int32(1000)),"
            " block=(2, 1, 1)), stack_kib=64)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(emu.__file__).parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "fiber stack overflow in block (0,0,0)" in proc.stderr and "CUFLASH_EMULATE_STACK_KIB" in proc.stderr


def test_device_intrinsics(capfd):
    from emu_helpers import from_bf16_bits, to_bf16_bits

    x = np.array([0.7, 1.9, 3.25], np.float32)
    out, dsum, imax = np.zeros(16, np.float32), np.zeros(1), np.zeros(2, np.int32)
    run("intrinsics_kernel", (x, out, dsum, imax), block=(64, 1, 1))
    a, b = x[0], x[1]
    bf16 = from_bf16_bits(to_bf16_bits(x[:2]))
    expected = [np.exp2(a), np.exp(a), np.exp(a), np.log(b), np.log2(b), b, a / b, np.float16(a), np.float16(a),
                np.float16(b), bf16[0], bf16[0], bf16[1], x[2], 1 / np.sqrt(b), 8]
    np.testing.assert_allclose(out, np.array(expected, np.float32), rtol=1e-6)
    assert dsum[0] == sum(range(64)) and list(imax) == [63, 7]
    assert "emulated printf 42" in capfd.readouterr().out


def _guard_mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.split()[1] == "---p")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_fiber_stacks_are_unmapped_after_each_launch():
    """Each kernel library has its own runtime: stacks kept after a launch stayed mapped once per library, a guard
    page per thread each, and a long test process ran out of mappings (vm.max_map_count) after a few hundred."""
    import cuflash

    rng = np.random.default_rng(0)
    cuflash.attention(*(rng.standard_normal((1, 40, 2, 32)).astype(np.float16) for _ in range(3)), backend="emulate")
    before = _guard_mappings()
    for d in (64, 96, 128):  # three more kernel libraries, 128 threads or more per block each
        cuflash.attention(*(rng.standard_normal((1, 40, 2, d)).astype(np.float16) for _ in range(3)),
                          backend="emulate")
    assert _guard_mappings() - before < 64


# ------------------------------------------------------------------------------------------ threads and forks

@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_a_launch_can_launch():
    """The launch lock, held by a launch at the fork, was held in the child by a thread it does not have: its first
    launch waited for ever. (Held here by the forking thread itself, which a launch of the child's would wait for
    just the same.)"""
    from cuflash.emulate import _runner

    out = np.zeros(4, np.float32)
    copy = spec("runtime_tests.cu", "copy_kernel", (np.arange(1, 5, dtype=np.float32), out, np.int32(4)))
    emu.launch(copy)  # compiled and loaded before the fork
    with _runner._LAUNCH_LOCK:
        pid = os.fork()
        if pid == 0:  # the child: one launch, then leave without running the parent's cleanup
            try:
                emu.launch(copy)
                os._exit(0 if out.tolist() == [1.0, 2.0, 3.0, 4.0] else 3)
            except BaseException:  # noqa: BLE001 - any failure is the child's exit code
                os._exit(4)
    assert child_exit_code(pid) == 0


def test_each_launch_returns_its_own_bank_counts_while_another_thread_launches():
    """The bank-conflict counters are the library's; they were read after the launch lock was let go, so a launch
    of the same library by another thread could restart them first: 306 of 700 launches got the other one's
    counts (or zeros)."""
    import threading

    from cuflash.backends import emulate as emulate_backend
    from cuflash.cuda import launch as launches
    from cuflash.problem import make_problem

    rng = np.random.default_rng(0)

    def forward(sq):
        q = rng.standard_normal((1, sq, 2, 32)).astype(np.float16)
        return launches.forward_launch(make_problem(q, q, q), max_smem=emulate_backend._max_smem(),
                                       cc=emulate_backend._cc()).launch

    small, large = forward(64), forward(128)
    want = {id(small): emu.launch(small), id(large): emu.launch(large)}
    assert want[id(small)] != want[id(large)]
    wrong = []

    def loop(launch, n):
        for _ in range(n):
            got = emu.launch(launch)
            if got != want[id(launch)]:
                wrong.append(got)

    threads = [threading.Thread(target=loop, args=(launch, 40)) for launch in (small, large)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_threads_asking_for_one_kernel_at_once_compile_it_once(monkeypatch, tmp_path):
    """Four threads launching one kernel not yet built compiled it four times (each compile a second of g++)."""
    import threading

    from cuflash.emulate import _build

    monkeypatch.setenv("CUFLASH_EMULATE_CACHE", str(tmp_path))  # nothing built yet
    monkeypatch.setattr(emu, "_by_spec", {})
    before = len(_build.compile_log)
    go, outs = threading.Barrier(4, timeout=60), [np.zeros(4, np.float32) for _ in range(4)]

    def launch(out):
        go.wait()
        emu.launch(spec("runtime_tests.cu", "copy_kernel", (np.arange(1, 5, dtype=np.float32), out, np.int32(4)),
                        options=("-DCUFLASH_ONE_BUILD=1",)))

    threads = [threading.Thread(target=launch, args=(out,)) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out.tolist() == [1.0, 2.0, 3.0, 4.0] for out in outs)
    assert len(_build.compile_log) - before == 1

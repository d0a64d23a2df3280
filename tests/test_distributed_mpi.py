"""cuflash.distributed on real MPI ranks: ``mpiexec -n 2`` and ``-n 4`` running tests/mpi/ring_cases.py.

One mpiexec call per rank count runs every case (forward and backward, causal and not, windows, GQA/MQA, float16 /
bfloat16 / float32 / float64, uneven and empty per-rank lengths, Lq != Lk, contiguous and zigzag layouts, ring and
Ulysses, the vjp), each held on rank 0 to the 2x/3x rule against the float64 reference after gathering the parts;
this file turns each case's record into one test. Error cases must raise the same exception on every rank (no
hang), and the memory probe checks that a rank's peak memory does not grow with the number of ranks. A third run,
``-n 2`` with CuPy arrays of tests/fake_cupy.py (kernels on the CPU emulator), covers CuPy over MPI: device buffers
staged through host memory, the CUDA kernels on the shifted pair windows.

Needs mpi4py and an ``mpiexec`` (``pip install -e '.[dist]'``: the mpich wheel brings one); skipped, with the
reason, where either is missing.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi"))
import mpi_launch as launch  # noqa: E402  (tests/mpi/mpi_launch.py)
import ring_cases  # noqa: E402  (tests/mpi/ring_cases.py)

RANKS = (2, 4)
pytestmark = pytest.mark.skipif(launch.why_not() is not None, reason=str(launch.why_not()))
_RESULTS = {}


def results(ranks, tmp_path_factory, arrays="numpy"):
    """The records of one ``mpiexec -n ranks`` run of every case (run once per session)."""
    key = (ranks, arrays)
    if key not in _RESULTS:
        _RESULTS[key] = launch.run_cases(ranks, arrays, tmp_path_factory.mktemp(f"mpi{ranks}-{arrays}") / "out.json")
    got = _RESULTS[key]
    if isinstance(got, str):
        pytest.fail(got, pytrace=False)
    assert got["size"] == ranks and got["arrays"] == arrays
    return got


@pytest.mark.parametrize("name", sorted(ring_cases.CASES))
@pytest.mark.parametrize("ranks", RANKS)
def test_case_matches_reference(ranks, name, tmp_path_factory):
    record = results(ranks, tmp_path_factory)[name]
    assert record.get("ok"), f"mpiexec -n {ranks}, case {name}:\n{record.get('error')}"


@pytest.mark.emulate
@pytest.mark.parametrize("name", sorted(ring_cases.CASES))
def test_case_with_cupy_arrays_over_mpi(name, tmp_path_factory):
    from cuflash import emulate

    emulate.skip_unless_available()
    record = results(2, tmp_path_factory, arrays="fake-cupy")[name]
    assert record.get("ok"), f"mpiexec -n 2 with fake CuPy arrays, case {name}:\n{record.get('error')}"


@pytest.mark.parametrize("name", sorted(ring_cases.ERRORS))
@pytest.mark.parametrize("ranks", RANKS)
def test_error_raised_alike_on_every_rank(ranks, name, tmp_path_factory):
    raised = results(ranks, tmp_path_factory)[name]["raised"]
    kind, fragment = ring_cases.ERRORS[name]
    assert len(raised) == ranks
    for rank, got in enumerate(raised):
        assert got is not None, f"rank {rank} raised nothing"
        assert got[0] == kind and fragment in got[1], f"rank {rank} raised {got[0]}: {got[1]}"


@pytest.mark.parametrize("name", sorted(ring_cases.ONE_RANK_ERRORS))
@pytest.mark.parametrize("ranks", RANKS)
def test_an_error_on_one_rank_is_raised_on_every_rank(ranks, name, tmp_path_factory):
    """Bad input or environment on rank 0 only (a shape, CUFLASH_NUM_THREADS, dout, gather's axis): it raised
    alone before the first exchange, and the other ranks waited in it for ever. Rank 0 raises its own error, the
    others one naming rank 0."""
    raised = results(ranks, tmp_path_factory)[name]["raised"]
    assert len(raised) == ranks
    for rank, got in enumerate(raised):
        kind, fragment = ring_cases.ONE_RANK_ERRORS[name] if rank == 0 else ring_cases.ONE_RANK_REFUSED
        assert got is not None, f"rank {rank} raised nothing"
        assert got[0] == kind and fragment in got[1], f"rank {rank} raised {got[0]}: {got[1]}"


@pytest.mark.parametrize("name", sorted(ring_cases.MID_CALL_ERRORS))
@pytest.mark.parametrize("ranks", RANKS)
def test_an_error_on_one_rank_mid_call_is_raised_on_every_rank(ranks, name, tmp_path_factory):
    """Rank 0's pair computation raises mid-call: it raised alone, and the others waited for ever for the blocks it no
    longer passed on. Rank 0 raises its own error, the others a RuntimeError naming rank 0, and the next call on the
    same communicator matches a clean one."""
    raised = results(ranks, tmp_path_factory)[name]["raised"]
    assert len(raised) == ranks
    for rank, got in enumerate(raised):
        kind, fragment = ring_cases.MID_CALL_OWN if rank == 0 else ring_cases.MID_CALL_TOLD
        assert got is not None, f"rank {rank} raised nothing"
        assert got[0] == kind and fragment in got[1], f"rank {rank} raised {got[0]}: {got[1]}"
    if ranks > 1:  # the others' errors carry the same note of the next call
        assert all("the next call matched a clean one" in got[1] for got in raised[1:]), raised


def test_memory_per_rank_does_not_grow_with_ranks(tmp_path_factory):
    """At a fixed local length, 3 and 4 ranks (sub-communicators of the 4-rank run) give the same peak: an
    implementation holding O(total) K/V would need one more local K/V block (512 KiB here) at 4 ranks."""
    probes = results(4, tmp_path_factory)["memory"]
    for rank, probe in enumerate(probes[:3]):
        peaks, block = probe["peaks"], probe["kv_block_bytes"]
        assert abs(peaks["4"] - peaks["3"]) < 0.05 * block, (rank, peaks, block)
        # and the peak is a small multiple of the local data (tiles of the NumPy backend included)
        assert peaks["4"] < 16 * block, (rank, peaks, block)



def test_readme_example_runs_under_mpiexec(tmp_path):
    """The README's example, verbatim except for a shorter sequence (2048 -> 256), under ``mpiexec -n 4``: every
    rank prints its rows' largest difference from single-device attention."""
    import re
    import subprocess

    readme = open(os.path.join(launch.ROOT, "README.md")).read()
    section = readme[readme.index("## Sequence parallelism"):readme.index("## Not done yet")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "mpiexec -n 4 python example.py" in section and code.count("\n") <= 10
    assert "(2048, 8, 64)" in code
    (tmp_path / "example.py").write_text(code.replace("(2048, 8, 64)", "(256, 8, 64)"))
    env = dict(os.environ, CUFLASH_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([launch.ROOT, os.environ.get("PYTHONPATH", "")]))
    # each rank's output to its own file (the ranks' lines would interleave on one pipe), whatever the launcher
    run = ("import runpy, sys; from mpi4py import MPI; sys.stdout = open(f'out-{MPI.COMM_WORLD.rank}.txt', 'w'); "
           "runpy.run_path('example.py', run_name='__main__')")
    proc = subprocess.run([launch.mpiexec(), "-n", "4", sys.executable, "-m", "mpi4py", "-c", run], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=launch.TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    for rank in range(4):
        printed = (tmp_path / f"out-{rank}.txt").read_text().split()
        assert int(printed[0]) == rank and float(printed[1]) < 1e-5, printed

"""cuflash.distributed on real MPI ranks: ``mpiexec -n 2`` and ``-n 4`` running tests/mpi/ring_cases.py.

One mpiexec call per rank count runs every case (forward and backward, causal and not, windows, GQA/MQA, float16 /
bfloat16 / float32 / float64, uneven and empty per-rank lengths, Lq != Lk, contiguous and zigzag layouts, ring and
Ulysses, the vjp), each held on rank 0 to the 2x/3x rule against the float64 reference after gathering the parts;
this file turns each case's record into one test. Error cases must raise the same exception on every rank (no
hang), and the memory probe checks that a rank's peak memory does not grow with the number of ranks.

Needs mpi4py and an ``mpiexec`` (``pip install -e '.[dist]'``: the mpich wheel brings one); skipped, with the
reason, where either is missing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "mpi"))
import ring_cases  # noqa: E402  (tests/mpi/ring_cases.py)

RANKS = (2, 4)
TIMEOUT_S = 240


def _mpiexec():
    # the environment's own launcher first (a virtualenv's bin/, where the mpich wheel puts it)
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("mpiexec", path=path)


def _why_not():
    try:
        import mpi4py  # noqa: F401
    except ImportError as exc:
        return f"mpi4py is not installed ({exc}); pip install -e '.[dist]'"
    if _mpiexec() is None:
        return "no mpiexec on PATH or beside the Python executable; pip install -e '.[dist]' (the mpich wheel)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))

_RESULTS = {}


def results(ranks, tmp_path_factory):
    """Run ring_cases.py once under ``mpiexec -n ranks`` (cached for the session) and return its records."""
    if ranks not in _RESULTS:
        out = tmp_path_factory.mktemp(f"mpi{ranks}") / "records.json"
        env = dict(os.environ, CUFLASH_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        env.pop("CUFLASH_MPI_CASES", None)
        # python -m mpi4py: an exception escaping on one rank aborts them all instead of leaving the others waiting
        cmd = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py",
               os.path.join(HERE, "mpi", "ring_cases.py"), str(out)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            _RESULTS[ranks] = f"mpiexec -n {ranks} timed out after {TIMEOUT_S} s (a deadlock?)\n{exc.stdout}\n{exc.stderr}"
        else:
            if proc.returncode != 0 or not out.exists():
                _RESULTS[ranks] = f"mpiexec -n {ranks} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            else:
                _RESULTS[ranks] = json.loads(out.read_text())
    got = _RESULTS[ranks]
    if isinstance(got, str):
        pytest.fail(got, pytrace=False)
    assert got["size"] == ranks
    return got


@pytest.mark.parametrize("name", sorted(ring_cases.CASES))
@pytest.mark.parametrize("ranks", RANKS)
def test_case_matches_reference(ranks, name, tmp_path_factory):
    record = results(ranks, tmp_path_factory)[name]
    assert record.get("ok"), f"mpiexec -n {ranks}, case {name}:\n{record.get('error')}"


@pytest.mark.parametrize("name", sorted(ring_cases.ERRORS))
@pytest.mark.parametrize("ranks", RANKS)
def test_error_raised_alike_on_every_rank(ranks, name, tmp_path_factory):
    raised = results(ranks, tmp_path_factory)[name]["raised"]
    kind, fragment = ring_cases.ERRORS[name]
    assert len(raised) == ranks
    for rank, got in enumerate(raised):
        assert got is not None, f"rank {rank} raised nothing"
        assert got[0] == kind and fragment in got[1], f"rank {rank} raised {got[0]}: {got[1]}"


def test_memory_per_rank_does_not_grow_with_ranks(tmp_path_factory):
    """At a fixed local length, 3 and 4 ranks (sub-communicators of the 4-rank run) give the same peak: an
    implementation holding O(total) K/V would need one more local K/V block (512 KiB here) at 4 ranks."""
    probes = results(4, tmp_path_factory)["memory"]
    for rank, probe in enumerate(probes[:3]):
        peaks, block = probe["peaks"], probe["kv_block_bytes"]
        assert abs(peaks["4"] - peaks["3"]) < 0.05 * block, (rank, peaks, block)
        # and the peak is a small multiple of the local data (tiles of the NumPy backend included)
        assert peaks["4"] < 16 * block, (rank, peaks, block)


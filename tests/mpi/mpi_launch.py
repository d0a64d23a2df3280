"""Launching tests/mpi/ring_cases.py under mpiexec from pytest (tests/test_distributed_mpi.py, tests/test_distributed_gpu.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 240


def mpiexec():
    """The environment's own launcher first (a virtualenv's bin/, where the mpich wheel puts it), then PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("mpiexec", path=path)


def why_not():
    """Why MPI tests cannot run here, or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as exc:
        return f"mpi4py is not installed ({exc}); pip install -e '.[dist]'"
    if mpiexec() is None:
        return "no mpiexec on PATH or beside the Python executable; pip install -e '.[dist]' (the mpich wheel)"
    return None


def run_cases(ranks, arrays, out_path, timeout=TIMEOUT_S):
    """Run every case under ``mpiexec -n ranks`` with ``arrays`` (numpy, cupy, fake-cupy); return the records, or a
    string saying why there are none (failure, timeout)."""
    env = dict(os.environ, CUFLASH_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               CUFLASH_MPI_ARRAYS=arrays, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("CUFLASH_MPI_CASES", None)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root (the lent GPU machines run as root)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # python -m mpi4py: an exception escaping on one rank aborts them all instead of leaving the others waiting
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", os.path.join(HERE, "ring_cases.py"),
           str(out_path)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return f"mpiexec -n {ranks} ({arrays}) timed out after {timeout} s (a deadlock?)\n{exc.stdout}\n{exc.stderr}"
    if proc.returncode != 0 or not os.path.exists(out_path):
        return f"mpiexec -n {ranks} ({arrays}) failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    with open(out_path) as f:
        return json.load(f)

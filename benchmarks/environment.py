"""Device, versions and commit: what a result is measured on and with."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def gpu_available() -> bool:
    """CuPy importable and at least one CUDA device visible."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError (no driver), ...
        return False


def best_device() -> str:
    """"cuda" when CuPy and a GPU are there, else "cpu" (the NumPy backend)."""
    return "cuda" if gpu_available() else "cpu"


def cuflash_backend_status(device: str) -> tuple[bool, str]:
    """``(available, reason)`` of the cuflash backend that runs on ``device`` ("cpu": numpy, "cuda": cuda)."""
    from cuflash import backends

    return backends.status()["cuda" if device == "cuda" else "numpy"]


def cpu_info() -> dict:
    """``{"kind": "cpu", "name": model name, "cores": cores this process may use}``."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"kind": "cpu", "name": name, "cores": cores}


def gpu_info() -> dict:
    """Name, compute capability, memory, SMs and peak DRAM bandwidth of the current CuPy device."""
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    info = {"kind": "cuda", "name": name, "compute_capability": dev.compute_capability,
            "memory_bytes": int(props.get("totalGlobalMem", 0)) or None, "sms": props.get("multiProcessorCount")}
    # Peak DRAM bandwidth = 2 (DDR) x memory clock x bus width; CUDA 13 dropped these fields.
    clock_khz, bus_bits = props.get("memoryClockRate", 0), props.get("memoryBusWidth", 0)
    info["bandwidth_gbps"] = round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, 1) if clock_khz and bus_bits else None
    return info


def device_slug(info: dict) -> str:
    """File-system name of a device: ``nvidia-h100-80gb-hbm3``, ``cpu-<model>-<n>c``."""
    base = info["name"] if info["kind"] == "cuda" else f"cpu-{info['name']}-{info.get('cores')}c"
    slug = re.sub(r"\((r|tm)\)", "", base.lower())
    return re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or "unknown"


def cuda_versions() -> dict:
    """CUDA runtime, driver and NVRTC versions as CuPy reports them (integers, e.g. 13000)."""
    import cupy

    out = {"cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
           "cuda_driver": cupy.cuda.runtime.driverGetVersion()}
    try:
        from cupy.cuda import nvrtc

        major, minor = nvrtc.getVersion()
        out["nvrtc"] = f"{major}.{minor}"
    except Exception as exc:  # noqa: BLE001 -- a missing libnvrtc is a finding to record, not a crash
        out["nvrtc"] = f"unavailable ({type(exc).__name__}: {exc})"
    return out


def versions(device: str) -> dict:
    """Versions of everything that can change a number; absent packages are left out."""
    from cuflash import __version__

    out = {"python": platform.python_version(), "numpy": np.__version__, "cuflash": __version__,
           "platform": platform.platform()}
    for mod in ("cupy", "torch", "jax", "jaxlib"):  # the baselines this run imported
        if mod in sys.modules:
            out[mod] = getattr(sys.modules[mod], "__version__", "unknown")
    try:
        out["matplotlib"] = importlib.metadata.version("matplotlib")
    except importlib.metadata.PackageNotFoundError:
        pass
    if device == "cuda":
        out.update(cuda_versions())
    return out


def git_commit(*, given: Optional[str] = None) -> tuple[str, Optional[bool]]:
    """``(sha, dirty)`` of this checkout, git's word whenever git can tell: ``given`` (``--commit``) must then be a
    prefix of HEAD's sha (a ValueError otherwise, so that no run records a commit it did not measure). Where git
    cannot tell (a copy of the tree without ``.git``, e.g. on a device machine, knows its commit only from the
    caller), ``(given, None)`` if ``given`` looks like a commit (7 to 40 hex digits; a ValueError otherwise);
    ``("unknown", None)`` when neither can tell. One exception to git's word: the device machine's copy, which can
    carry the ``.git`` of the session's start under a newer tree (seen on the H200 run of 2026-11-27), records
    ``given`` with ``dirty`` None where the tree is dirty, its ``.git`` does not know ``given`` at all, and ``given``
    is the ``GPU_SESSION_COMMIT`` that ``benchmarks/gpu_session.sh`` was started with (it passes that as
    ``--commit``). Anywhere else it is refused (a real checkout with uncommitted changes recorded any unknown
    ``--commit``, with ``dirty`` None), as is a ``given`` that git knows and that is not HEAD."""
    if given is not None and not re.fullmatch(r"[0-9a-fA-F]{7,40}", given):
        raise ValueError(f"--commit {given!r} does not look like a commit (7 to 40 hex digits)")
    given = given and given.lower()
    head = _git_head()
    if head is None:
        return given or "unknown", None
    sha, dirty = head
    if given and not sha.startswith(given):
        known = _git_knows(given)
        if dirty and not known and _session_commit() == given:
            return given, None
        raise ValueError(f"--commit {given} is not this checkout's HEAD ({sha})"
                         f"{'' if known else ' and git does not know it'}; in a git checkout the commit comes from "
                         f"git: leave --commit out")
    return sha, dirty


def _session_commit() -> Optional[str]:
    """The commit ``benchmarks/gpu_session.sh`` was told (``GPU_SESSION_COMMIT``, which its children inherit), in
    lower case; None outside such a session."""
    commit = os.environ.get("GPU_SESSION_COMMIT", "").strip().lower()
    return commit or None


def _git_knows(commit: str) -> bool:
    """Whether this checkout's git has ``commit`` (a prefix of one) among its objects."""
    try:
        return subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _git_head() -> Optional[tuple[str, bool]]:
    """``(HEAD's sha, dirty)`` where this tree is a git checkout; None where git cannot tell (no git, no .git, or
    the tree is a copy inside another repository's folder: that repository's HEAD is not this tree's commit)."""
    try:
        top, sha = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True, timeout=10, check=True).stdout.splitlines()
        # the results a run writes are not code: a rerun that rewrote the committed figures was "dirty", and then
        # refused as another run's (its key holds this flag)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)benchmarks/results"], cwd=REPO, capture_output=True, text=True,
                                timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return (sha, bool(status.strip())) if Path(top).resolve() == REPO else None

"""``cupy`` for the dry run of benchmarks/gpu_session.sh (``GPU_SESSION_DRY_RUN=1`` puts tests/fake_gpu and
tests/ first on ``PYTHONPATH``): replaces itself in ``sys.modules`` by tests/fake_cupy_bench.py's fake, whose
kernels run on the CPU emulator. ``FAKE_GPUS`` / ``FAKE_CUPY_MISSING`` choose the devices (see that module)."""
import fake_cupy_bench

fake_cupy_bench.install_from_environment()

"""Shared test configuration: hypothesis profiles, the golden-vector loader and the ``within`` hang guard.

Hypothesis profiles (select with ``HYPOTHESIS_PROFILE=ci|dev|fuzz``; the default is ``ci`` when
the ``CI`` environment variable is set, else ``dev``):

- ``ci``: bounded example counts, no deadline, derandomized (the same examples on every run), and
  a reproduction blob printed on failure;
- ``dev``: a few more examples, random each run;
- ``fuzz``: many examples for long runs, e.g. ``HYPOTHESIS_PROFILE=fuzz pytest tests/``.

A test whose examples are expensive asks for a fraction of the active profile's count
(``settings.default.max_examples``, read after this file has loaded the profile) rather than a
fixed number, so ``fuzz`` still scales it up.

Golden vectors: see tests/golden.py (where they are looked for; a golden test with no vector fails).
"""
from __future__ import annotations

import contextlib
import os
import signal

import pytest
from hypothesis import HealthCheck, settings

# JAX takes 75% of a GPU's memory when it first sees one; one pytest-xdist worker per core, each with JAX (and CuPy
# beside it), cannot all do that
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=100, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=30, **_COMMON)
settings.register_profile("fuzz", max_examples=2000, print_blob=True, **_COMMON)
PROFILES = ("ci", "dev", "fuzz")
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "").strip() or ("ci" if os.environ.get("CI") else "dev")
if PROFILE in PROFILES:
    settings.load_profile(PROFILE)


def pytest_configure(config):
    """Another HYPOTHESIS_PROFILE is pytest's one-line usage error, before any test is collected (loading it here
    at import was hypothesis' own traceback, naming neither the variable nor the profiles)."""
    if PROFILE not in PROFILES:
        raise pytest.UsageError(f"environment variable HYPOTHESIS_PROFILE={os.environ['HYPOTHESIS_PROFILE']!r} is not "
                                f"valid: expected one of {', '.join(PROFILES)} (empty: ci where CI is set, else dev)")


# ------------------------------------------------------------------------------------ hangs
@contextlib.contextmanager
def _within(seconds: float):
    """A hang fails the test instead of stalling the suite (the interpreter handles SIGALRM between bytecodes)."""
    def hung(signum, frame):  # pytest.fail, not TimeoutError: that is an OSError, which the code under test may catch
        pytest.fail(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def within():
    """``with within(seconds):`` around a call that once hung (a FIFO with no writer, a loop over 2**70 ranks)."""
    return _within


# ------------------------------------------------------------------------------------ golden
from golden import GOLDEN_DIR, GOLDEN_MISSING, GoldenVector, golden_names  # noqa: E402


class GoldenLoader:
    """``loader(name) -> GoldenVector``; ``loader.names``: every vector's name; ``loader.directory``: where
    they are. Each fails the test (:data:`GOLDEN_MISSING`) when there are no vectors."""

    @property
    def names(self):
        return golden_names() or pytest.fail(GOLDEN_MISSING, pytrace=False)

    @property
    def directory(self):
        return GOLDEN_DIR or pytest.fail(GOLDEN_MISSING, pytrace=False)

    def __call__(self, name):
        if name is None:  # the one "missing" case of pytest_generate_tests
            pytest.fail(GOLDEN_MISSING, pytrace=False)
        return GoldenVector(name)


@pytest.fixture
def jax_cpu():
    """JAX's default device set to its CPU for the test: the JAX tests that compare with NumPy-backend calls (and CI
    has no GPU) mean CPU JAX, where a machine with a GPU would put ``jnp.asarray`` on it (tests/test_gpu_jax.py holds
    JAX on a GPU to its own rule)."""
    jax = pytest.importorskip("jax", reason="JAX is not installed (it comes with the test extra)")
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="session")
def golden():
    """A :class:`GoldenLoader`."""
    return GoldenLoader()


def pytest_generate_tests(metafunc):
    """A test that takes ``golden_name`` runs once per golden file, with the file's stem as id; without
    any file, once as ``missing``, a case that fails (an empty parametrization would pass unseen)."""
    if "golden_name" in metafunc.fixturenames:
        names = golden_names()
        metafunc.parametrize("golden_name", names or [None], ids=names or ["missing"])


def pytest_runtest_setup(item):
    """The ``missing`` case of :func:`golden.golden_cases` fails, saying where it looked."""
    if item.get_closest_marker("golden_missing"):
        pytest.fail(GOLDEN_MISSING, pytrace=False)

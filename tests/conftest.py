"""Shared test configuration: hypothesis profiles and the golden-vector loader.

Hypothesis profiles (select with ``HYPOTHESIS_PROFILE=ci|dev|fuzz``; the default is ``ci`` when
the ``CI`` environment variable is set, else ``dev``):

- ``ci``: bounded example counts, no deadline, derandomized (the same examples on every run), and
  a reproduction blob printed on failure;
- ``dev``: a few more examples, random each run;
- ``fuzz``: many examples for long runs, e.g. ``HYPOTHESIS_PROFILE=fuzz pytest tests/``.

A test whose examples are expensive asks for a fraction of the active profile's count
(``settings.default.max_examples``, read after this file has loaded the profile) rather than a
fixed number, so ``fuzz`` still scales it up.

Golden vectors are read from ``$CUFLASH_GOLDEN_DIR`` when it is set, else from ``.golden/`` in the
checkout (git-ignored: a copy that travels with the tree to a device machine), else from
``../shared/golden`` next to the repository. Without any, a test that uses them FAILS with a message
saying where it looked and how to provide them: a golden test must never pass by running no case.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=100, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=30, **_COMMON)
settings.register_profile("fuzz", max_examples=2000, print_blob=True, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
settings.load_profile(PROFILE)


# ------------------------------------------------------------------------------------ golden
_REPO = Path(__file__).resolve().parents[1]


def golden_candidates():
    """Where golden vectors are looked for, in order: ``$CUFLASH_GOLDEN_DIR`` alone when set (an explicit
    choice never falls back), else ``<checkout>/.golden`` and ``<checkout>/../shared/golden``."""
    explicit = os.environ.get("CUFLASH_GOLDEN_DIR")
    if explicit:
        return [Path(explicit).resolve()]
    return [_REPO / ".golden", _REPO.parent / "shared" / "golden"]


def find_golden_dir():
    """The first candidate directory holding at least one ``.npz``, or None."""
    return next((d for d in golden_candidates() if d.is_dir() and any(d.glob("*.npz"))), None)


GOLDEN_DIR = find_golden_dir()
GOLDEN_MISSING = (f"golden vectors not found: looked for *.npz in {', '.join(map(str, golden_candidates()))}. "
                  f"Provide them with CUFLASH_GOLDEN_DIR=<dir>, or copy ../shared/golden/*.npz into .golden/ "
                  f"in the checkout (git-ignored; name .golden in a device call's carry)")


def golden_names():
    """Stems of the golden ``.npz`` files, sorted; empty when no directory holds any."""
    return sorted(p.stem for p in GOLDEN_DIR.glob("*.npz")) if GOLDEN_DIR is not None else []


class GoldenVector:
    """One golden ``.npz``: arrays as attributes and ``kwargs`` for :func:`cuflash.attention`."""

    def __init__(self, name):
        from cuflash import BlockMask

        self.name = name
        with np.load(GOLDEN_DIR / f"{name}.npz") as data:
            self.arrays = {key: data[key] for key in data.files}
        self.options = json.loads(str(self.arrays.pop("options")))
        for key in ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv"):
            setattr(self, key, self.arrays[key])
        kw = {}
        if self.options.get("causal"):
            kw["causal"] = True
        if self.options.get("scale") is not None:
            kw["scale"] = float(self.options["scale"])
        if self.options.get("window") is not None:
            kw["window"] = tuple(self.options["window"])
        if "block_mask" in self.arrays:
            kw["block_mask"] = BlockMask(self.arrays["block_mask"], block=tuple(self.options["block"]),
                                         seqlen_q=self.q.shape[-3], seqlen_k=self.k.shape[-3])
        for key in ("seqlens_q", "seqlens_k"):
            if key in self.arrays:
                kw[key] = self.arrays[key]
        self.kwargs = kw

    def __repr__(self):
        return f"GoldenVector({self.name!r}, q={self.q.shape}, k={self.k.shape}, options={self.options})"


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

"""The golden vectors (computed in float64 by an independent oracle): where they are and how to read them.

Read from ``$CUFLASH_GOLDEN_DIR`` when it is set, else from ``.golden/`` in the checkout (git-ignored: a
copy that travels with the tree to a device machine), else from ``../shared/golden`` next to the
repository. Without any, a test that uses them FAILS with :data:`GOLDEN_MISSING`: a golden test must
never pass by running no case.
"""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

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
        path = GOLDEN_DIR / f"{name}.npz"
        try:  # a truncated copy failed collection with "BadZipFile: File is not a zip file", naming no file
            with np.load(path) as data:  # allow_pickle stays False: arrays only
                self.arrays = {key: data[key] for key in data.files}
            self.options = json.loads(str(self.arrays.pop("options")))
            for key in ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv"):
                setattr(self, key, self.arrays[key])
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise ValueError(f"golden vector {path} is unreadable ({type(exc).__name__}: {exc}); copy it again from "
                             f"../shared/golden") from None
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




def golden_cases(dtype=np.float16):
    """``(name, Case with inputs rounded to dtype, golden out, golden lse)`` per golden vector, as
    ``pytest.param``\\ s; without vectors one ``missing`` param that fails with :data:`GOLDEN_MISSING`."""
    from cuflash.testing import Case

    if GOLDEN_DIR is None:
        return [pytest.param(None, None, None, None, id="missing",
                             marks=pytest.mark.golden_missing)]
    out = []
    for name in golden_names():
        g = GoldenVector(name)
        q, k, v, dout = (a.astype(dtype) for a in (g.q, g.k, g.v, g.dout))
        out.append(pytest.param(name, Case(q, k, v, dout, options=g.kwargs), g.out, g.lse, id=name))
    return out

"""NumPy's floating-point error state, set aside for cuflash's own arithmetic."""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import numpy as np

F = TypeVar("F", bound=Callable[..., Any])


def ignore_fp_errors(fn: F) -> F:
    """``fn`` run with NumPy's floating-point errors ignored, whatever the caller set: ``np.seterr(all="raise")`` (or
    warnings as errors) made ordinary calls fail, as the softmax's tail underflows as a rule. What the errors would
    report, cuflash's arithmetic handles itself (non-finite values reach exactly the results that see them), so the
    results are the same bits either way. A new ``np.errstate`` per call: one instance entered by two threads at once
    is not safe before NumPy 2. Threads that ``fn`` starts need their own (NumPy 1 keeps the state per thread; NumPy
    2 in the context, which cuflash's workers copy)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]

"""The one validation of every call (:mod:`.core`: dense calls and the visibility rule; :mod:`.ragged`: varlen and
KV-cache calls). Every public entry point funnels its arguments through here before any backend runs."""
from .core import (FLOAT_DTYPES, PRECISIONS, Problem, _check_window, _is_cupy, array_module, as_float,  # noqa: F401
                   check_backward, check_buffer, check_current_device, check_dropout,
                   check_flags, check_int, check_precision_name, dtype_name, key_range, make_problem, native,
                   stats_dtype, visible)
from .ragged import (KVCacheProblem, VarlenProblem, check_offsets, check_varlen_backward,  # noqa: F401
                     make_kvcache_problem, make_varlen_problem)

__all__ = ["FLOAT_DTYPES", "PRECISIONS", "Problem", "_check_window", "_is_cupy", "array_module", "as_float",
           "check_backward", "check_buffer", "check_current_device", "check_dropout", "check_flags",
           "check_int", "check_precision_name",
           "dtype_name", "key_range", "make_problem", "native",
           "stats_dtype", "visible",
           "KVCacheProblem", "VarlenProblem", "check_offsets", "check_varlen_backward", "make_kvcache_problem",
           "make_varlen_problem"]

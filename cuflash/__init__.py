"""cuflash: exact FlashAttention for NumPy and CuPy arrays.

``cuflash.attention(q, k, v, causal=True)`` runs the fused CUDA kernel on CuPy arrays and a
blocked O(N)-memory implementation on NumPy arrays; ``cuflash.attention_backward`` gives dQ,
dK, dV by recomputation from the saved log-sum-exp. ``cuflash.reference`` is the float64 oracle.
Importing cuflash needs neither a GPU, a CUDA driver nor CuPy. Arrays of other libraries (PyTorch, JAX,
array-api-strict, ...: anything with ``__dlpack__``) are taken too and results come back in their type
(:mod:`cuflash.interop`); :mod:`cuflash.jax` is the adapter for ``jax.jit``, ``jax.grad`` and ``jax.vmap``.
"""
from typing import Any

__version__ = "0.1.0"

from . import reference  # noqa: E402
from .api import (AttentionResidual, attention, attention_backward, attention_kvpacked,  # noqa: E402
                  attention_qkvpacked, attention_vjp)
from .blockmask import BlockMask  # noqa: E402
from .dropout import dropout_mask  # noqa: E402
from .io_cost import io_cost  # noqa: E402
from .kvcache import attention_with_kvcache  # noqa: E402
from .merge import merge_attention_states  # noqa: E402
from .varlen import attention_varlen, attention_varlen_backward, attention_varlen_vjp  # noqa: E402


def warmup(*args: Any, **kwargs: Any) -> Any:
    """Compile CUDA kernel specializations ahead of use; see :func:`cuflash.backends.cuda.warmup`."""
    from .backends import cuda

    return cuda.warmup(*args, **kwargs)


__all__ = ["warmup", "attention", "attention_backward", "attention_vjp", "attention_qkvpacked", "attention_kvpacked",
           "attention_varlen", "attention_varlen_backward", "attention_varlen_vjp", "attention_with_kvcache",
           "AttentionResidual", "BlockMask", "dropout_mask", "io_cost", "merge_attention_states", "reference",
           "__version__"]

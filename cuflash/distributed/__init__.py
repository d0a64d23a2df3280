"""Exact sequence-parallel attention across ranks: ring attention and Ulysses, over MPI (mpi4py) or NCCL (CuPy).

When a sequence's keys and values do not fit one device, each rank holds a part of the sequence and calls::

    out, lse = cuflash.distributed.ring_attention(q, k, v, comm, causal=True, return_lse=True)
    dq, dk, dv = cuflash.distributed.ring_attention_backward(dout, q, k, v, out, lse, comm, causal=True)

with ``comm`` an ``mpi4py.MPI.Comm`` (NumPy arrays) or a ``cupy.cuda.nccl.NcclCommunicator`` (CuPy arrays). Each
rank gets its own rows of single-device attention over the whole sequence. :mod:`.ring` explains the algorithm
(what travels, the overlap, memory per rank), :mod:`.layout` the contiguous and zigzag layouts, :mod:`.cost` when
communication is hidden. Nothing here imports mpi4py or CuPy until a communicator of theirs is passed.
"""
from .cost import min_local_seqlen, ring_step
from .layout import LAYOUTS, gather_sequence, local_segments, shard_sequence, unshard_sequence
from .ring import METHODS, ring_attention, ring_attention_backward, ring_attention_vjp

__all__ = ["ring_attention", "ring_attention_backward", "ring_attention_vjp", "shard_sequence", "unshard_sequence",
           "gather_sequence", "local_segments", "ring_step", "min_local_seqlen", "LAYOUTS", "METHODS"]

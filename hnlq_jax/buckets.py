"""Eager row-wise calls on bucketed shapes: one compiled program per row bucket.

A compiled program is specialized to its input shapes, so an eager call on ``x[..., k]`` would
compile again for every new batch size. :func:`run_rows` pads the flattened rows to
:func:`row_bucket` of their count, runs the compiled function on the bucket and cuts the padding
off. On a CPU the padding and slicing run in NumPy on the same memory, so a new batch size inside
a compiled bucket compiles nothing; on an accelerator they are two small cached programs per
shape (still nothing as costly as the function itself).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax.kernels import platform

__all__ = ["row_bucket", "run_rows"]


def row_bucket(rows: int) -> int:
    """Rows an eager call pads ``rows`` rows to: exact up to 8, then four sizes per octave
    (10, 12, 14, 16, 20, 24, ...), so at most 25 % of padding and O(log n) compiled programs
    for any stream of batch sizes."""
    if rows <= 8:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def run_rows(fn, x: jax.Array, *args) -> jax.Array:
    """``fn(x, *args)`` for a row-wise ``fn``, computed on ``x``'s rows padded to their bucket.

    Args:
      fn: a jitted function ``fn(rows[R, k], *args) -> [R, n]`` whose output row ``r`` depends
        only on input row ``r`` (zero rows of padding are computed and dropped).
      x: ``[..., k]``, a NumPy or concrete JAX array (not a tracer).
      *args: the rest of ``fn``'s arguments.

    Returns:
      ``[..., n]``: ``fn``'s rows for ``x``'s rows, a JAX array that owns its memory (on a
      CPU a copy of the bucket's rows: ``jax.device_put`` copies a NumPy array), on ``x``'s
      device where ``x`` is committed to one (as the unpadded call's result is; an ``x``
      sharded over several gives an uncommitted result).
    """
    batch = math.prod(x.shape[:-1])
    pad = row_bucket(batch) - batch
    if not pad and x.ndim == 2:  # the common case: one compiled call, no glue
        return fn(x, *args)
    if platform(x) != "cpu":
        return _rows_out(fn(_pad_rows(x.reshape(batch, x.shape[-1]), pad), *args), x.shape[:-1])
    rows = np.pad(np.asarray(x).reshape(batch, x.shape[-1]), ((0, pad), (0, 0)))
    y = np.asarray(fn(rows, *args))
    one = isinstance(x, jax.Array) and x.committed and len(x.devices()) == 1
    device = next(iter(x.devices())) if one else None
    return jax.device_put(y[:batch].reshape(x.shape[:-1] + y.shape[-1:]), device)  # a copy


@functools.partial(jax.jit, static_argnums=1)
def _pad_rows(rows, pad: int):
    return jnp.pad(rows, ((0, pad), (0, 0)))


@functools.partial(jax.jit, static_argnums=1)
def _rows_out(y, lead: tuple):
    """The first ``prod(lead)`` rows of a bucket's output, shaped ``lead + (n,)``."""
    return y[:int(np.prod(lead, dtype=np.int64))].reshape(lead + (y.shape[-1],))

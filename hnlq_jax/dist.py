"""Compressed data-parallel means: HNLQ codes on JAX's collectives, and an optax transformation.

Inside ``jax.shard_map`` or ``jax.pmap`` over a named axis, :func:`compressed_mean` replaces
``lax.pmean(x, axis)``: every device encodes its array (flattened, cut into d-blocks, in chunks
of ``chunk`` blocks that share one scale), the collective moves only the packed label
bitstream, the int8 T and one int8 exponent per chunk, and every device decodes and averages.

A chunk's scale is the power of two nearest its RMS, ``2^e``, so the chunk enters the codec with
an RMS in ``[0.71, 1.41)``: ``config.beta`` is for unit-RMS data (:func:`hnlq_jax.gaussian_beta`).
Scaling by a power of two is exact, so what a device sent is the same value wherever it is
decoded (no rounding, no FMA contraction can change it), which keeps error feedback exact.

Two methods:

* ``"all_gather"``: one all-gather of every device's payload; each device decodes all ``n``
  payloads. One quantization; each device sends ``(n - 1) P`` bytes (P = one payload).
* ``"reduce_scatter"``: an all-to-all of payload slices, so device i receives slice i of every
  device and averages it, then re-encodes its averaged slice, and an all-gather of those codes
  completes the mean. Each device sends ``2 (n - 1) / n P`` bytes, like a ring all-reduce, but
  the mean is quantized twice (the second time at the scale of the averaged slice), so its
  error is about that of two quantizations instead of one.

Why not sum the codes? Labels add mod q level by level (:mod:`hnlq_jax.modq`), but the carry of
each level into the next is lost and the top level's carry leaves the constellation (SPEC §5):
the sum of n codes decodes to the true sum only while no carry occurs, which for gradient
chunks with their own scales and T is rare. So the codes are decoded and the floats averaged.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import kernels
from hnlq_jax.codec import Codes
from hnlq_jax.config import HNLQConfig
from hnlq_jax.packing import _pack, _unpack, bits_per_block

__all__ = ["METHODS", "Payload", "compressed_mean", "wire_bytes", "compress_gradients",
           "CompressState", "compression_stats"]

METHODS = ("all_gather", "reduce_scatter")
CHUNK = 256  # blocks per scale (a multiple of 8, so a chunk's bitstream is whole bytes)


class Payload(NamedTuple):
    """What goes over the wire for ``C`` chunks of ``chunk`` blocks.

    Attributes:
      data: ``[C, chunk * bits_per_block / 8]`` uint8 label bitstream, one row per chunk.
      T: ``[C, chunk]`` int8.
      exponent: ``[C]`` int8, the chunk's scale is ``2^exponent``.
    """

    data: jax.Array
    T: jax.Array
    exponent: jax.Array


def _check(config, method, chunk, fn):
    if not isinstance(config, HNLQConfig):
        raise TypeError(f"{fn}: config must be an HNLQConfig, got {type(config).__name__}")
    if method not in METHODS:
        raise ValueError(f"{fn}: method must be one of {METHODS}, got {method!r}")
    if not isinstance(chunk, int) or chunk < 8 or chunk % 8:
        raise ValueError(f"{fn}: chunk must be a positive multiple of 8 blocks, got {chunk!r}")


def _layout(size: int, config: HNLQConfig, chunk: int, parts: int) -> tuple[int, int]:
    """``(blocks per chunk, chunks)`` covering ``size`` values in a multiple of ``parts`` chunks.

    Small arrays get smaller chunks (a multiple of 8 blocks), so padding stays below 8 blocks
    per part plus one chunk.
    """
    blocks = max(1, -(-size // config.d))
    chunk = min(chunk, 8 * -(-blocks // (8 * parts)))
    return chunk, parts * -(-blocks // (chunk * parts))


def _encode(v, config: HNLQConfig, chunk: int, n_chunks: int, implementation):
    """Payload of the flat float32 ``v`` (zero-padded to ``n_chunks`` chunks)."""
    d = config.d
    v = jnp.pad(v, (0, n_chunks * chunk * d - v.shape[0])).reshape(n_chunks, chunk * d)
    rms = jnp.sqrt(jnp.mean(jnp.square(v), axis=1))
    mantissa, e = jnp.frexp(jnp.where(jnp.isfinite(rms), rms, 1.0))  # rms = mantissa 2^e
    e = jnp.clip(jnp.where(mantissa < np.sqrt(0.5), e - 1, e), -126, 127)
    blocks = jnp.ldexp(v, -e[:, None]).reshape(-1, d)
    codes = kernels.encode(blocks, config, implementation=implementation)
    data = _pack(codes.labels, config).reshape(n_chunks, -1)
    return Payload(data, codes.T.reshape(n_chunks, chunk), e.astype(jnp.int8))


def _decode(p: Payload, config: HNLQConfig, implementation):
    """Flat float32 values of a payload (``C * chunk * d``); NaN in blocks with T = -1."""
    C, chunk = p.T.shape
    labels, _ = _unpack(p.data.reshape(-1), config, C * chunk)
    x = kernels.decode(Codes(labels.reshape(C * chunk, config.M, config.d), p.T.reshape(-1)),
                       config, dtype=jnp.float32, implementation=implementation)
    return jnp.ldexp(x.reshape(C, -1), p.exponent.astype(jnp.int32)[:, None]).reshape(-1)


def _ordered_mean(dec):
    """Mean over the leading (device) axis, summed in device order.

    A fixed order makes the mean the same function on every backend (a tree reduction's order
    is the compiler's choice), which matters where the mean is quantized again.
    """
    total = jax.lax.fori_loop(1, dec.shape[0], lambda i, acc: acc + dec[i], dec[0])
    return total / dec.shape[0]


def _gather(p: Payload, axis_name) -> Payload:
    return Payload(*(jax.lax.all_gather(a, axis_name, to="invarying") for a in p))


def _mean_all_gather(v, config, chunk, axis_name, implementation):
    chunk, n_chunks = _layout(v.shape[0], config, chunk, 1)
    mine = _encode(v, config, chunk, n_chunks, implementation)
    everyone = _gather(mine, axis_name)  # [n, ...]
    dec = jax.vmap(lambda p: _decode(p, config, implementation))(everyone)
    return _ordered_mean(dec), mine


def _mean_reduce_scatter(v, config, chunk, axis_name, implementation):
    n = jax.lax.axis_size(axis_name)
    chunk, n_chunks = _layout(v.shape[0], config, chunk, n)
    mine = _encode(v, config, chunk, n_chunks, implementation)
    # Slice i of every device's payload goes to device i.
    parts = Payload(*(jax.lax.all_to_all(a.reshape((n, -1) + a.shape[1:]), axis_name, 0, 0)
                      for a in mine))
    avg = _ordered_mean(jax.vmap(lambda p: _decode(p, config, implementation))(parts))
    slice_codes = _encode(avg, config, chunk, n_chunks // n, implementation)
    everyone = _gather(slice_codes, axis_name)  # [n, ...], slice i from device i
    return jax.vmap(lambda p: _decode(p, config, implementation))(everyone).reshape(-1), mine


def _compressed_mean(x, axis_name, config, method, chunk, implementation):
    """``(mean, own payload)`` of ``x`` over the axis (float32, flat, padded)."""
    v = jnp.ravel(x).astype(jnp.float32)
    f = _mean_all_gather if method == "all_gather" else _mean_reduce_scatter
    return f(v, config, chunk, axis_name, implementation)


def compressed_mean(x, axis_name, config: HNLQConfig, method: str = "all_gather", *,
                    chunk: int = CHUNK, implementation=None):
    """The mean of ``x`` over a named axis, communicated as HNLQ codes.

    Call inside ``jax.shard_map`` (a ``pallas_call`` there needs ``check_vma=False``, which
    matters when the kernels run, on a GPU) or ``jax.pmap``.

    Args:
      x: array of any shape and floating dtype (the local value on this device).
      axis_name: the mapped axis to average over.
      config: the quantizer; ``beta`` for unit-RMS data (:func:`hnlq_jax.gaussian_beta`).
      method: ``"all_gather"`` or ``"reduce_scatter"`` (see the module docstring).
      chunk: d-blocks per float32 scale.
      implementation: encode/decode implementation (:mod:`hnlq_jax.kernels`).

    Returns:
      The mean, shaped and typed as ``x``; identical on every device.
    """
    _check(config, method, chunk, "compressed_mean")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"compressed_mean: x must be floating, got {x.dtype}")
    mean, _ = _compressed_mean(x, axis_name, config, method, chunk, implementation)
    return mean[: x.size].reshape(x.shape).astype(x.dtype)


def _nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree))


def wire_bytes(x, config: HNLQConfig, axis_size: int, method: str = "all_gather", *,
               chunk: int = CHUNK) -> dict:
    """Bytes each device sends for one :func:`compressed_mean` of ``x``, and the float32 baseline.

    Computed from the payload's actual shapes and dtypes (``jax.eval_shape`` of the encoder).
    A device sends its payload P to the ``n - 1`` others (all_gather: ``(n - 1) P``); for
    reduce_scatter, ``(n - 1) / n`` of P in the all-to-all and its averaged slice (``P / n``)
    to the ``n - 1`` others. The baseline is a ring all-reduce of float32, ``2 (n - 1) / n``
    times the array's float32 bytes.

    Args:
      x: the array (or anything with ``.shape``).
      config, method, chunk: as for :func:`compressed_mean`.
      axis_size: number of devices n.

    Returns:
      dict with ``payload`` (P), ``sent`` (bytes per device), ``float32_allreduce`` and
      ``ratio`` (float32_allreduce / sent).
    """
    _check(config, method, chunk, "wire_bytes")
    n = int(axis_size)
    size = int(np.prod(np.shape(x)))
    chunk, n_chunks = _layout(size, config, chunk, n if method == "reduce_scatter" else 1)
    P = _nbytes(jax.eval_shape(
        lambda v: _encode(v, config, chunk, n_chunks, "xla"),
        jax.ShapeDtypeStruct((size,), jnp.float32)))
    sent = (n - 1) * P if method == "all_gather" else 2 * (n - 1) * P // n
    base = 2 * (n - 1) * 4 * size / n
    return {"payload": P, "sent": sent, "float32_allreduce": base,
            "ratio": base / sent if sent else float("inf")}


# --------------------------------------------------------------------------- optax


class CompressState(NamedTuple):
    """State of :func:`compress_gradients`.

    Attributes:
      step: int32 count of updates.
      residual: per-leaf float32 error-feedback residuals (``()`` for leaves sent plainly or
        without error feedback).
      stats: ``bytes_sent`` and ``float32_bytes`` of the last step (per device), their
        ``ratio``, and ``overload_rate`` (fraction of this step's blocks with T > 0).
    """

    step: jax.Array
    residual: Any
    stats: dict


def _zero_stats():
    return {"bytes_sent": jnp.zeros((), jnp.float32), "float32_bytes": jnp.zeros((), jnp.float32),
            "ratio": jnp.ones((), jnp.float32), "overload_rate": jnp.zeros((), jnp.float32)}


def compress_gradients(config: HNLQConfig, axis_name, method: str = "all_gather",
                       error_feedback: bool = True, warmup_steps: int = 0,
                       min_size: int = 1024, *, chunk: int = CHUNK,
                       implementation=None):
    """An optax transformation replacing each device's gradient by its compressed mean.

    Use inside ``jax.shard_map`` / ``jax.pmap`` over ``axis_name``, first in an
    ``optax.chain``. Leaves with fewer than ``min_size`` entries, and every leaf during the
    first ``warmup_steps`` updates, take the exact mean (``lax.pmean``). With error feedback,
    what quantization left out is kept per leaf and added to the next gradient:
    ``v = g + r``, send codes of v, ``r' = v - sent`` where ``sent`` is v's decoded codes, the
    very values the other devices receive.

    Args:
      config: the quantizer (``beta`` for unit-RMS chunks: :func:`hnlq_jax.gaussian_beta`).
      axis_name: the data-parallel axis.
      method: ``"all_gather"`` or ``"reduce_scatter"``.
      error_feedback: keep the residuals.
      warmup_steps: updates that use the exact mean first.
      min_size: leaves smaller than this use the exact mean.
      chunk, implementation: as for :func:`compressed_mean`.

    Returns:
      ``optax.GradientTransformation``; its state is a :class:`CompressState`
      (:func:`compression_stats` finds it in a chain's state).
    """
    import optax  # only here: optax comes with the flax extra, the collectives need only jax

    _check(config, method, chunk, "compress_gradients")
    for name, v in (("warmup_steps", warmup_steps), ("min_size", min_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"compress_gradients: {name} must be an int >= 0, got {v!r}")

    def compressed(leaf) -> bool:
        return leaf.size >= min_size

    def init(params):
        def res(p):
            if error_feedback and compressed(p):
                return jnp.zeros(p.shape, jnp.float32)
            return ()
        return CompressState(jnp.zeros((), jnp.int32), jax.tree.map(res, params), _zero_stats())

    def leaf_update(g, r):
        """``(mean, new residual, overloaded blocks)`` of one compressed leaf."""
        v = g.astype(jnp.float32)
        if error_feedback:
            v = v + r
        mean, mine = _compressed_mean(v, axis_name, config, method, chunk, implementation)
        mean = mean[: g.size].reshape(g.shape).astype(g.dtype)
        if error_feedback:
            r = v - _decode(mine, config, implementation)[: g.size].reshape(g.shape)
        return mean, r, jnp.sum(mine.T > 0)

    def update(updates, state, params=None):
        del params
        n = jax.lax.axis_size(axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        residuals = treedef.flatten_up_to(state.residual)
        which = [compressed(g) for g in leaves]
        f32 = [2 * (n - 1) * 4 * g.size / n for g in leaves]
        sent = sum(wire_bytes(g, config, n, method, chunk=chunk)["sent"] if c else b
                   for g, c, b in zip(leaves, which, f32))
        blocks = max(1, sum(-(-g.size // config.d) for g, c in zip(leaves, which) if c))

        def exact(args):
            gs, rs = args
            return [jax.lax.pmean(g, axis_name) for g in gs], rs, jnp.zeros((), jnp.int32)

        def coded(args):
            gs, rs = args
            outs, new_rs, over = [], [], jnp.zeros((), jnp.int32)
            for g, r, c in zip(gs, rs, which):
                if c:
                    g, r, k = leaf_update(g, r)
                    over = over + k
                else:
                    g = jax.lax.pmean(g, axis_name)
                outs.append(g)
                new_rs.append(r)
            return outs, new_rs, jax.lax.psum(over, axis_name).astype(jnp.int32)

        args = (leaves, residuals)
        if warmup_steps:
            out, new_res, over = jax.lax.cond(state.step < warmup_steps, exact, coded, args)
            sent = jnp.where(state.step < warmup_steps, sum(f32), sent)
        else:
            out, new_res, over = coded(args)
        total = sum(f32)
        stats = {"bytes_sent": jnp.asarray(sent, jnp.float32),
                 "float32_bytes": jnp.asarray(total, jnp.float32),
                 "ratio": jnp.asarray(total / jnp.maximum(sent, 1), jnp.float32),
                 "overload_rate": (over / (blocks * n)).astype(jnp.float32)}
        return (treedef.unflatten(out),
                CompressState(state.step + 1, treedef.unflatten(new_res), stats))

    return optax.GradientTransformation(init, update)


def compression_stats(opt_state) -> dict | None:
    """The ``stats`` of the first :class:`CompressState` inside an optimizer state."""
    for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, CompressState)):
        if isinstance(s, CompressState):
            return s.stats
    return None

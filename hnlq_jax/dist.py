"""Compressed data-parallel means: HNLQ codes on JAX's collectives, and an optax transformation.

Inside ``jax.shard_map`` or ``jax.pmap`` over a named axis, :func:`compressed_mean` replaces
``lax.pmean(x, axis)``: every device encodes its array into the payload of
:mod:`hnlq_jax.wire` (flattened, cut into d-blocks, in chunks of up to ``chunk`` blocks with one
power-of-two scale each; labels at ``M log2 q`` bits per block, T as flag bits and unary
codes in a fixed per-chunk capacity), the collective moves only those bytes, and every device decodes and
averages. Each chunk's scale puts its RMS in ``[0.71, 1.41)``, so the config's beta is for
unit-RMS data (an uncalibrated config, beta = 1.0, gets :func:`hnlq_jax.gaussian_beta`; see
:func:`hnlq_jax.wire.chunk_config`). Scaling by a power of two is exact, so what a device sent
is the same value wherever it is decoded, which keeps error feedback exact. A chunk's scale also
grows with its largest block, so a spike (even 1e20) is coded, and costs only its own chunk's
resolution, instead of turning into NaN; only non-finite input decodes to NaN.

Two methods:

* ``"all_gather"``: one all-gather of every device's payload; each device decodes all ``n``
  payloads. One quantization; each device sends ``(n - 1) P`` bytes (P = one payload).
* ``"reduce_scatter"``: an all-to-all of payload parts, so device i receives part i of every
  device and averages it, then re-encodes its averaged part, and an all-gather of those codes
  completes the mean. Each device sends ``2 (n - 1) / n P`` bytes, like a ring all-reduce, but
  the mean is quantized twice (the second time at the scale of the averaged part), so its
  error is about that of two quantizations instead of one.

Why not sum the codes? Labels add mod q level by level (:mod:`hnlq_jax.modq`), but the carry of
each level into the next is lost and the top level's carry leaves the constellation
(``docs/math.md``, "Mod-q arithmetic"): the sum of n codes decodes to the true sum only while no
carry occurs, which for gradient chunks with their own scales and T is rare. So the codes are
decoded and the floats averaged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import wire
from hnlq_jax._numerics import saturating_cast as saturate  # (public here: the DDP hook's too)
from hnlq_jax.config import HNLQConfig, check_config

__all__ = ["METHODS", "CHUNK", "compressed_mean", "wire_bytes", "compress_gradients",
           "CompressState", "compression_stats", "decode_parts", "mean_of_parts",
           "feedback_residual", "requantize", "saturate"]

METHODS = ("all_gather", "reduce_scatter")
CHUNK = wire.CHUNK


def _layout(size: int, config: HNLQConfig, method: str, n: int, chunk: int, t_capacity,
            fn: str) -> wire.Layout:
    """The wire layout of one device's ``size`` values (validates the arguments)."""
    check_config(config, fn)
    if method not in METHODS:
        raise ValueError(f"{fn}: method must be one of {METHODS}, got {method!r}")
    return wire.layout(size, config, n if method == "reduce_scatter" else 1, chunk=chunk,
                       t_capacity=t_capacity)


def _ordered_mean(dec):
    """Mean over the leading (device) axis, summed in device order.

    A fixed order makes the mean the same function on every backend (a tree reduction's order
    is the compiler's choice), which matters where the mean is quantized again. Where the sum
    overflows (n values near the float maximum) the mean is that of the values scaled by
    ``2^-k`` (``2^k >= n``; exact for such values) and scaled back, so a finite mean never
    turns into Inf; elsewhere it is ``sum / n`` (scaling would flush tiny values).
    """
    n = dec.shape[0]
    k = max(0, (n - 1).bit_length())

    def mean(v):
        return jax.lax.fori_loop(1, n, lambda i, acc: acc + v[i], v[0]) / n

    plain = mean(dec)
    scaled = mean(dec * jnp.asarray(2.0**-k, dec.dtype)) * jnp.asarray(2.0**k, dec.dtype)
    return jnp.where(jnp.isfinite(plain), plain, scaled)


def decode_parts(parts, lay: wire.Layout, implementation=None):
    """``[n, lay.part_values]`` float32 values of wire parts ``uint8 [n, lay.part_bytes]``
    (each part one device's, :func:`hnlq_jax.wire.decode_part`)."""
    return jax.vmap(lambda p: wire.decode_part(p, lay, implementation))(parts)


def mean_of_parts(parts, lay: wire.Layout, implementation=None):
    """The mean ``[lay.part_values]`` float32 of wire parts ``uint8 [n, lay.part_bytes]``,
    summed in the parts' (device) order: the same bits on every device and backend, and
    finite wherever every part's value is (the sum cannot overflow)."""
    return _ordered_mean(decode_parts(parts, lay, implementation))


def feedback_residual(v, sent, previous):
    """Error feedback's next residual ``v - sent`` (``v`` the gradient plus ``previous``,
    ``sent`` its decoded payload), but ``previous`` where ``sent`` is NaN: a chunk of
    non-finite values (sent as NaN) leaves the residual as it was, so one overflowed step (a
    loss scaler then skips it) does not make every later step's chunk NaN too."""
    return jnp.where(jnp.isnan(sent), previous, v - sent)


def requantize(avg, lay: wire.Layout, residual=None, implementation=None):
    """A reduce-scatter's second quantization: ``(payload, next residual)`` of a device's
    averaged part ``avg [lay.part_values]`` (``lay``: the full layout), with error feedback
    where ``residual`` (the part's, ``[lay.part_values]``) is given: ``avg + residual`` is
    encoded and what its codes left out kept for the next step (:func:`feedback_residual`),
    so that the owner's re-encoding, repeated step after step, leaves no bias either."""
    if residual is not None:
        avg = avg + residual
    part, _ = wire.encode(avg, lay.slice(), implementation)
    if residual is not None:
        residual = feedback_residual(avg, wire.decode(part, lay.slice(), implementation),
                                     residual)
    return part, residual


def _compressed_mean(v, axis_name, lay: wire.Layout, implementation, part_residual=None):
    """``(mean [padded], own payload, Info, next part residual)`` of the flat float32 ``v``
    over the axis (``part_residual``: reduce_scatter's, see :func:`requantize`)."""
    mine, info = wire.encode(v, lay, implementation)
    if lay.parts == 1:  # all_gather
        everyone = jax.lax.all_gather(mine[0], axis_name, to="invarying")  # [n, part_bytes]
        return mean_of_parts(everyone, lay, implementation), mine, info, None
    # reduce_scatter: part i of every device goes to device i.
    parts = jax.lax.all_to_all(mine, axis_name, 0, 0)
    part, part_residual = requantize(mean_of_parts(parts, lay, implementation), lay,
                                     part_residual, implementation)
    everyone = jax.lax.all_gather(part[0], axis_name, to="invarying")  # part i from device i
    return decode_parts(everyone, lay, implementation).reshape(-1), mine, info, part_residual


def compressed_mean(x, axis_name, config: HNLQConfig, method: str = "all_gather", *,
                    chunk: int = CHUNK, t_capacity: float | None = None, implementation=None):
    """The mean of ``x`` over a named axis, communicated as HNLQ codes.

    Call inside ``jax.shard_map`` (a ``pallas_call`` there needs ``check_vma=False``, which
    matters when the kernels run, on a GPU) or ``jax.pmap``. Inside them the arrays are
    traced, and the implementation (and the Pallas kernels' interpret mode) follows JAX's
    default device: for a mesh of CPU devices on a GPU machine, trace under
    ``jax.default_device(jax.devices("cpu")[0])`` (or pass ``implementation="xla"``).

    Args:
      x: array of any shape and floating dtype (the local value on this device).
      axis_name: the mapped axis to average over.
      config: the quantizer; beta for unit-RMS data (:func:`hnlq_jax.gaussian_beta`, used
        when beta is the default 1.0).
      method: ``"all_gather"`` or ``"reduce_scatter"`` (see the module docstring).
      chunk: d-blocks per power-of-two scale (a multiple of 8).
      t_capacity: T stream bits per block of a chunk (:func:`hnlq_jax.wire.layout`).
      implementation: encode/decode implementation (as for :func:`hnlq_jax.encode`).

    Returns:
      The mean, shaped and typed as ``x`` (:func:`saturate`: a mean near a half-precision
      maximum stays finite); identical on every device. NaN where some device's input was
      not finite, and possibly where its chunk held values within a factor of about 2 of
      float32's maximum (no power-of-two scale may take it; ``docs/dist.md``). On a
      one-device axis ``x`` itself (``lax.pmean``'s: exact, nothing is communicated).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"compressed_mean: x must be floating, got {x.dtype}")
    n = jax.lax.axis_size(axis_name) if method == "reduce_scatter" else 1
    lay = _layout(x.size, config, method, n, chunk, t_capacity, "compressed_mean")
    if jax.lax.axis_size(axis_name) == 1:  # nothing is sent: the mean of one value is itself,
        return jax.lax.pmean(x, axis_name)  # typed as the same on every device (x would vary)
    mean = _compressed_mean(jnp.ravel(x).astype(jnp.float32), axis_name, lay,
                            implementation)[0]
    return saturate(mean[: x.size].reshape(x.shape), x.dtype)


def wire_bytes(x, config: HNLQConfig, axis_size: int, method: str = "all_gather", *,
               chunk: int = CHUNK, t_capacity: float | None = None) -> dict:
    """Bytes each device sends for one :func:`compressed_mean` of ``x``, and the float32 baseline.

    A device sends its payload P (``wire.Layout.payload_bytes``) to the ``n - 1`` others
    (all_gather: ``(n - 1) P``); for reduce_scatter, ``(n - 1) / n`` of P in the all-to-all
    and its averaged part (``P / n``) to the ``n - 1`` others. The baseline is a ring
    all-reduce of float32, ``2 (n - 1) / n`` times the array's float32 bytes. On one device
    nothing is sent either way and the ratio is 1.

    Args:
      x: the array (or anything with ``.shape``).
      config, method, chunk, t_capacity: as for :func:`compressed_mean`.
      axis_size: number of devices n.

    Returns:
      dict with ``payload`` (P), ``sent`` (bytes per device), ``float32_allreduce`` and
      ``ratio_to_float32`` (``sent / float32_allreduce``, the name and direction of every size
      ratio in the library, :mod:`hnlq_jax.sizes`).
    """
    n = int(axis_size)
    if n < 1:
        raise ValueError(f"wire_bytes: axis_size must be >= 1, got {axis_size!r}")
    size = int(np.prod(np.shape(x), dtype=np.int64))
    P = _layout(size, config, method, n, chunk, t_capacity, "wire_bytes").payload_bytes
    sent = (n - 1) * P if method == "all_gather" else 2 * (n - 1) * P // n
    base = 2 * (n - 1) * 4 * size / n
    return {"payload": P, "sent": sent, "float32_allreduce": base,
            "ratio_to_float32": sent / base if base else 1.0}


# --------------------------------------------------------------------------- optax


class CompressState(NamedTuple):
    """State of :func:`compress_gradients`.

    Attributes:
      step: int32 count of updates.
      residual: per-leaf float32 error-feedback residuals (``()`` for leaves sent plainly or
        without error feedback; with ``"reduce_scatter"`` a pair: the leaf's, and that of the
        device's part of the mean, held at its place in a leaf-shaped array: twice the
        memory of all_gather's, as ``init`` does not know the number of devices).
      stats: ``bytes_sent`` and ``float32_bytes`` of the last step (per device),
        ``ratio_to_float32`` (``bytes_sent / float32_bytes``), ``overload_rate`` (fraction of
        this step's coded blocks with T > 0, over all devices), ``rescaled_chunks`` (chunks whose scale the wire's rate control raised
        to fit the T capacity) and ``failed_chunks`` (chunks of non-finite values, sent as
        NaN), both summed over the devices' own payloads.
    """

    step: jax.Array
    residual: Any
    stats: dict


def _zero_stats():
    return {"bytes_sent": jnp.zeros((), jnp.float32), "float32_bytes": jnp.zeros((), jnp.float32),
            "ratio_to_float32": jnp.ones((), jnp.float32),
            "overload_rate": jnp.zeros((), jnp.float32),
            "rescaled_chunks": jnp.zeros((), jnp.int32), "failed_chunks": jnp.zeros((), jnp.int32)}


def compress_gradients(config: HNLQConfig, axis_name, method: str = "all_gather",
                       error_feedback: bool = True, warmup_steps: int = 0,
                       min_size: int = 1024, *, chunk: int = CHUNK,
                       t_capacity: float | None = None, implementation=None):
    """An optax transformation replacing each device's gradient by its compressed mean.

    Use inside ``jax.shard_map`` / ``jax.pmap`` over ``axis_name``, first in an
    ``optax.chain``. Leaves with fewer than ``min_size`` entries, every leaf during the
    first ``warmup_steps`` updates, and all of them on a one-device axis (nothing to send)
    take the exact mean (``lax.pmean``). With error feedback, what quantization left out is
    kept per leaf and added to the next gradient: ``v = g + r``, send codes of v,
    ``r' = v - sent`` where ``sent`` is v's decoded codes, the very values the other devices
    receive (:func:`feedback_residual`: a chunk of non-finite values keeps ``r``). With
    ``"reduce_scatter"`` the second quantization, each device's re-encoding of its averaged
    part of the mean, is fed back too (:func:`requantize`: that device keeps the part's
    residual), so that its error, repeated step after step, leaves no bias either.

    Args:
      config: the quantizer (``beta`` for unit-RMS chunks: :func:`hnlq_jax.gaussian_beta`,
        used when beta is the default 1.0).
      axis_name: the data-parallel axis.
      method: ``"all_gather"`` or ``"reduce_scatter"``.
      error_feedback: keep the residuals.
      warmup_steps: updates that use the exact mean first.
      min_size: leaves smaller than this use the exact mean.
      chunk, t_capacity, implementation: as for :func:`compressed_mean`.

    Returns:
      ``optax.GradientTransformation``; its state is a :class:`CompressState`
      (:func:`compression_stats` finds it in a chain's state).
    """
    import optax  # only here: optax comes with the flax extra, the collectives need only jax

    _layout(1, config, method, 1, chunk, t_capacity, "compress_gradients")  # validates
    for name, v in (("warmup_steps", warmup_steps), ("min_size", min_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"compress_gradients: {name} must be an int >= 0, got {v!r}")

    def compressed(leaf) -> bool:
        return leaf.size >= min_size

    def init(params):
        def res(p):
            if error_feedback and compressed(p):
                def r():  # (two buffers: a donated state must not hold one twice)
                    return jnp.zeros(p.shape, jnp.float32)
                # reduce_scatter: the residual of this device's part of the mean too, held at
                # its place in a leaf-shaped array (the parts' size depends on the axis size,
                # unknown here)
                return (r(), r()) if method == "reduce_scatter" else r()
            return ()
        return CompressState(jnp.zeros((), jnp.int32), jax.tree.map(res, params), _zero_stats())

    def leaf_update(g, r, lay):
        """``(mean, new residual, wire.Info)`` of one compressed leaf."""
        v = jnp.ravel(g).astype(jnp.float32)
        own = None
        if error_feedback:
            if lay.parts > 1:
                r, r_mean = r
                at = jax.lax.axis_index(axis_name) * lay.part_values
                own = jax.lax.dynamic_slice(jnp.pad(jnp.ravel(r_mean), (
                    0, lay.parts * lay.part_values - g.size)), (at,), (lay.part_values,))
            v = v + jnp.ravel(r)
        mean, mine, info, own = _compressed_mean(v, axis_name, lay, implementation, own)
        mean = saturate(mean[: g.size].reshape(g.shape), g.dtype)
        if error_feedback:  # what this device sent, as every receiver decodes it
            sent = wire.decode(mine, lay, implementation)
            r = feedback_residual(v, sent, jnp.ravel(r)).reshape(g.shape)
            if lay.parts > 1:  # (the padding's mean is 0, coded exactly: its residual 0)
                r_mean = jax.lax.dynamic_update_slice(
                    jnp.zeros(lay.parts * lay.part_values, jnp.float32), own, (at,))
                r = (r, r_mean[: g.size].reshape(g.shape))
        return mean, r, info

    def update(updates, state, params=None):
        del params
        n = jax.lax.axis_size(axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        residuals = treedef.flatten_up_to(state.residual)
        which = [compressed(g) for g in leaves]
        if error_feedback and method == "reduce_scatter" and any(
                c and not isinstance(r, tuple) for c, r in zip(which, residuals)):
            raise ValueError("compress_gradients: with method='reduce_scatter' each coded "
                             "leaf's residual is a pair (the leaf's, its part of the mean's); "
                             "this state holds one array (made by an older hnlq_jax?): make "
                             "it with this transformation's init")
        lays = [_layout(g.size, config, method, n, chunk, t_capacity, "compress_gradients")
                if c else None for g, c in zip(leaves, which)]
        f32 = [2 * (n - 1) * 4 * g.size / n for g in leaves]
        # what pmean sends of a leaf: a ring all-reduce in the leaf's own dtype
        plain = [2 * (n - 1) * jnp.dtype(g.dtype).itemsize * g.size / n for g in leaves]
        sent = sum(wire_bytes(g, config, n, method, chunk=chunk, t_capacity=t_capacity)["sent"]
                   if c else b for g, c, b in zip(leaves, which, plain))
        blocks = max(1, sum(-(-g.size // config.d) for g, c in zip(leaves, which) if c))
        none = wire.Info(*(jnp.zeros((), jnp.int32) for _ in wire.Info._fields))

        def exact(args):
            gs, rs = args
            return [jax.lax.pmean(g, axis_name) for g in gs], rs, none

        def coded(args):
            gs, rs = args
            outs, new_rs, total = [], [], none
            for g, r, lay in zip(gs, rs, lays):
                if lay is None:
                    g = jax.lax.pmean(g, axis_name)
                else:
                    g, r, info = leaf_update(g, r, lay)
                    total = jax.tree.map(jnp.add, total, info)
                outs.append(g)
                new_rs.append(r)
            return outs, new_rs, jax.lax.psum(total, axis_name)

        args = (leaves, residuals)
        if n == 1:  # one device: the mean is its own gradient, nothing is sent
            out, new_res, info = exact(args)
        elif warmup_steps:
            out, new_res, info = jax.lax.cond(state.step < warmup_steps, exact, coded, args)
            sent = jnp.where(state.step < warmup_steps, sum(plain), sent)
        else:
            out, new_res, info = coded(args)
        total = sum(f32)
        stats = {"bytes_sent": jnp.asarray(sent, jnp.float32),
                 "float32_bytes": jnp.asarray(total, jnp.float32),
                 # one device sends nothing either way: 1, as wire_bytes reports
                 "ratio_to_float32": jnp.where(
                     total > 0, jnp.asarray(sent, jnp.float32)
                     / jnp.maximum(jnp.asarray(total, jnp.float32), 1), 1.0),
                 "overload_rate": (info.overloaded / (blocks * n)).astype(jnp.float32),
                 "rescaled_chunks": info.rescaled, "failed_chunks": info.failed}
        return (treedef.unflatten(out),
                CompressState(state.step + 1, treedef.unflatten(new_res), stats))

    return optax.GradientTransformation(init, update)


def compression_stats(opt_state) -> dict | None:
    """The ``stats`` of the first :class:`CompressState` inside an optimizer state."""
    for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, CompressState)):
        if isinstance(s, CompressState):
            return s.stats
    return None

"""Mod-q arithmetic on HNLQ labels: compressed-domain sums and when they are right.

(``docs/math.md``, "Mod-q arithmetic".)

Labels add componentwise mod q, level by level: ``r((b + b') mod q) = r(b) + r(b') mod qL``, so
the sum of two level-m labels is the sum of their lattice points modulo ``qL``. What the
level-wise sum loses is the carry: ``r(b) + r(b') - r(b + b')`` is a point of ``qL`` that
belongs to level ``m + 1`` and is dropped, and the top level's carry leaves the constellation.
Hence ``decode(accumulate(codes))`` equals the sum of the decoded codes only for some blocks;
:func:`validate` says which, and :func:`sum_with_fallback` returns the true sum, taking the
decoded path where the mod-q one is wrong.

All summands of a block must share the same scale (``beta`` and T): blocks whose T differ along
the summed axis, or are invalid (``T = -1``, or an index or T out of range: corrupted codes under
``jit``, where they cannot raise), get ``T = -1`` in the result. Dithered configs
are rejected: each dithered code decodes with ``-z``, so a sum of K codes would need ``-K z``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hnlq_jax.codec import check_beta_fits, decode_blocks, default_float, lattice_sum
from hnlq_jax.codes import (Codes, check_codes, index_dtype, index_from_labels, pack_t, unpack_t,
                            valid_blocks)
from hnlq_jax.config import is_integer

__all__ = ["add", "accumulate", "validate", "sum_with_fallback"]


def check(codes, fn: str):
    """``(labels [..., M, d] int32, T [...] int32)`` of block codes fit for mod-q sums."""
    check_codes(codes, fn)
    config = codes.config
    if config.dither is not None:
        raise ValueError(
            f"{fn}: mod-q sums need a config without dither (each dithered code decodes with "
            "-z, a sum of K codes would need -K z)"
        )
    if codes.scale is not None:
        raise ValueError(f"{fn}: mod-q sums need codes without row scales (the summands of a "
                         "block must share one scale)")
    lead = codes.blocks_shape
    u = unpack_t(codes.tfield, config, lead[-1] if lead else None)
    # An index or T out of range (corrupted codes under jit, where it cannot raise) sums as a
    # failed block: its labels are a valid label's digits, its value would be finite garbage.
    T = jnp.where(valid_blocks(codes.index, u, config), u - 1, -1)
    return codes.labels.astype(jnp.int32), T


def leading_axis(axis, T, fn: str) -> int:
    """``axis`` (an int, NumPy's too; not a bool) as a non-negative axis of ``T``, checked."""
    if not is_integer(axis) or not -T.ndim <= axis < T.ndim:
        raise ValueError(
            f"{fn}: axis must be an int indexing the leading (block) axes of shape {T.shape}, "
            f"got {axis!r}"
        )
    if T.shape[axis] == 0:
        raise ValueError(f"{fn}: the summed axis {axis} of the codes (blocks {T.shape}) is empty; "
                         "a mod-q sum needs at least one summand")
    return int(axis) % T.ndim


def _same_T(T, axis: int):
    """T along ``axis`` when all equal and valid, else -1 (the block has no common scale)."""
    first = jnp.take(T, 0, axis=axis)
    ok = jnp.all(T == jnp.expand_dims(first, axis), axis=axis) & (first >= 0)
    return jnp.where(ok, first, -1)


def _sum_labels(labels, T, config, axis):
    """``(labels [..., M, d] int32, T [...])`` of the label-wise sum mod q along ``axis``."""
    return jnp.remainder(jnp.sum(labels, axis=axis), config.q), _same_T(T, axis)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _accumulate(labels, T, config, axis):
    lab, T = _sum_labels(labels, T, config, axis)
    return Codes(index_from_labels(lab, config.q, index_dtype(config)), pack_t(T, config), config)


def add(codes_a: Codes, codes_b: Codes) -> Codes:
    """Label-wise sum mod q of two codes, per level.

    Args:
      codes_a, codes_b: block codes of one config (without dither) with broadcastable leading
        shapes.

    Returns:
      ``Codes`` of the broadcast shape; T is the common T, or -1 where the two differ. Row
      codes (``n`` set, no scale) give row codes of that ``n``.
    """
    la, Ta = check(codes_a, "add")
    lb, Tb = check(codes_b, "add")
    config = codes_a.config
    if codes_b.config != config:
        raise ValueError(f"add: the two codes were made with different configs: {config} and "
                         f"{codes_b.config}")
    try:
        shape = jnp.broadcast_shapes(Ta.shape, Tb.shape)
    except ValueError:
        raise ValueError(f"add: leading shapes {Ta.shape} and {Tb.shape} do not broadcast") from None
    lab = jnp.stack([jnp.broadcast_to(la, shape + la.shape[-2:]),
                     jnp.broadcast_to(lb, shape + lb.shape[-2:])])
    if None not in (codes_a.n, codes_b.n) and codes_a.n != codes_b.n:
        raise ValueError(f"add: row codes of different lengths n = {codes_a.n} and "
                         f"{codes_b.n}")
    out = _accumulate(lab, jnp.stack([jnp.broadcast_to(Ta, shape), jnp.broadcast_to(Tb, shape)]),
                      config, 0)
    return _keep_rows(out, codes_a.n if codes_b.n is None else codes_b.n)


def _keep_rows(codes: Codes, n) -> Codes:
    """``codes`` as row codes of length ``n`` (the summands'), or block codes (``n`` None)."""
    return codes if n is None else codes.with_rows(n=n)


def accumulate(codes: Codes, axis: int = 0) -> Codes:
    """Label-wise sum mod q along a leading axis: the compressed-domain sum.

    Args:
      codes: block codes (config without dither).
      axis: the leading axis to sum over (an axis of ``codes.T``).

    Returns:
      ``Codes`` with ``axis`` removed; T is the common T of the summands, or -1 where they
      differ. Decoding it gives the true sum only where :func:`validate` says so. Row codes
      (``n`` set, no scale) summed over a row axis stay row codes of that ``n``; summed over
      their blocks (the last axis) they are block codes.
    """
    labels, T = check(codes, "accumulate")
    axis = leading_axis(axis, T, "accumulate")
    out = _accumulate(labels, T, codes.config, axis)
    return _keep_rows(out, codes.n if axis < T.ndim - 1 else None)


def _lattice_points(labels, config):
    """``[..., d]`` int32 P coordinates of ``labels[..., M, d]``."""
    return jnp.stack(lattice_sum(index_from_labels(labels, config.q, jnp.uint32), config), -1)


def _exact_sum(points, axis: int):
    """``sum(points, axis)`` of int32 ``points`` exactly, as the words ``(hi int32, lo uint32)``
    of a 64-bit two's complement sum: an int32 sum of many large summands wraps, and a wrap
    can land on the mod-q value."""
    def add(a, b):
        lo = a[1] + b[1]
        return a[0] + b[0] + (lo < a[1]).astype(jnp.int32), lo

    words = (jnp.right_shift(points, 31), points.astype(jnp.uint32))
    return jax.lax.reduce(words, (jnp.int32(0), jnp.uint32(0)), add, (axis,))


def _validate(labels, T, config, axis):
    lab, T_acc = _sum_labels(labels, T, config, axis)
    modq = _lattice_points(lab, config)
    hi, lo = _exact_sum(_lattice_points(labels, config), axis)
    same = (hi == jnp.right_shift(modq, 31)) & (lo == modq.astype(jnp.uint32))
    return lab, T_acc, (T_acc >= 0) & jnp.all(same, axis=-1)


def validate(codes: Codes, axis: int = 0):
    """Per block: does the decoded mod-q sum equal the sum of the decoded summands?

    Compared exactly, on the integer lattice points. True iff the summands share one T and
    ``sum_m q^m r(b'_m) = sum_i sum_m q^m r(b_{i,m})`` for the accumulated labels ``b'``.

    Args:
      codes: block codes (config without dither).
      axis: the leading axis summed over.

    Returns:
      ``[...]`` bool (``axis`` removed).
    """
    labels, T = check(codes, "validate")
    axis = leading_axis(axis, T, "validate")
    return _validate_jit(labels, T, codes.config, axis)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _validate_jit(labels, T, config, axis):
    return _validate(labels, T, config, axis)[2]


@functools.partial(jax.jit, static_argnums=(2, 3))
def _sum_with_fallback(labels, T, config, axis):
    lab, T_acc, exact = _validate(labels, T, config, axis)
    dtype = default_float()

    def dec(lb, t):
        k = index_from_labels(lb, config.q, jnp.uint32)
        return decode_blocks(k, t + 1, config, None, dtype, config.beta)

    from_modq = dec(lab, T_acc)
    decoded = dec(labels, T)
    return jnp.where(exact[..., None], from_modq, jnp.sum(decoded, axis=axis)), exact


def sum_with_fallback(codes: Codes, axis: int = 0):
    """The sum of the decoded codes along ``axis``, through the mod-q sum where it is exact.

    Blocks where :func:`validate` is true decode the accumulated labels once; the others fall
    back to decoding every summand and adding the results. Both give the same value up to float
    rounding; the fallback keeps the answer right when carries are lost.

    Args:
      codes: block codes (config without dither).
      axis: the leading axis summed over.

    Returns:
      ``(x, exact)``: ``x[..., d]`` the sum (float64 under x64, else float32; NaN for blocks
      with a ``T = -1`` summand) and ``exact[...]`` the mask of blocks taken from the mod-q sum.
    """
    labels, T = check(codes, "sum_with_fallback")
    check_beta_fits(codes.config.beta, default_float(), "sum_with_fallback")
    axis = leading_axis(axis, T, "sum_with_fallback")
    return _sum_with_fallback(labels, T, codes.config, axis)

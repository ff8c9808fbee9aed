"""Numerics shared by the XLA path, the Pallas kernels and the layers, defined once.

* the overload scale ``2^(alpha T)`` of a block, from its T field value ``u = T + 1``;
* the level weights ``q^m``;
* the dtype decoded weights are held and products summed in (:func:`wide_dtype`);
* the straight-through estimator (forward: the quantized value; backward: the incoming
  gradient, optionally masked);
* a mean of squares that does not depend on the program it runs in (:func:`mean_square`);
* a product by a power of two, and the binary exponent, that fuse (:func:`times_pow2`,
  :func:`exponent`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax.config import HNLQConfig, pow2_table

__all__ = ["mean_square", "pow2", "overload_scale", "level_weights", "straight_through",
           "times_pow2", "exponent", "wide_dtype"]


def pow2(config: HNLQConfig, dtype) -> jax.Array:
    """``[max_T + 1]`` table ``2^(alpha t)`` in ``dtype`` (the reference's float64 values)."""
    return jnp.asarray(pow2_table(config.alpha, config.max_T), dtype)


def times_pow2(x, e):
    """``x 2^e`` for float32 ``x`` and int32 ``e`` (``|e| <= 252``, broadcast) as two products by
    exact powers of two, ``2^floor(e/2)`` then ``2^ceil(e/2)`` from their bits: correctly
    rounded, as ``jnp.ldexp``, wherever ``x`` and ``x 2^floor(e/2)`` are not subnormal; inf,
    NaN and 0 pass through. On a GPU it fuses into the operations around it, where ``jnp.ldexp``'s
    ``frexp`` and ``pow`` make kernels of their own."""
    a = e >> 1

    def exact(k):  # 2^k, |k| <= 126: the exponent field alone
        return jax.lax.bitcast_convert_type((k + 127).astype(jnp.int32) << 23, jnp.float32)

    return x * exact(a) * exact(e - a)


def exponent(x):
    """``frexp``'s exponent of float32 ``x >= 0`` (``x = m 2^e``, ``m`` in ``[1/2, 1)``), from its
    bits; ``-125`` for 0 and subnormals (whose ``2^e`` it overstates). Like :func:`times_pow2`,
    a few integer operations that fuse, where ``jnp.frexp`` makes a kernel of its own."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.maximum((bits >> 23) & 255, 1) - 126


def overload_scale(u, config: HNLQConfig, table):
    """``2^(alpha T)`` per block from ``u = T + 1`` (int32) through ``table`` (``pow2`` or a
    kernel's table ref); failed blocks (``u = 0``) read entry 0 and are masked by the caller."""
    return table[jnp.clip(u - 1, 0, config.max_T)]


def level_weights(config: HNLQConfig, dtype=None):
    """``q^m`` for m = 0..M-1: a float array in ``dtype``, or Python ints when ``dtype`` is None
    (the exact integer path)."""
    w = [config.q**m for m in range(config.M)]
    return w if dtype is None else jnp.asarray(np.asarray(w, np.float64), dtype)


@jax.jit  # eager callers (calibration) run one program, not one per slice and add
def mean_square(x):
    """The mean over the last axis of ``x[..., k]``'s squares, the same bits in every program.

    ``jnp.mean(jnp.square(x))`` is not: XLA picks the summation order from the program around
    it (on AVX-512 a row's sum differed in the last bit between ``w`` and a transpose fused
    into the reduction under ``jit``), contracts a square and an add into one fused
    multiply-add inside a fusion but not between eager ops, and divides by ``k`` differently
    for a constant and an argument. Here each entry is first rounded to half its dtype's
    significant bits (12 of float32's 24, 26 of float64's 53), so its square is exact and a
    fused multiply-add gives the same sum; the sum halves the zero-padded power-of-two length
    (entries ``i`` and ``i + k'/2``) until one is left, a fixed order; the mean multiplies by
    ``1/k``. The rounding moves a float32 result by at most ~2^-11 relative (float64: 2^-25):
    a row scale is that close to the exact RMS, and the same everywhere.
    """
    info = jnp.finfo(x.dtype)
    x = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=(info.nmant - 1) // 2)
    x = x * x
    k = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << max(k - 1, 0).bit_length()) - k)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0] * np.asarray(1 / max(k, 1), x.dtype)


@jax.custom_vjp
def straight_through(x, x_hat, mask):
    """``x_hat`` forward; the gradient goes to ``x`` unchanged (times ``mask`` if not None).

    Args:
      x: the real value.
      x_hat: its quantized value (same shape); gets no gradient.
      mask: ``None`` or an array broadcastable to ``x`` (e.g. 0 in clipped blocks).
    """
    return x_hat


def _st_fwd(x, x_hat, mask):
    return x_hat, mask


def _st_bwd(mask, g):
    gx = g if mask is None else g * mask.astype(g.dtype)
    return gx, jnp.zeros_like(g), None if mask is None else jnp.zeros_like(mask)


straight_through.defvjp(_st_fwd, _st_bwd)


def saturating_cast(x, dtype):
    """``x`` in ``dtype``, values beyond a narrower dtype's range clipped to its largest finite
    value (NaN stays NaN): a block near a half-precision input's maximum can decode just beyond
    it, where a plain cast gives Inf."""
    if jnp.finfo(dtype).bits < jnp.finfo(x.dtype).bits:
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def wide_dtype(dtype):
    """The dtype a matmul decodes its weight in and sums in, for activations of ``dtype``:
    float32, or float64 for float64 activations (under x64)."""
    return jnp.promote_types(dtype, jnp.float32)

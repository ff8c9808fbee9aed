"""Numerics shared by the XLA path, the Pallas kernels and the layers, defined once.

* the overload scale ``2^(alpha T)`` of a block, from its T field value ``u = T + 1``;
* the level weights ``q^m``;
* the dtype decoded weights are held and products summed in (:func:`wide_dtype`);
* the straight-through estimator (forward: the quantized value; backward: the incoming
  gradient, optionally masked).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax.config import HNLQConfig, pow2_table

__all__ = ["pow2", "overload_scale", "level_weights", "straight_through", "wide_dtype"]


def pow2(config: HNLQConfig, dtype) -> jax.Array:
    """``[max_T + 1]`` table ``2^(alpha t)`` in ``dtype`` (the reference's float64 values)."""
    return jnp.asarray(pow2_table(config.alpha, config.max_T), dtype)


def overload_scale(u, config: HNLQConfig, table):
    """``2^(alpha T)`` per block from ``u = T + 1`` (int32) through ``table`` (``pow2`` or a
    kernel's table ref); failed blocks (``u = 0``) read entry 0 and are masked by the caller."""
    return table[jnp.clip(u - 1, 0, config.max_T)]


def level_weights(config: HNLQConfig, dtype=None):
    """``q^m`` for m = 0..M-1: a float array in ``dtype``, or Python ints when ``dtype`` is None
    (the exact integer path)."""
    w = [config.q**m for m in range(config.M)]
    return w if dtype is None else jnp.asarray(np.asarray(w, np.float64), dtype)


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

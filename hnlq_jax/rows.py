"""Per-row scaled quantization of matrices: the weight format of QDense and QLinear.

Row ``r`` of ``w[r, k]`` is divided by ``c_r = beta * rms(w_r)`` and encoded in d-blocks along k
with the codec at unit beta, so ``w_hat_r = c_r * decode(codes_r)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hnlq_jax.codec import Codes, decode_blocks, encode_blocks, from_blocks, to_blocks
from hnlq_jax.config import HNLQConfig

__all__ = ["row_rms", "rows_codes", "rows_decode", "unit"]


def unit(config: HNLQConfig) -> HNLQConfig:
    """The codec config used inside the layers: beta lives in the channel scales."""
    return config.replace(beta=1.0)


def row_rms(w):
    """RMS of each row of ``w[r, k]`` (1 for an all-zero row, which then codes to zeros)."""
    rms = jnp.sqrt(jnp.mean(jnp.square(w), axis=-1))
    return jnp.where(rms > 0, rms, 1.0)


@functools.partial(jax.jit, static_argnums=1)
def rows_codes(w, config: HNLQConfig, beta):
    """Codes of the rows of ``w[r, k]`` with per-row scales ``c = beta * rms``.

    Returns:
      ``(Codes(labels[r, nb, M, d], T[r, nb]), c[r])``.
    """
    w = w.astype(jnp.promote_types(w.dtype, jnp.float32))  # half precision: code in float32
    c = beta * row_rms(w)
    blocks = to_blocks(w / c[:, None].astype(w.dtype), config.d)  # [r, nb, d]
    codes = encode_blocks(blocks.reshape(-1, config.d), unit(config), 1.0)
    r, nb = blocks.shape[:2]
    return Codes(codes.labels.reshape(r, nb, config.M, config.d), codes.T.reshape(r, nb)), c


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def rows_decode(codes: Codes, c, config: HNLQConfig, k: int, dtype):
    """``[r, k]`` reconstruction ``c_r * decode(codes_r)`` in ``dtype`` (computed in >= float32)."""
    compute = jnp.promote_types(dtype, jnp.float32)
    dec = decode_blocks(codes.labels, codes.T, unit(config), None, compute, 1.0)  # [r, nb, d]
    return (from_blocks(dec, k) * c[:, None].astype(compute)).astype(dtype)

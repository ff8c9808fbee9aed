"""Bit-packing of HNLQ labels.

Each block's ``M*d`` labels (C order over ``[M, d]``) are read as base-q digits and grouped into
chunks of ``k`` digits, the largest ``k`` with ``q^k <= 2^32``; a chunk is the little-endian
mixed-radix number ``sum_j digit_j q^j`` written in ``bit_length(q^k' - 1)`` bits (``k'`` digits
in the chunk). The chunks of all blocks form one little-endian bitstream.

* q a power of two: a chunk is the plain concatenation of the digits, so a block takes exactly
  ``M d log2 q`` bits (D4 q=4 M=2: 16 bits, E8 q=4 M=2: 32 bits).
* other q: at most one bit per 32-bit chunk above ``M d log2 q`` (D4 q=3 M=2: 13 bits against
  12.68; E8 q=3 M=2: 26 bits against 25.36).

``T`` stays a separate int8 array (its leading shape is the shape of the codes); entropy coding
it is left to the caller (see :func:`hnlq_jax.rate_stats` for its entropy).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hnlq_jax.codec import Codes, check_codes, is_concrete
from hnlq_jax.config import HNLQConfig

__all__ = ["Packed", "pack", "unpack", "bits_per_block"]


class Packed(NamedTuple):
    """Packed codes (a pytree).

    Attributes:
      data: ``[ceil(N * bits_per_block / 8)]`` uint8 bitstream of the labels of all N blocks.
      T: ``[...]`` int8 overload steps; its shape is the leading shape of the codes.
    """

    data: jax.Array
    T: jax.Array


@functools.lru_cache(maxsize=None)
def _chunks(q: int, n: int) -> tuple[tuple[int, int], ...]:
    """``(digits, bits)`` per chunk for ``n`` base-q digits."""
    k = 1
    while q ** (k + 1) <= 2**32:
        k += 1
    out = []
    for start in range(0, n, k):
        nd = min(k, n - start)
        out.append((nd, (q**nd - 1).bit_length()))
    return tuple(out)


def bits_per_block(config: HNLQConfig) -> int:
    """Packed bits per d-block (labels only; T is stored apart)."""
    return sum(b for _, b in _chunks(config.q, config.M * config.d))


@functools.partial(jax.jit, static_argnums=1)
def _pack(labels, config):
    q = config.q
    digits = labels.reshape(-1, config.M * config.d).astype(jnp.uint32)
    fields, start = [], 0
    for nd, nbits in _chunks(q, digits.shape[1]):
        value = jnp.zeros(digits.shape[0], jnp.uint32)
        for j in reversed(range(nd)):  # Horner: fits uint32 since q^nd <= 2^32
            value = value * jnp.uint32(q) + digits[:, start + j]
        fields.append((value[:, None] >> jnp.arange(nbits, dtype=jnp.uint32)) & 1)
        start += nd
    bits = jnp.concatenate(fields, axis=1).astype(jnp.uint8).reshape(-1)
    return jnp.packbits(bits, bitorder="little")


def pack(codes: Codes, config: HNLQConfig) -> Packed:
    """Packs the labels into a bitstream of :func:`bits_per_block` bits per block.

    Args:
      codes: ``Codes(labels[..., M, d], T[...])``.
      config: the quantizer that made them.

    Returns:
      ``Packed(data[ceil(N * bits / 8)] uint8, T[...] int8)`` with N the number of blocks.
    """
    labels, T = check_codes(codes, config, None, "pack")
    return Packed(_pack(labels, config), T.astype(jnp.int8))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _unpack(data, config, n_blocks):
    q, n = config.q, config.M * config.d
    bpb = bits_per_block(config)
    bits = jnp.unpackbits(data, bitorder="little")[: n_blocks * bpb]
    bits = bits.reshape(n_blocks, bpb).astype(jnp.uint32)
    digits, start, corrupt = [], 0, jnp.zeros((), bool)
    for nd, nbits in _chunks(q, n):
        weights = jnp.uint32(1) << jnp.arange(nbits, dtype=jnp.uint32)
        value = jnp.sum(bits[:, start : start + nbits] * weights, axis=1, dtype=jnp.uint32)
        for _ in range(nd):
            digits.append(value % jnp.uint32(q))
            value = value // jnp.uint32(q)
        corrupt = corrupt | jnp.any(value != 0)  # a chunk above q^nd - 1
        start += nbits
    return jnp.stack(digits, axis=1).astype(jnp.uint8), corrupt


def unpack(packed: Packed, config: HNLQConfig) -> Codes:
    """Exact inverse of :func:`pack`.

    Args:
      packed: ``Packed(data, T[...])``.
      config: the quantizer of the codes.

    Returns:
      ``Codes(labels[..., M, d] uint8, T[...] int8)``.

    Raises:
      ValueError: when the bitstream length does not match ``T.shape`` and ``config``, or a
        chunk decodes to a digit outside ``0..q-1`` (corrupt data; checked when concrete).
    """
    data, T = jnp.asarray(packed[0]), jnp.asarray(packed[1])
    n_blocks = T.size
    expect = -(-n_blocks * bits_per_block(config) // 8)
    if data.dtype != jnp.uint8 or data.shape != (expect,):
        raise ValueError(
            f"unpack: expected data uint8[{expect}] for {n_blocks} blocks of "
            f"{bits_per_block(config)} bits ({config.lattice}, q={config.q}, M={config.M}), got "
            f"{data.dtype}{list(data.shape)}"
        )
    labels, corrupt = _unpack(data, config, n_blocks)
    if is_concrete(corrupt) and bool(corrupt):
        raise ValueError(
            f"unpack: corrupt bitstream: a chunk exceeds the largest value for q={config.q}"
        )
    labels = labels.reshape(T.shape + (config.M, config.d))
    return Codes(labels, T.astype(jnp.int8))

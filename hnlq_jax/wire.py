"""The wire format: the fixed-size payload that :mod:`hnlq_jax.dist` and the DDP hook send.

A flat float32 array of ``size`` values is cut into d-blocks (zero-padded), the blocks into
chunks of at most ``chunk`` blocks (:func:`layout`) with one power-of-two scale each, and the
chunks into ``parts`` equal parts (``parts = n`` for a reduce-scatter, where part i goes to
device i; 1 otherwise).
A payload is ``uint8 [parts, part_bytes]``; each part decodes on its own (:func:`decode_part`)::

    part   = record[0] ... record[chunks - 1]
    record = labels[label_bytes]  tstream[t_bytes]  exponent[1]

* ``labels``: the chunk's label bitstream, as in :func:`hnlq_jax.packing.pack_labels`.
* ``tstream``: the chunk's T in a buffer of ``t_bytes`` bytes, ``C = 8 t_bytes`` bits, by
  default ``1.25 + d/4`` bits per block (D4: 2.25, E8: 3.25). With symbols ``v = T`` (``v =
  max_T + 1`` for a failed block), little-endian bit order:

  - ``flags``: ``chunk`` bits, bit i set when block i has ``v >= 1``;
  - ``tail``: the rest of the buffer. For every flagged block in block order, ``v - 1`` one
    bits then a zero bit (unary). The bits after the last code are zeros.

  A chunk needs ``chunk + sum(v)`` bits. For Gaussian chunks at a calibrated beta that is
  about 2.1 bits per block (D4 q=4 M=2) at the top of the RMS window (a chunk's RMS 1.41 times
  a power of two), within 0.1 bit of the entropy-coded T of :mod:`hnlq_jax.packing`, and
  about 1.05 at its bottom (0.71 times), where there is room to spare. Unlike ``pack``'s
  stream it is written and read with a few whole-array passes, no loop over T values, which
  is what the collectives need: they code every step.
* ``exponent``: int8 ``e``; the chunk's values are ``2^e`` times its decoded codes.
  ``e = -128`` (``FAILED``) marks a chunk that could not be sent (non-finite input, or in
  principle a chunk that does not fit even at ``e = 127``): it decodes to NaN; ``e = -127``
  (``ZERO``) an all-zero chunk: it decodes to zeros (with a dither ``z`` its codes would
  decode to ``beta (Q(z) - z)``).

**Choosing e (rate control).** ``e`` starts at the power of two nearest the chunk's RMS (RMS in
``[0.71, 1.41)`` after scaling, so ``config.beta`` is the beta for unit-RMS data), raised if
the chunk's largest block is beyond what T <= max_T can reach. A chunk that still does not fit
-- a block that cannot be encoded, or a T stream longer than ``C`` -- is encoded again with
``e + 1`` until it fits: a larger scale lowers every T, and at all T = 0 a chunk's stream is its
``chunk`` flag bits, which ``C`` is never below. So the fixed size never drops
data: an unusual chunk is quantized more coarsely instead (error feedback carries what it
lost), and how many were is reported (:class:`Info`). Powers of two are exact, so what a
device sends is the same value wherever it is decoded.

**Config.** The chunks are unit-RMS, so a config whose beta is ``HNLQConfig``'s default 1.0
(not calibrated; several times the error of a calibrated beta) is replaced by
:func:`chunk_config` with :func:`hnlq_jax.gaussian_beta`'s beta. Every party derives the
layout and config from the same arguments (the DDP hook checks that all ranks agree, and
:data:`WIRE_VERSION` with them); nothing in a payload describes its own config.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import ops, packing
from hnlq_jax._numerics import divide, flush_subnormals, sqrt, sum_of_squares
from hnlq_jax.codec import check_beta_fits, scale_tables
from hnlq_jax.codes import Codes, pack_t
from hnlq_jax.config import HNLQConfig, check_config
from hnlq_jax.rows import row_rms
from hnlq_jax.stats import gaussian_beta

__all__ = ["CHUNK", "FAILED", "WIRE_VERSION", "ZERO", "default_t_capacity", "Layout", "Info",
           "layout", "chunk_config", "encode", "decode", "decode_part"]

CHUNK = 256  # blocks per scale
# The payload layout's version. Payloads are not stored, so it is not FORMAT_VERSION (the codes'
# stored form): parties exchanging payloads compare it (the DDP hook does). 1: T streams as in
# ``pack`` (Rice-coded planes) and the Rice parameters at the end of each part; 2: flags + unary;
# 3: the exponent ZERO; 4: chunks sized to the blocks (layout).
WIRE_VERSION = 4
FAILED = -128  # the exponent of a chunk that decodes to NaN
# The exponent of an all-zero chunk, which decodes to zeros: its codes would decode to
# beta (Q(z) - z) with a dither z, a steady bias on a parameter whose gradient is 0
ZERO = -127
_E_MIN, _E_MAX = -126, 127


def chunk_config(config: HNLQConfig) -> HNLQConfig:
    """The config the unit-RMS chunks are coded with: ``config``, or with
    :func:`hnlq_jax.gaussian_beta` when its beta is the uncalibrated default 1.0."""
    check_config(config, "wire")
    if config.beta == HNLQConfig.beta:
        return config.replace(beta=gaussian_beta(config))
    return config


def default_t_capacity(config: HNLQConfig) -> float:
    """T stream bits per block of a chunk: ``1.25 + d/4``, just above what a Gaussian chunk
    needs at the top of the RMS window (see the module docstring)."""
    return 1.25 + config.d / 4


class Layout(NamedTuple):
    """Sizes of one payload (static; hashable).

    Attributes:
      config: the quantizer (see :func:`chunk_config`).
      size: values coded (the rest of the last part is zero padding).
      chunk: blocks per chunk (a multiple of 8).
      chunks: chunks per part.
      parts: parts of the payload.
      t_bytes: bytes of a chunk's T stream.
    """

    config: HNLQConfig
    size: int
    chunk: int
    chunks: int
    parts: int
    t_bytes: int

    @property
    def label_bytes(self) -> int:
        return -(-packing.label_bits(self.config, self.chunk) // 8)

    @property
    def record_bytes(self) -> int:
        return self.label_bytes + self.t_bytes + 1

    @property
    def part_bytes(self) -> int:
        return self.chunks * self.record_bytes

    @property
    def payload_bytes(self) -> int:
        return self.parts * self.part_bytes

    @property
    def part_values(self) -> int:
        """Values per part (padded): a part decodes to this many."""
        return self.chunks * self.chunk * self.config.d

    def slice(self) -> Layout:
        """The layout of one part re-encoded alone (a reduce-scatter's averaged slice)."""
        return self._replace(size=self.part_values, parts=1)


def layout(size: int, config: HNLQConfig, parts: int = 1, *, chunk: int = CHUNK,
           t_capacity: float | None = None) -> Layout:
    """The layout covering ``size`` values in ``parts`` parts.

    A part takes the fewest chunks of at most ``chunk`` blocks that hold its share, each as
    small as holds it (a multiple of 8 blocks): padding stays below 8 blocks a chunk.

    Args:
      size: number of values, an int >= 0.
      config: the quantizer (passed through :func:`chunk_config`).
      parts: parts (devices of a reduce-scatter), >= 1.
      chunk: largest blocks per chunk, a positive multiple of 8.
      t_capacity: T stream bits per block (default :func:`default_t_capacity`); raised to 1
        where lower (a chunk with all T = 0 needs its flag bits).

    Raises:
      TypeError, ValueError: a bad config, size, chunk, parts or capacity.
    """
    config = chunk_config(config)
    check_beta_fits(config.beta, jnp.float32, "wire")  # (the wire computes in float32)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"wire: size must be an int >= 0 (the number of values), got {size!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 8 or chunk % 8:
        raise ValueError(f"wire: chunk must be a positive multiple of 8 blocks, got {chunk!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"wire: parts must be an int >= 1, got {parts!r}")
    if t_capacity is None:
        t_capacity = default_t_capacity(config)
    if isinstance(t_capacity, bool) or not (isinstance(t_capacity, (int, float))
                                            and 0 < t_capacity < math.inf):
        raise ValueError(f"wire: t_capacity must be a positive number of bits per block, got "
                         f"{t_capacity!r}")
    blocks = max(1, -(-int(size) // config.d))
    chunks = -(-blocks // (chunk * parts))
    # The fewest chunks a part needs, each as small as holds the blocks: the padding spreads
    # over them (a chunk a part almost empty cost up to 1.9x the bytes of a reduce-scatter)
    chunk = min(chunk, 8 * -(-blocks // (8 * parts * chunks)))
    # At all T = 0 a chunk's stream is its flags: chunk bits.
    t_bytes = max(-(-int(chunk * t_capacity) // 8), chunk // 8)
    return Layout(config, int(size), chunk, chunks, parts, t_bytes)


class Info(NamedTuple):
    """What :func:`encode` did (int32 scalars).

    Attributes:
      overloaded: blocks with T > 0.
      rescaled: chunks whose exponent the rate control raised (see the module docstring).
      failed: chunks sent as NaN (non-finite input).
    """

    overloaded: jax.Array
    rescaled: jax.Array
    failed: jax.Array


def _exponents(x, config: HNLQConfig):
    """Initial exponents ``[C]`` of chunks ``x[C, values]`` and which chunks are finite."""
    finite = jnp.all(jnp.isfinite(x), axis=1)
    xs = jnp.where(finite[:, None], x, 0.0)
    mantissa, e = jnp.frexp(row_rms(xs))  # overflow-safe RMS; 1 for an all-zero chunk
    # (math.sqrt: jnp's would run on the default device, whose square root may be approximate)
    e = jnp.where(mantissa < math.sqrt(0.5), e - 1, e)
    # Raise e until the largest block is within reach of T = max_T (a necessary condition):
    # its norm and ratio to the reach IEEE's on every backend (a backend's sum, root or
    # quotient can put r = 2^k a step to either side), so a chunk gets one exponent everywhere.
    y = jnp.ldexp(xs, -e[:, None]).reshape(x.shape[0], -1, config.d)
    top = jnp.max(sqrt(sum_of_squares(y)), axis=1)
    reach = scale_tables(config, config.beta, jnp.float32)[1][config.max_T]
    # ceil(log2(r)) for r >= 1 from r's bits, where a GPU's log2 is approximate (at r = 2^k
    # it could round up a whole step)
    m, k = jnp.frexp(jnp.maximum(divide(top, reach), 1.0))
    lift = jnp.where(m > 0.5, k, k - 1)
    return jnp.clip(e + lift, _E_MIN, _E_MAX), finite


def _t_streams(u, lay: Layout):
    """T streams ``uint8 [C, t_bytes]`` and their bits ``[C]`` of ``u[C, chunk]`` (u = T + 1).

    A stream longer than the buffer is cut (``bits > 8 t_bytes``: the caller re-encodes).
    """
    C, n = u.shape
    v = packing.t_symbols(u, lay.config)
    end = jnp.cumsum(v, axis=1)  # where each block's unary code ends in the tail
    start = end - v
    tail = 8 * lay.t_bytes - n
    # A code's ones are the tail bits [start, start + v - 1) (a code may be longer than a word:
    # max_T goes up to 127): mark where each run of ones begins (+1) and ends (-1), clipped to
    # the tail so that nothing spills into the next chunk's row, and sum the marks up.
    at = jnp.minimum(jnp.concatenate([start, end - 1], axis=1), tail)
    mark = jnp.where(jnp.concatenate([v, v], axis=1) > 1,
                     jnp.concatenate([jnp.ones_like(v), -jnp.ones_like(v)], axis=1), 0)
    marks = jnp.zeros(C * (tail + 1), jnp.int32).at[
        (at + (tail + 1) * jnp.arange(C)[:, None]).reshape(-1)].add(mark.reshape(-1))
    ones = jnp.cumsum(marks.reshape(C, tail + 1)[:, :tail], axis=1) > 0
    streams = jnp.concatenate([jnp.packbits(v > 0, axis=1, bitorder="little"),
                               jnp.packbits(ones, axis=1, bitorder="little")], axis=1)
    return streams, n + end[:, -1]


def _t_from_streams(t, lay: Layout):
    """``(u [C, chunk], ok [C])`` of T streams ``uint8 [C, t_bytes]`` (inverse of
    :func:`_t_streams`). ``ok`` is false for a stream that cannot have been written: more
    flagged blocks than codes, a symbol above ``max_T`` (``max_T + 1``, a failed block, is
    never sent), or one bits after the last code.
    """
    C, n = t.shape[0], lay.chunk
    flags = jnp.unpackbits(t[:, :n // 8], axis=1, bitorder="little").astype(bool)
    bits = jnp.unpackbits(t[:, n // 8:], axis=1, bitorder="little").astype(jnp.int32)
    tail = bits.shape[1]
    # zero_at[k]: where the k-th code ends (its zero bit); tail when there is none.
    zeros = jnp.cumsum(1 - bits, axis=1)
    slot = jnp.where((bits == 0) & (zeros <= n), zeros - 1 + n * jnp.arange(C)[:, None], C * n)
    zero_at = jnp.full(C * n, tail, jnp.int32).at[slot].set(
        jnp.broadcast_to(jnp.arange(tail, dtype=jnp.int32), (C, tail)), mode="drop").reshape(C, n)
    length = zero_at - jnp.concatenate([jnp.full((C, 1), -1, jnp.int32), zero_at[:, :-1]], 1)
    rank = jnp.cumsum(flags, axis=1, dtype=jnp.int32) - 1
    v = jnp.where(flags, jnp.take_along_axis(length, jnp.maximum(rank, 0), axis=1), 0)
    F = rank[:, -1] + 1  # flagged blocks
    last = jnp.take_along_axis(zero_at, jnp.maximum(F - 1, 0)[:, None], axis=1)[:, 0]
    used = jnp.where(F > 0, last + 1, 0)  # tail bits the codes take
    top = lay.config.max_T + 1
    ok = (used <= tail) & (jnp.sum(bits, axis=1) == used - F) & jnp.all(v < top, axis=1)
    return packing.t_from_symbols(jnp.minimum(v, top), lay.config), ok


def encode(v, lay: Layout, implementation=None, interpret=None):
    """The payload of the flat float32 ``v[lay.size]`` (traceable).

    Args:
      v: ``[lay.size]`` float32 values.
      lay: the :class:`Layout`.
      implementation, interpret: as for :func:`hnlq_jax.encode`.

    Returns:
      ``(payload uint8 [parts, part_bytes], Info)``.

    Raises:
      ValueError: ``v`` is not a flat array of ``lay.size`` values.
      TypeError: ``v`` is not floating point.
    """
    _check_layout(lay, "encode")
    v = jnp.asarray(v)
    if not jnp.issubdtype(v.dtype, jnp.floating):
        raise TypeError(f"wire.encode: expected floating-point values, got dtype {v.dtype}")
    if v.shape != (lay.size,):
        raise ValueError(f"wire.encode: expected a flat array of {lay.size} values (the layout's "
                         f"size), got shape {tuple(v.shape)}; make the layout with "
                         "wire.layout(v.size, ...)")
    config = lay.config
    impl = ops.resolve(implementation, config, "encode", v)
    C = lay.parts * lay.chunks
    x = jnp.pad(v.astype(jnp.float32), (0, lay.parts * lay.part_values - v.shape[0]))
    # Subnormals are zero (the codes count them so): scaled by jnp.ldexp, one mis-scaled its
    # whole chunk in a jitted program (flush_subnormals)
    x = flush_subnormals(x).reshape(C, lay.chunk * config.d)
    e0, finite = _exponents(x, config)

    def attempt(e):
        blocks = jnp.ldexp(x, -e[:, None]).reshape(-1, config.d)
        index, T = ops.encode_flat(blocks, config, impl, interpret)
        return index.reshape(C, lay.chunk, config.M), (T + 1).reshape(C, lay.chunk)

    def fits(u, used):
        return jnp.all(u > 0, axis=1) & (used <= 8 * lay.t_bytes)

    def cond(s):
        e, _, _, _, ok = s
        return jnp.any(~ok & finite & (e < _E_MAX))

    def body(s):
        e, _, _, _, ok = s
        # (a chunk that fails at the largest exponent stays there, failed, while others rise)
        e = jnp.where(ok | ~finite | (e >= _E_MAX), e, e + 1)
        index, u = attempt(e)
        tstream, used = _t_streams(u, lay)
        return e, index, u, tstream, fits(u, used)

    index, u = attempt(e0)
    tstream, used = _t_streams(u, lay)
    e, index, u, tstream, ok = jax.lax.while_loop(
        cond, body, (e0, index, u, tstream, fits(u, used)))
    sent = ok & finite
    labels = jax.vmap(lambda i: packing.pack_labels(i, config))(index)
    zero = jnp.all(x == 0, axis=1)
    exponent = jnp.where(sent, jnp.where(zero, ZERO, e), FAILED).astype(jnp.int8)
    records = jnp.concatenate([labels, tstream, jax.lax.bitcast_convert_type(
        exponent, jnp.uint8)[:, None]], axis=1)
    payload = records.reshape(lay.parts, -1)
    info = Info(jnp.sum((u > 1) & sent[:, None], dtype=jnp.int32),
                jnp.sum(sent & (e > e0), dtype=jnp.int32), jnp.sum(~sent, dtype=jnp.int32))
    return payload, info


def _check_layout(lay, fn: str):
    if not isinstance(lay, Layout):
        raise TypeError(f"wire.{fn}: expected a wire.Layout (from wire.layout(size, config, "
                        f"parts)), got {type(lay).__name__}")


def _check_payload(payload, shape: tuple, lay: Layout, fn: str):
    """``payload`` as an array; raises unless it is ``uint8[shape]``."""
    payload = jnp.asarray(payload)
    if payload.dtype != jnp.uint8 or payload.shape != shape:
        raise ValueError(f"wire.{fn}: expected a payload uint8{list(shape)} for this layout "
                         f"({lay.size} values, {lay.parts} part(s) of {lay.part_bytes} bytes), got "
                         f"{payload.dtype}{list(payload.shape)}; a payload made with another "
                         "config or layout?")
    return payload


def decode_part(part, lay: Layout, implementation=None, interpret=None):
    """The values ``[lay.part_values]`` float32 of one part ``uint8 [lay.part_bytes]``.

    Chunks marked failed, or whose labels or T stream are inconsistent (corrupted), decode to
    NaN. Values are saturated at the float32 maximum (a value near it can decode just beyond).
    Traceable.

    Raises:
      ValueError: ``part`` is not ``uint8 [lay.part_bytes]`` (a part of another layout).
    """
    _check_layout(lay, "decode_part")
    part = _check_payload(part, (lay.part_bytes,), lay, "decode_part")
    config = lay.config
    impl = ops.resolve(implementation, config, "decode", part)
    records = part.reshape(lay.chunks, lay.record_bytes)
    lb, tb = lay.label_bytes, lay.t_bytes
    index, bad = jax.vmap(lambda r: packing.unpack_labels(r, config, lay.chunk))(records[:, :lb])
    u, ok = _t_from_streams(records[:, lb:lb + tb], lay)
    e = jax.lax.bitcast_convert_type(records[:, -1], jnp.int8).astype(jnp.int32)
    u = u.reshape(-1)
    codes = Codes(index.reshape(-1, config.M), pack_t(u - 1, config), config)
    x = ops.decode(codes, dtype=jnp.float32, implementation=impl, interpret=interpret)
    # Saturated: a value within a quantization step of the float32 maximum can decode just
    # beyond it, and an Inf would poison error feedback (x - Inf) for good.
    big = float(jnp.finfo(jnp.float32).max)
    x = jnp.clip(jnp.ldexp(x.reshape(lay.chunks, -1), e[:, None]), -big, big)
    x = jnp.where((e == ZERO)[:, None], 0.0, x)
    good = ok & ~jnp.any(bad, axis=1) & (e != FAILED)
    return jnp.where(good[:, None], x, jnp.nan).reshape(-1)


def decode(payload, lay: Layout, implementation=None, interpret=None):
    """The values ``[lay.size]`` float32 of a payload ``uint8 [parts, part_bytes]``.

    Raises:
      ValueError: ``payload`` is not ``uint8 [lay.parts, lay.part_bytes]`` (a payload of
        another config or layout, or truncated).
    """
    _check_layout(lay, "decode")
    payload = _check_payload(payload, (lay.parts, lay.part_bytes), lay, "decode")
    parts = jax.vmap(functools.partial(decode_part, lay=lay, implementation=implementation,
                                       interpret=interpret))(payload)
    return parts.reshape(-1)[:lay.size]

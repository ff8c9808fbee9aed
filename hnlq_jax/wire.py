"""The wire format: the fixed-size payload that :mod:`hnlq_jax.dist` and the DDP hook send.

A flat float32 array of ``size`` values is cut into d-blocks (zero-padded), the blocks into
chunks of ``chunk`` blocks with one power-of-two scale each, and the chunks into ``parts``
equal parts (``parts = n`` for a reduce-scatter, where part i goes to device i; 1 otherwise).
A payload is ``uint8 [parts, part_bytes]``; each part decodes on its own (:func:`decode_part`)::

    part   = record[0] ... record[chunks - 1]  rice[ceil((max_T + 1) / 2)]
    record = labels[label_bytes]  tstream[t_bytes]  exponent[1]

* ``labels``: the chunk's label bitstream, as in :func:`hnlq_jax.packing.pack_labels`.
* ``tstream``: the chunk's T, entropy coded as in :mod:`hnlq_jax.packing` (unary planes,
  Rice-coded runs; unary parts from the front, remainders from the back) in a buffer of fixed
  capacity ``C = 8 t_bytes`` bits, by default ``1.25 + d/4`` bits per block (D4: 2.25, E8:
  3.25). A Gaussian chunk at a calibrated beta needs about 1.1 (D4 q=4 M=2) to 1.7 (E8 q=3 M=2)
  bits per block when its RMS is a power of two, 0.3 to 0.6 when it is 0.71 times one and 1.6
  (Z2, A2), 2.1 (D4) to 2.9 (E8 q=3) when it is 1.41 times one.
* ``exponent``: int8 ``e``; the chunk's values are ``2^e`` times its decoded codes.
  ``e = -128`` (``FAILED``) marks a chunk that could not be sent (non-finite input, or in
  principle a chunk that does not fit even at ``e = 127``): it decodes to NaN.
* ``rice``: the part's Rice parameter (0..15) of each T plane, two per byte (plane 2i in the
  low nibble), chosen by the encoder from the part's histogram of T.

**Choosing e (rate control).** ``e`` starts at the power of two nearest the chunk's RMS (RMS in
``[0.71, 1.41)`` after scaling, so ``config.beta`` is the beta for unit-RMS data), raised if
the chunk's largest block is beyond what T <= max_T can reach. A chunk that still does not fit
-- a block that cannot be encoded, or a T stream longer than ``C`` -- is encoded again with
``e + 1`` until it fits: a larger scale lowers every T, and at all T = 0 a chunk's stream is at
most ``max(chunk + 1, 31)`` bits, which ``C`` is never below. So the fixed size never drops
data: an unusual chunk is quantized more coarsely instead (error feedback carries what it
lost), and how many were is reported (:class:`Info`). Powers of two are exact, so what a
device sends is the same value wherever it is decoded.

**Config.** The chunks are unit-RMS, so a config whose beta is ``HNLQConfig``'s default 1.0
(not calibrated; several times the error of a calibrated beta) is replaced by
:func:`chunk_config` with :func:`hnlq_jax.gaussian_beta`'s beta. Every party derives the
layout and config from the same arguments (the DDP hook checks that all ranks agree, and
:data:`~hnlq_jax.FORMAT_VERSION` with them); nothing in a payload describes its own config.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import ops, packing
from hnlq_jax.codec import scale_tables
from hnlq_jax.codes import Codes, pack_t
from hnlq_jax.config import HNLQConfig, check_config
from hnlq_jax.rows import row_rms
from hnlq_jax.stats import gaussian_beta

__all__ = ["CHUNK", "FAILED", "RICE_MAX", "default_t_capacity", "Layout", "Info", "layout", "chunk_config",
           "encode", "decode", "decode_part"]

CHUNK = 256  # blocks per scale
RICE_MAX = 15  # Rice parameters travel as nibbles
FAILED = -128  # the exponent of a chunk that decodes to NaN
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
    def planes(self) -> int:
        """T planes coded: symbols run 0..max_T + 1 (``max_T + 1``: a failed block)."""
        return self.config.max_T + 1

    @property
    def label_bytes(self) -> int:
        return -(-packing.label_bits(self.config, self.chunk) // 8)

    @property
    def record_bytes(self) -> int:
        return self.label_bytes + self.t_bytes + 1

    @property
    def rice_bytes(self) -> int:
        return -(-self.planes // 2)

    @property
    def part_bytes(self) -> int:
        return self.chunks * self.record_bytes + self.rice_bytes

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

    Small arrays get smaller chunks (a multiple of 8 blocks), so padding stays below 8 blocks
    per part plus one chunk.

    Args:
      size: number of values, an int >= 0.
      config: the quantizer (passed through :func:`chunk_config`).
      parts: parts (devices of a reduce-scatter), >= 1.
      chunk: largest blocks per chunk, a positive multiple of 8.
      t_capacity: T stream bits per block (default :func:`default_t_capacity`); raised where
        needed to hold a chunk with all T = 0.

    Raises:
      TypeError, ValueError: a bad config, size, chunk, parts or capacity.
    """
    config = chunk_config(config)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"wire: size must be an int >= 0 (the number of values), got {size!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 8 or chunk % 8:
        raise ValueError(f"wire: chunk must be a positive multiple of 8 blocks, got {chunk!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"wire: parts must be an int >= 1, got {parts!r}")
    if t_capacity is None:
        t_capacity = default_t_capacity(config)
    if isinstance(t_capacity, bool) or not (isinstance(t_capacity, (int, float))
                                            and t_capacity > 0):
        raise ValueError(f"wire: t_capacity must be a positive number of bits per block, got "
                         f"{t_capacity!r}")
    blocks = max(1, -(-int(size) // config.d))
    chunk = min(chunk, 8 * -(-blocks // (8 * parts)))
    chunks = -(-blocks // (chunk * parts))
    # At all T = 0 a chunk's stream is one Rice codeword: at most max(chunk + 1, 31) bits.
    t_bytes = max(-(-int(chunk * t_capacity) // 8), -(-max(chunk + 1, 31) // 8))
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
    e = jnp.where(mantissa < jnp.sqrt(0.5), e - 1, e)
    # Raise e until the largest block is within reach of T = max_T (a necessary condition).
    y = jnp.ldexp(xs, -e[:, None]).reshape(x.shape[0], -1, config.d)
    top = jnp.max(jnp.sqrt(jnp.sum(jnp.square(y), axis=-1)), axis=1)
    reach = scale_tables(config, config.beta, jnp.float32)[1][config.max_T]
    lift = jnp.ceil(jnp.log2(jnp.maximum(top / reach, 1.0))).astype(jnp.int32)
    return jnp.clip(e + lift, _E_MIN, _E_MAX), finite


def _streams(u, ks, lay: Layout):
    """T streams ``[C, t_bytes]`` and their bits ``[C]`` of ``u[C, chunk]`` (ks: ``[C, P]``)."""
    v = packing.t_symbols(u, lay.config)
    return jax.vmap(lambda vi, ki: packing.encode_stream(vi, ki, lay.planes, 8 * lay.t_bytes,
                                                         lay.t_bytes))(v, ks)


def _rice(u, lay: Layout):
    """``[parts, P]`` Rice parameters from each part's histogram of T symbols."""
    v = packing.t_symbols(u, lay.config).reshape(lay.parts, lay.chunks, lay.chunk)
    top = lay.planes + 1

    def one(vp):
        counts = jnp.bincount(vp.reshape(-1), length=top)
        tops = jnp.bincount(jnp.max(vp, axis=1), length=top)
        return packing.rice_parameters(counts, lay.planes, tops, RICE_MAX)

    return jax.vmap(one)(v)


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
    """
    v = jnp.asarray(v)
    if v.shape != (lay.size,):
        raise ValueError(f"wire.encode: expected a flat array of {lay.size} values (the layout's "
                         f"size), got shape {tuple(v.shape)}; make the layout with "
                         "wire.layout(v.size, ...)")
    config = lay.config
    impl = ops.resolve(implementation, config, "encode")
    C = lay.parts * lay.chunks
    x = jnp.pad(v.astype(jnp.float32), (0, lay.parts * lay.part_values - v.shape[0]))
    x = x.reshape(C, lay.chunk * config.d)
    e0, finite = _exponents(x, config)

    def attempt(e):
        blocks = jnp.ldexp(x, -e[:, None]).reshape(-1, config.d)
        index, T = ops.encode_flat(blocks, config, impl, interpret)
        return index.reshape(C, lay.chunk, config.M), (T + 1).reshape(C, lay.chunk)

    index, u = attempt(e0)
    ks = jnp.repeat(_rice(u, lay), lay.chunks, axis=0)  # fixed from the first attempt

    def fits(u, used):
        return jnp.all(u > 0, axis=1) & (used <= 8 * lay.t_bytes)

    def cond(s):
        e, _, _, _, ok = s
        return jnp.any(~ok & finite & (e < _E_MAX))

    def body(s):
        e, _, _, _, ok = s
        e = jnp.where(ok | ~finite, e, e + 1)
        index, u = attempt(e)
        tstream, used = _streams(u, ks, lay)
        return e, index, u, tstream, fits(u, used)

    tstream, used = _streams(u, ks, lay)
    e, index, u, tstream, ok = jax.lax.while_loop(
        cond, body, (e0, index, u, tstream, fits(u, used)))
    sent = ok & finite
    labels = jax.vmap(lambda i: packing.pack_labels(i, config))(index)
    exponent = jnp.where(sent, e, FAILED).astype(jnp.int8)
    records = jnp.concatenate([labels, tstream, jax.lax.bitcast_convert_type(
        exponent, jnp.uint8)[:, None]], axis=1)
    rice = jnp.pad(ks[::lay.chunks], ((0, 0), (0, 2 * lay.rice_bytes - lay.planes)))
    rice = (rice[:, 0::2] | (rice[:, 1::2] << 4)).astype(jnp.uint8)
    payload = jnp.concatenate([records.reshape(lay.parts, -1), rice], axis=1)
    info = Info(jnp.sum((u > 1) & sent[:, None], dtype=jnp.int32),
                jnp.sum(sent & (e > e0), dtype=jnp.int32), jnp.sum(~sent, dtype=jnp.int32))
    return payload, info


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
    NaN. Traceable.

    Raises:
      ValueError: ``part`` is not ``uint8 [lay.part_bytes]`` (a part of another layout).
    """
    part = _check_payload(part, (lay.part_bytes,), lay, "decode_part")
    config = lay.config
    impl = ops.resolve(implementation, config, "decode")
    records = part[:lay.chunks * lay.record_bytes].reshape(lay.chunks, lay.record_bytes)
    nibbles = part[lay.chunks * lay.record_bytes:].astype(jnp.int32)
    ks = jnp.stack([nibbles & 15, nibbles >> 4], axis=1).reshape(-1)[:lay.planes]
    lb, tb = lay.label_bytes, lay.t_bytes
    index, bad = jax.vmap(lambda r: packing.unpack_labels(r, config, lay.chunk))(records[:, :lb])
    v, ok = jax.vmap(lambda r: packing.decode_stream(
        r, ks, lay.planes, 8 * tb, lay.chunk, lay.chunk))(records[:, lb:lb + tb])
    e = jax.lax.bitcast_convert_type(records[:, -1], jnp.int8).astype(jnp.int32)
    u = packing.t_from_symbols(v, config).reshape(-1)
    codes = Codes(index.reshape(-1, config.M), pack_t(u - 1, config), config)
    x = ops.decode(codes, dtype=jnp.float32, implementation=impl, interpret=interpret)
    x = jnp.ldexp(x.reshape(lay.chunks, -1), e[:, None])
    good = ok & ~jnp.any(bad, axis=1) & (e != FAILED)
    return jnp.where(good[:, None], x, jnp.nan).reshape(-1)


def decode(payload, lay: Layout, implementation=None, interpret=None):
    """The values ``[lay.size]`` float32 of a payload ``uint8 [parts, part_bytes]``.

    Raises:
      ValueError: ``payload`` is not ``uint8 [lay.parts, lay.part_bytes]`` (a payload of
        another config or layout, or truncated).
    """
    payload = _check_payload(payload, (lay.parts, lay.part_bytes), lay, "decode")
    parts = jax.vmap(functools.partial(decode_part, lay=lay, implementation=implementation,
                                       interpret=interpret))(payload)
    return parts.reshape(-1)[:lay.size]

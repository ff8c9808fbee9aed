"""The storage form of :class:`~hnlq_jax.Codes`: labels at their information rate, T entropy coded.

``pack(codes) -> Packed`` and ``unpack(packed) -> Codes``. A :class:`Packed` holds two
bitstreams (``docs/format.md``, "Pack bitstream"):

**Labels.** The labels of all blocks (C order over ``[..., M, d]``, the digit view
``codes.labels``) are one sequence of base-q digits, cut into chunks of ``k`` digits
(:func:`label_chunk`); a chunk is the little-endian mixed-radix number ``sum_j digit_j q^j`` in
``B = bit_length(q^k - 1)`` bits (the last, shorter chunk in ``bit_length(q^k' - 1)``), and the
chunks form one little-endian bitstream. For q a power of two this is every digit in
``log2 q`` bits; otherwise ``B / k`` bits per digit, within 0.015 of ``log2 q`` for q <= 8
(q = 3: 27 bits per 17 digits).

**T.** Each block's T becomes the symbol ``v = T`` (``v = max_T + 1`` for a failed block,
``T = -1``), coded in *unary planes*: plane ``j`` (``j = 0, 1, ...``) holds, for every block
with ``v >= j`` in block order, the flag ``v >= j + 1``. The flags of a plane are run-length
coded: each flag 1 ends a run of zeros, and a virtual 1 after the plane's last block ends the
final run, so a plane with ``n`` blocks and ``m`` ones is ``m + 1`` runs summing to ``n - m``.
Each run ``r`` is Rice coded with the plane's parameter ``k``: the quotient ``r >> k`` in unary
(that many 0 bits, then a 1) and the remainder ``r mod 2^k`` in ``k`` bits. Planes with no block
are skipped, and only planes ``0 .. P-1`` are coded with ``P`` the largest ``v`` (blocks still
eligible after the last plane have ``v = P``). For iid T concentrated at 0, as at a
calibrated beta, this is within about 0.03 bits per block of ``H(T)`` (the chain rule splits
``H(T)`` over the binary planes, and Rice codes are near-optimal for geometric runs); every
plane costs at least a bit per block that reaches it, so T mostly above 0 (a beta far too
small) costs up to several bits a block more than ``H(T)``.

The codewords go into one buffer of ``C`` bits from both ends: the unary parts of all planes
(in plane order) forward from bit 0, the ``k``-bit remainders backward from bit ``C`` (the
field of the ``i``-th remainder of the stream ends where the previous one began). Decoding is
vectorized: the unary terminators are the set bits of the forward part (one ``nonzero``), a
plane's runs are ``(quotient << k) + remainder`` and its flags a scatter at the cumulative sum
of ``run + 1``; only a loop over the (at most ``max_T + 1``) planes remains. The plane's Rice
parameter is chosen by the encoder from the histogram of v (``rice_parameters``) and stored.
(:mod:`hnlq_jax.wire` codes T more simply, in one pass without this loop over planes: its
payloads are coded every training step and have a fixed size anyway.)

``pack`` sizes its output from the data, so it runs eagerly (outside ``jit``); ``unpack`` is
traceable. ``Packed.to_bytes`` / ``Packed.from_bytes`` give a self-describing byte string
(format version, config, shapes, a CRC-32).
"""

from __future__ import annotations

import functools
import json
import math
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax.codes import (FORMAT_VERSION, Codes, check_codes, check_rows, index_dtype,
                            index_from_labels, is_concrete, labels_of_index, pack_t)
from hnlq_jax.config import HNLQConfig, check_config
from hnlq_jax.ops import bucket

__all__ = ["Packed", "pack", "unpack", "bits_per_block", "label_bits", "label_chunk",
           "pack_labels", "unpack_labels",
           "t_symbols", "t_from_symbols", "rice_parameters", "encode_stream", "decode_stream",
           "stream_bits", "MAX_RICE"]

# Rice parameters run 0..MAX_RICE; runs are shorter than 2^31 blocks.
MAX_RICE = 30
_MAGIC = b"HNLQPACK"


# ------------------------------------------------------------------------------------ labels


@functools.lru_cache(maxsize=None)
def label_chunk(q: int) -> tuple[int, int]:
    """``(k, B)``: digits per chunk of the label bitstream and the bits of a full chunk.

    ``k`` minimizes ``B / k`` with ``B = bit_length(q^k - 1)`` over ``q^k <= 2^32`` (ties: the
    largest ``k``), e.g. q = 3: 17 digits in 27 bits (1.588 bits per digit against
    log2 3 = 1.585); q = 5: 12 digits in 28 bits (3 in 7 has the same ratio; ties take the
    larger k). For q a power of two, ``B / k = log2 q``.
    """
    best, k = None, 1
    while q**k <= 2**32:
        B = (q**k - 1).bit_length()
        if best is None or B * best[0] <= best[1] * k:
            best = (k, B)
        k += 1
    return best


def label_bits(config: HNLQConfig, n_blocks: int) -> int:
    """Bits of the label bitstream of ``n_blocks`` blocks (the last chunk may be partial)."""
    k, B = label_chunk(config.q)
    digits = n_blocks * config.M * config.d
    full, rest = divmod(digits, k)
    return full * B + (config.q**rest - 1).bit_length()


def bits_per_block(config: HNLQConfig) -> float:
    """Label bits per d-block of a long bitstream: ``M d B / k`` (:func:`label_chunk`), which
    is ``M d log2 q`` for q a power of two. T is coded apart.

    Raises:
      TypeError: ``config`` is not an :class:`~hnlq_jax.HNLQConfig`.
    """
    k, B = label_chunk(check_config(config, "bits_per_block").q)
    return config.M * config.d * B / k


def pack_labels(index, config: HNLQConfig):
    """The label bitstream of blocks ``index[N, M]`` (traceable).

    The digits ``labels[N, M, d]`` in C order are cut into chunks of ``k`` (the last one
    shorter); a chunk is the little-endian mixed-radix number ``sum_j digit_j q^j`` in ``B``
    bits (the last in ``bit_length(q^k' - 1)``), all chunks in one little-endian bitstream.

    Returns:
      ``[ceil(label_bits(config, N) / 8)]`` uint8.
    """
    q = config.q
    k, B = label_chunk(q)
    digits = labels_of_index(index, config).reshape(-1).astype(jnp.uint32)
    n = digits.shape[0]
    digits = jnp.pad(digits, (0, (-n) % k)).reshape(-1, k)
    value = jnp.zeros(digits.shape[0], jnp.uint32)
    for j in reversed(range(k)):  # Horner: fits uint32 since q^k <= 2^32
        value = value * jnp.uint32(q) + digits[:, j]
    bits = ((value[:, None] >> jnp.arange(B, dtype=jnp.uint32)) & 1).astype(jnp.uint8)
    # The last chunk's value is below q^k', so the bits cut off here are zeros.
    bits = bits.reshape(-1)[:label_bits(config, index.shape[0])]
    return jnp.packbits(bits, bitorder="little")


def unpack_labels(data, config: HNLQConfig, n_blocks: int, n_valid=None):
    """Inverse of :func:`pack_labels` (traceable).

    Args:
      data: ``[>= ceil(label_bits(config, n_blocks) / 8)]`` uint8.
      config: the quantizer.
      n_blocks: blocks decoded (static).
      n_valid: blocks coded in ``data`` (traceable, at most ``n_blocks``; default
        ``n_blocks``), for a stream padded to ``n_blocks`` blocks to reuse a compiled decoder;
        the bits after the stream's end are ignored.

    Returns:
      ``(index [n_blocks, M], bad [n_blocks] bool)``: ``bad`` marks blocks with a digit in a
      chunk above ``q^k - 1``, or in the last (shorter) chunk of ``k'`` digits above
      ``q^k' - 1`` (impossible in a valid stream; only for q not a power of two).
    """
    q = config.q
    k, B = label_chunk(q)
    n = n_blocks * config.M * config.d
    chunks = -(-n // k)
    bits = jnp.unpackbits(data, bitorder="little")[:label_bits(config, n_blocks)]
    end = n  # digits coded
    if n_valid is not None:
        end = n_valid * (config.M * config.d)
        # The stream's bits: full chunks of B, then bit_length(q^k' - 1) for the k' left.
        tail = jnp.asarray(np.array([(q**r - 1).bit_length() for r in range(k)], np.int32))
        nbits = (end // k) * B + tail[end % k]
        bits = jnp.where(jnp.arange(bits.shape[0]) < nbits, bits, jnp.uint8(0))
    bits = jnp.pad(bits, (0, chunks * B - bits.shape[0])).reshape(chunks, B).astype(jnp.uint32)
    value = jnp.sum(bits << jnp.arange(B, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)
    digits = []
    for _ in range(k):
        digits.append(value % jnp.uint32(q))
        value = value // jnp.uint32(q)
    digits = jnp.stack(digits, axis=1)  # [chunks, k]
    # A chunk is bad above q^k - 1 (value left after k digits), the last one above q^k' - 1 (a
    # digit past the last coded one).
    beyond = jnp.arange(chunks * k).reshape(chunks, k) >= end
    bad = (value != 0) | jnp.any(beyond & (digits != 0), axis=1)
    bad = jnp.broadcast_to(bad[:, None], digits.shape).reshape(-1)[:n]
    labels = digits.reshape(-1)[:n].reshape(n_blocks, config.M, config.d)
    bad = jnp.any(bad.reshape(n_blocks, -1), axis=1)
    return index_from_labels(labels, q, index_dtype(config)), bad


# ------------------------------------------------------------------------ T: symbols, Rice


def t_symbols(u, config: HNLQConfig):
    """Coded symbols ``v`` (int32) of ``u = T + 1``: ``T``, or ``max_T + 1`` for ``u = 0``."""
    u = u.astype(jnp.int32)
    return jnp.where(u == 0, config.max_T + 1, u - 1)


def t_from_symbols(v, config: HNLQConfig):
    """``u = T + 1`` (int32) of symbols ``v`` (inverse of :func:`t_symbols`)."""
    return jnp.where(v == config.max_T + 1, 0, v + 1).astype(jnp.int32)


def rice_parameters(counts, planes: int):
    """Rice parameter of each plane ``0 .. planes-1`` from the histogram of the symbols.

    Plane j holds ``n_j = #(v >= j)`` flags with ``m_j = n_{j+1}`` ones, coded as ``m_j + 1``
    runs (the last one ended by the plane's end; none for an empty plane) of
    ``z_j = n_j - m_j`` zeros in all. Modelling the runs as geometric with
    ``theta = z_j / (z_j + m_j + 1)``, a run's expected unary length is
    ``theta^(2^k) / (1 - theta^(2^k))``; the parameter minimizes the expected bits
    ``(m_j + 1) (1 + k + that)`` over ``k = 0 .. MAX_RICE``.

    Args:
      counts: ``[S]`` counts of the symbols ``v = 0 .. S-1`` (traceable).
      planes: number of parameters wanted (static).

    Returns:
      ``[planes]`` int32.
    """
    def tail(c):  # tail(c)[j] = sum_{i >= j} c[i], for j = 0 .. planes
        c = jnp.pad(c.astype(jnp.float32), (0, max(0, planes + 1 - c.shape[0])))
        return jnp.cumsum(c[::-1])[::-1][:planes + 1]

    n = tail(counts)
    zeros, runs = n[:-1] - n[1:], n[1:] + (n[:-1] > 0).astype(jnp.float32)
    theta = zeros / jnp.maximum(zeros + runs, 1)
    k = jnp.arange(MAX_RICE + 1, dtype=jnp.float32)
    log_theta = jnp.log2(jnp.where(theta > 0, theta, 1.0))[:, None]
    tk = jnp.where(theta[:, None] > 0, jnp.exp2(log_theta * jnp.exp2(k)), 0.0)  # theta^(2^k)
    cost = runs[:, None] * (1 + k + tk / jnp.maximum(1 - tk, 1e-30))
    return jnp.argmin(cost, axis=1).astype(jnp.int32)


def _plane(v, j):
    """The Rice codewords of plane j of symbols ``v[N]`` (``-1``: not a block).

    Returns:
      ``(valid, run, count)``: ``[N + 1]`` mask of the plane's codewords (``m + 1`` of them,
      none for an empty plane), ``[N + 1]`` int32 run lengths, and ``count`` (a scalar).
    """
    N = v.shape[0]
    elig, ones = v >= j, v >= j + 1
    i32 = jnp.int32  # explicit: under jax_enable_x64 sums and cumsums default to int64
    n, m = jnp.sum(elig, dtype=i32), jnp.sum(ones, dtype=i32)
    rank = jnp.cumsum(elig, dtype=i32) - 1
    slot = jnp.where(ones, jnp.cumsum(ones, dtype=i32) - 1, N + 1)
    pos = jnp.full(N + 1, n, jnp.int32).at[slot].set(rank, mode="drop")  # the ones, then n
    run = pos - jnp.concatenate([jnp.full(1, -1, jnp.int32), pos[:-1]]) - 1
    t = jnp.arange(N + 1, dtype=i32)
    valid = (t <= m) & (n > 0)
    return valid, run, jnp.where(n > 0, m + 1, 0)


def _zero(x, dtype):
    """A zero scalar computed from ``x``: as a loop's initial carry it has ``x``'s varying
    axes under ``shard_map`` (a literal would not, and the loop would not type-check)."""
    return jnp.sum(jnp.zeros_like(x, dtype), dtype=dtype)


def _over_planes(planes, nonempty, body, init):
    """``carry = body(j, carry)`` for ``j = 0, 1, ...`` while ``j < planes`` and plane j has a
    block (``nonempty(j, carry)``); once a plane is empty so are all later ones."""
    def cond(s):
        return (s[0] < planes) & nonempty(s[0], s[1])

    return jax.lax.while_loop(cond, lambda s: (s[0] + 1, body(*s)), (jnp.int32(0), init))[1]


def _unary_bits(valid, run, k):
    return jnp.where(valid, (run >> k) + 1, 0)


def stream_bits(v, ks, planes):
    """Bits of the T stream of symbols ``v[N]`` (``-1`` pads) with Rice parameters ``ks``.

    Args:
      v: ``[N]`` int32 symbols (traceable); entries ``-1`` are padding, not coded.
      ks: ``[S]`` int32 Rice parameters, ``S >= planes`` (traceable).
      planes: planes coded (traceable int).
    """
    def body(j, used):
        k = ks[j]
        valid, run, count = _plane(v, j)
        return used + jnp.sum(_unary_bits(valid, run, k), dtype=jnp.int32) + count * k

    return _over_planes(planes, lambda j, _: jnp.any(v >= j), body, _zero(v, jnp.int32))


def _write(words, pos, value, ok):
    """Adds ``value`` (at most 32 bits) at bit ``pos`` of little-endian uint32 ``words``."""
    W = words.shape[0]
    w = jnp.where(ok, pos >> 5, W)  # out of range: dropped
    s = (pos & 31).astype(jnp.uint32)
    value = value.astype(jnp.uint32)
    hi = jnp.where(s == 0, jnp.uint32(0), value >> (jnp.uint32(32) - s))
    words = words.at[w].add(value << s, mode="drop")
    return words.at[w + 1].add(hi, mode="drop")


def _read(words, pos, k):
    """``k``-bit fields (``k < 32``) at bit positions ``pos`` of uint32 ``words``."""
    W = words.shape[0]
    w = jnp.clip(pos >> 5, 0, W - 1)
    s = (pos & 31).astype(jnp.uint32)
    lo = words[w] >> s
    hi = jnp.where(s == 0, jnp.uint32(0), words[jnp.minimum(w + 1, W - 1)] << (jnp.uint32(32) - s))
    mask = (jnp.uint32(1) << k.astype(jnp.uint32)) - jnp.uint32(1)
    return ((lo | hi) & mask).astype(jnp.int32)


def _to_bytes(words, nbytes: int):
    b = (words[:, None] >> jnp.arange(0, 32, 8, dtype=jnp.uint32)) & jnp.uint32(255)
    return b.astype(jnp.uint8).reshape(-1)[:nbytes]


def _to_words(data):
    pad = (-data.shape[0]) % 4 + 4  # one word more: a field may straddle the last word
    b = jnp.pad(data, (0, pad)).astype(jnp.uint32).reshape(-1, 4)
    return jnp.sum(b << jnp.arange(0, 32, 8, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def encode_stream(v, ks, planes, capacity, nbytes: int):
    """The T stream of symbols ``v[N]`` in a buffer of ``capacity`` bits (traceable).

    Args:
      v: ``[N]`` int32 symbols; ``-1`` entries are padding (not coded).
      ks: ``[S]`` int32 Rice parameters (``S >= planes``).
      planes: planes coded (traceable int; blocks with ``v >= planes`` decode as ``planes``).
      capacity: the buffer's bits ``C`` (traceable, ``<= 8 nbytes``): remainders end there.
      nbytes: static size of the returned buffer.

    Returns:
      ``(data [nbytes] uint8, used bits)``. When ``used > capacity`` the stream overflowed and
      ``data`` is not decodable.
    """
    N = v.shape[0]
    t = jnp.arange(N + 1, dtype=jnp.int32)

    def body(j, carry):
        words, u_used, r_used = carry
        k = ks[j]
        valid, run, count = _plane(v, j)
        ulen = _unary_bits(valid, run, k)
        term = u_used + jnp.cumsum(ulen, dtype=jnp.int32) - 1  # each codeword's unary 1
        words = _write(words, term, jnp.ones_like(term), valid & (term < capacity))
        field = capacity - r_used - (t + 1) * k  # remainders from the end, backward
        rem = run & ((1 << k) - 1)
        words = _write(words, field, rem, valid & (k > 0) & (field >= 0))
        return words, u_used + jnp.sum(ulen, dtype=jnp.int32), r_used + count * k

    zero = _zero(v, jnp.int32)
    words = jnp.zeros(nbytes // 4 + 2, jnp.uint32) + zero.astype(jnp.uint32)
    words, u, r = _over_planes(planes, lambda j, _: jnp.any(v >= j), body, (words, zero, zero))
    return _to_bytes(words, nbytes), u + r


def decode_stream(data, ks, planes, capacity, n_valid, n_blocks: int):
    """Symbols of a T stream (inverse of :func:`encode_stream`; traceable).

    Args:
      data: ``[nbytes]`` uint8 buffer.
      ks: ``[S]`` int32 Rice parameters (``S >= planes``).
      planes: planes coded (traceable).
      capacity: the stream's ``C`` in bits (traceable, ``<= 8 nbytes``).
      n_valid: blocks coded (traceable, ``<= n_blocks``).
      n_blocks: static length of the result.

    Returns:
      ``(v [n_blocks] int32, ok)``: symbols (``-1`` beyond ``n_valid``) and whether the stream
      is consistent (every plane's runs end exactly at its last block, the unary and remainder
      parts fit in ``C`` without overlap, and no plane needs more codewords than are there).
    """
    N = n_blocks
    C = 8 * data.shape[0]
    words = _to_words(data)
    bits = jnp.where(jnp.arange(C) < capacity, jnp.unpackbits(data, bitorder="little"), 0)
    seen = jnp.cumsum(bits, dtype=jnp.int32)
    n_terms = seen[-1]
    term = jnp.full(C, C, jnp.int32).at[jnp.where(bits == 1, seen - 1, C)].set(
        jnp.arange(C, dtype=jnp.int32), mode="drop")  # positions of the unary 1s
    quot = term - jnp.concatenate([jnp.full(1, -1, jnp.int32), term[:-1]]) - 1
    t = jnp.arange(N + 1, dtype=jnp.int32)

    def body(j, carry):
        # idx: the plane's blocks in order (N past its n of them); n, c, o: its block count,
        # first codeword and remainder offset.
        v, idx, n, c, o, ok = carry
        k = ks[j]
        q = quot[jnp.clip(c + t, 0, C - 1)]
        r = jnp.where(k > 0, _read(words, capacity - o - (t + 1) * k, k), 0)
        # A run beyond N is corrupt; clamp before shifting so nothing wraps.
        run = jnp.where(q > (N >> k), N + 1, (q << k) + r)
        cum = jnp.cumsum(run + 1, dtype=jnp.int32)  # codeword i's 1 is the plane's block cum_i - 1
        # The first codeword to reach n + 1 is the plane's last (it comes before the sum can
        # wrap: every term is at least 1).
        m = jnp.argmax(cum >= n + 1).astype(jnp.int32)
        ones = idx[jnp.where(t < m, cum - 1, N)]  # blocks with v >= j + 1, in order
        count = jnp.where(n > 0, m + 1, 0)
        ok = ok & ((n == 0) | (cum[m] == n + 1)) & (c + count <= n_terms)
        return (v.at[ones].add(1, mode="drop"), ones, jnp.where(n > 0, m, 0), c + count,
                o + count * k, ok)

    zero = _zero(data, jnp.int32)
    n = jnp.minimum(n_valid, N) + zero
    idx = jnp.where(t < n, t, N)
    init = (jnp.where(t[:N] < n, 0, -1), idx, n, zero, zero, zero == 0)
    v, _, _, c, o, ok = _over_planes(planes, lambda j, s: s[2] > 0, body, init)
    u_end = jnp.where(c > 0, term[jnp.clip(c - 1, 0, C - 1)] + 1, 0)
    return v, ok & (u_end + o <= capacity)


# ------------------------------------------------------------------------------------ Packed


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_dims(v) -> bool:
    return isinstance(v, list) and all(_is_int(s) and s >= 0 for s in v)


def _dtype_name(dtype) -> str:
    """A scale dtype as the header writes it: NumPy's string with its byte order (``'<f4'``),
    or for the ml_dtypes floats NumPy has no string for (bfloat16: ``'<V2'``) the name."""
    return dtype.str if dtype.kind == "f" else dtype.name


def _named_dtype(name: str):
    """The floating dtype a header's scale names (inverse of :func:`_dtype_name`)."""
    try:
        # '<V2' is how the writer named bfloat16 before it wrote names (no other float it
        # keeps is a 2-byte NumPy void).
        dtype = (jnp.dtype(jnp.bfloat16) if name == "<V2" else
                 np.dtype(name) if name[:1] in "<>=|" else jnp.dtype(name))
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise _bad_header(f"'scale' dtype must be a floating NumPy dtype string (e.g. '<f4') "
                          f"or 'bfloat16', got {name!r}")
    return dtype


# The header :meth:`Packed.to_bytes` writes: key -> (check, what it must be). "version" comes
# first: it is checked before the rest, whose schema is that of the version.
_HEADER = {
    "version": (_is_int, "an int"),
    "config": (lambda v: isinstance(v, dict), "an object"),
    "blocks_shape": (_is_dims, "a list of ints >= 0"),
    "n": (lambda v: v is None or (_is_int(v) and v >= 0), "null or an int >= 0"),
    "sizes": (lambda v: _is_dims(v) and len(v) == 3,
              "a list of 3 ints >= 0 (bytes of labels, tcode and rice)"),
    "scale": (lambda v: v is None or (isinstance(v, list) and len(v) == 2
                                      and isinstance(v[0], str) and _is_dims(v[1])),
              "null or [NumPy dtype string, shape]"),
}
_HEADER_CONFIG = {
    "lattice": (lambda v: isinstance(v, str), "a string"),
    "q": (_is_int, "an int"),
    "M": (_is_int, "an int"),
    "beta": (_is_real, "a number"),
    "alpha": (_is_real, "a number"),
    "max_T": (_is_int, "an int"),
    "dither": (lambda v: v is None or (isinstance(v, list) and all(_is_real(z) for z in v)),
               "null or a list of numbers"),
}


def _bad_header(what: str) -> ValueError:
    return ValueError(f"Packed.from_bytes: not a valid hnlq_jax packed header: {what}")


def _check_fields(obj: dict, schema: dict, where: str, keys=None):
    """Raises ``_bad_header`` unless ``obj`` has the ``keys`` of ``schema`` (default: all of
    them, and no other), each passing its check."""
    for key in schema if keys is None else keys:
        check, what = schema[key]
        if key not in obj:
            raise _bad_header(f"missing {where}{key!r}")
        if not check(obj[key]):
            raise _bad_header(f"{where}{key!r} must be {what}, got {obj[key]!r}")
    extra = sorted(set(obj) - set(schema)) if keys is None else []
    if extra:
        raise _bad_header(f"unexpected {where}key(s) {extra}")


@jax.tree_util.register_pytree_node_class
class Packed:
    """The storage form of :class:`~hnlq_jax.Codes` (a pytree).

    :func:`pack` sizes the T stream from the data: it runs eagerly (outside ``jit``). A Packed
    passes through ``jit`` and :func:`unpack` is traceable.

    Attributes:
      labels: ``[ceil(label_bits(config, N) / 8)]`` uint8 label bitstream of the N blocks.
      tcode: ``[B]`` uint8 entropy-coded T stream (``8 B`` bits, the stream's ``C``).
      rice: ``[P]`` uint8 Rice parameter of each coded plane (``P`` = largest symbol).
      scale: ``None``, or the row scales ``[...rows]`` of row codes.
      config: the quantizer (static).
      blocks_shape: leading shape of the blocks (static).
      n: logical row length of row codes, ``None`` for block codes (static).
      version: the :data:`~hnlq_jax.FORMAT_VERSION` that wrote it (static).
    """

    __slots__ = ("labels", "tcode", "rice", "scale", "config", "blocks_shape", "n", "version")

    def __init__(self, labels, tcode, rice, config: HNLQConfig, blocks_shape: tuple, *,
                 scale=None, n: int | None = None, version: int = FORMAT_VERSION):
        self.labels, self.tcode, self.rice, self.scale = labels, tcode, rice, scale
        self.config, self.blocks_shape, self.n, self.version = (
            config, tuple(int(s) for s in blocks_shape), n, version)

    def tree_flatten(self):
        return ((self.labels, self.tcode, self.rice, self.scale),
                (self.config, self.blocks_shape, self.n, self.version))

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.labels, obj.tcode, obj.rice, obj.scale = children
        obj.config, obj.blocks_shape, obj.n, obj.version = aux
        return obj

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held: labels, T stream, Rice parameters and scale."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self))

    def bits_per_value(self) -> float:
        """``8 nbytes`` over the number of coded values (as ``Codes.bits_per_value``)."""
        lead = self.blocks_shape
        shape = lead + (self.config.d,) if self.n is None else lead[:-1] + (self.n,)
        size = int(np.prod(shape, dtype=np.int64))
        return 8 * self.nbytes / size if size else float("nan")

    def __repr__(self) -> str:
        c = self.config
        return (f"Packed({c.lattice} q={c.q} M={c.M}, blocks {list(self.blocks_shape)}, "
                f"labels {self.labels.shape[0]} B, T {self.tcode.shape[0]} B, "
                f"{self.rice.shape[0]} planes, version {self.version})")

    # -- bytes
    def to_bytes(self) -> bytes:
        """A self-describing byte string: magic, a JSON header (format version, config,
        shapes, sizes), the arrays, and a CRC-32 of everything before it."""
        c = self.config
        scale = None if self.scale is None else np.asarray(self.scale)
        header = {
            "version": self.version,
            "config": {"lattice": c.lattice, "q": c.q, "M": c.M, "beta": c.beta,
                       "alpha": c.alpha, "max_T": c.max_T,
                       "dither": None if c.dither is None else list(c.dither)},
            "blocks_shape": list(self.blocks_shape), "n": self.n,
            "sizes": [int(self.labels.shape[0]), int(self.tcode.shape[0]),
                      int(self.rice.shape[0])],
            "scale": None if scale is None else [_dtype_name(scale.dtype), list(scale.shape)],
        }
        head = json.dumps(header, sort_keys=True).encode()
        body = b"".join(np.asarray(a, np.uint8).tobytes()
                        for a in (self.labels, self.tcode, self.rice))
        if scale is not None:
            body += scale.tobytes()
        out = _MAGIC + struct.pack("<I", len(head)) + head + body
        return out + struct.pack("<I", zlib.crc32(out))

    @classmethod
    def from_bytes(cls, buf: bytes, config: HNLQConfig | None = None) -> Packed:
        """Reads :meth:`to_bytes` output.

        Args:
          buf: the bytes (``bytes``, ``bytearray`` or ``memoryview``; from a file,
            ``Path(file).read_bytes()``).
          config: if given, the config the data must have been made with.

        Raises:
          TypeError: ``buf`` is not bytes (e.g. a file name).
          ValueError: not packed HNLQ data, truncated or corrupted (size or checksum), another
            format version, a header that does not follow the schema of ``docs/format.md``
            (a missing key, a value of the wrong type, an invalid config), or (``config``
            given) another config; the message names both.
        """
        if not isinstance(buf, (bytes, bytearray, memoryview)):
            raise TypeError("Packed.from_bytes: expected the packed data as bytes, bytearray or "
                            "memoryview (for a file, Path(file).read_bytes()), got "
                            f"{type(buf).__name__}")
        if config is not None:
            check_config(config, "Packed.from_bytes")
        buf = bytes(buf)
        if len(buf) < len(_MAGIC) + 8 and _MAGIC.startswith(buf[:len(_MAGIC)]):
            raise ValueError(f"Packed.from_bytes: truncated data ({len(buf)} bytes; the "
                             f"smallest packed data has {len(_MAGIC) + 8})")
        if not buf.startswith(_MAGIC):
            raise ValueError("Packed.from_bytes: not HNLQ packed data (bad magic bytes)")
        (crc,) = struct.unpack("<I", buf[-4:])
        if zlib.crc32(buf[:-4]) != crc:
            raise ValueError("Packed.from_bytes: corrupted or truncated data (CRC-32 mismatch)")
        (hlen,) = struct.unpack("<I", buf[8:12])
        if 12 + hlen > len(buf) - 4:
            raise _bad_header(f"its length {hlen} runs past the data ({len(buf)} bytes)")
        try:
            h = json.loads(buf[12:12 + hlen])
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting
            raise _bad_header(f"not JSON ({type(e).__name__})") from None
        if not isinstance(h, dict):
            raise _bad_header(f"expected a JSON object, got {type(h).__name__}")
        _check_fields(h, _HEADER, "", keys=("version",))
        if h["version"] != FORMAT_VERSION:
            raise ValueError(f"Packed.from_bytes: the data is in format version {h['version']}, "
                             f"this hnlq_jax reads version {FORMAT_VERSION}; decode it with "
                             "the version that wrote it")
        _check_fields(h, _HEADER, "")
        _check_fields(h["config"], _HEADER_CONFIG, "config ")
        cd = dict(h["config"])
        cd["dither"] = None if cd["dither"] is None else tuple(cd["dither"])
        try:
            made = HNLQConfig(**cd)
        except (TypeError, ValueError) as e:
            raise _bad_header(f"its config is not valid: {e}") from e
        # The label bytes follow from the number of blocks: a shape that disagrees (one whose
        # size overflows an int64 included) is refused here, not by a reshape in unpack.
        shape, sizes = h["blocks_shape"], h["sizes"]
        if (max(shape, default=0) >= 2**62
                or -(-label_bits(made, math.prod(shape)) // 8) != sizes[0]):
            raise _bad_header(f"blocks_shape {shape} does not match its {sizes[0]} bytes of "
                              f"labels for {made.lattice} q={made.q} M={made.M}")
        scale_dtype = None if h["scale"] is None else _named_dtype(h["scale"][0])
        # Row codes (those with scales) are made at beta = 1, theirs lives in the row scales:
        # the config they were made from matches whatever its beta.
        rows = scale_dtype is not None
        if config is not None and (config.replace(beta=made.beta) if rows else config) != made:
            raise ValueError(f"Packed.from_bytes: the data was made with {made}, not {config}"
                             + (" (beta aside: row codes keep it in their scales)" if rows else ""))
        body = memoryview(buf)[12 + hlen:-4]
        scale_size = 0 if scale_dtype is None else math.prod(h["scale"][1]) * scale_dtype.itemsize
        if sum(sizes) + scale_size != len(body):
            raise ValueError(f"Packed.from_bytes: the header announces {sum(sizes) + scale_size} "
                             f"bytes of arrays, the data holds {len(body)}")
        arrays, at = [], 0
        for s in sizes:
            arrays.append(np.frombuffer(body[at:at + s], np.uint8))
            at += s
        scale = None
        if scale_dtype is not None:
            # Another writer's byte order is read as written, then held in native order
            # (what JAX arrays need); the values are exactly the same.
            scale = np.frombuffer(body[at:], scale_dtype).reshape(h["scale"][1])
            if scale_dtype.kind == "f":
                scale = scale.astype(scale_dtype.newbyteorder("="))
            scale = jnp.asarray(scale)
        labels, tcode, rice = (jnp.asarray(a) for a in arrays)
        return cls(labels, tcode, rice, made, tuple(h["blocks_shape"]), scale=scale, n=h["n"],
                   version=h["version"])


# ------------------------------------------------------------------------------- pack/unpack


@functools.partial(jax.jit, static_argnums=1)
def _measure(u, config: HNLQConfig, planes):
    """``(v padded with -1, Rice parameters [max_T + 1], stream bits)``; u padded with -1."""
    v = jnp.where(u < 0, -1, t_symbols(u, config))
    counts = jnp.bincount(jnp.where(v < 0, config.max_T + 2, v), length=config.max_T + 3)
    ks = rice_parameters(counts[:config.max_T + 2], config.max_T + 1)
    return v, ks, stream_bits(v, ks, planes)


_encode_stream = jax.jit(encode_stream, static_argnums=(4,))
_pack_labels = jax.jit(pack_labels, static_argnums=1)


def pack(codes: Codes) -> Packed:
    """The storage form of codes: labels near ``M d log2 q`` bits per block, T entropy coded.

    Runs eagerly (it sizes the T stream from the data). On iid Gaussian data at the calibrated
    beta it takes about ``M log2 q + (H(T) + 0.03) / d`` bits per value for q a power of two.

    Args:
      codes: :class:`~hnlq_jax.Codes` (block or row codes).

    Returns:
      :class:`Packed`, carrying the config, the blocks' shape, ``n``, the scale and the format
      version.

    Raises:
      TypeError: not ``Codes``, or called under ``jit`` (use :mod:`hnlq_jax.wire` for
        fixed-size buffers).
      ValueError: corrupted codes (see :func:`hnlq_jax.codes.check_codes`).
    """
    check_codes(codes, "pack")
    if not (is_concrete(codes.index) and is_concrete(codes.tfield)):
        raise TypeError("pack: sizes its output from the data, so it runs outside jit; for a "
                        "fixed-size buffer under jit use hnlq_jax.wire")
    config = codes.config
    lead = codes.blocks_shape
    N = int(np.prod(lead, dtype=np.int64))
    Nb = bucket(N)  # padded, so that new sizes reuse the compiled coder
    index = codes.index.reshape(N, config.M)
    u = codes.T.reshape(N).astype(jnp.int32) + 1
    u = jnp.pad(u, (0, Nb - N), constant_values=-1)
    v_max = int(jnp.max(jnp.where(u < 0, 0, t_symbols(u, config)))) if N else 0
    v, ks, used = _measure(u, config, v_max)
    nbytes = -(-int(used) // 8)
    tcode = _encode_stream(v, ks, v_max, 8 * nbytes, bucket(nbytes))[0][:nbytes]
    labels = _pack_labels(jnp.pad(index, ((0, Nb - N), (0, 0))), config)
    labels = labels[: -(-label_bits(config, N) // 8)]
    return Packed(labels, tcode, ks[:v_max].astype(jnp.uint8), config, lead, scale=codes.scale,
                  n=codes.n)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _unpack(arrays, config: HNLQConfig, n_blocks: int):
    labels, tcode, ks, planes, capacity, n_valid = arrays
    index, bad = unpack_labels(labels, config, n_blocks, n_valid)
    v, ok = decode_stream(tcode, ks, planes, capacity, n_valid, n_blocks)
    u = jnp.where(ok & ~bad, t_from_symbols(v, config), 0)
    return index, u, ok, bad


def unpack(packed: Packed) -> Codes:
    """Exact inverse of :func:`pack` (traceable). The config travels with the data.

    Args:
      packed: a :class:`Packed`.

    Returns:
      :class:`~hnlq_jax.Codes` equal to the packed ones (index, T field, scale, ``n``).

    Raises:
      TypeError: not a ``Packed``.
      ValueError: another format version, inconsistent sizes, more planes than ``max_T + 1``
        or a Rice parameter above ``MAX_RICE``, or (checked when concrete) a corrupted stream
        (a T stream whose runs do not end at the last block, or a label chunk above its
        largest value, ``q^k - 1`` or for the last, shorter chunk ``q^k' - 1``). Under ``jit``
        a corrupted T stream marks every block failed (``T = -1``: they decode to NaN) and a
        corrupted label chunk its blocks.
    """
    if not isinstance(packed, Packed):
        how = ("; read bytes with hnlq_jax.Packed.from_bytes(buf) first"
               if isinstance(packed, (bytes, bytearray, memoryview)) else "")
        raise TypeError(f"unpack: expected hnlq_jax.Packed, got {type(packed).__name__}{how}")
    if packed.version != FORMAT_VERSION:
        raise ValueError(f"unpack: the data is in format version {packed.version}, this "
                         f"hnlq_jax reads version {FORMAT_VERSION}")
    config = check_config(packed.config, "unpack", "Packed.config")
    lead = packed.blocks_shape
    N = math.prod(lead)  # exact: a size beyond int64 fails the labels' size check below
    labels, tcode, rice = (jnp.asarray(a) for a in (packed.labels, packed.tcode, packed.rice))
    expect = -(-label_bits(config, N) // 8)
    for name, a, size in (("labels", labels, expect), ("tcode", tcode, None),
                          ("rice", rice, None)):
        if a.dtype != jnp.uint8 or a.ndim != 1 or (size is not None and a.shape[0] != size):
            want = f"[{size}]" if size is not None else "[...]"
            raise ValueError(f"unpack: expected {name} uint8{want} for {N} blocks of "
                             f"{config.lattice} q={config.q} M={config.M}, got "
                             f"{a.dtype}{list(a.shape)} (truncated or another config?)")
    if rice.shape[0] > config.max_T + 1:
        raise ValueError(f"unpack: {rice.shape[0]} T planes for max_T = {config.max_T} (at most "
                         f"{config.max_T + 1}): corrupted data or another config")
    # A plane of n <= N blocks codes at most n + 1 runs: at most 2 (n + 1) bits of unary parts
    # and MAX_RICE bits of remainder each, so a longer stream is corrupted or padded: refused
    # before the decoder allocates per bit. (Loose: a stream of 10^6 blocks may still be padded
    # to tens of MB.)
    most = -(-rice.shape[0] * (N + 1) * (2 + MAX_RICE) // 8)
    if tcode.shape[0] > most:
        raise ValueError(f"unpack: a T stream of {tcode.shape[0]} bytes is longer than any of "
                         f"{N} blocks in {rice.shape[0]} planes (at most {most}): corrupted or "
                         "padded data")
    if is_concrete(rice) and rice.size and int(jnp.max(rice)) > MAX_RICE:
        raise ValueError(f"unpack: Rice parameter {int(jnp.max(rice))} > {MAX_RICE}: corrupted "
                         "data")
    # At least one block and one byte: an all-zero T stream is empty, no codes have no blocks,
    # and the decoder indexes the last of each.
    Nb, Bb = ((bucket(N), bucket(tcode.shape[0])) if is_concrete(tcode)
              else (max(N, 1), max(tcode.shape[0], 1)))
    arrays = (jnp.pad(labels, (0, -(-label_bits(config, Nb) // 8) - labels.shape[0])),
              jnp.pad(tcode, (0, Bb - tcode.shape[0])),
              jnp.pad(rice.astype(jnp.int32), (0, config.max_T + 1 - rice.shape[0])),
              jnp.int32(rice.shape[0]), jnp.int32(8 * tcode.shape[0]), jnp.int32(N))
    index, u, ok, bad = _unpack(arrays, config, Nb)
    if is_concrete(ok) and not bool(ok):
        raise ValueError("unpack: corrupted T stream (its runs do not end at the last block, "
                         "or its parts overlap or run past its end)")
    if is_concrete(bad) and bool(jnp.any(bad[:N])):
        raise ValueError(f"unpack: corrupted label bitstream: {int(jnp.sum(bad[:N]))} block(s) "
                         f"hold a chunk above the largest value for q={config.q}")
    index = index[:N].reshape(lead + (config.M,))
    T = (u[:N] - 1).reshape(lead)
    if packed.n is None and packed.scale is None:
        return Codes(index, pack_t(T, config), config)
    n, scale = check_rows(lead, config, packed.scale, packed.n, "unpack")
    return Codes(index, pack_t(T, config), config, scale=scale, n=n)


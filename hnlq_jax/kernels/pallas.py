"""Pallas kernels on compact :class:`~hnlq_jax.Codes` (Triton; Mosaic GPU for the mod-q sum).

This module holds kernels only: the front doors :func:`hnlq_jax.encode`, ``decode``,
``quantize`` and ``matmul`` dispatch here with ``implementation="pallas"`` (and validate their
arguments first). Each kernel equals its XLA reference bit for bit where the arithmetic allows:

=================  ============================================  =================================
kernel             what one program does                         reference (``"xla"``)
=================  ============================================  =================================
``encode``         a tile of blocks: overload loop over T, all   :func:`hnlq_jax.encode`
                   M levels in registers                         (identical codes)
``decode``         a tile of blocks, all levels fused            :func:`hnlq_jax.decode`
                                                                 (identical values)
``decode_matmul``  ``bb x bn`` outputs: decodes the weight tile  :func:`hnlq_jax.matmul`
                   by tile next to the ``dot`` (weight-only)     (identical weights; sums
                                                                 in another order)
``gemv``           ``bb x bn`` outputs for up to 8 rows of x:    :func:`hnlq_jax.matmul`
                   packed codebook words, inner products in      (float32 rounding)
                   registers, no decoded weight, or gathers
                   from x's one-sided tables (split-K)
``modq_sum``       a tile of blocks: digit-wise sum mod q,       :func:`hnlq_jax.modq.accumulate`
                   common T                                      (identical codes)
=================  ============================================  =================================

**The codes are read where they lie.** ``index [..., M]`` is viewed (a free reshape) as
``[N, M]`` or ``[n, nb, M]`` and loaded one level column at a time. The T field is unpacked in
the kernel: a block's byte is gathered by address (8-bit field: byte ``row * L + l``; 4-bit:
byte ``row * ceil(L/2) + l // 2``, the high nibble for odd ``l``, where ``L`` is the length of
the last leading axis), so codes of any leading shape, odd ``L`` included, need no re-layout.
Only activations are re-laid out per call (``decode_matmul``: coordinate planes of x;
``gemv``: x's blocks in the codebook's basis, or x's one-sided tables), and ``modq_sum``, whose
kernel Mosaic GPU also lowers,
reads planar copies (Mosaic GPU has no gathers and wants contiguous rows).

**The codebook** ``r(k)`` (integer P coordinates) is a kernel input where it fits: packed
(:func:`packed_codebook`: one uint32 word an entry, byte fields, or for E8 4-bit fields split
into two words of bytes; a level is one gather and the levels add as integers; D4 q = 4: 1 KiB,
E8 q = 4: 256 KiB), else as int32
``[d, q^d]`` up to 64 KiB (one gather a coordinate). Beyond both the kernel computes ``r``
from the index digits (:func:`~hnlq_jax.codec.level_sum` with ``use_table=False``:
``G b - q Q_L(G b / q)``). All paths are exact and give identical values; ``use_table=``
forces one (tests, timing). On an H100 the digits were 50x slower than the packed E8 table in
the 2-D matmul tiles (docs/gpu.md), so the packed table is the default wherever it exists.

**Ragged edges.** The Pallas Triton lowering neither pads nor masks a block that runs past the
end of an array (its loads and stores are plain pointer accesses), so every kernel masks the
loads and stores of its edge tiles (:func:`jax.experimental.pallas.triton.load` / ``store``)
and clamps its gather addresses.

The kernels run the library's own lattice code (:func:`~hnlq_jax.codec.encode_at`,
:func:`~hnlq_jax.codec.level_sum`, :mod:`hnlq_jax._numerics`), so the codes and the tie rule
are the reference's by construction. That code is written in the subset Triton lowers:
floor-based rounding, per-column loads (no value slicing), no captured array constants,
power-of-two tiles, gathers as ``ref[index]``.

``interpret=None`` runs a kernel in interpret mode where its inputs live on a CPU (the kernel
body as XLA ops, slower than the XLA path; :func:`platform`, so a CPU array on a GPU machine too);
``False`` forces the real lowering. ``gpu_backend``: ``"triton"`` (every kernel) or
``"mosaic_gpu"`` (:data:`MOSAIC_GPU_OPS`, empty on jax >= 0.11).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from hnlq_jax import _numerics, codec, lut, modq
from hnlq_jax.kernels import gpu_tiles
from hnlq_jax.codes import (Codes, check_activations, check_codes, check_weight_codes,
                             digits_of_index, index_dtype, pack_t, t_bits, unpack_t,
                             valid_blocks)
from hnlq_jax.config import HNLQConfig, check_config, pow2_table
from hnlq_jax.lattices import sumsq

__all__ = [
    "GPU_BACKENDS",
    "MOSAIC_GPU_OPS",
    "decode",
    "decode_matmul",
    "encode",
    "few_rows_on_tensor_cores",
    "gemv",
    "gpu_generation",
    "GEMV_ROWS",
    "launch_params",
    "modq_sum",
    "packed_codebook",
    "platform",
    "unsupported",
]

GPU_BACKENDS = ("triton", "mosaic_gpu")
# JAX 0.11 no longer lowers pl.pallas_call through Mosaic GPU (0.10 deprecated that path for
# plgpu.kernel; seen with jax 0.11.2 on an H200): there no kernel has a Mosaic GPU version.
MOSAIC_GPU_OPS = ("modq_sum",) if jax.__version_info__ < (0, 11) else ()
_HIGHEST = jax.lax.Precision.HIGHEST
# The codebook is a kernel input (one gather per level) up to this many int32 entries (64 KiB).
_TABLE_ENTRIES = 2**14
# use_table=True is refused beyond this many codebook rows (E8 q = 4 is 2^16).
_TABLE_ROWS_MAX = 2**16
# Mosaic GPU copies whole warpgroups of bytes: the mod-q kernel takes 256 blocks per program.
_MOSAIC_TILE = 256
# decode_matmul keeps a [bb, bn] float32 accumulator per program: at most this many batch rows.
_BATCH_TILE = 64


def unsupported(config: HNLQConfig) -> str | None:
    """Why no kernel applies to ``config`` (``None`` when they all do)."""
    d = config.d
    if d & (d - 1):
        return f"d = {d} is not a power of two (Triton tiles must be)"
    return None


# ---------------------------------------------------------------------------- shared helpers


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def platform(*arrays) -> str:
    """The platform (``"cpu"``, ``"gpu"``, ...) a computation on ``arrays`` runs on.

    That of the first concrete array committed to a device (a DLPack import of a CPU tensor,
    ``jax.device_put(x, device)``), else that of ``jax.default_device`` where it is set, else
    JAX's default backend. On a GPU machine a CPU array must take the CPU's path: a kernel
    compiled for the GPU cannot run on it.

    Args:
      *arrays: the operation's inputs (pytrees such as :class:`~hnlq_jax.Codes` too); tracers
        and other leaves are skipped.
    """
    for v in jax.tree_util.tree_leaves(arrays):
        if isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer) and v.committed:
            return next(iter(v.devices())).platform
    device = jax.config.jax_default_device
    if device is not None:
        return device if isinstance(device, str) else device.platform
    return jax.default_backend()


def interpret_mode(interpret, *arrays) -> bool:
    """A kernel's ``interpret`` argument resolved: ``None`` is interpret mode where the inputs
    live on a CPU (:func:`platform`)."""
    return platform(*arrays) == "cpu" if interpret is None else bool(interpret)


def _check_config(config: HNLQConfig, fn: str):
    check_config(config, fn)
    why = unsupported(config)
    if why:
        raise ValueError(f"{fn}: no Pallas kernel for {config.lattice}: {why}; use "
                         "implementation='xla'")


def _compiler_params(gpu_backend: str, fn: str):
    if gpu_backend == "triton":
        return pltriton.CompilerParams(num_warps=4, num_stages=1)
    if gpu_backend == "mosaic_gpu" and fn in MOSAIC_GPU_OPS:
        return plgpu.CompilerParams()
    if gpu_backend == "mosaic_gpu":
        why = (f"jax {jax.__version__} no longer lowers pl.pallas_call through Mosaic GPU"
               if fn == "modq_sum" else
               "it needs gathers or vector while loops, which Mosaic GPU lacks")
        raise ValueError(f"{fn}: no Mosaic GPU kernel ({why}); use gpu_backend='triton'. "
                         f"Mosaic GPU kernels: {MOSAIC_GPU_OPS}")
    raise ValueError(f"{fn}: gpu_backend must be one of {GPU_BACKENDS}, got {gpu_backend!r}")


def _tile(n: int, block: int, fn: str, what: str = "block") -> int:
    """Rows per program: a power of two >= 16 (Triton's ``dot`` minimum), no larger than needed."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 16 or block & (block - 1):
        raise ValueError(f"{fn}: {what} must be a power of two >= 16, got {block!r}")
    return min(block, max(16, _pow2_at_least(n)))


def _padded(values, size: int):
    """A small table padded to a power-of-two length (Triton's tensor sizes must be)."""
    return jnp.pad(values, (0, size - values.shape[0]))


def _tables(config: HNLQConfig, dtype):
    """``2^(alpha t)`` (padded to a power of two) and ``[beta]``, as kernel inputs."""
    pow2 = _numerics.pow2(config, dtype)
    return _padded(pow2, _pow2_at_least(pow2.shape[0])), jnp.full((1,), config.beta, dtype)


def _use_table(config: HNLQConfig, use_table, fn: str) -> bool:
    rows = config.q**config.d
    if use_table is None:  # the packed table wherever it exists (docs/kernels.md, gpu.md)
        return packed_codebook(config) is not None or rows * config.d <= _TABLE_ENTRIES
    if use_table and rows > _TABLE_ROWS_MAX:
        raise ValueError(f"{fn}: use_table=True needs q^d <= {_TABLE_ROWS_MAX}, got "
                         f"{config.lattice} q={config.q} with {rows} codebook rows")
    return bool(use_table)


def _codebook_input(config: HNLQConfig):
    """The codebook ``r`` as a flat input: packed fields (:func:`packed_codebook`) where they
    hold it, else int32 ``[d * q^d]`` (column j at ``j q^d``)."""
    packed = packed_codebook(config)
    table = (codec.codebook_table(config.lattice, config.q).T.reshape(-1).astype(np.int32)
             if packed is None else packed[0])
    return _padded(jnp.asarray(table), _pow2_at_least(table.shape[0]))


def packed_codebook(config: HNLQConfig):
    """The codebook as packed fields, or ``None`` where they would not hold ``P``.

    Byte fields for ``d <= 4``: field ``j`` of entry ``k`` (bits ``8 j``) holds ``r_j(k) + c``,
    with ``c = -min r``. The levels' words then add as integers, ``sum_m q^m word(k_m)``, each
    field giving ``P_j + c sum_m q^m`` with no carry into the next, when
    ``(max r - min r) sum_m q^m <= 255`` (``q = 4``: D4 up to ``M = 3``). For ``d = 8``
    (E8 q = 4 up to ``M = 2``, where ``max r - min r = 15``), 4-bit fields, coordinate ``j`` at
    bits ``4 j``: two masks split a word into two words of byte fields (coordinates ``2 i``
    and ``2 i + 1`` in byte ``i`` of each), which add as above. One gather a level and block
    instead of ``d``.

    Returns:
      ``(table, c)``: uint32 ``[q^d]``, a word an entry, and the bias ``c``; ``None`` for
      larger codebooks (``q^d > 2^16``) or ranges.
    """
    return _packed_codebook(config.lattice, config.q, config.M)


@functools.lru_cache(maxsize=None)
def _packed_codebook(lattice: str, q: int, M: int):
    r = codec.codebook_table(lattice, q).astype(np.int64)
    rows, d = r.shape
    c = -int(r.min())
    if rows > _TABLE_ROWS_MAX or (int(r.max()) + c) * sum(q**m for m in range(M)) > 255:
        return None
    packed = codec.packed_codebook(lattice, q, 8 if d <= 4 else 4)  # E8: 4-bit fields
    return None if packed is None else (packed[0], c)


def _index_can_overflow(config: HNLQConfig) -> bool:
    """Whether the index dtype holds values past ``q^d - 1`` (corrupt codes can name no entry)."""
    return config.q**config.d - 1 < np.iinfo(index_dtype(config)).max


def _codebook_row(k, config: HNLQConfig):
    """Index ``k`` as an int32 row of a codebook-sized table, clamped where the index dtype
    holds values past ``q^d`` (such corrupt blocks are masked by the caller)."""
    if _index_can_overflow(config):
        k = jnp.minimum(k, jnp.uint32(config.q**config.d - 1))
    return k.astype(jnp.int32)


# float(0x4B000000 | b) is 2^23 + b exactly for a byte b: a byte to float without a conversion
# instruction (Hopper's integer-to-float convert runs at a quarter of the FMA rate).
_MAGIC = 0x4B000000
_TWO23 = float(2**23)


def word_view(config: HNLQConfig) -> tuple | None:
    """``(g, parts, t_dtype)``: the weight blocks whose index items fill one uint32 word, the
    blocks of one element of the T field's view (``parts = max(g, 8 / t_bits)``: a whole
    number of bytes, a whole number of index words) and its dtype (``parts t_bits`` bits);
    ``None`` where a block's index items do not divide a word (3 levels of bytes)."""
    isz = np.dtype(index_dtype(config)).itemsize
    if 4 % (config.M * isz):
        return None
    g = 4 // (config.M * isz)
    parts = max(g, 8 // t_bits(config))
    return g, parts, {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[parts * t_bits(config)]


def code_words(codes: Codes) -> tuple:
    """``codes``' index and T field as words, viewed, not copied (:func:`word_view`): index
    uint32 ``[n, nb / g]`` (block ``p`` of a word in its items ``p M .. (p + 1) M - 1``,
    little-endian), as ``[n, nb / parts, parts / g]`` where a T element's blocks take several
    words, and T ``[n, nb / parts]`` (block ``p`` of an element in bits ``p t_bits``);
    ``nb % parts == 0``."""
    n, nb = codes.blocks_shape
    g, parts, t_dtype = word_view(codes.config)
    w = jax.lax.bitcast_convert_type(codes.index.reshape(n, nb // g, -1), jnp.uint32)
    w = w.reshape(n, nb // parts, parts // g) if parts > g else w
    tf = codes.tfield.reshape(n, -1)
    if t_dtype != jnp.uint8:
        tf = jax.lax.bitcast_convert_type(tf.reshape(n, nb // parts, -1), t_dtype)
    return w, tf


def prmt(a, b, selector: int):
    """PTX ``prmt.b32`` (default mode) on uint32 arrays: byte ``i`` of the result is byte
    ``(selector >> 4 i) & 7`` of ``b:a`` (0-3: ``a``'s, 4-7: ``b``'s). What interpret mode
    runs where a kernel has the instruction, so that the CPU tests pin its selectors."""
    out = jnp.zeros(jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)), jnp.uint32)
    for i in range(4):
        k = (selector >> 4 * i) & 7
        byte = ((a if k < 4 else b) >> jnp.uint32(8 * (k % 4))) & jnp.uint32(255)
        out = out | (byte << jnp.uint32(8 * i))
    return out


def magic_selector(i: int) -> int:
    """The ``prmt`` selector of byte ``i`` of ``b`` under the magic exponent, with ``a`` the
    constant :data:`_MAGIC` (bytes 00 00 00 4B): bytes ``b_i``, 00, 00, 4B."""
    return 0x3104 + i


def _magic_byte(word, i: int, interpret: bool):
    """Byte ``i`` of ``word`` (uint32) as the float ``2^23 + byte``: one ``prmt`` where a
    shift, a mask and an OR took two or three instructions."""
    if interpret:
        return jax.lax.bitcast_convert_type(prmt(jnp.uint32(_MAGIC), word, magic_selector(i)),
                                            jnp.float32)
    return pltriton.elementwise_inline_asm(
        f"prmt.b32 $0, {_MAGIC}, $1, {magic_selector(i)};", args=[word], constraints="=f,r",
        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(word.shape, jnp.float32)])[0]


def _fma(a, b, c, interpret: bool):
    """``a b + c`` rounded once: Triton's lowering rounds each product and sum apart (no
    contraction), two instructions where one does."""
    a, b, c = jnp.broadcast_arrays(a, b, c)
    if interpret:
        return a * b + c
    return pltriton.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


# float16's magic exponent over two byte fields (0x64 above a byte: 1024 + byte)
_F16_MAGIC_PAIR = 0x64006400


def _f16_field(word, i: int, *, s, bias: int, interpret: bool):
    """Byte field ``i`` of packed-field words (uint32 ``[.., c]``) less ``bias``, times ``s``
    (float16 ``[.., c]``), as float16: ``P 2^(alpha T - e_A)`` of one coordinate of the blocks,
    ``P`` exact (at most 255 in magnitude) and the product rounded once. Two neighbouring
    blocks' fields in one ``prmt`` and an AND-OR under float16's magic exponent, then one
    ``sub.f16x2`` and one ``mul.f16x2``: two instructions a weight where float32 took five."""
    if interpret:
        f = ((word >> jnp.uint32(8 * i)) & jnp.uint32(255)).astype(jnp.float16)
        return (f - np.float16(bias)) * s  # (exact, then one rounding)
    sel = i | i << 4 | (4 + i) << 8 | (4 + i) << 12  # byte i of each word, twice (masked)
    off = int(np.float16(1024 + bias).view(np.uint16)) * 0x10001
    return pltriton.elementwise_inline_asm(
        # lop3 0xEA: (t & 0x00FF00FF) | magic
        f"{{ .reg .b32 t, o; prmt.b32 t, $1, $2, {sel}; "
        f"lop3.b32 t, t, 0x00FF00FF, {_F16_MAGIC_PAIR}, 0xEA; mov.b32 o, {off}; "
        "sub.rn.f16x2 t, t, o; mul.rn.f16x2 $0, t, $3; }", args=[word, s],
        constraints="=r,r,r,r", pack=2,  # $1 $2: two blocks' words, $3: their two scales
        result_shape_dtypes=[jax.ShapeDtypeStruct(word.shape, jnp.float16)])[0]


def _byte(word, i: int):
    return (word >> jnp.uint32(8 * i)) & jnp.uint32(255)


def _packed_fields(ks: list, tab_ref, config: HNLQConfig, first: int, byte=_byte) -> list:
    """The ``d`` fields (uint32) of ``sum_{m >= first} q^m word(k_m)``: ``P_j`` plus the bias
    ``c sum_{m >= first} q^m`` (:func:`packed_codebook`); ``byte(word, i)``: how a field is
    taken from byte ``i`` of a word of fields."""
    weights = _numerics.level_weights(config)
    # the words of byte fields a level's entry gives: itself, or a 4-bit entry's two halves
    halves = (0,) if config.d <= 4 else (0, 4)
    words = [None] * len(halves)
    for m in range(first, config.M):
        entry = tab_ref[_codebook_row(ks[m], config)]
        for h, shift in enumerate(halves):
            part = entry if config.d <= 4 else (entry >> jnp.uint32(shift)) & jnp.uint32(
                0x0F0F0F0F)
            part = part * jnp.uint32(weights[m])
            words[h] = part if words[h] is None else words[h] + part
    # coordinate j: byte j of the word, or byte j // 2 of half j % 2
    return [byte(words[j % len(halves)], j // len(halves)) for j in range(config.d)]


def _packed_floats(ks: list, tab_ref, config: HNLQConfig, first: int, interpret: bool) -> list:
    """``sum_{m >= first} q^m r(k_m)`` as float32 ``P`` coordinates from the packed fields:
    each field under the magic exponent (one ``prmt``) less ``2^23`` and the bias, exact (the
    values an integer subtract and a conversion give, without the conversion unit)."""
    base = np.float32(_TWO23 + packed_bias(config, first))
    return [f - base for f in _packed_fields(
        ks, tab_ref, config, first, functools.partial(_magic_byte, interpret=interpret))]


def packed_bias(config: HNLQConfig, first: int) -> int:
    """The bias of each field of the levels' packed sum from level ``first`` on
    (:func:`packed_codebook`)."""
    return packed_codebook(config)[1] * sum(config.q**m for m in range(first, config.M))


def _whole(a):
    """A block spec of all of ``a`` (tables, and the T field, which is gathered by address)."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def _iota(n: int):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _at(i: int):
    """A static index of a masked load or store: interpret mode wants an array of the default
    integer dtype (as its slice starts; int64 under x64)."""
    return jnp.asarray(i, jax.dtypes.canonicalize_dtype(jnp.int64))


def _load(ref, mask):
    """``ref``'s values where ``mask`` holds, 0 elsewhere (edge tiles run past the array);
    ``mask=None``: all of them (a tile inside the array)."""
    if mask is None:
        return pltriton.load(ref)
    return pltriton.load(ref, mask=mask, other=0)


def _read_u(t_ref, row, col, L: int, config: HNLQConfig):
    """``u = T + 1`` (int32) of the blocks at ``(row, col)`` of blocks ``[rows, L]``.

    ``t_ref`` is the whole T field, flat. The block's byte is gathered by address: with 8 bits
    byte ``row L + col``; with 4 bits byte ``row ceil(L/2) + col // 2``, whose high nibble
    holds odd ``col``. ``row`` and ``col`` must be in range (callers clamp edge tiles).
    """
    if t_bits(config) == 8:
        return t_ref[row * L + col].astype(jnp.int32)
    f = t_ref[row * ((L + 1) // 2) + (col >> 1)].astype(jnp.int32)
    return (f >> ((col & 1) * 4)) & 15


def _lattice_point(ks: list, tab_ref, config: HNLQConfig, first: int) -> list:
    """``sum_{m >= first} q^m r(k_m)`` (int32 P coordinates) from index columns ``ks``.

    ``tab_ref``: the codebook input (see :func:`_codebook_input`), or ``None`` to compute ``r``
    from the digits.
    """
    if tab_ref is None:
        return codec.level_sum(ks, config, first, use_table=False)
    if packed_codebook(config) is not None:
        bias = packed_bias(config, first)
        return [f.astype(jnp.int32) - bias for f in _packed_fields(ks, tab_ref, config, first)]
    rows, d = config.q**config.d, config.d
    weights = _numerics.level_weights(config)
    total = None
    for m in range(first, config.M):
        k = _codebook_row(ks[m], config)
        r = [tab_ref[j * rows + k] * weights[m] for j in range(d)]
        total = r if total is None else [a + b for a, b in zip(total, r)]
    return total


def _decoded(ks: list, u, tab_ref, pow_ref, beta_ref, config: HNLQConfig, dtype,
             interpret: bool, first: int = 0) -> list:
    """Decoded Cartesian columns ``(beta (x_hat - z)) 2^(alpha T)`` of index columns ``ks``.

    NaN where the block is invalid (as :func:`hnlq_jax.codec.decode_blocks`). The products
    must round in the reference's order. Triton keeps it; XLA, which runs interpret mode, moves
    constants outward (``(c k) beta -> (c beta) k`` for A2's ``k = sqrt(3)/2``), hence the
    barriers there (Triton has no lowering for them and needs none).
    """
    dtype = jnp.dtype(dtype)
    fence = jax.lax.optimization_barrier if interpret else (lambda v: v)
    if tab_ref is not None and packed_codebook(config) is not None and dtype == jnp.float32:
        P = _packed_floats(ks, tab_ref, config, first, interpret)
    else:
        P = [c.astype(dtype) for c in _lattice_point(ks, tab_ref, config, first)]
    xhat = fence(config.lat.cart_from_P(P))
    s = _numerics.overload_scale(u, config, pow_ref)
    z = config.dither_array
    scaled = fence([beta_ref[0] * (c - dtype.type(zj)) for c, zj in zip(xhat, z)])
    s = jnp.where(valid_blocks(ks, u, config), s, jnp.nan)  # once a block, not a coordinate
    return [c * s for c in scaled]


def _block_scale(table_ref, ks, u, config: HNLQConfig):
    """The blocks' ``2^(alpha T)`` from an overload table by ``u = T + 1`` (NaN for ``u = 0``,
    a failed block: :func:`overload_table`, :func:`f16_overload_table`), NaN too where an
    index passes ``q^d`` (a corrupt index), in the table's dtype."""
    s = table_ref[u]
    if _index_can_overflow(config):
        s = jnp.where(valid_blocks(ks, u, config), s, jnp.nan)
    return s


def _index_columns(idx_ref, M: int, mask, at=()):
    """The ``M`` index columns (uint32) of a tile, masked (``at``: leading index of the tile)."""
    return [_load(idx_ref.at[at + (Ellipsis, _at(m))], mask).astype(jnp.uint32)
            for m in range(M)]


# ----------------------------------------------------------------------------------- encode


def _div_rn(a, b):
    """PTX ``div.rn.f32``: IEEE's quotient, where Triton's ``/`` is ``div.full.f32`` (up to two
    units in the last place off)."""
    return pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=list(jnp.broadcast_arrays(a, b)), constraints="=f,f,f",
        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(jnp.broadcast_shapes(
            jnp.shape(a), jnp.shape(b)), jnp.float32)])[0]


def _divide(a, b, interpret: bool):
    """The reference's ``a / b`` (:func:`hnlq_jax._numerics.divide`): its exact steps in
    interpret mode; compiled, one correctly rounded division (float64's ``/`` is)."""
    if interpret:
        return _numerics.divide(a, b, cpu_exact=True)
    return _numerics.divide(a, b, _div_rn if a.dtype == jnp.float32 else None, exact=True)


def _search(x: list, t, active, scale_ref, *, config: HNLQConfig, once: bool,
            interpret: bool) -> tuple:
    """Algorithm 1's overload loop over a tile of blocks (``x``: their ``d`` columns) from
    each block's step ``t`` where ``active``: ``(t, active, T, index)``, the steps reached,
    the blocks still unresolved, their T (``-1``: failed or not tried) and ``M`` index
    columns. ``once``: one attempt (``t``, ``active``: where the loop would go on)."""
    max_T = config.max_T
    dtype = x[0].dtype
    z = [dtype.type(v) for v in config.dither_array]

    def attempt(state):
        t, active, T, digits = state
        s = scale_ref[jnp.minimum(t, max_T)]
        new, over = codec.encode_at([_divide(c, s, interpret) + zj for c, zj in zip(x, z)],
                                    config, lookup=False)
        ok = active & ~over
        digits = tuple(jnp.where(ok, a, b) for a, b in zip(new, digits))
        T = jnp.where(ok, t, T)
        t = t + 1
        return t, active & over & (t <= max_T), T, digits

    def any_active(state):
        return jnp.max(state[1].astype(jnp.int32)) > 0

    state = (t, active, jnp.full(t.shape, -1, jnp.int32),
             tuple(jnp.zeros(t.shape, jnp.int32) for _ in range(config.d)))
    state = attempt(state) if once else jax.lax.while_loop(any_active, attempt, state)
    t, active, T, digits = state
    return t, active, T, codec.index_from_digits(list(digits), config)


def _encode_kernel(x_ref, scale_ref, *refs, config: HNLQConfig, thresholds, unit, n: int,
                   interpret: bool):
    """Algorithm 1 on a tile of blocks from each block's first step (the reference's lower
    bound from its norm): ``refs`` the outputs ``idx_ref, T_ref``. With a zeroed count (an
    input aliased to the first output: ``_, count_ref, idx_ref, T_ref, left_ref, next_ref``):
    one attempt, and the blocks it leaves unresolved are listed, each tile's at slots it
    takes from the count with one atomic add (tiles in any order: a block's codes depend on
    its own data only): ``left_ref`` their rows, ``next_ref`` the steps they try next."""
    once = len(refs) == 6
    _, count_ref, idx_ref, T_ref, left_ref, next_ref = refs if once else (None, None, *refs,
                                                                           None, None)
    bn = T_ref.shape[0]
    rows = pl.program_id(0) * bn + _iota(bn)
    live = rows < n
    x = [_load(x_ref.at[:, _at(j)], live) for j in range(config.d)]
    dtype = x[0].dtype
    finite = jnp.isfinite(x[0])
    for c in x[1:]:
        finite = finite & jnp.isfinite(c)
    norm = jnp.sqrt(sumsq([jnp.where(finite, c * dtype.type(unit), 0) for c in x]))
    # The reference's lower bound on T, the number of thresholds below the norm, against
    # constant thresholds (both in units of codec.norm_unit).
    t = jnp.zeros(norm.shape, jnp.int32)
    for th in thresholds:
        t = t + (dtype.type(th) < norm).astype(jnp.int32)
    t, active, T, index = _search(x, t, finite & (t <= config.max_T), scale_ref, config=config,
                                  once=once, interpret=interpret)
    for m, k in enumerate(index):
        pltriton.store(idx_ref.at[:, _at(m)], k.astype(idx_ref.dtype), mask=live)
    pltriton.store(T_ref, T, mask=live)
    if once:  # the tile's unresolved blocks at consecutive slots from its share of the count
        left = active & live
        a = left.astype(jnp.int32)
        base = pltriton.atomic_add(count_ref, _at(0), jnp.sum(a))
        slots = base + jnp.cumsum(a) - a
        pltriton.store(left_ref.at[slots], rows, mask=left)
        pltriton.store(next_ref.at[slots], t, mask=left)


def _encode_left_kernel(count_ref, left_ref, next_ref, x_ref, scale_ref, _index, _T, idx_ref,
                        T_ref, *, config: HNLQConfig, bn: int, programs: int, interpret: bool):
    """The overload loop over the blocks a first attempt left unresolved (``left``: their
    rows, the first ``count`` of them; ``next``: their next steps), ``bn`` at a time, program
    ``p`` taking tiles ``p``, ``p + programs``, ... while there are any: each block's columns
    of x gathered by its row, its codes stored at its row (elsewhere the outputs keep the
    first attempt's codes: they alias them). The count is read here, on the device: no host
    sync."""
    count = count_ref[0]
    n = left_ref.shape[0]
    first = pl.program_id(0) * bn
    stride = programs * bn

    def tile(k, carry):
        slots = first + k * stride + _iota(bn)
        live = slots < count
        at = jnp.minimum(slots, n - 1)
        rows = _load(left_ref.at[at], live)
        x = [_load(x_ref.at[rows, _at(j)], live) for j in range(config.d)]
        t = _load(next_ref.at[at], live)
        _, _, T, index = _search(x, t, live, scale_ref, config=config, once=False,
                                 interpret=interpret)
        for m, k_m in enumerate(index):
            pltriton.store(idx_ref.at[rows, _at(m)], k_m.astype(idx_ref.dtype), mask=live)
        pltriton.store(T_ref.at[rows], T, mask=live)
        return carry

    jax.lax.fori_loop(0, jax.lax.div(jnp.maximum(count - first, 0) + stride - 1, stride),
                      tile, 0)


def _encode_call(x, scales, config: HNLQConfig, thresholds, unit, interpret, block: int,
                 gpu_backend, once: bool):
    """One kernel pass over blocks ``x [N, d]``: ``(index, T)``; with ``once`` (one attempt)
    ``(count, index, T, left, next)``, the blocks left unresolved listed (the first
    ``count`` of ``left`` and ``next``: :func:`_encode_kernel`)."""
    N, d = x.shape
    bn = _tile(N, block, "kernels.encode")
    vec = jax.ShapeDtypeStruct((N,), jnp.int32)
    count = [jnp.zeros((1,), jnp.int32)] if once else []  # the atomic adds' start
    return pl.pallas_call(
        functools.partial(_encode_kernel, config=config, thresholds=thresholds, unit=unit, n=N,
                          interpret=interpret),
        grid=(pl.cdiv(N, bn),),
        in_specs=[pl.BlockSpec((bn, d), lambda i: (i, 0)),
                  pl.BlockSpec(scales.shape, lambda i: (0,))] + [_whole(c) for c in count],
        out_specs=[_whole(c) for c in count]
        + [pl.BlockSpec((bn, config.M), lambda i: (i, 0)), pl.BlockSpec((bn,), lambda i: (i,))]
        + [_whole(vec)] * 2 * once,
        out_shape=[jax.ShapeDtypeStruct((1,), jnp.int32)] * once
        + [jax.ShapeDtypeStruct((N, config.M), index_dtype(config)), vec] + [vec] * 2 * once,
        input_output_aliases={2: 0} if once else {},
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "encode"),
    )(x, scales, *count)


def _encode_left_call(x, count, left, t_next, index, T, scales, config: HNLQConfig, interpret,
                      block: int, gpu_backend):
    """The second pass over the ``count`` blocks listed in ``left`` (rows) and ``t_next``
    (their next steps), into ``index`` and ``T``."""
    N = x.shape[0]
    # persistent programs: a few a multiprocessor, fewer for small inputs
    programs = min(pl.cdiv(N, block), 8 * gpu_target()[1])
    operands = (count, left, t_next, x, scales, index, T)
    return pl.pallas_call(
        functools.partial(_encode_left_kernel, config=config, bn=block, programs=programs,
                          interpret=interpret),
        grid=(programs,),
        in_specs=[_whole(a) for a in operands],
        out_specs=[_whole(index), _whole(T)],
        out_shape=[jax.ShapeDtypeStruct(index.shape, index.dtype),
                   jax.ShapeDtypeStruct(T.shape, T.dtype)],
        input_output_aliases={5: 0, 6: 1},
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "encode"),
    )(*operands)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _encode_pallas(x, config, interpret, block, gpu_backend):
    """One attempt over every block, then the overload loop over the blocks still unresolved
    (a quarter to a half for Gaussian data), listed by the first kernel (an atomic count,
    no XLA pass over N) and their rows gathered by the second: a tile's loop
    runs as long as its slowest block (about 4 attempts for 256 blocks where a block needs
    1.3 on average), so looping over all N did about 3x the work. No conditional: the count
    left stays on the device (an XLA conditional on a GPU copies its branch to the host, a
    sync a call). Each block's result depends on its own data only: the codes are the same.
    With at most four tiles the loop runs over all of them."""
    N = x.shape[0]
    with jax.ensure_compile_time_eval():
        scales, thresholds = codec.scale_tables(config, config.beta, x.dtype)
        unit = codec.norm_unit(thresholds)
        thresholds = [float(v) for v in np.asarray(thresholds * unit)]
        scales = _padded(scales, _pow2_at_least(config.max_T + 1))
    call = functools.partial(_encode_call, x, scales, config, thresholds, float(unit),
                             interpret, block, gpu_backend)
    if N <= 4 * block:
        return tuple(call(once=False))
    count, index, T, left, t_next = call(once=True)
    return tuple(_encode_left_call(x, count, left, t_next, index, T, scales, config, interpret,
                                   _tile(N, block, "kernels.encode"), gpu_backend))


def encode(x, config: HNLQConfig, *, interpret=None, block: int = 256,
           gpu_backend: str = "triton"):
    """Algorithm 1 with the overload loop, as one kernel pass over flat blocks.

    Args:
      x: ``[N, d]`` float32 or float64 blocks (the front door has validated them).
      config: the quantizer.
      interpret: Pallas interpret mode; ``None``: where ``x`` lives on a CPU (:func:`platform`).
      block: blocks per program (a power of two >= 16).
      gpu_backend: ``"triton"``.

    Returns:
      ``(index [N, M], T [N] int32)``: codebook indices in
      :func:`~hnlq_jax.codes.index_dtype` and the overload steps (-1: failed), identical to
      :func:`hnlq_jax.codec.encode_blocks`.

    Raises:
      ValueError: ``x`` is not ``[N, d]``, a config no kernel supports, a bad ``block`` or
        ``gpu_backend``.
    """
    _check_config(config, "kernels.encode")
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[1] != config.d or x.dtype not in (jnp.float32, jnp.float64):
        raise ValueError(f"kernels.encode: expected float32/float64 blocks [N, d={config.d}], "
                         f"got {x.dtype}{list(x.shape)}; hnlq_jax.encode takes any shape")
    if x.shape[0] == 0:
        return (jnp.zeros((0, config.M), index_dtype(config)), jnp.zeros((0,), jnp.int32))
    return _encode_pallas(x, config, interpret_mode(interpret, x), block, gpu_backend)


# ----------------------------------------------------------------------------------- decode


def _decode_kernel(idx_ref, t_ref, *refs, config: HNLQConfig, first: int, n: int, L: int,
                   flat: bool, interpret: bool):
    *tab, pow_ref, beta_ref, o_ref = refs
    bn = o_ref.shape[0]
    i = pl.program_id(0) * bn + _iota(bn)
    live = i < n
    ks = _index_columns(idx_ref, config.M, live)
    i = jnp.minimum(i, n - 1)
    # The 4-bit field pairs blocks along the last leading axis; a flat block number is the
    # pair position unless that axis has odd length L (then each row of blocks starts a byte).
    row, col = (0, i) if flat else (i // L, i % L)
    u = _read_u(t_ref, row, col, L, config)
    cols = _decoded(ks, u, tab[0] if tab else None, pow_ref, beta_ref, config, o_ref.dtype,
                    interpret, first)
    pltriton.store(o_ref, _interleaved(cols), mask=live[:, None])


def _interleaved(cols: list):
    """Columns ``[bn]`` as one tile ``[bn, len(cols)]`` (a power of two), from Triton's
    two-argument joins: ``join(join(c0, c2), join(c1, c3))`` is ``[bn, 2, 2]`` with ``c(2k +
    l)`` at ``[:, k, l]``."""
    if len(cols) == 1:
        return cols[0][:, None]
    tile = jnp.stack([_interleaved(cols[0::2]), _interleaved(cols[1::2])], axis=-1)
    return tile.reshape(tile.shape[0], len(cols))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8, 9))
def _decode_pallas(index, tfield, config, levels, dtype, L, table, interpret, block,
                   gpu_backend):
    N, M = index.shape
    d = config.d
    bn = _tile(N, block, "kernels.decode")
    pow2, beta = _tables(config, dtype)
    tabs = [_codebook_input(config)] if table else []
    flat = t_bits(config) == 8 or L % 2 == 0 or N == L
    return pl.pallas_call(
        functools.partial(_decode_kernel, config=config, first=M - levels, n=N, L=L, flat=flat,
                          interpret=interpret),
        grid=(pl.cdiv(N, bn),),
        in_specs=[pl.BlockSpec((bn, M), lambda i: (i, 0)), _whole(tfield)]
        + [_whole(a) for a in tabs] + [_whole(pow2), _whole(beta)],
        out_specs=pl.BlockSpec((bn, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((N, d), dtype),
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "decode"),
    )(index, tfield, *tabs, pow2, beta)


def decode(codes: Codes, levels: int | None, dtype, *, interpret=None, block: int = 256,
           gpu_backend: str = "triton", use_table: bool | None = None):
    """Algorithm 2, all levels fused in one kernel pass over the codes as stored.

    Args:
      codes: block :class:`~hnlq_jax.Codes` (``n is None``, no scale) of any leading shape.
      levels: keep only the ``levels`` coarsest levels (``None``: all M).
      dtype: the compute and output dtype, float32 or float64.
      interpret, block, gpu_backend: see :func:`encode`.
      use_table: the codebook as a gathered table (``True``) or from the digits (``False``);
        ``None``: by its size (module docstring).

    Returns:
      ``[..., d]`` in ``dtype``, identical to :func:`hnlq_jax.codec.decode_xla`; NaN in blocks
      with ``T = -1`` or corrupted fields.

    Raises:
      ValueError: row codes, a config no kernel supports, a bad ``block`` or ``gpu_backend``.
      TypeError: not ``Codes``, or ``dtype`` not float32/float64.
    """
    check_codes(codes, "kernels.decode")
    config = codes.config
    _check_config(config, "kernels.decode")
    if codes.n is not None:
        raise ValueError("kernels.decode: expected block codes; the front door hnlq_jax.decode "
                         "takes row codes")
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.float64):
        raise TypeError(f"kernels.decode: dtype must be float32 or float64, got {dtype}")
    table = _use_table(config, use_table, "kernels.decode")
    lead = codes.blocks_shape
    N = int(np.prod(lead, dtype=np.int64))
    if N == 0:
        return jnp.zeros(lead + (config.d,), dtype)
    out = _decode_pallas(codes.index.reshape(N, config.M), codes.tfield.reshape(-1), config,
                         config.M if levels is None else levels, dtype, lead[-1] if lead else 1,
                         table, interpret_mode(interpret, codes), block, gpu_backend)
    return out.reshape(lead + (config.d,))


# ---------------------------------------------------------------------------- decode_matmul


def weight_codes(codes, fn: str) -> Codes:
    """``codes`` checked as a weight's codes (blocks ``[n, nb]``) whose config has kernels."""
    check_weight_codes(codes, fn)
    _check_config(codes.config, fn)
    return codes


def _weight_codes_tile(idx_ref, t_ref, rows, k0, bk: int, config: HNLQConfig, n: int, nb: int,
                       exact: bool = False):
    """Index columns and ``u`` (``[bn, bk]`` each) of weight blocks ``k0 .. k0 + bk`` of ``rows``.

    Past the edges the index reads 0 and ``u`` repeats the row's last block, so such a block
    decodes to a finite value unless its row holds a failed block (then the row is NaN anyway,
    as in the reference); it meets zero-padded activations, and rows past ``n`` are not stored.
    ``exact``: the tiles cover the weight exactly (no edges), so nothing is masked or clamped.
    """
    l = k0 + _iota(bk)
    if exact:
        ks = _index_columns(idx_ref, config.M, None, (slice(None), pl.ds(k0, bk)))
        return ks, _read_u(t_ref, rows[:, None], l[None, :], nb, config)
    live = (rows < n)[:, None] & (l < nb)[None, :]
    ks = _index_columns(idx_ref, config.M, live, (slice(None), pl.ds(k0, bk)))
    u = _read_u(t_ref, jnp.minimum(rows, n - 1)[:, None], jnp.minimum(l, nb - 1)[None, :], nb,
                config)
    return ks, u


def _word_codes_tiles(idx_ref, t_ref, rows, e0, c: int, words: int, config: HNLQConfig,
                      n: int, nb: int, exact: bool) -> list:
    """``[(ks, u)]`` of each part ``p < words`` of T elements ``e0 .. e0 + c`` of a tile's rows
    (:func:`code_words`' views; part ``p``: blocks ``words e + p``), ``[bn, c]`` each.

    A 32-bit load for the index items of ``g`` blocks and one of T for ``words`` blocks, where
    reading the codes block by block takes a byte load a level and block (Triton spreads a
    tile's blocks across its threads); each block's items and T are split off by shifts. An
    element's ``words / g`` index words are the last axis of its view: one load each. Past the
    rows (``n``) or the blocks (``nb``) a block reads index 0 and ``T = 0``: a finite weight
    that meets x's zero padding (or a row that is not stored); ``exact``: no edges, no masks.
    """
    live = None if exact else (rows < n)[:, None] & (e0 + _iota(c) < nb // words)[None, :]
    g, _, t_dtype = word_view(config)
    per = words // g
    iws = [_load(idx_ref.at[(slice(None), pl.ds(e0, c)) + ((_at(j),) if per > 1 else ())],
                 live) for j in range(per)]
    tb = t_bits(config)
    t_at = t_ref.at[:, pl.ds(e0, c)]  # past the edges u = T + 1 = 1 in every field
    tw = (pltriton.load(t_at) if live is None else pltriton.load(
        t_at, mask=live, other=t_dtype(sum(1 << (p * tb) for p in range(words))))
          ).astype(jnp.uint32)
    item = 8 * np.dtype(index_dtype(config)).itemsize
    out = []
    for p in range(words):
        ks = [(iws[p // g] >> jnp.uint32(item * ((p % g) * config.M + m)))
              & jnp.uint32(2**item - 1) for m in range(config.M)]
        out.append((ks, ((tw >> jnp.uint32(p * tb)) & jnp.uint32(2**tb - 1)).astype(jnp.int32)))
    return out


def _tile_product(a, b, wide):
    """``a [bb, bk] @ b [bn, bk]^T`` in ``wide``. Float64 takes the products and a sum over k
    instead of a ``dot``: Triton's float64 dot gave wrong sums on an H200 (Triton 3.6: 70 % of a
    64 x 24 product wrong, from the 9th column on; docs/gpu.md)."""
    if wide == jnp.float64:
        return jnp.sum(a[:, None, :] * b[None, :, :], axis=2)
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                               preferred_element_type=wide)


def _decode_matmul_kernel(x_ref, idx_ref, t_ref, *refs, config: HNLQConfig, n: int, nb: int,
                          batch: int, bk: int, steps: int, compute, wide, scaled: bool,
                          table: bool, exact: bool, words: int, f16: bool, interpret: bool):
    s_ref = refs[0] if scaled else None
    tab = refs[int(scaled)] if table else None
    pow_ref, beta_ref, o_ref = refs[-3:]
    bb, bn = o_ref.shape[-2:]
    rows = pl.program_id(1) * bn + _iota(bn)
    s = _load(s_ref, None if exact else rows < n)[:, None] if scaled else None
    first = pl.program_id(2) * steps * bk  # this program's share of the blocks (split-K)

    def tile(t, acc):
        k0 = pl.multiple_of(first + t * bk, bk)
        if words:  # x's planes in the same parts as the words' blocks
            c = bk // words
            e0 = pl.multiple_of(first // words + t * c, c)
            parts = [(ks, u, lambda j, p=p: x_ref[p, j, :, pl.ds(e0, c)]) for p, (ks, u) in
                     enumerate(_word_codes_tiles(idx_ref, t_ref, rows, e0, c, words, config,
                                                 n, nb, exact))]
        else:
            ks, u = _weight_codes_tile(idx_ref, t_ref, rows, k0, bk, config, n, nb, exact)
            parts = [(ks, u, lambda j: x_ref[j, :, pl.ds(k0, bk)])]
        for ks, u, x_at in parts:
            if f16:  # P 2^(alpha T - e_A); x's planes hold beta C^T x and -offsets
                s16 = _block_scale(pow_ref, ks, u, config)
                w = _packed_fields(ks, tab, config, 0, functools.partial(
                    _f16_field, s=s16, bias=packed_bias(config, 0), interpret=interpret))
                w += [s16] if config.dither is not None else []
            else:
                w = _decoded(ks, u, tab, pow_ref, beta_ref, config, wide, interpret)
            for j, wj in enumerate(w):
                if scaled:  # the reference's rounding: the decoded weight times its row scale
                    wj = wj * s
                acc = acc + _tile_product(x_at(j).astype(compute), wj.astype(compute), wide)
        return acc

    acc = jax.lax.fori_loop(0, steps, tile, jnp.zeros((bb, bn), wide))
    b = pl.program_id(0) * bb + _iota(bb)
    pltriton.store(o_ref.at[_at(0)] if o_ref.ndim == 3 else o_ref, acc.astype(o_ref.dtype),
                   mask=(b < batch)[:, None] & (rows < n)[None, :])


def decode_matmul(x, codes: Codes, compute_dtype, out_dtype, *, interpret=None,
                  block_n: int | None = None, block_k: int | None = None,
                  splits: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, gpu_backend: str = "triton",
                  use_table: bool | None = None, words: bool | None = None,
                  f16: bool | None = None):
    """``y = x @ W_hat^T`` with the weight read as codes: decoded tile by tile next to the
    ``dot``, the dense weight never in memory.

    Args:
      x: ``[..., k]`` activations.
      codes: the weight ``W[n, k]`` as codes with blocks ``[n, nb]``: row codes (their row
        scale is applied to the decoded weight, as the reference does) or block codes
        with ``k = nb d``.
      compute_dtype: dtype of the ``dot`` operands (bfloat16, or at least float32).
      out_dtype: the result's dtype.
      interpret, gpu_backend: see :func:`encode`.
      block_n: output rows per program; block_k: weight blocks per step of the inner loop
        (powers of two >= 16). Up to 64 activation rows share a program.
      splits, num_warps, num_stages: as :func:`gemv`.
      use_table: see :func:`decode`.
      words: as :func:`gemv`, where each part of a step still has 16 blocks for the ``dot``.
      f16: with a bfloat16 ``compute_dtype`` and a packed codebook (:func:`f16_fits`), the
        ``dot``'s operands in float16 instead: the weight ``P 2^(alpha T - e_A)`` (exact
        ``P``, two instructions a weight: :func:`_f16_field`), x's planes ``beta C^T x`` with
        each row of x scaled by its own power of two (:func:`f16_rows`), the row scale and
        the powers of two after the split-K sum. Finer than the bfloat16 product (about
        2^-11 a weight against 2^-9), not the reference's decoded weights bit for bit.
        Elsewhere it is ignored.

      Launch parameters left ``None`` come from the tuning table (:func:`launch_params`).

    Returns:
      ``[..., n]`` in ``out_dtype``: the products of the reference's decoded weights (float32,
      float64 for a float64 ``compute_dtype``), summed in that dtype in another order than
      :func:`hnlq_jax.matmul`'s ``"xla"`` path (equal bit for bit whenever each sum has one
      nonzero term, e.g. one-hot rows of x, and no split); with ``f16``, float32 sums of the
      float16 products.

    Raises:
      ValueError, TypeError: codes that are not ``[n, nb]`` weight codes, a mismatched ``x``,
        a config no kernel supports, bad tiles, launch parameters or ``gpu_backend``.
    """
    codes = weight_codes(codes, "kernels.decode_matmul")
    x = check_activations(x, codes, "kernels.decode_matmul")
    config = codes.config
    table = _use_table(config, use_table, "kernels.decode_matmul")
    _compiler_params(gpu_backend, "decode_matmul")  # a bad backend raises here
    n, nb = codes.blocks_shape
    lead = x.shape[:-1]
    B = int(np.prod(lead, dtype=np.int64))
    t = _launch(launch_params("decode_matmul", config, n, nb, B), "kernels.decode_matmul",
                block_n=block_n, block_k=block_k, splits=splits, num_warps=num_warps,
                num_stages=num_stages, words=words, f16=f16)
    bn = _tile(n, t["block_n"], "kernels.decode_matmul", "block_n")
    bk = _tile(nb, t["block_k"], "kernels.decode_matmul", "block_k")
    if B == 0 or n == 0 or nb == 0:
        return jnp.zeros(lead + (n,), out_dtype)
    compute = jnp.dtype(compute_dtype)
    out = _decode_matmul_call(x.reshape(B, x.shape[-1]), codes, compute,
                              jnp.dtype(out_dtype), table, interpret_mode(interpret, x, codes),
                              bn, bk, t["splits"], t["num_warps"], t["num_stages"],
                              bool(t.get("words")),
                              bool(t.get("f16")) and f16_fits(config, compute, table))
    return out.reshape(lead + (n,))


def f16_fits(config: HNLQConfig, compute_dtype, table: bool = True) -> bool:
    """Whether :func:`decode_matmul`'s ``f16`` applies: a bfloat16 ``compute_dtype``, the
    packed codebook (``table``), and overload steps whose weights float16 holds
    (:func:`f16_exponent` at most :data:`F16_EXPONENT_MAX`)."""
    return (jnp.dtype(compute_dtype) == jnp.bfloat16 and table
            and packed_codebook(config) is not None
            and f16_exponent(config) <= F16_EXPONENT_MAX)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12))
def _decode_matmul_call(x, codes: Codes, compute, out_dtype, table, interpret, bn, bk, splits,
                        num_warps, num_stages, words, f16):
    config = codes.config
    n, nb = codes.blocks_shape
    B, k = x.shape
    d, M = config.d, config.M
    bb = min(_BATCH_TILE, max(16, _pow2_at_least(B)))  # dot tiles are >= 16 on every side
    steps, splits, nbp = _split_k(nb, splits, bk)
    Bp = pl.cdiv(B, bb) * bb
    exact = n % bn == 0 and nbp == nb
    words = _words_fit(config, nb, bk, False, least=16) if words else 0  # the dot's k >= 16
    # Activations only are re-laid out: coordinate planes [d, Bp, nbp], zero-padded; with
    # words, in parts as the words' blocks: [words, d, Bp, nbp / words]
    if f16:  # x's planes beta C^T x (and -offsets), each row scaled into float16's range
        xt = gemv_activations(jnp.pad(x, ((0, Bp - B), (0, 0))), config, nbp,
                              parts=words or None)[..., :Bp, :]
        xt = (jnp.concatenate([xt[..., :d, :, :], -xt[..., d:, :, :]], axis=-3)
              if config.dither is not None else xt[..., :d, :, :])
        xp, e = f16_rows(xt)
        compute = jnp.dtype(jnp.float16)
    else:
        xp = jnp.pad(x, ((0, Bp - B), (0, nbp * d - k)))
        xp = (xp.reshape(Bp, nbp // words, words, d).transpose(2, 3, 0, 1) if words else
              xp.reshape(Bp, nbp, d).transpose(2, 0, 1))
    wide = _numerics.wide_dtype(compute)  # decoded weight and accumulation
    pow2, beta = _tables(config, wide)
    if f16:  # 2^(alpha T - e_A) by u
        pow2 = jnp.asarray(f16_overload_table(config))
    scaled = codes.scale is not None and not f16  # (with f16 after the split-K sum)
    extra = ([codes.scale.astype(wide)] if scaled else []) \
        + ([_codebook_input(config)] if table else [])
    extra_specs = ([pl.BlockSpec((bn,), lambda b, i, s: (i,))] if scaled else []) \
        + ([_whole(extra[-1])] if table else [])
    if words:  # rows of words as tiles
        index, tfield = code_words(codes)
        i_spec, t_spec = (pl.BlockSpec((bn,) + a.shape[1:], lambda b, i, s, a=a: (i,) + (
            0,) * (a.ndim - 1)) for a in (index, tfield))
    else:  # the index by blocks, T gathered by address
        index, tfield = codes.index, codes.tfield.reshape(-1)
        i_spec, t_spec = pl.BlockSpec((bn, nb, M), lambda b, i, s: (i, 0, 0)), _whole(tfield)
    split = splits > 1 or f16  # (f16: float32 sums, scaled after the kernel)
    out = pl.pallas_call(
        functools.partial(_decode_matmul_kernel, config=config, n=n, nb=nb, batch=B, bk=bk,
                          steps=steps, compute=compute, wide=wide, scaled=scaled, table=table,
                          exact=exact, words=words, f16=f16, interpret=interpret),
        grid=(Bp // bb, pl.cdiv(n, bn), splits),
        in_specs=[pl.BlockSpec(xp.shape[:-2] + (bb, xp.shape[-1]),
                               lambda b, i, s: (0,) * (xp.ndim - 2) + (b, 0)),
                  i_spec, t_spec] + extra_specs + [_whole(pow2), _whole(beta)],
        out_specs=(pl.BlockSpec((1, bb, bn), lambda b, i, s: (s, b, i)) if split else
                   pl.BlockSpec((bb, bn), lambda b, i, s: (b, i))),
        out_shape=jax.ShapeDtypeStruct((splits, B, n) if split else (B, n),
                                       wide if split else out_dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(xp, index, tfield, *extra, pow2, beta)
    if f16:
        return split_k_sum(out, B, codes.scale, out_dtype, e[:B] + f16_exponent(config))
    return jnp.sum(out, axis=0).astype(out_dtype) if split else out


# ------------------------------------------------------------------------------------- gemv


def _gemv_kernel(xt_ref, idx_ref, t_ref, *refs, config: HNLQConfig, n: int, nb: int,
                 nbp: int, bk: int, steps: int, scaled: bool, mode: str, exact: bool,
                 words: int, batch: int, interpret: bool):
    s_ref = refs[0] if scaled else None
    tab_ref = refs[int(scaled)] if mode != "digits" else None
    ptab_ref, o_ref = refs[-2:]
    bn = o_ref.shape[-1]
    rows = pl.program_id(0) * bn + _iota(bn)
    first = pl.program_id(1) * steps * bk  # this program's share of the blocks (split-K)
    q_rows = config.q**config.d
    weights = _numerics.level_weights(config)

    # The rows of x one by one, each against [bn, c] tiles with its planes as [c]: Triton
    # loads those in the tile's layout, where [rows, bn, c] tiles took each plane through
    # shared memory every step; a block is decoded once for all the rows.
    def block_sums(accs, ks, u, k0, x_at):
        """``accs`` (one ``[bn, c]`` a row of x) plus the blocks' inner products with the rows
        times ``2^(alpha T)``; ``x_at(j, b)``: plane ``j`` of row ``b`` at the blocks (``[c]``;
        plane ``d``: the dither's offsets)."""
        if mode == "lut":  # the block's inner products, gathered from x's tables
            rows_k = [_codebook_row(k, config) for k in ks]
        elif mode == "packed":
            coords = _packed_floats(ks, tab_ref, config, 0, interpret)
        else:
            coords = [c.astype(jnp.float32) for c in _lattice_point(ks, tab_ref, config, 0)]
        vs = []
        for b in range(len(accs)):
            if mode == "lut":
                at = (b * nbp + k0 + _iota(bk))[None, :] * q_rows
                v = None
                for m, row in enumerate(rows_k):
                    g = tab_ref[at + row] * np.float32(weights[m])
                    v = g if v is None else v + g
            else:
                v = None
                for j, c in enumerate(coords):  # the block's inner product
                    xj = x_at(j, b)[None, :]
                    v = xj * c if v is None else _fma(xj, c, v, interpret)
            vs.append(v if config.dither is None else v - x_at(config.d, b)[None, :])
        # 2^(alpha T) by u = T + 1; NaN for u = 0 (a failed block) and past max_T. (Gathered
        # after the products: before them Triton keeps more registers live, 190 against 148.)
        s = _block_scale(ptab_ref, ks, u, config)
        return tuple(_fma(s, v, acc, interpret) for v, acc in zip(vs, accs))

    def tile(t, accs):
        # accs: each tile column's sum over the steps, added up after the loop (a sum over
        # the tile each step costs cross-lane shuffles every step)
        k0 = pl.multiple_of(first + t * bk, bk)
        if not words:
            ks, u = _weight_codes_tile(idx_ref, t_ref, rows, k0, bk, config, n, nb, exact)
            return block_sums(accs, ks, u, k0, lambda j, b: xt_ref[j, _at(b), pl.ds(k0, bk)])
        # x's planes in the same parts as the words' blocks (gemv_activations)
        c = bk // words
        e0 = pl.multiple_of(first // words + t * c, c)
        for p, (ks, u) in enumerate(_word_codes_tiles(idx_ref, t_ref, rows, e0, c, words,
                                                      config, n, nb, exact)):
            accs = block_sums(accs, ks, u, k0,
                              lambda j, b, p=p: xt_ref[p, j, _at(b), pl.ds(e0, c)])
        return accs

    accs = jax.lax.fori_loop(0, steps, tile, tuple(
        jnp.zeros((bn, bk // max(words, 1)), jnp.float32) for _ in range(batch)))
    live = None if exact else rows < n
    s = _load(s_ref, live) if scaled else None
    for b, acc in enumerate(accs):  # x's padding rows are not stored: the caller drops them
        y = jnp.sum(acc, axis=-1)
        if scaled:
            y = y * s
        pltriton.store(o_ref.at[(_at(0),) * (o_ref.ndim - 2) + (_at(b),)], y.astype(o_ref.dtype),
                       mask=live)


def _gemv_mode(config: HNLQConfig, use_table, lut_tables, fn: str) -> str:
    if lut_tables:
        lut.check_one_sided(config, fn)
        return "lut"
    if use_table is False:
        return "digits"
    if packed_codebook(config) is not None:
        return "packed"
    return "table" if _use_table(config, use_table, fn) else "digits"


def gemv(x, codes: Codes, out_dtype, *, interpret=None, block_n: int | None = None,
         block_k: int | None = None, splits: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None, use_table=None, lut_tables: bool | None = None,
         words: bool | None = None):
    """``y = x @ W_hat^T`` for a few rows of ``x`` (at most :data:`GEMV_ROWS`): no ``dot``,
    no decoded weight; each weight block's lattice point meets the activations in registers.

    Per weight block the kernel gathers one packed codebook word a level
    (:func:`packed_codebook`), adds the levels as integers, turns each byte field into the
    float ``2^23 + field`` (one ``prmt``) less ``2^23`` and the fields' bias (exact: ``P``) and
    takes the inner product with the block's activations in fused multiply-adds; ``beta``, the
    lattice's basis and the dither are folded into the activations once per call, ``2^(alpha
    T)`` multiplies the block's inner product and the row scale the row's sum. Each tile column
    keeps its own sum over the steps, added up once after the loop.
    Codebooks the packed table cannot hold take the int32 table or the index digits
    (``use_table``, as :func:`decode`).

    Args:
      x: ``[..., k]`` activations (at most :data:`GEMV_ROWS` rows in all); computed in float32.
      codes: the weight ``W[n, k]`` as codes with blocks ``[n, nb]`` (row or block codes).
      out_dtype: the result's dtype.
      interpret: see :func:`encode`.
      block_n: output rows per program; block_k: weight blocks per step (powers of two).
      splits: programs each row's blocks are split across (split-K; their float32 partial
        sums are added after the kernel), so that a few rows still fill the GPU.
      num_warps, num_stages: Triton's launch parameters.
      use_table: ``False`` computes the codebook from the digits; see :func:`decode`.
      lut_tables: the paper's one-sided product instead (codebooks of at most
        ``lut.MAX_ONE_SIDED`` entries): per call, each row of x gets a table of its blocks'
        inner products with the whole codebook (:func:`hnlq_jax.lut.one_sided`, 1 KiB a block
        for D4 q=4), and a weight block costs one gather a level, no decoding.
      words: read the index and T as words of several blocks (:func:`code_words`: one 32-bit
        load for 2 blocks of D4 q=4 M=2, not a byte load a level and block), each word's
        blocks split off by shifts in registers (the same sums), where the codes have a word
        view whose T elements divide the rows and the steps and ``lut_tables`` is off;
        elsewhere the blocks one by one.

      Arguments left ``None`` come from the tuning table for the GPU in use
      (:func:`launch_params`).

    Returns:
      ``[..., n]`` in ``out_dtype``: float32 sums of the products of the exact decoded weights
      (not rounded to x's dtype), equal to :func:`hnlq_jax.matmul`'s ``"xla"`` path up to
      float32 rounding; NaN in rows with a failed block.

    Raises:
      ValueError, TypeError: as :func:`decode_matmul`; more rows than :data:`GEMV_ROWS`; bad
        tiles, ``splits``, ``num_warps`` or ``num_stages``.
    """
    codes = weight_codes(codes, "kernels.gemv")
    x = check_activations(x, codes, "kernels.gemv")
    config = codes.config
    n, nb = codes.blocks_shape
    lead = x.shape[:-1]
    B = int(np.prod(lead, dtype=np.int64))
    if B > GEMV_ROWS:
        raise ValueError(f"kernels.gemv: at most {GEMV_ROWS} rows of x, got {B}; use "
                         "decode_matmul")
    t = _launch(launch_params("gemv", config, n, nb, B), "kernels.gemv", block_n=block_n,
                block_k=block_k, splits=splits, num_warps=num_warps, num_stages=num_stages,
                use_table=use_table, lut_tables=lut_tables, words=words)
    mode = _gemv_mode(config, t.get("use_table"), t.get("lut_tables"), "kernels.gemv")
    bn = _small_tile(t["block_n"], "kernels.gemv", "block_n")
    bk = _tile(nb, t["block_k"], "kernels.gemv", "block_k")
    if B == 0 or n == 0 or nb == 0:
        return jnp.zeros(lead + (n,), out_dtype)
    out = _gemv_call(x.reshape(B, x.shape[-1]), codes, jnp.dtype(out_dtype), mode,
                     interpret_mode(interpret, x, codes), bn, bk, t["splits"], t["num_warps"],
                     t["num_stages"], bool(t.get("words")))
    return out.reshape(lead + (n,))


def _split_k(nb: int, splits: int, bk: int) -> tuple:
    """``(steps, splits, nbp)``: each program's steps of ``bk`` blocks, the programs a row's
    blocks are split across (none without blocks) and the blocks they cover (``>= nb``)."""
    steps = pl.cdiv(pl.cdiv(nb, splits), bk)
    splits = pl.cdiv(nb, steps * bk)
    return steps, splits, splits * steps * bk


def _words_fit(config: HNLQConfig, nb: int, bk: int, lut_tables: bool, least: int = 1) -> int:
    """The blocks of a T element :func:`gemv`'s ``words`` reads (:func:`word_view`), or 0:
    the blocks one by one (also where a part of a step would have fewer than ``least``)."""
    view = word_view(config)
    fit = (view and nb % view[1] == 0 and bk % view[1] == 0 and bk // view[1] >= least
           and not lut_tables)
    return view[1] if fit else 0


def reads_words(config: HNLQConfig, nb: int, t: dict) -> bool:
    """Whether :func:`gemv` with launch parameters ``t`` (as :func:`launch_params` gives them,
    ``words`` among them) reads a weight of ``nb`` blocks a row as words: asked to, codes with
    a word view (:func:`word_view`) whose elements divide the rows and the steps, and not the
    LUT method."""
    bk = _tile(nb, t["block_k"], "kernels.reads_words", "block_k")
    return bool(t.get("words")) and bool(_words_fit(config, nb, bk, bool(t.get("lut_tables"))))


def launch_params(op: str, config: HNLQConfig, n: int, nb: int, batch: int,
                  entry: dict | None = None) -> dict:
    """Launch parameters of ``op`` (``"gemv"`` or ``"decode_matmul"``) for a weight with blocks
    ``[n, nb]`` and ``batch`` rows of x on the default GPU.

    ``entry`` (else the tuning table's entry, :mod:`hnlq_jax.kernels.gpu_tiles`, for the GPU's
    generation, the op, the lattice and the smallest batch class holding ``batch``; else the
    op's defaults) gives the tiles and ``waves``; ``splits`` (split-K) grows until about
    ``waves`` programs run per multiprocessor, at most one per step of ``block_k`` blocks.
    Without a GPU: the defaults of an H100 (sm90, 132 multiprocessors).
    """
    t, sms = launch_entry(op, config, batch, entry)
    waves = t.pop("waves")
    t.pop("backend", None)  # which gemv kernel runs (mosaic_gpu.chosen), not a Triton parameter
    row_tiles = 1 if op == "gemv" else -(-max(batch, 1) // _BATCH_TILE)
    programs = max(1, -(-n // t["block_n"]) * row_tiles)
    t["splits"] = max(1, min(-(-waves * sms // programs), -(-nb // t["block_k"])))
    return t


def gpu_target() -> tuple:
    """``(generation, multiprocessors)`` of the default GPU, the tuning table's key
    (:func:`gpu_generation`) and its size; without a GPU an H100's, ``("sm90", 132)``."""
    gpus = jax.devices("gpu") if jax.default_backend() == "gpu" else []
    if not gpus:
        return "sm90", 132
    return gpu_generation(gpus[0]), getattr(gpus[0], "core_count", 132)


def few_rows_on_tensor_cores(codes: Codes, batch: int, dtype) -> bool:
    """Whether :func:`hnlq_jax.matmul`'s kernels take :func:`decode_matmul` (tensor cores) for
    ``batch`` rows of x where :func:`gemv` would run: at most :data:`GEMV_ROWS` rows of
    bfloat16 x (a bfloat16 product, as from 9 rows on; what the sweep times), and the tuning
    table's ``gemv`` entry for the GPU's generation, lattice and batch class says
    ``"backend": "triton_mma"`` (the sweep found it faster than the gemvs)."""
    if batch > GEMV_ROWS or jnp.dtype(dtype) != jnp.bfloat16:
        return False
    entry = tuning_entry("gemv", codes.config, batch, gpu_target()[0])
    return entry.get("backend") == "triton_mma"


def launch_entry(op: str, config: HNLQConfig, batch: int, entry: dict | None = None) -> tuple:
    """``(params, multiprocessors)`` for ``op`` on the default GPU (:func:`gpu_target`):
    ``entry`` over the op's defaults, else the tuning table's entry (:func:`tuning_entry`)."""
    generation, sms = gpu_target()
    if entry is not None:
        return {**gpu_tiles.DEFAULT[op], **entry}, sms
    return tuning_entry(op, config, batch, generation), sms


def tuning_entry(op: str, config: HNLQConfig, batch: int, generation: str) -> dict:
    """The tuning table's launch parameters (``waves``, not yet ``splits``) of ``op`` for
    ``config``'s lattice and ``batch`` rows of x on a GPU ``generation``: the smallest batch
    class holding ``batch``, over the op's defaults."""
    by_batch = gpu_tiles.TILES.get(generation, {}).get(op, {}).get(config.lattice, {})
    for cls in sorted(by_batch, key=lambda c: int(c.split("<=")[1])):
        if batch <= int(cls.split("<=")[1]):
            return {**gpu_tiles.DEFAULT[op], **by_batch[cls]}
    return dict(gpu_tiles.DEFAULT[op])


def gpu_generation(device) -> str | None:
    """The tuning table's key for ``device``: ``"sm90"`` for compute capability 9.x (Hopper);
    ``None`` for a device without one (a CPU)."""
    cc = getattr(device, "compute_capability", "")
    return f"sm{cc.split('.')[0]}0" if cc else None


def _launch(t: dict, fn: str, **given) -> dict:
    """Launch parameters ``t`` with the caller's (those not ``None``), checked."""
    t = {**t, **{k: v for k, v in given.items() if v is not None}}
    for name in ("splits", "num_warps", "num_stages"):
        if not isinstance(t[name], int) or isinstance(t[name], bool) or t[name] < 1:
            raise ValueError(f"{fn}: {name} must be a positive int, got {t[name]!r}")
    for name in ("words", "lut_tables", "f16"):
        if not isinstance(t.get(name, False), bool):
            raise TypeError(f"{fn}: {name} must be a bool, got {t[name]!r}")
    return t


# gemv takes up to this many rows of x (each row's multiply-adds on every weight block).
GEMV_ROWS = 8


def _small_tile(block: int, fn: str, what: str) -> int:
    """Rows per program of a kernel without a ``dot``: any power of two."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 1 or block & (block - 1):
        raise ValueError(f"{fn}: {what} must be a power of two, got {block!r}")
    return block


def gemv_activations(x, config: HNLQConfig, nbp: int, parts: int | None = None):
    """x's planes, float32 ``[d + 1, bb, nbp]``: planes ``j < d`` are ``beta C^T x`` per block
    (``C``: P to Cartesian coordinates), plane ``d`` the offsets ``beta x . z`` (the dither;
    zeros without one); x's rows zero-padded to ``bb`` (a power of two) and its blocks to
    ``nbp``. One array: XLA computes it in one kernel.

    ``parts``: the blocks interleaved ``parts`` ways, block ``parts w + p`` in part ``p`` at
    ``w``: ``[parts, d + 1, bb, nbp / parts]`` (kernels that read several blocks from one word
    of the codes)."""
    B, k = x.shape
    d = config.d
    bb = _pow2_at_least(B)
    xb = jnp.pad(x.astype(jnp.float32), ((0, bb - B), (0, nbp * d - k))).reshape(bb, nbp, d)
    C = np.stack([np.asarray(config.lat.cart_from_P(list(e)), np.float64)
                  for e in np.eye(d)], axis=1)  # column i: the Cartesian point of P = e_i
    beta = np.float32(config.beta)
    xt = _constant_products(xb, (C * config.beta).astype(np.float32))
    off = jnp.zeros((bb, nbp), jnp.float32)
    if config.dither is not None:
        dither = np.asarray(config.dither_array, np.float32)[:, None]
        off = off + beta * _constant_products(xb, dither)[0]
    planes = jnp.stack(xt + [off])
    if parts is not None:
        planes = planes.reshape(d + 1, bb, nbp // parts, parts).transpose(3, 0, 1, 2)
    return planes


def _constant_products(x, m: np.ndarray) -> list:
    """``x [..., d]`` times a constant ``m [d, e]`` as e arrays ``[...]``, each a float32 sum of
    products in order of ``j``, the zero entries of ``m`` left out. A dot would be a kernel of
    its own on a GPU (XLA's GEMM of a [d, e] constant); elementwise, XLA fuses it with the
    padding and transposes around it into one kernel a call."""
    cols = []
    for i in range(m.shape[1]):
        terms = [x[..., j] * m[j, i] for j in range(m.shape[0]) if m[j, i] != 0]
        cols.append(functools.reduce(jnp.add, terms) if terms else
                    jnp.zeros(x.shape[:-1], x.dtype))
    return cols


def overload_table(config: HNLQConfig):
    """float32 ``2^(alpha (u - 1))`` by ``u`` (every value the T field holds), NaN where
    ``u = 0`` (a failed block) or ``u > max_T + 1``."""
    size = 1 << t_bits(config)
    table = np.full(size, np.nan, np.float32)
    table[1:config.max_T + 2] = pow2_table(config.alpha, config.max_T)  # _numerics.pow2's
    return table


# The tensor cores' float16 weights: P 2^(alpha T - e_A) (|P| <= 255, the packed fields' P,
# exact in float16) with the overload table halved e_A times (exactly) into float16's range;
# past this many halvings T = 0's scale 2^-e_A would be a float16 subnormal.
F16_EXPONENT_MAX = 14


def f16_exponent(config: HNLQConfig) -> int:
    """``e_A``: the fewest halvings that keep ``P 2^(alpha T - e_A)`` with ``|P| <= 255`` in
    float16's range (at most 65504)."""
    top = float(np.nanmax(overload_table(config)))
    return max(0, int(np.ceil(np.log2(top / 256))))


def f16_overload_table(config: HNLQConfig) -> np.ndarray:
    """float16 ``2^(alpha (u - 1) - e_A)`` by ``u`` (:func:`overload_table` halved
    :func:`f16_exponent` times, exactly, then rounded once), NaN where it is NaN."""
    return np.ldexp(overload_table(config), -f16_exponent(config)).astype(np.float16)


def f16_rows(X):
    """``X [..., rows, w]`` (float32) in float16 with each row scaled by its own power of two
    ``2^-e`` (exact) to put its largest finite entry in ``[2^14, 2^15)`` (float16's top binade
    below 65504): any bfloat16 row fits float16's range and keeps 11 bits down to 2^-28 of its
    largest (docs/kernels.md, "Precision"). Returns them and ``e`` (int32 ``[rows]``)."""
    axes = tuple(a for a in range(X.ndim) if a != X.ndim - 2)
    big = jnp.max(jnp.where(jnp.isfinite(X), jnp.abs(X), 0), axis=axes)
    e = _numerics.exponent(big) - 15
    return _numerics.times_pow2(X, -e[:, None]).astype(jnp.float16), e


def split_k_sum(out, rows: int, scale, out_dtype, exponent=None):
    """The split-K partial sums ``out [splits, bb, n]`` of x's first ``rows`` rows added up,
    times ``2^exponent`` (``[rows]``, by x's row) and the row ``scale`` (``[n]`` or ``None``),
    in ``out_dtype``: the XLA epilogue of the kernels that leave those to it."""
    y = jnp.sum(out, axis=0)[:rows]
    if exponent is not None:
        y = _numerics.times_pow2(y, exponent[:, None])
    if scale is not None:
        y = y * scale.astype(jnp.float32)[None, :]
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8, 9, 10))
def _gemv_call(x, codes: Codes, out_dtype, mode, interpret, bn, bk, splits, num_warps,
               num_stages, words):
    config = codes.config
    n, nb = codes.blocks_shape
    steps, splits, nbp = _split_k(nb, splits, bk)
    exact = n % bn == 0 and nbp == nb
    words = _words_fit(config, nb, bk, mode == "lut") if words else 0
    # with words of g blocks, x's planes in g parts: [g, ...]
    xt = gemv_activations(x, config, nbp, parts=words or None)
    bb = xt.shape[-2]  # x's rows padded to a power of two
    extra, extra_specs = [], []
    if codes.scale is not None:
        extra.append(codes.scale.astype(jnp.float32))
        extra_specs.append(pl.BlockSpec((bn,), lambda i, s: (i,)))
    if mode == "lut":  # beta <r(k), x_l> for every row of x, block l and codebook entry k
        xp = jnp.pad(x.astype(jnp.float32),
                     ((0, bb - x.shape[0]), (0, nbp * config.d - x.shape[1])))
        extra.append((lut.one_sided(xp, config) * np.float32(config.beta)).reshape(-1))
    elif mode != "digits":
        extra.append(_codebook_input(config))
    if mode != "digits":
        extra_specs.append(_whole(extra[-1]))
    ptab = overload_table(config)
    if words:  # rows of words as tiles
        index, tfield = code_words(codes)
        i_spec, t_spec = (pl.BlockSpec((bn,) + a.shape[1:], lambda i, s, a=a: (i,) + (0,) * (
            a.ndim - 1)) for a in (index, tfield))
    else:  # the index by blocks, T gathered by address
        index, tfield = codes.index, codes.tfield.reshape(-1)
        i_spec, t_spec = pl.BlockSpec((bn, nb, config.M), lambda i, s: (i, 0, 0)), \
            _whole(tfield)
    split = splits > 1
    out = pl.pallas_call(
        functools.partial(_gemv_kernel, config=config, n=n, nb=nb, nbp=nbp, bk=bk, steps=steps,
                          scaled=codes.scale is not None, mode=mode, exact=exact, words=words,
                          batch=x.shape[0], interpret=interpret),
        grid=(pl.cdiv(n, bn), splits),
        in_specs=[_whole(xt), i_spec, t_spec] + extra_specs + [_whole(ptab)],
        out_specs=(pl.BlockSpec((1, bb, bn), lambda i, s: (s, 0, i)) if split else
                   pl.BlockSpec((bb, bn), lambda i, s: (0, i))),
        out_shape=jax.ShapeDtypeStruct((splits, bb, n) if split else (bb, n),
                                       jnp.float32 if split else out_dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(xt, index, tfield, *extra, ptab)
    if split:
        out = jnp.sum(out, axis=0)
    return out[:x.shape[0]].astype(out_dtype)


# --------------------------------------------------------------------------------- modq_sum


def _modq_kernel(k_ref, u_ref, ok_ref, ou_ref, *, config: HNLQConfig):
    q, d, M = config.q, config.d, config.M
    K = u_ref.shape[0]
    u0 = u_ref[0, :].astype(jnp.int32)

    def digits(k):
        return tuple(c for m in range(M) for c in digits_of_index(k_ref[k, m, :], q, d))

    def add(k, state):
        sums, same = state
        sums = tuple(a + b for a, b in zip(sums, digits(k)))
        return sums, same & (u_ref[k, :].astype(jnp.int32) == u0)

    # The carries start from loaded rows, not zeros: Mosaic GPU gives constants a different
    # register layout and rejects the loop.
    sums, same = jax.lax.fori_loop(1, K, add, (digits(0), u0 >= 1))
    for m in range(M):
        b = [jnp.remainder(s, q) for s in sums[m * d:(m + 1) * d]]
        ok_ref[m, :] = codec.flat_index(b, q).astype(ok_ref.dtype)
    ou_ref[...] = jnp.where(same, u0, 0).astype(ou_ref.dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _modq_call(codes: Codes, axis, interpret, block, gpu_backend):
    """Planar copies (index ``[K, M, N]``, ``u [K, N]``), which Triton and Mosaic GPU both
    lower: Mosaic GPU copies need 16-byte strides and whole warpgroups of bytes."""
    config = codes.config
    lead = codes.blocks_shape
    K = lead[axis]
    rest = lead[:axis] + lead[axis + 1:]
    N = int(np.prod(rest, dtype=np.int64))
    bn = _MOSAIC_TILE if gpu_backend == "mosaic_gpu" else _tile(N, block, "kernels.modq_sum")
    pad = (-N) % bn
    index = jnp.moveaxis(codes.index, axis, 0).reshape(K, N, config.M).transpose(0, 2, 1)
    u = unpack_t(codes.tfield, config, lead[-1])
    # a corrupted block (index or T out of range: under jit, unchecked) sums as a failed one,
    # as modq.accumulate sums it (its digits would be a valid label's)
    u = jnp.where(valid_blocks(codes.index, u, config), u, 0)
    u = jnp.moveaxis(u, axis, 0).reshape(K, N)
    out, u = pl.pallas_call(
        functools.partial(_modq_kernel, config=config),
        grid=((N + pad) // bn,),
        in_specs=[pl.BlockSpec((K, config.M, bn), lambda i: (0, 0, i)),
                  pl.BlockSpec((K, bn), lambda i: (0, i))],
        out_specs=[pl.BlockSpec((config.M, bn), lambda i: (0, i)),
                   pl.BlockSpec((bn,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((config.M, N + pad), index.dtype),
                   jax.ShapeDtypeStruct((N + pad,), jnp.uint8)],
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "modq_sum"),
    )(jnp.pad(index, ((0, 0), (0, 0), (0, pad))), jnp.pad(u.astype(jnp.uint8), ((0, 0), (0, pad))))
    T = u[:N].astype(jnp.int32).reshape(rest) - 1
    return Codes(out[:, :N].T.reshape(rest + (config.M,)), pack_t(T, config), config)


def modq_sum(codes: Codes, axis: int = 0, *, interpret=None, block: int = 256,
             gpu_backend: str = "triton") -> Codes:
    """Digit-wise sum mod q of the codes along a leading axis (the compressed-domain sum).

    Args:
      codes: block codes of a config without dither, no row scales.
      axis: the leading (block) axis summed over.
      interpret, block: see :func:`encode`.
      gpu_backend: ``"triton"``, or ``"mosaic_gpu"`` with jax < 0.11
        (:data:`MOSAIC_GPU_OPS`).

    Returns:
      Block ``Codes`` with ``axis`` removed, identical to :func:`hnlq_jax.modq.accumulate`:
      T is the common T of the summands, or -1 where they differ or one is -1.

    Raises:
      ValueError, TypeError: as :func:`hnlq_jax.modq.accumulate`; a config no kernel
        supports; an empty summed axis.
    """
    check_codes(codes, "kernels.modq_sum")
    config = codes.config
    _check_config(config, "kernels.modq_sum")
    # modq's own checks (dither, row scales, axis), traced abstractly: no labels computed.
    _, T = jax.eval_shape(lambda c: modq.check(c, "kernels.modq_sum"), codes)
    axis = modq.leading_axis(axis, T, "kernels.modq_sum")
    lead = codes.blocks_shape
    rest = lead[:axis] + lead[axis + 1:]
    if int(np.prod(rest, dtype=np.int64)) == 0:
        return Codes(jnp.zeros(rest + (config.M,), index_dtype(config)),
                     pack_t(jnp.zeros(rest, jnp.int32), config), config)
    _compiler_params(gpu_backend, "modq_sum")  # a bad backend raises here, not in the trace
    return _modq_call(codes, axis, interpret_mode(interpret, codes), block, gpu_backend)

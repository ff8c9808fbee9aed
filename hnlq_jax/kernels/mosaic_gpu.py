"""Mosaic GPU kernels (``plgpu.kernel``: the GPU backend Pallas keeps from jax 0.11 on).

``gemv``: ``y = x @ W_hat^T`` for up to :data:`~hnlq_jax.kernels.pallas.GEMV_ROWS` rows of x,
the twin of the Triton :func:`hnlq_jax.kernels.pallas.gemv` (packed codebook mode) and equal
to it, and to the XLA path, up to float32 rounding.

``decode_matmul``: the same product on the tensor cores for up to :data:`MMA_ROWS` rows of
bfloat16 or float16 x, the twin of the Triton :func:`hnlq_jax.kernels.pallas.decode_matmul` (in float16
precision, finer than Triton's bfloat16). It shares ``gemv``'s work split and block decode;
each block's P coordinates times ``2^(alpha T)`` become the float16 A operand of a ``wgmma``
(swap-AB: the weight's rows are M, x's rows N), two coordinates a register built in three
instructions (Marlin's magic-exponent conversion, a subtraction, a multiply), with K permuted
in both operands to the order in which the layout holds a thread's registers (no shuffles);
x's planes are laid out once a call, each row scaled into float16's range.

**What one program does.** Programs are persistent: each loads the two tables once, then
takes work items in turn, a work item being a tile of ``block_n`` weight rows and a share of
their blocks (split-K: ``splits`` items a row tile). The codes stream from HBM through a TMA
pipeline (``stages`` tiles in flight) in the layout they are stored in, viewed, not copied:

* the index as uint32 words, ``g = 4 / (M bytes)`` blocks a word (D4 q=4 M=2: two blocks,
  levels in bytes ``2s``, ``2s + 1`` for block ``s`` of the word);
* the T field as one ``g t_bits``-bit field per index word (D4 M=2 with 4-bit T: the byte
  whose low nibble is the word's first block).

A block's level words are gathered from the packed codebook
(:func:`~hnlq_jax.kernels.pallas.packed_codebook`) held in shared memory, added as integers,
their byte fields turned into floats, the fields' bias subtracted with the magic constant (the
coordinates themselves); in ``gemv`` their inner product with the block's activations
(``beta``, the basis and the dither folded in once per call, as the Triton kernel does), times
``2^(alpha T)`` (gathered from a 16- or 256-entry table), is summed per weight row; the row
scale multiplies the row's sum after the split-K sums.

**Gathers.** Pallas' Mosaic GPU lowering has no gather, so the two shared-memory tables are
read through ``plgpu.inline_mgpu``: one ``ld.shared`` per element at the thread's own address.
Each table is stored 32 times over, entry ``k`` of lane ``l`` at word ``32 k + l`` (the
codebook at ``64 k + l``: its rows 256 bytes apart, so that an index byte under the lane's
byte offset is the address, one ``prmt``), so the 32 lanes of a warp always read 32 distinct
banks (a 1 KiB table read at random addresses would serialize about 3-4 ways). The byte
fields under the float magic exponent also come from one ``prmt`` each
(:func:`_magic_byte`; ``experiments/sass_profile.py`` counts the instructions). GPU
interpret mode cannot run ``inline_mgpu``; there the gathers are an indexing of the table and
``prmt`` is shifts and masks (``interpret=True``), and everything else is the kernel as
compiled.

Supported (:func:`unsupported` says why not): jax >= 0.11 (``plgpu.InterpretGPUParams``,
``plgpu.kernel``), a packed codebook of one word an entry and at most 256 entries (D4 up to
q = 4, Z2 and A2), ``M`` index bytes a block of 1, 2 or 4, a T field a byte-aligned view of
the index words, and weights the tiles cover exactly. Elsewhere the Triton kernels run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from hnlq_jax import codec
from hnlq_jax.codes import Codes, check_activations, t_bits
from hnlq_jax.config import HNLQConfig
from hnlq_jax.kernels import pallas as _pallas

__all__ = ["MMA_ROWS", "available", "chosen", "decode_matmul", "gemv", "launch_params",
           "supported_shape", "unsupported"]

# A warp's 32 lanes each read their own copy of a shared-memory table (no bank conflicts).
_LANES = 32
# TMA boxes hold at most 256 elements a dimension: one copy brings a 256-entry table.
_TABLE_ROWS_MAX = 256
_LAYOUT = plgpu.Layout.WGMMA if hasattr(plgpu, "Layout") else None
# float(0x4B000000 | b) = 2^23 + b exactly for a byte b (as the Triton kernel).
_MAGIC = 0x4B000000
_TWO23 = float(2**23)


def available() -> bool:
    """Whether this jax has what the kernels need (``plgpu.kernel``, ``inline_mgpu``, GPU
    interpret mode: jax >= 0.11)."""
    return jax.__version_info__ >= (0, 11) and hasattr(plgpu, "InterpretGPUParams")


def unsupported(config: HNLQConfig, op: str = "gemv") -> str | None:
    """Why ``op`` (:func:`gemv` or :func:`decode_matmul`) has no kernel for ``config``
    (``None`` where it has one)."""
    if not available():
        return f"jax {jax.__version__} lacks Mosaic GPU's plgpu.kernel / GPU interpret mode"
    if _pallas.unsupported(config):
        return _pallas.unsupported(config)
    if config.d > 4 or config.q**config.d > _TABLE_ROWS_MAX:
        return ("the packed codebook must be one word of byte fields an entry (d <= 4) with "
                f"at most {_TABLE_ROWS_MAX} entries (d = {config.d}, q^d = {config.q**config.d})")
    if _pallas.packed_codebook(config) is None:
        r = codec.codebook_table(config.lattice, config.q)
        span = (int(r.max()) - int(r.min())) * sum(config.q**m for m in range(config.M))
        return (f"the levels' byte fields would carry: (max r - min r) sum_m q^m = {span} > 255 "
                "(fewer levels or a smaller q)")
    view = _pallas.word_view(config)
    if view is None or view[0] != view[1]:
        return (f"M = {config.M} index bytes a block and {t_bits(config)}-bit T have no "
                "uint32 word view whose words match the T field's elements")
    if op == "decode_matmul" and _pallas.f16_exponent(config) > _pallas.F16_EXPONENT_MAX:
        return (f"2^(alpha max_T) = 2^{config.alpha * config.max_T:.3g} is past the float16 "
                "range of the tensor cores' operands (at most 2^22)")
    return None


def supported_shape(config: HNLQConfig, n: int, nb: int, t: dict) -> bool:
    """Whether launch parameters ``t`` tile a weight with blocks ``[n, nb]`` exactly (the
    kernel has no edge masks; such weights take the Triton kernel)."""
    if unsupported(config):
        return False
    g = _pallas.word_view(config)[0]
    return (n > 0 and nb > 0 and n % t["block_n"] == 0 and nb % g == 0
            and (nb // g) % t["block_w"] == 0)


# The tuning table's key of each kernel's own launch parameters
_OPS = {"gemv": "gemv_mosaic", "decode_matmul": "decode_matmul_mosaic"}
# What the "backend" of the table's Triton entry ("gemv": up to GEMV_ROWS rows of x;
# "decode_matmul": more) names: this module's kernel to run instead
_BACKENDS = {"gemv": {"mosaic_gpu": "gemv", "mosaic_gpu_mma": "decode_matmul"},
             "decode_matmul": {"mosaic_gpu": "decode_matmul"}}


def chosen(codes: Codes, batch: int, dtype) -> str | None:
    """This module's kernel (``"gemv"`` or ``"decode_matmul"``) that
    :func:`hnlq_jax.matmul`'s kernels take for ``batch`` rows of x of ``dtype`` (``None``:
    Triton's). The tuning table's entry of the Triton op for the GPU's generation, the lattice
    and the batch class names it (the sweep found it the fastest): ``"backend":
    "mosaic_gpu"`` (the entry's own op), or, up to ``GEMV_ROWS`` rows, ``"mosaic_gpu_mma"``
    (the tensor-core kernel, for 16-bit x only); and the kernel supports the codes, its
    launch parameters are valid and tile the weight exactly."""
    generation, _ = _pallas.gpu_target()
    config = codes.config
    op = "gemv" if batch <= _pallas.GEMV_ROWS else "decode_matmul"
    backend = _pallas.tuning_entry(op, config, batch, generation).get("backend")
    kernel = _BACKENDS[op].get(backend)
    if kernel is None or unsupported(config, kernel):  # the entry is the lattice's
        return None
    if kernel == "decode_matmul" and (jnp.dtype(dtype) not in _MMA_DTYPES
                                      or batch > MMA_ROWS):
        return None
    n, nb = codes.blocks_shape
    t = launch_params(kernel, config, n, nb, batch)
    ok = _launch_error(kernel, t, config, batch) is None and supported_shape(config, n, nb, t)
    return kernel if ok else None


def _replicated(table: np.ndarray, row_words: int = _LANES):
    """uint32 ``[rows, row_words]``: entry ``k`` repeated for each lane of a warp (columns past
    the 32 lanes zero)."""
    rows = np.asarray(table).view(np.uint32)
    out = np.zeros((rows.shape[0], row_words), np.uint32)
    out[:, :_LANES] = rows[:, None]
    return jnp.asarray(out)


# The codebook's rows are 256 bytes apart (64 words, the lanes' 32 and zeros): a byte of an
# index word under the lane's byte offset is then the entry's address (one prmt, no multiply)
_CODEBOOK_ROW_WORDS = 64
assert 4 * _CODEBOOK_ROW_WORDS == 256 == _TABLE_ROWS_MAX  # a byte's step, every byte a row


def _prmt(a, b, selector: int, interpret: bool = False):
    """PTX ``prmt.b32`` (default mode): byte ``i`` of the result is byte ``(selector >> 4 i) &
    7`` of ``b:a`` (0-3: ``a``'s, 4-7: ``b``'s). Of two i32 MLIR values (inside
    ``inline_mgpu``), or, ``interpret``, of uint32 arrays (the same selector, emulated: the
    interpret-mode tests then pin the selectors the kernels use)."""
    if interpret:
        return _pallas.prmt(a, b, selector)
    from jax._src.lib.mlir import ir  # noqa: PLC0415 (MLIR only where the kernel compiles)
    from jax._src.lib.mlir.dialects import llvm  # noqa: PLC0415
    return llvm.inline_asm(ir.IntegerType.get_signless(32), [a, b],
                           f"prmt.b32 $0, $1, $2, {selector};", "=r,r,r")


def _codebook_selector(at: int) -> int:
    """The ``prmt`` selector of a codebook gather's address (:func:`_gather`): the lane's
    byte offset (``4 lane < 256``, byte 0 of ``a``), index byte ``at`` of the word (``b``),
    then the offset's zero bytes."""
    return (2 << 12) | (1 << 8) | ((4 + at) << 4)


def _gather(table_ref, x, interpret: bool, at: int | None = None):
    """``table[k, lane]`` (uint32, shape and layout of ``x``) from a shared-memory table whose
    rows hold an entry once per lane of a warp (each thread reads its own lane's copy): ``k =
    x`` from a ``[rows, 32]`` table (a shift-add from the lane's byte offset), or ``k`` byte
    ``at`` of ``x`` from the codebook ``[256, 64]`` (:data:`_CODEBOOK_ROW_WORDS`: the offset
    ``256 k + 4 lane`` is one ``prmt`` of the lane's offset and the word). A ``memref.load``
    at ``[k, lane]`` took the row-major index apart again per element
    (``experiments/sass_profile.py``)."""
    if interpret:  # lane 0's copy: its byte offset is 0
        k = x if at is None else _prmt(jnp.uint32(0), x, _codebook_selector(at), True) >> 8
        return table_ref[...][k.astype(jnp.int32), 0]
    from jax._src.lib.mlir import ir  # noqa: PLC0415 (MLIR only where the kernel compiles)
    from jax._src.lib.mlir.dialects import arith, llvm  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _LAYOUT),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.uint32, layout=_LAYOUT))
    def gather(ctx, tref, xs):
        i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        lane4 = arith.shli(arith.remui(mgpu_utils.thread_idx(), arith.constant(i32, _LANES)),
                           arith.constant(i32, 2))
        base = mgpu_utils.memref_ptr(tref)
        if at is None:  # row k at byte 128 k of the lane's column (its address once)
            base = mgpu_utils.getelementptr(base, [lane4], i8)
            row = arith.constant(i32, (4 * _LANES).bit_length() - 1)
            offset = lambda v: arith.shli(v, row)  # noqa: E731
        else:  # bytes: lane4's byte 0, the word's byte `at`, zeros (lane4's bytes 1 and 2)
            offset = lambda v: _prmt(lane4, v, _codebook_selector(at))  # noqa: E731
        return xs.foreach(
            lambda v, _: llvm.load(i32, mgpu_utils.getelementptr(base, [offset(v)], i8)),
            create_array=True, is_signed=False)
    return gather(table_ref, x)


def _magic_byte(word, c: int, interpret: bool):
    """Byte ``c`` of each element of ``word`` (uint32) under the float magic exponent:
    ``0x4B0000cc``, the float ``2^23 + byte``. One ``prmt`` where shifts, a mask and an OR
    took two or three (ptxas does not fold the OR into its own byte extracts)."""
    # The constant first (bytes 0-3: 00 00 00 4B), the word's bytes 4-7: result bytes the
    # word's byte c, 00, 00, 4B. (With the constant second and the selector an immediate,
    # ptxas rebuilt the selector in a register every time.)
    selector = _pallas.magic_selector(c)
    if interpret:
        return _prmt(jnp.uint32(_MAGIC), word, selector, True)
    from jax._src.lib.mlir import ir  # noqa: PLC0415 (MLIR only where the kernel compiles)
    from jax._src.lib.mlir.dialects import arith  # noqa: PLC0415

    @plgpu.inline_mgpu(arg_types=(_LAYOUT,),
                       return_type=plgpu.ShapeDtypeStruct(word.shape, jnp.uint32,
                                                          layout=_LAYOUT))
    def magic_byte(ctx, ws):
        magic = arith.constant(ir.IntegerType.get_signless(32), _MAGIC)
        return ws.foreach(lambda v, _: _prmt(magic, v, selector), create_array=True,
                          is_signed=False)
    return magic_byte(word)


def _levels(w, p: int, tab_smem, *, config: HNLQConfig, interpret: bool):
    """Block ``p`` of each index word of a tile (``w``: uint32 ``[rows, words]``): its
    levels' packed sum (uint32, ``d`` byte fields ``P + bias``) and whether its indices name
    codebook entries (``None``: every byte does)."""
    rows = config.q**config.d
    word, valid = None, None
    for m in range(config.M):
        at = p * config.M + m  # the level's byte in the word (q^d <= 256: one-byte indices)
        v = _gather(tab_smem, w, interpret, at) * jnp.uint32(config.q**m)
        word = v if word is None else word + v
        if rows < 256:  # a corrupt index names no entry: NaN, as Triton's
            ok = ((w >> jnp.uint32(8 * at)) & jnp.uint32(255)) < jnp.uint32(rows)
            valid = ok if valid is None else valid & ok
    return word, valid


def _overload(tw, p: int, pow_smem, valid, nan: int, *, config: HNLQConfig,
              interpret: bool):
    """Block ``p``'s ``2^(alpha T)`` as the bits of the overload table's entry (uint32, the
    shape of ``tw``), ``nan`` where its indices name no entry."""
    tb = t_bits(config)
    u = (tw >> jnp.uint32(tb * p)) & jnp.uint32((1 << tb) - 1)
    bits = _gather(pow_smem, u, interpret)
    return bits if valid is None else jnp.where(valid, bits, jnp.uint32(nan))


def _block(w, tw, p: int, tab_smem, pow_smem, *, config: HNLQConfig, interpret: bool):
    """Block ``p`` of each index word of a tile (``w``, ``tw``: uint32 ``[rows, words]``):
    ``(coords, scale)``, its ``d`` coordinates ``P`` as float32 and ``2^(alpha T)``, NaN
    where the block failed or its index names no entry."""
    word, valid = _levels(w, p, tab_smem, config=config, interpret=interpret)
    # byte c under the magic exponent: 0x4B0000cc, the float 2^23 + field, less 2^23 and the
    # fields' bias in one exact subtraction (as Triton's gemv: no offsets term a block)
    base = np.float32(_TWO23 + _pallas.packed_bias(config, 0))
    fields = [jax.lax.bitcast_convert_type(_magic_byte(word, c, interpret), jnp.float32) - base
              for c in range(config.d)]
    nan = int(np.float32(np.nan).view(np.uint32))
    scale = jax.lax.bitcast_convert_type(
        _overload(tw, p, pow_smem, valid, nan, config=config, interpret=interpret),
        jnp.float32)
    return fields, scale


def _load_tables(tab_gmem, pow_gmem, tab_smem, pow_smem, barrier):
    plgpu.copy_gmem_to_smem(tab_gmem, tab_smem, barrier.at[0])
    plgpu.copy_gmem_to_smem(pow_gmem, pow_smem, barrier.at[1])
    plgpu.barrier_wait(barrier.at[0])
    plgpu.barrier_wait(barrier.at[1])


def _codes_specs(bn: int, bw: int, i, first) -> list:
    """Pipeline specs of a work item's index words and T view (row tile ``i``, its share of
    word tiles from ``first``)."""
    return [plgpu.BlockSpec((bn, bw), lambda k: (i, first + k))] * 2


def _kernel(w_gmem, t_gmem, xt_gmem, tab_gmem, pow_gmem, o_gmem, tab_smem, pow_smem,
            barrier, *, config: HNLQConfig, g: int, bn: int, bw: int, steps: int,
            stages: int, interpret: bool):
    _load_tables(tab_gmem, pow_gmem, tab_smem, pow_smem, barrier)
    d, bb = config.d, xt_gmem.shape[2]

    def step(_, w_smem, t_smem, xt_smem, acc):
        w = plgpu.layout_cast(w_smem[...], _LAYOUT)  # [bn, bw] index words
        tw = plgpu.layout_cast(t_smem[...], _LAYOUT).astype(jnp.uint32)
        acc = list(acc)
        for p in range(g):  # block p of each word
            coords, scale = _block(w, tw, p, tab_smem, pow_smem, config=config,
                                   interpret=interpret)
            for b in range(bb):
                v = None
                for c in range(d):
                    prod = coords[c] * xt_smem[p, c, b, :][None, :]
                    v = prod if v is None else v + prod
                if config.dither is not None:  # the offsets plane: beta x . z
                    v = v - xt_smem[p, d, b, :][None, :]
                acc[b] = acc[b] + scale * v
        return tuple(acc)

    # Persistent programs: each loads the tables once, then takes work items (a row tile and
    # its split-K share) in turn
    @plgpu.nd_loop((o_gmem.shape[2] // bn, o_gmem.shape[0]), collective_axes="p")
    def _work(loop):
        i, s = loop.index
        first = s * steps
        zero = plgpu.layout_cast(jnp.zeros((bn, bw), jnp.float32), _LAYOUT)
        acc = plgpu.emit_pipeline(
            step, grid=(steps,),
            in_specs=_codes_specs(bn, bw, i, first) + [
                plgpu.BlockSpec((g, xt_gmem.shape[1], bb, bw), lambda k: (0, 0, 0, first + k))],
            max_concurrent_steps=stages, init_carry=(zero,) * bb,
        )(w_gmem, t_gmem, xt_gmem)
        for b in range(bb):
            o_gmem.at[s, b][pl.ds(i * bn, bn)] = jnp.sum(acc[b], axis=1)


# An index word's byte under 0x64 is the float16 1024 + byte (10 mantissa bits: any byte)
_F16_MAGIC = 0x64646464
_F16_NAN = 0x7E007E00  # a float16 NaN in both halves
# A dither pair: scale p's low half (bytes 0, 1 of a), scale p + 1's high half (bytes 6, 7)
_SCALES_SELECTOR = 0x7610


def _pair_selector(c: int) -> int:
    """The ``prmt`` selector of a coordinate pair: the magic constant first (``a``: bytes
    0x64), the fields' word second; bytes ``c`` and ``c + 1`` of the fields under 0x64, the
    float16 pair ``(1024 + field_c, 1024 + field_c+1)``."""
    return (4 + c) | ((5 + c) << 8)


def _pairs(config: HNLQConfig) -> tuple:
    """The A operand's planes of an index word in pairs, a pair one float16x2 register:
    ``("coords", p, c)``, coordinates ``c`` and ``c + 1`` of block ``p`` (``d`` is even), then,
    with a dither, ``("scales", p, p + 1)``, the dither's planes of blocks ``p`` and ``p + 1``
    (their ``2^(alpha T)``; ``p + 1`` past the last block is ``None``: zeros)."""
    g = _pallas.word_view(config)[0]
    pairs = [("coords", p, c) for p in range(g) for c in range(0, config.d, 2)]
    if config.dither is not None:
        pairs += [("scales", p, p + 1 if p + 1 < g else None) for p in range(0, g, 2)]
    return tuple(pairs)


def _k_major(a):
    """``a [U, 2, rows, words]`` (pair ``u`` of a word, its element ``e'``; numpy or jax) in
    the wgmma's K order, ``[rows, 2 U words]``: the order in which a thread's registers hold
    the pairs (:func:`_a_register`), so that building A needs no shuffle. The layout gives a
    thread words ``8 j + 2 t + e`` of a row (``t`` its lane mod 4, ``e`` 0 or 1) and columns
    ``8 J + 2 t + e'``: ``J = 2 U j + U e + u`` holds pair ``u`` of word ``8 j + 2 t + e``."""
    U, _, rows, words = a.shape
    return (a.reshape(U, 2, rows, words // 8, 4, 2).transpose(2, 3, 5, 0, 4, 1)
            .reshape(rows, 2 * U * words))


def _a_register(idx: tuple, e: int, u: int, pairs: int) -> tuple:
    """The A operand's register (its index in the layout's register array) holding pair ``u``
    of element ``e`` of the index words' register ``idx``: dimension 1 counts 8-column
    groups, the rest are the rows' (:func:`_k_major`)."""
    return idx[:1] + (2 * pairs * idx[1] + pairs * e + u,) + idx[2:]


def _planes(config: HNLQConfig) -> int:
    """The A operand's planes (K columns) an index word: two a pair (:func:`_pairs`)."""
    return 2 * len(_pairs(config))


def _a_operand(levels: list, scales: list, config: HNLQConfig, interpret: bool):
    """The A operand ``[rows, 2 U words]`` (float16, the wgmma's register layout; K in
    :func:`_k_major`'s order) of a tile's blocks: ``levels[p]``, ``scales[p]`` (uint32 ``[rows,
    words]``: block ``p``'s packed fields, and its ``2^(alpha T - e_A)`` as float16 in both
    halves) give ``U`` (:func:`_pairs`) registers a word, ``(P_c, P_c+1) 2^(alpha T -
    e_A)``: P exact from the fields under :data:`_F16_MAGIC` (one ``prmt`` a pair) less
    ``1024 + bias``, times the float16 scale (rounded: the scale was itself rounded to
    float16, so about 1.5 2^-11 relative at most)."""
    pairs = _pairs(config)
    U = len(pairs)
    rows, words = levels[0].shape
    offset = np.float16(1024 + _pallas.packed_bias(config, 0))
    if interpret:
        vals = []
        for kind, p, c in pairs:
            if kind == "coords":
                bits = _prmt(jnp.uint32(_F16_MAGIC), levels[p], _pair_selector(c), True)
                h = jax.lax.bitcast_convert_type(bits, jnp.float16)
                v = (h - offset) * jax.lax.bitcast_convert_type(scales[p], jnp.float16)
            else:
                bits = (scales[p] & jnp.uint32(0xFFFF) if c is None
                        else _prmt(scales[p], scales[c], _SCALES_SELECTOR, True))
                v = jax.lax.bitcast_convert_type(bits, jnp.float16)
            vals.append(v)
        return _k_major(jnp.stack(vals).transpose(0, 3, 1, 2))  # [U, rows, words, 2]
    from jax._src.lib.mlir import ir  # noqa: PLC0415 (MLIR only where the kernel compiles)
    from jax._src.lib.mlir.dialects import arith, vector  # noqa: PLC0415
    from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415

    g = len(levels)

    @plgpu.inline_mgpu(arg_types=(_LAYOUT,) * (2 * g),
                       return_type=plgpu.ShapeDtypeStruct((rows, 2 * U * words), jnp.float16,
                                                          layout=_LAYOUT))
    def build(ctx, *arrays):
        i32, f16 = ir.IntegerType.get_signless(32), ir.F16Type.get()
        h2 = ir.VectorType.get((2,), f16)
        const = lambda v: arith.constant(i32, v)  # noqa: E731
        off = arith.constant(h2, ir.DenseElementsAttr.get_splat(h2, ir.FloatAttr.get(f16,
                                                                                   offset)))
        lv, sc = arrays[:g], arrays[g:]
        layout = lv[0].layout
        shape = layout.registers_shape((rows, 2 * U * words))
        assert shape == _a_register(lv[0].registers.shape, 0, 0, U)  # (see _a_register)
        out = np.empty(shape, object)
        for idx in np.ndindex(lv[0].registers.shape):
            for e in range(2):
                elem = lambda a: vector.extract(  # noqa: E731
                    a.registers[idx], dynamic_position=[],
                    static_position=ir.DenseI64ArrayAttr.get([e]))
                v, s = [elem(a) for a in lv], [elem(a) for a in sc]
                for u, (kind, p, c) in enumerate(pairs):
                    if kind == "coords":
                        h = mgpu_utils.bitcast(
                            _prmt(const(_F16_MAGIC), v[p], _pair_selector(c)), h2)
                        r = arith.mulf(arith.subf(h, off), mgpu_utils.bitcast(s[p], h2))
                    else:
                        bits = (arith.andi(s[p], const(0xFFFF)) if c is None
                                else _prmt(s[p], s[c], _SCALES_SELECTOR))
                        r = mgpu_utils.bitcast(bits, h2)
                    out[_a_register(idx, e, u, U)] = r
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)
    return build(*levels, *scales)


def _chunk_words(config: HNLQConfig, bw: int, batch: int) -> int:
    """Index words a wgmma of :func:`decode_matmul` takes: the fewest (a multiple of 8, the
    layout's column group) dividing ``bw`` whose planes are whole swizzle tiles of x's operand
    (its padded rows), so that decoding the next words overlaps the tensor cores' product."""
    planes = _planes(config)
    for cw in range(8, bw + 1, 8):
        if bw % cw == 0 and (planes * cw) % _mma_rows(batch) == 0:
            return cw
    return bw


def _mma_kernel(w_gmem, t_gmem, x_gmem, tab_gmem, pow_gmem, o_gmem, tab_smem, pow_smem,
                barrier, *a_smem, config: HNLQConfig, g: int, bn: int, bw: int, cw: int,
                steps: int, stages: int, interpret: bool):
    _load_tables(tab_gmem, pow_gmem, tab_smem, pow_smem, barrier)
    bb = x_gmem.shape[1]
    kw = _planes(config) * cw  # x's rows (K) of a chunk of cw words

    def step(acc_ref, w_smem, t_smem, x_smem):
        w_all = plgpu.layout_cast(w_smem[...], _LAYOUT)  # [bn, bw] index words
        tw_all = plgpu.layout_cast(t_smem[...], _LAYOUT).astype(jnp.uint32)
        for j in range(bw // cw):  # a chunk's wgmma runs while the next chunk decodes
            w, tw = w_all[:, j * cw:(j + 1) * cw], tw_all[:, j * cw:(j + 1) * cw]
            levels, scales = [], []
            for p in range(g):
                word, valid = _levels(w, p, tab_smem, config=config, interpret=interpret)
                levels.append(word)
                scales.append(_overload(tw, p, pow_smem, valid, _F16_NAN, config=config,
                                        interpret=interpret))
            a = _a_operand(levels, scales, config, interpret)
            if a_smem:  # through shared memory (in interpret mode always: wgmma reads refs)
                a_smem[0].at[j][...] = a
                plgpu.commit_smem()
                a = a_smem[0].at[j]
            plgpu.wgmma(acc_ref, a, x_smem.at[pl.ds(j * kw, kw), :])
        plgpu.wgmma_wait(0)  # the tiles' buffers (and a_smem) are free for the next step

    @plgpu.nd_loop((o_gmem.shape[1] // bn, o_gmem.shape[0]), collective_axes="p")
    def _work(loop):
        i, s = loop.index
        first = s * steps

        def acc_scope(acc_ref):
            plgpu.emit_pipeline(
                lambda _, *tiles: step(acc_ref, *tiles),
                grid=(steps,),
                in_specs=_codes_specs(bn, bw, i, first)
                + [plgpu.BlockSpec((bw // cw * kw, bb), lambda k: (first + k, 0))],
                max_concurrent_steps=stages,
            )(w_gmem, t_gmem, x_gmem)
            return acc_ref[...]

        o_gmem.at[s][pl.ds(i * bn, bn), :] = pl.run_scoped(
            acc_scope, plgpu.ACC((bn, bb), jnp.float32))


def _prepare(op: str, x, codes: Codes, fn: str, given: dict) -> tuple:
    """The checked codes, activations ``[B, k]``, leading axes and launch parameters of a
    call, with the work split (``steps`` a work item, ``programs`` at most one a work item);
    ``t`` is ``None`` where the product is empty."""
    codes = _pallas.weight_codes(codes, fn)
    x = check_activations(x, codes, fn)
    config = codes.config
    why = unsupported(config, op)
    if why:
        raise ValueError(f"{fn}: no kernel for {config}: {why}")
    n, nb = codes.blocks_shape
    lead = x.shape[:-1]
    B = int(np.prod(lead, dtype=np.int64))
    rows = _pallas.GEMV_ROWS if op == "gemv" else MMA_ROWS
    if B > rows:
        raise ValueError(f"{fn}: at most {rows} rows of x, got {B}")
    t = launch_params(op, config, n, nb, B)
    t.update({k: v for k, v in given.items() if v is not None})
    if given.get("stages") is None:  # the table's, for the caller's tiles
        _fit_stages(op, t, config, B)
    why = _launch_error(op, t, config, B)
    if why:
        raise ValueError(f"{fn}: {why}")
    if B == 0 or n == 0 or nb == 0:
        return codes, x.reshape(B, x.shape[-1]), lead, None
    if not supported_shape(config, n, nb, t):
        raise ValueError(f"{fn}: blocks [{n}, {nb}] are not tiled exactly by block_n = "
                         f"{t['block_n']}, block_w = {t['block_w']} words; use the Triton "
                         "kernel")
    if given.get("programs") is None:  # the caller's tiles may need more shared memory
        t["programs"] = min(t["programs"],
                            _resident_cap(op, t, config, B) * _pallas.gpu_target()[1])
    tiles = nb // _pallas.word_view(config)[0] // t["block_w"]
    t["steps"] = _steps(tiles, t["splits"])
    t["programs"] = min(t["programs"], n // t["block_n"] * (tiles // t["steps"]))
    return codes, x.reshape(B, x.shape[-1]), lead, t


def gemv(x, codes: Codes, out_dtype, *, interpret=None, block_n: int | None = None,
         block_w: int | None = None, splits: int | None = None, stages: int | None = None,
         programs: int | None = None):
    """``y = x @ W_hat^T`` for a few rows of ``x`` on Mosaic GPU (see the module docstring).

    Args:
      x: ``[..., k]`` activations (at most ``GEMV_ROWS`` rows); computed in float32.
      codes: the weight ``W[n, k]`` as codes with blocks ``[n, nb]``.
      out_dtype: the result's dtype.
      interpret: ``None``: GPU interpret mode where the inputs live on a CPU (the gathers as
        indexing); ``False`` compiles for the GPU.
      block_n: weight rows a program (a multiple of 64: the warpgroup's register layout);
        block_w: index words a pipeline step (a multiple of 16: TMA copies whole 16-byte
          rows, and the T field's view may be a byte a word);
        splits: programs a row tile's blocks are split across (split-K);
        stages: pipeline steps in flight;
        programs: persistent programs (each loads the tables once, then takes work items in
          turn; at most one a work item). ``None``: :func:`launch_params`.

    Returns:
      ``[..., n]`` in ``out_dtype``, as :func:`hnlq_jax.kernels.gemv`.

    Raises:
      ValueError: an unsupported config or a weight the tiles do not cover exactly
        (:func:`unsupported`, :func:`supported_shape`); more than ``GEMV_ROWS`` rows; bad
        launch parameters.
    """
    codes, x, lead, t = _prepare("gemv", x, codes, "kernels.mosaic_gpu.gemv", dict(
        block_n=block_n, block_w=block_w, splits=splits, stages=stages, programs=programs))
    if t is None:
        return jnp.zeros(lead + (codes.blocks_shape[0],), out_dtype)
    out = _gemv_call(x, codes, jnp.dtype(out_dtype), _pallas.interpret_mode(interpret, x, codes),
                     t["block_n"], t["block_w"], t["steps"], t["stages"], t["programs"])
    return out.reshape(lead + out.shape[-1:])


# decode_matmul's activations: its float16 operands are as fine as x
_MMA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# decode_matmul takes up to this many rows of x: the wgmma's N (x's rows, padded to a power
# of two >= 16, whose rows of 2-byte elements shared memory swizzles), and past 64 rows the
# x tiles outgrow the weight's in shared memory.
MMA_ROWS = 64


def decode_matmul(x, codes: Codes, out_dtype, *, interpret=None, block_n: int | None = None,
                  block_w: int | None = None, splits: int | None = None,
                  stages: int | None = None, programs: int | None = None,
                  a_registers: bool | None = None):
    """``y = x @ W_hat^T`` on Hopper's tensor cores for up to :data:`MMA_ROWS` rows of
    bfloat16 or float16 ``x`` (see the module docstring): each block's P coordinates times
    ``2^(alpha T)``, rounded to float16, are the A operand of a ``wgmma`` whose B operand is
    x's matching plane, ``beta C^T x`` times a power of two a row of x, rounded to float16;
    float32 accumulation, scaled back exactly.

    Args:
      x: ``[..., k]`` bfloat16 or float16 activations, at most :data:`MMA_ROWS` rows.
      codes: the weight ``W[n, k]`` as codes with blocks ``[n, nb]``.
      out_dtype: the result's dtype.
      interpret: as :func:`gemv`.
      block_n, block_w, splits, stages, programs: as :func:`gemv` (``block_w`` words make
        the planes' K: a multiple of 16, the wgmma's).
      a_registers: the decoded planes go to the wgmma from registers (``True``; then the
        planes of ``block_w`` words must be a multiple of x's rows padded to a power of two
        >= 16, whole swizzle tiles of x's operand) or through shared memory; interpret mode
        always takes shared memory (its wgmma reads refs only).

    Returns:
      ``[..., n]`` in ``out_dtype``: the products of the decoded weights in float16
      precision (each weight's P coordinates are exact integers; their products with
      ``2^(alpha T)``, and x's planes, round to float16: about 2^-11 relative a term), as
      :func:`hnlq_jax.kernels.decode_matmul` up to its bfloat16 rounding.

    Raises:
      ValueError: as :func:`gemv`; ``x`` not bfloat16 or float16; more than
        :data:`MMA_ROWS` rows; overload steps past float16's range (:func:`unsupported`).
    """
    fn = "kernels.mosaic_gpu.decode_matmul"
    if getattr(x, "dtype", None) not in _MMA_DTYPES:
        raise ValueError(f"{fn}: x must be bfloat16 or float16 (16-bit activations, for "
                         "which the wgmma's float16 operands are as fine), got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    codes, x, lead, t = _prepare("decode_matmul", x, codes, fn, dict(
        block_n=block_n, block_w=block_w, splits=splits, stages=stages, programs=programs,
        a_registers=a_registers))
    if t is None:
        return jnp.zeros(lead + (codes.blocks_shape[0],), out_dtype)
    interpret = _pallas.interpret_mode(interpret, x, codes)
    out = _mma_call(x, codes, jnp.dtype(out_dtype), interpret, t["block_n"], t["block_w"],
                    t["steps"], t["stages"], t["programs"], t["a_registers"] and not interpret)
    return out.reshape(lead + out.shape[-1:])


# Hopper's shared memory a block (227 KiB) and a multiprocessor (228 KiB, 1 KiB of it kept by
# the system for each resident block); the kernels' use is estimated before compiling.
_SMEM_BYTES = 227 * 1024
_SM_SMEM_BYTES = 228 * 1024
_SMEM_RESERVED = 1024
# the pipeline's and the tables' barriers (48 bytes in the programs Mosaic GPU built), with room
_BARRIER_BYTES = 128
# Stages of a launch whose entry leaves them to launch_params (``None``): two a program, more
# for a program alone on its multiprocessor
AUTO_STAGES = 2


def _mma_rows(batch: int) -> int:
    """x's rows in :func:`decode_matmul`'s wgmma: ``batch`` padded to a power of two >= 16."""
    return max(16, 1 << max(0, batch - 1).bit_length())


def _smem_bytes(op: str, t: dict, config: HNLQConfig, batch: int) -> int:
    """Shared memory of a program: the two lane-replicated tables and ``stages`` pipeline
    buffers (index words, T view, x's planes; :func:`decode_matmul`'s planes through shared
    memory)."""
    g, _, t_dtype = _pallas.word_view(config)
    tables = 4 * (_TABLE_ROWS_MAX * _CODEBOOK_ROW_WORDS + _LANES * (1 << t_bits(config)))
    bn, bw = t["block_n"], t["block_w"]
    codes = bn * bw * (4 + np.dtype(t_dtype).itemsize)
    tables += _BARRIER_BYTES
    if op == "gemv":
        bb = 1 << max(0, batch - 1).bit_length()  # x's rows, padded to a power of two
        return tables + t["stages"] * (codes + g * _gemv_planes(config) * bb * bw * 4)
    planes = _planes(config)
    a = 0 if t["a_registers"] else planes * bn * bw * 2
    return tables + a + t["stages"] * (codes + planes * bw * _mma_rows(batch) * 2)


def _launch_error(op: str, t: dict, config: HNLQConfig, batch: int) -> str | None:
    """What is wrong with launch parameters ``t`` of ``op`` (``None`` where they are valid)."""
    for name in ("block_n", "block_w", "splits", "stages", "programs"):
        if not isinstance(t[name], int) or isinstance(t[name], bool) or t[name] < 1:
            return f"{name} must be a positive int, got {t[name]!r}"
    if op == "decode_matmul" and not isinstance(t["a_registers"], bool):
        return f"a_registers must be a bool, got {t['a_registers']!r}"
    if t["block_n"] % 64 or t["block_w"] % 16:
        return (f"block_n must be a multiple of 64 and block_w of 16, got {t['block_n']}, "
                f"{t['block_w']}")
    planes = _planes(config)
    if op == "decode_matmul" and t["a_registers"] and planes * t["block_w"] % _mma_rows(batch):
        # x's tile [planes block_w, rows] is swizzled along its rows; a wgmma with A in
        # registers takes K in whole swizzle tiles (Mosaic GPU's lowering refuses the rest)
        return (f"with a_registers, {planes} planes x block_w must be a multiple of x's rows "
                f"padded to a power of two >= 16 ({_mma_rows(batch)}), got block_w = "
                f"{t['block_w']}")
    if _smem_bytes(op, t, config, batch) > _SMEM_BYTES:
        return (f"block_n = {t['block_n']}, block_w = {t['block_w']}, stages = {t['stages']} "
                f"need {_smem_bytes(op, t, config, batch)} bytes of shared memory (at most "
                f"{_SMEM_BYTES})")
    return None


def _steps(tiles: int, splits: int) -> int:
    """Pipeline steps a program: the largest divisor of ``tiles`` (a row's word tiles) that
    leaves at least ``splits`` programs a row tile (exact tiles: no edges); 1 (a program a
    tile) where ``splits`` exceeds the tiles."""
    best = 1
    for steps in range(1, tiles + 1):
        if tiles % steps == 0 and tiles // steps >= splits:
            best = steps
    return best


def launch_params(op: str, config: HNLQConfig, n: int, nb: int, batch: int,
                  entry: dict | None = None) -> dict:
    """The launch parameters of ``op`` (:func:`gemv` or :func:`decode_matmul`) for blocks
    ``[n, nb]`` and ``batch`` rows of x: ``entry``, else the tuning table's entry for the
    op (``"gemv_mosaic"``, ``"decode_matmul_mosaic"``) and the GPU's generation
    (:func:`hnlq_jax.kernels.pallas.tuning_entry`), over its defaults; ``splits`` grows until
    about ``waves`` work items (a row tile's split-K share) a multiprocessor, taken in turn by
    ``resident`` persistent programs a multiprocessor (``programs`` in all; at most as many as
    its shared memory holds at once); ``stages`` at most what a program's shared memory holds
    (``None``, the default's: ``AUTO_STAGES``, and where fewer programs fit than asked, up to
    the stages they would have held together);
    ``block_n`` and ``block_w`` halved (down to 64 and 16) until they tile the weight exactly
    (MiniLM's 384 x 384: 48 words a row, not a multiple of the default 32). Without a GPU: an
    H100's (sm90, 132)."""
    if op not in _OPS:
        raise ValueError(f"kernels.mosaic_gpu.launch_params: op must be one of {tuple(_OPS)}, "
                         f"got {op!r}")
    t, sms = _pallas.launch_entry(_OPS[op], config, batch, entry)
    waves = t.pop("waves")
    view = _pallas.word_view(config)
    if view is not None and nb % view[0] == 0:  # tiles halved until they cover the weight
        for name, size, least in (("block_n", n, 64), ("block_w", nb // view[0], 16)):
            while t[name] > least and t[name] % (2 * least) == 0 and size % t[name]:
                t[name] //= 2
    row_tiles = max(1, -(-n // t["block_n"]))
    tiles = -(-nb // ((view[0] if view else 1) * t["block_w"]))  # a row's steps
    t["splits"] = max(1, min(-(-waves * sms // row_tiles), tiles))
    resident = t.pop("resident")
    auto = t["stages"] is None  # (the default's: AUTO_STAGES, grown below)
    if auto:
        t["stages"] = AUTO_STAGES
    if view is not None:
        _fit_stages(op, t, config, batch)
        cap = _resident_cap(op, t, config, batch)
        if auto and cap < resident:  # fewer programs than asked: each takes the stages the
            # others' shared memory would have held (two programs of 2 stages at 16 rows of
            # x are one of 3 at 64), as far as its own, the cap and the pipeline's steps allow
            want = min(t["stages"] * resident // cap, _steps(tiles, t["splits"]))
            while t["stages"] < want:
                more = dict(t, stages=t["stages"] + 1)
                if (_smem_bytes(op, more, config, batch) > _SMEM_BYTES
                        or _resident_cap(op, more, config, batch) < cap):
                    break
                t["stages"] += 1
        resident = min(resident, cap)
    t["programs"] = resident * sms
    return t


def _fit_stages(op: str, t: dict, config: HNLQConfig, batch: int):
    """Drops ``t``'s stages past what a program's shared memory holds (x's planes grow with its
    rows; in place)."""
    while t["stages"] > 1 and _smem_bytes(op, t, config, batch) > _SMEM_BYTES:
        t["stages"] -= 1


def _resident_cap(op: str, t: dict, config: HNLQConfig, batch: int) -> int:
    """Programs of launch parameters ``t`` that a multiprocessor's shared memory holds at
    once: more would wait for a whole program to finish, then take their items alone."""
    return max(1, _SM_SMEM_BYTES // (_smem_bytes(op, t, config, batch) + _SMEM_RESERVED))


def _operands(codes: Codes, f16: bool = False) -> tuple:
    """The codes as the kernels read them, viewed, not copied (index words ``[n, words]``
    uint32, the T field's view ``[n, words]``), and the two lane-replicated tables (the
    overload table as float32, or with ``f16`` as float16 ``2^(alpha T - e_A)`` in both
    halves of a word: :func:`decode_matmul`'s)."""
    config = codes.config
    w, tf = _pallas.code_words(codes)
    # padded to every value an index byte holds (zeros: corrupt indices are masked), so that
    # no gather reads past the table
    table = _pallas.packed_codebook(config)[0]
    tab = _replicated(np.pad(table, (0, _TABLE_ROWS_MAX - table.shape[0])),
                      _CODEBOOK_ROW_WORDS)
    pow_tab = _pallas.overload_table(config)
    if f16:
        h = _pallas.f16_overload_table(config).view(np.uint16)
        pow_tab = h.astype(np.uint32) * np.uint32(0x10001)
    return w, tf, tab, _replicated(pow_tab)


def _launch(kernel, out_shape, programs: int, tables: tuple, scratch: list, interpret: bool):
    """``plgpu.kernel`` of ``programs`` persistent programs (axis ``"p"``) with the two
    ``tables`` and their barriers in shared memory before ``scratch``."""
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(programs,), grid_names=("p",),
        scratch_types=[plgpu.SMEM(t.shape, jnp.uint32) for t in tables]
        + [plgpu.Barrier(num_barriers=2)] + scratch,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _gemv_call(x, codes: Codes, out_dtype, interpret, bn, bw, steps, stages, programs):
    config = codes.config
    n, nb = codes.blocks_shape
    g = _pallas.word_view(config)[0]
    # block g w + p of x in part p at word w; the offsets plane only with a dither (it is zero
    # without one: neither copied nor held)
    xt = _pallas.gemv_activations(x, config, nb, parts=g)[:, :_gemv_planes(config)]
    bb = xt.shape[2]
    splits = nb // g // bw // steps
    kernel = functools.partial(_kernel, config=config, g=g, bn=bn, bw=bw, steps=steps,
                               stages=stages, interpret=interpret)
    w, tf, tab, pow_tab = _operands(codes)
    out = _launch(kernel, (splits, bb, n), programs, (tab, pow_tab), [], interpret)(
        w, tf, xt, tab, pow_tab)
    return _pallas.split_k_sum(out, x.shape[0], codes.scale, out_dtype)


def _gemv_planes(config: HNLQConfig) -> int:
    """x's planes a block in :func:`gemv`: the coordinates', and the offsets' with a dither."""
    return config.d + (config.dither is not None)


def _mma_planes(x, config: HNLQConfig, nb: int, bb: int, bw: int) -> tuple:
    """x's planes as the wgmma's B operand, float16 ``[2 U words, bb]`` (K permuted as
    :func:`_a_operand`'s; x's rows padded to ``bb``), each row of x scaled by its own power of
    two (:func:`~hnlq_jax.kernels.pallas.f16_rows`). Returns them and ``e + e_A`` for x's rows,
    the exponents that scale the product back
    (:func:`~hnlq_jax.kernels.pallas.f16_exponent`)."""
    g = _pallas.word_view(config)[0]
    B = x.shape[0]
    # [g, d + 1, bb, words]: beta C^T x, the dither's offsets
    xt = _pallas.gemv_activations(jnp.pad(x, ((0, bb - B), (0, 0))), config, nb, parts=g)
    d = config.d
    planes = []
    for kind, p, c in _pairs(config):
        if kind == "coords":
            planes += [xt[p, c], xt[p, c + 1]]
        else:  # the dither's planes: -offsets (zeros past the last block)
            planes += [-xt[p, d], jnp.zeros_like(xt[p, d]) if c is None else -xt[c, d]]
    X, e = _pallas.f16_rows(jnp.stack(planes))  # [2 U, bb, words]
    # [(u, e'), bb, (step, word)] -> [(step, K of the step's words), bb]
    xk = _k_major(X.reshape(len(planes) // 2, 2, -1, bw))  # [(bb, step), K]
    xk = xk.reshape(bb, -1, xk.shape[-1]).transpose(1, 2, 0).reshape(-1, bb)
    return xk, e[:B] + _pallas.f16_exponent(config)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8, 9))
def _mma_call(x, codes: Codes, out_dtype, interpret, bn, bw, steps, stages, programs,
              a_registers):
    config = codes.config
    n, nb = codes.blocks_shape
    g = _pallas.word_view(config)[0]
    cw = _chunk_words(config, bw, x.shape[0])
    xk, e = _mma_planes(x, config, nb, _mma_rows(x.shape[0]), bw)
    splits = nb // g // bw // steps
    kernel = functools.partial(_mma_kernel, config=config, g=g, bn=bn, bw=bw, cw=cw,
                               steps=steps, stages=stages, interpret=interpret)
    planes = _planes(config)
    scratch = [] if a_registers else [plgpu.SMEM((bw // cw, bn, planes * cw), jnp.float16)]
    w, tf, tab, pow_tab = _operands(codes, f16=True)
    out = _launch(kernel, (splits, n, xk.shape[1]), programs, (tab, pow_tab), scratch,
                  interpret)(w, tf, xk, tab, pow_tab)
    return _pallas.split_k_sum(out.transpose(0, 2, 1), x.shape[0], codes.scale, out_dtype, e)

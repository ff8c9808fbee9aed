"""Native CPU kernels: C++ registered with XLA as typed FFI custom calls (``jax.ffi``).

The sources are ``hnlq_jax/kernels/csrc`` (one kernel per file), compiled by the package's own
build (``setup.py``: a setuptools extension, the machine's C++ compiler, the XLA FFI headers
of jaxlib). They run inside ``jit`` and ``vmap`` like any XLA operation, with no Python on the
hot path, on XLA's intra-op thread pool. Where the extension was not built the library works
as before and :func:`available` says why (``python -m hnlq_jax info`` prints it).

=================  ===========================================  ================================
kernel             what it does                                 reference
=================  ===========================================  ================================
``decode_matmul``  ``x @ W_hat^T``: each task decodes a tile of  ``hq.matmul(...,
                   8 weight rows, straight into the sums for    implementation="xla"``
                   up to 4 rows of x, else 512 weights at a     (identical decoded weights;
                   time into an L1 buffer multiplied into       sums in another order)
                   every row of x (AVX-512 or AVX2 + FMA
                   where the CPU has them, chosen at run
                   time: :func:`isa`)
``decode``         the dense weight ``W_hat[n, k]`` float32,    ``hq.decode(...,
                   tiles of rows decoded straight into the      implementation="xla"``
                   output (for a large batch's product: one     (bit for bit)
                   decode, then a float GEMM)
``lut_matmul``     the lookup-table products' sums: per block    ``hq.lut.matmul`` /
                   and level one lookup in the tables U and an  ``matmul_one_sided(...,
                   add, per block a multiply by its step; a     implementation="xla"``
                   task 512 columns, 64 a register by byte      (sums in another order)
                   permutes of the tables' planes (VBMI), or
                   8 columns, 16 blocks a register by AVX-512
                   gathers
``rotate``         ``x R`` / ``x R^T`` of a rotation (signs,        ``Rotation.apply(...,
                   butterflies, mixer), rows of x a task        implementation="xla"``
                                                                (equal within float32
                                                                rounding; bit for bit when
                                                                n is a power of two)
=================  ===========================================  ================================

The first two decode with ``csrc/decode_rows.h``, the reference's operations in its order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax.codec import codebook_table
from hnlq_jax.codes import Codes, index_dtype, t_bits
from hnlq_jax.config import HNLQConfig, pow2_table

__all__ = ["GEMM_ROWS", "HostCodes", "ISAS", "available", "decode", "decode_host",
           "decode_matmul", "decode_matmul_host", "isa", "lut_matmul", "rotate", "rotate_host",
           "unsupported", "use_isa", "why_unavailable"]

_EXTENSION = "hnlq_jax.kernels._cpu"
try:  # by its full name: `from hnlq_jax.kernels import _cpu` here, while the package is still
    # initializing, reports a missing module as a likely circular import
    _cpu = importlib.import_module(_EXTENSION)
except ImportError as e:
    # Not built (no compiler at install time, a source checkout, a build for another
    # Python's file suffix), or built but not loading (a missing library, a broken build).
    _cpu, _WHY = None, (
        f"the extension {_EXTENSION} is not built (the XLA paths run instead): build it by "
        "installing the package, `pip install -e .`, with a C++17 compiler"
        if isinstance(e, ModuleNotFoundError) and e.name == _EXTENSION else
        f"the extension {_EXTENSION} does not load ({e}); rebuild it: `pip install -e .`")
else:
    _WHY = None
    for _name, _capsule in _cpu.handlers.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

_MAX_ROWS = 2**16  # codebook rows (the uint16 index range): the table must stay in cache


def available() -> bool:
    """Whether the native kernels are built and registered."""
    return _cpu is not None


def why_unavailable() -> str | None:
    """Why the native kernels are missing (``None`` when :func:`available`)."""
    return _WHY


# The instruction sets the kernels have code for, in order (csrc/decode_rows.h's Isa).
ISAS = ("portable", "avx2", "avx512", "avx512vbmi")


def isa() -> str:
    """The instruction set the product and decode kernels run with now: the best of
    :data:`ISAS` this CPU has (``"avx512vbmi"``: AVX-512 with VBMI's byte permutes;
    ``"avx512"``: AVX-512 F/BW/DQ/VL + FMA; ``"avx2"``: AVX2 + FMA; ``"portable"``: plain
    C++), at most :func:`use_isa`'s limit.

    Decoded weights are the same bits on every level; products sum 16 lanes with AVX-512 and
    8 with AVX2, and D4 q=4 M=2 products with VBMI sum by coordinate planes, so their float
    sums differ in rounding between levels.

    Raises:
      RuntimeError: the native kernels are not built.
    """
    return ISAS[_built().active_isa()]


@contextlib.contextmanager
def use_isa(name: str):
    """Runs the kernels called inside the context with at most the instruction set ``name``
    (one of :data:`ISAS`): to compare the levels on one machine (tests, benchmarks). The limit
    is process-wide; a call already running keeps its level.

    Raises:
      ValueError: an unknown ``name``.
      RuntimeError: the native kernels are not built.
    """
    if name not in ISAS:
        raise ValueError(f"use_isa: name must be one of {ISAS}, got {name!r}")
    module = _built()
    previous = module.set_isa_limit(ISAS.index(name))
    try:
        yield
    finally:
        module.set_isa_limit(previous)


def _built():
    if _cpu is None:
        raise RuntimeError(f"the native kernels are not available: {_WHY}")
    return _cpu


@functools.lru_cache(maxsize=None)
def unsupported(config: HNLQConfig) -> str | None:
    """Why the native kernels do not apply to ``config`` (``None`` when they do)."""
    if _cpu is None:
        return _WHY
    if config.lat.kind == "A2":
        return "A2's Cartesian coordinates are not a power-of-two multiple of its integer ones"
    if config.q**config.d > _MAX_ROWS:
        return f"q^d = {config.q ** config.d} codebook rows exceed {_MAX_ROWS}"
    if config.d > 8 or 512 % config.d:
        return f"d = {config.d}: the kernel takes d in 1, 2, 4, 8"
    table = codebook_table(config.lattice, config.q)
    if np.abs(table).max() > 127:
        return "the codebook's coordinates do not fit int8"
    return None


# The codebook argument's layouts (the kernel's Mode): r itself; the two-level table of
# a 16-bit key k0 + 256 k1; r with int8 Horner sums; r as 32-bit words of 4-bit coordinates
# (excess 7) with int32 sums.
_GENERIC, _PAIRS, _HORNER, _PACKED = 0, 1, 2, 3


def _mode(config: HNLQConfig, table) -> int:
    """The fastest layout for ``config`` whose sums cannot wrap."""
    q, M, top = config.q, config.M, int(np.abs(table).max())
    fits = top * sum(q**m for m in range(M)) <= 127  # |sum_m q^m r_m| in every partial sum
    if fits and config.d == 4 and M == 2 and q**4 == 256:
        return _PAIRS
    if config.d == 8 and not q & (q - 1):
        # A table too large for L2 as 8 bytes a row (E8 q = 4: 512 KiB) in half the bytes,
        # where every coordinate is a 4-bit excess-7 value.
        if len(table) >= 2**16 and table.min() >= -7 and table.max() <= 8:
            return _PACKED
        if fits:
            return _HORNER
    return _GENERIC


@functools.lru_cache(maxsize=None)
def _tables(config: HNLQConfig):
    """``(mode, codebook s8[rows, d], pow2 f32[256], dither f32[d])``, numpy.

    The codebook is padded to the index dtype's whole range so that any stored index reads in
    bounds (the kernel marks indices >= q^d failed); in the pair layout it is the table of
    ``r(k0) + q r(k1)`` over all 65,536 keys followed by ``r``, in the packed layout one 32-bit word a row
    (two an 8-byte row of the argument). ``pow2[u]`` is ``2^(alpha (u - 1))`` for a valid
    T field value u and NaN otherwise (u = 0: a failed block; u > max_T + 1: corrupted).
    """
    table = codebook_table(config.lattice, config.q)
    mode = _mode(config, table)
    rows = np.iinfo(index_dtype(config)).max + 1
    codebook = np.zeros((rows, config.d), np.int8)
    codebook[:len(table)] = table
    if mode == _PAIRS:  # key = k0 + 256 k1 (little-endian uint16 of the two index bytes)
        pairs = (table[:, None, :] * config.q + table[None, :, :]).reshape(-1, 4)
        codebook = np.concatenate([pairs, table]).astype(np.int8)  # then r: the planes
    if mode == _PACKED:  # word k = sum_i (r_i + 7) 16^i, two words an 8-byte row
        words = np.zeros(rows, np.uint32)
        words[:len(table)] = np.sum((table + 7).astype(np.uint32) << (4 * np.arange(8)), axis=1)
        codebook = words.view(np.int8).reshape(-1, 8)
    steps = pow2_table(config.alpha, config.max_T).astype(np.float32)  # as _numerics.pow2
    pow2 = np.full(256, np.nan, np.float32)
    pow2[1:config.max_T + 2] = steps
    return mode, codebook, pow2, np.asarray(config.dither_array, np.float32)


# Rows of x from which a product decodes the weight once and leaves the sums to XLA's float
# GEMM, which blocks them better than the fused kernel's 4 x 2 tiles: on the 2-core machine
# the two cross between 64 and 128 rows at 384 x 384 to 1024 x 1024, and at 512 rows the
# decode + GEMM takes 0.7-0.8x the fused kernel's time (experiments/bench_cpu_matmul.py
# times products on both sides of it).
GEMM_ROWS = 128


def _codes_args(codes: Codes, bf16_weights: bool):
    """The codes' operands and attributes of the kernels (``csrc/decode_rows.h``)."""
    config = codes.config
    n = codes.blocks_shape[0]
    mode, codebook, pow2, dither = _tables(config)
    scale = (jnp.zeros((0,), jnp.float32) if codes.scale is None
             else codes.scale.astype(jnp.float32))
    operands = (codes.index, codes.tfield.reshape(n, -1), scale, codebook, pow2, dither)
    attrs = dict(beta=np.float32(config.beta),
                 cart=np.float32(0.5 if config.lat.kind == "E8" else 1.0),
                 q=np.int64(config.q), qd=np.int64(config.q**config.d),
                 t4=bool(t_bits(config) == 4), bf16=bool(bf16_weights), mode=np.int64(mode))
    return operands, attrs


def decode(codes: Codes, bf16_weights: bool = False):
    """The dense weight ``W_hat[n, k]`` float32 of weight codes, the reference's bit for bit.

    The caller (:func:`hnlq_jax.decode`, :func:`hnlq_jax.matmul`) has validated the codes and
    checked :func:`unsupported`.

    Args:
      codes: codes with blocks ``[n, nb]``: row codes (``k = codes.n``, the row scale
        applied) or block codes (``k = nb d``).
      bf16_weights: round the weights to bfloat16 values (as the product with bfloat16
        activations reads them).

    Returns:
      ``[n, k]`` float32 (NaN in failed blocks).
    """
    n, nb = codes.blocks_shape
    k = nb * codes.config.d if codes.n is None else codes.n
    operands, attrs = _codes_args(codes, bf16_weights)
    call = jax.ffi.ffi_call("hnlq_decode", jax.ShapeDtypeStruct((n, k), jnp.float32),
                            vmap_method="sequential")
    return call(*operands, **attrs)


def decode_matmul(x, codes: Codes, bf16_weights: bool = False):
    """``y = x @ W_hat^T`` with the weight read as codes (no dense weight in memory).

    The caller (:func:`hnlq_jax.matmul`) has validated the arguments and checked
    :func:`unsupported`.

    Args:
      x: ``[B, k]`` float32 activations.
      codes: the weight as codes with blocks ``[n, nb]`` (row codes, whose scale is applied
        to the decoded weight as the reference does, or block codes with ``k = nb d``).
      bf16_weights: round the decoded weights to bfloat16 (the reference's bfloat16 product).

    Returns:
      ``[B, n]`` float32: the reference's decoded weights times x, summed in float32.
    """
    operands, attrs = _codes_args(codes, bf16_weights)
    call = jax.ffi.ffi_call("hnlq_decode_matmul",
                            jax.ShapeDtypeStruct((x.shape[0], codes.blocks_shape[0]),
                                                 jnp.float32),
                            vmap_method="sequential")
    return call(x, *operands, **attrs)


def lut_matmul(U, E, index, tfield, steps, q: int, bits: int):
    """The lookup-table product's sums ``y[m, n] = sum_k steps[u[n, k]] (sum_j q^j U[m, k,
    index[n, k, j]] - E[m, k])`` (NaN where an index is ``>= Q``), ``u`` the T field's values:
    :mod:`hnlq_jax.lut`'s one- and two-sided matrix products on a CPU.

    Args:
      U: ``[m, nb, Q]`` float32 per-block tables.
      E: ``[m, nb]`` float32 per-block offsets, or ``None``.
      index: ``[n, nb, M]`` uint8 or uint16 codebook indices.
      tfield: ``[n, tb]`` uint8: the codes' T field (``bits`` 4: two blocks a byte, low
        nibble first, ``tb = ceil(nb / 2)``; 8: a byte a block).
      steps: ``[256]`` float32 block scales by ``u`` (NaN where ``u`` is not valid).
      q: the codes' q (level ``j`` weighs ``q^j``).
      bits: the T field's bits a block, 4 or 8.

    Returns:
      ``[m, n]`` float32.
    """
    E = jnp.zeros((0,), jnp.float32) if E is None else E
    call = jax.ffi.ffi_call("hnlq_lut_matmul",
                            jax.ShapeDtypeStruct((U.shape[0], index.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(U, E, index, tfield, steps, q=np.int64(q), t_bits=np.int64(bits))


def rotate(x, signs, mixer, k: int, m: int, inverse: bool):
    """``x R`` (``inverse``: ``x R^T``) of the rotation ``R = diag(signs) (H_{2^k} / 2^(k/2)
    kron mixer)`` (:class:`hnlq_jax.incoherence.Rotation`, whose ``apply`` / ``inverse`` call
    it on a CPU).

    Args:
      x: ``[R, n]`` float32 with ``n = 2^k m``.
      signs: ``[n]`` float32.
      mixer: ``[m, m]`` float32.
      k, m: the sizes of ``n``'s split (:func:`hnlq_jax.incoherence.split_size`).
      inverse: apply ``R^T``.

    Returns:
      ``[R, n]`` float32.
    """
    call = jax.ffi.ffi_call("hnlq_rotate", jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")
    return call(x, signs, mixer, k=np.int64(k), m=np.int64(m), inverse=bool(inverse))


# -------------------------------------------------------------- direct calls on host buffers


@dataclasses.dataclass(frozen=True)
class HostCodes:
    """A weight's codes ``[n, k]`` in host memory, by address: for callers that hold them in
    buffers of their own (the torch bridge's layers) and call the kernels without XLA.

    The caller guarantees C-contiguous buffers of these shapes and dtypes that live through
    the call: ``index`` ``[n, nb, M]`` of :func:`hnlq_jax.codes.index_dtype`, ``tfield``
    ``[n, tb]`` uint8 (``tb`` = ``ceil(nb / 2)`` with a 4-bit T field, else ``nb``),
    ``scale`` ``[n]`` float32 or 0 for none. The kernels read any index and T values safely
    (invalid ones give NaN, as under ``jit``).
    """

    config: HNLQConfig
    n: int
    k: int
    index: int
    tfield: int
    scale: int = 0

    @functools.cached_property
    def _blocks(self) -> tuple[int, int]:
        """``(nb, tb)``: blocks a row, bytes of T field a row."""
        nb = -(-self.k // self.config.d)
        return nb, (nb + 1) // 2 if t_bits(self.config) == 4 else nb

    @functools.cached_property
    def _fixed(self) -> tuple:
        """The codes' arguments of a direct call (``csrc/module.cc``) before bf16, and after."""
        config = self.config
        (nb, tb), (mode, codebook, pow2, dither) = self._blocks, _tables(config)
        return ((self.index, index_dtype(config) == np.uint16, self.n, nb, config.M,
                 self.tfield, tb, self.scale, codebook.ctypes.data, config.d, pow2.ctypes.data,
                 dither.ctypes.data, config.beta, 0.5 if config.lat.kind == "E8" else 1.0,
                 config.q, config.q**config.d, t_bits(config) == 4), (mode, self.k))

    def rows(self, start: int, stop: int) -> "HostCodes":
        """The codes of weight rows ``[start, stop)`` (the same buffers, offset)."""
        nb, tb = self._blocks
        step = nb * self.config.M * np.dtype(index_dtype(self.config)).itemsize
        return dataclasses.replace(self, n=stop - start, index=self.index + start * step,
                                   tfield=self.tfield + start * tb,
                                   scale=self.scale + 4 * start if self.scale else 0)

    def args(self, bf16: bool, threads: int) -> tuple:
        """The codes' part of a direct call's arguments."""
        before, after = self._fixed
        return before + (bf16,) + after + (threads,)


def decode_host(w: int, codes: HostCodes, bf16_weights: bool = False, threads: int = 1):
    """:func:`decode` into the host buffer ``w`` (float32 ``[n, k]``, by address), with no
    XLA dispatch, on up to ``threads`` threads (one more per 65,536 weights). The caller
    has checked :func:`unsupported`."""
    _cpu.decode(w, *codes.args(bf16_weights, threads))


def decode_matmul_host(y: int, x: int, rows: int, codes: HostCodes, bf16_weights: bool = False,
                       threads: int = 1):
    """:func:`decode_matmul` of the host buffers ``x`` (float32 ``[rows, k]``) into ``y``
    (float32 ``[rows, n]``), by address, with no XLA dispatch: the same sums as under XLA
    bit for bit. The caller has checked :func:`unsupported`."""
    _cpu.decode_matmul(y, x, rows, *codes.args(bf16_weights, threads))


def rotate_host(y: int, x: int, rows: int, signs: np.ndarray, mixer: np.ndarray, k: int,
                inverse: bool, threads: int = 1):
    """:func:`rotate` of the host buffer ``x`` (float32 ``[rows, n]``) into ``y`` (the same
    shape; it may be ``x``), by address, with no XLA dispatch: bit for bit :func:`rotate`.

    Args:
      signs: ``[n]`` float32, C-contiguous.
      mixer: ``[m, m]`` float32, C-contiguous.
    """
    if signs.dtype != np.float32 or mixer.dtype != np.float32 or not (
            signs.flags.c_contiguous and mixer.flags.c_contiguous):
        raise TypeError("rotate_host: signs and mixer must be C-contiguous float32 arrays")
    m = mixer.shape[0]
    _cpu.rotate(y, x, rows, signs.shape[0], signs.ctypes.data, mixer.ctypes.data, k, m,
                inverse, threads)

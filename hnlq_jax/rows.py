"""Per-row scaled quantization of matrices: the weight format of QDense, QLinear and PTQ.

Row ``r`` of ``w[..., n]`` is divided by ``c_r = beta * rms(w_r)`` and encoded in d-blocks along
its length with the codec at unit beta, so ``w_hat_r = c_r * decode(codes_r)``. The result is row
:class:`~hnlq_jax.Codes` (``scale = c``, ``n`` the row length) that :func:`hnlq_jax.decode` and
:func:`hnlq_jax.matmul` take directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import ops
from hnlq_jax._numerics import divide, flush_subnormals, mean_square, sqrt
from hnlq_jax.codec import check_beta_fits, check_x, to_blocks
from hnlq_jax.codes import Codes, concrete_all, is_concrete, pack_t
from hnlq_jax.config import HNLQConfig, check_config
from hnlq_jax.stats import search_beta

__all__ = ["CALIBRATION_BLOCKS", "bucket_rows", "calibrate_rows", "check_row_failures",
           "divide_rows", "encode_rows", "row_rms", "row_scale", "rows_codes", "unit",
           "zero_rows_scale"]

# Blocks the per-layer beta search looks at: a fixed-size sample compiles once for every layer.
CALIBRATION_BLOCKS = 4096


def unit(config: HNLQConfig) -> HNLQConfig:
    """The codec config of row codes: beta lives in the row scales."""
    return config.replace(beta=1.0)


def bucket_rows(rows: int, k: int, config: HNLQConfig) -> int:
    """Rows to pad ``rows`` rows of length ``k`` to, so their blocks fill an ``ops.bucket``.

    Eager row quantization of activations pads to it: a stream of batch sizes then compiles
    the encoder O(log n) times.
    """
    nb = -(-k // config.d)
    return -(-ops.bucket(rows * nb) // nb) if nb else rows


@jax.jit  # one program for an eager call (calibration), not one per operation
def row_rms(w):
    """RMS of each row of ``w[..., k]`` (1 for an all-zero row, whose codes then store the
    scale 0: :func:`zero_rows_scale`), over its finite entries: a NaN or Inf entry's block
    fails when coded (T = -1, a NaN block), and the row's other blocks code at their own scale
    (as 1, they decoded to zeros with T = 0).

    Computed as ``m sqrt(mean((w/m)^2))`` with ``m = max |w_row|``, so an entry near the float
    range (1e20 squares to inf in float32) gives a finite scale instead of a NaN row; the
    division is :func:`divide_rows`, safe up to the largest float. The mean is
    :func:`~hnlq_jax._numerics.mean_square` (entries rounded to 12 significant bits, a fixed
    summation order): the same bits in every program, eager or jitted, fused with a transpose
    or not, so the codes are too.
    """
    w = jnp.where(jnp.isfinite(w), w, 0)
    # subnormal entries count as zero (divide_rows flushes them), so a subnormal largest one
    # does too
    m = flush_subnormals(jnp.max(jnp.abs(w), axis=-1, initial=0.0))
    m = jnp.where(m > 0, m, 1.0)
    # a subnormal RMS is 0 (XLA:CPU flushes it, a GPU would not): such rows code as zero rows
    rms = flush_subnormals(m * sqrt(mean_square(divide_rows(w, m))))
    return jnp.where(rms > 0, rms, 1.0)


def row_scale(beta, rms):
    """The row scales ``c = beta * rms`` (broadcast), at least the smallest normal float.

    A subnormal scale (a small beta times a row RMS near 1e-38 in float32) would be zero to
    the division (:func:`~hnlq_jax._numerics.divide` counts subnormals as zero on every
    backend, as XLA:CPU flushes them), and every block of its row would fail. A larger scale
    only codes the row more coarsely: its blocks overload no more.
    """
    c = beta * rms
    return jnp.maximum(c, jnp.finfo(c.dtype).tiny)


def zero_rows_scale(w, c):
    """The row scales ``c [...]`` codes of ``w[..., k]`` store: 0 for an all-zero row, which
    then decodes to exactly 0 (its blocks decode to ``beta (Q(z) - z)``, not 0, with a dither
    ``z``)."""
    return jnp.where(jnp.any(w != 0, axis=-1), c, jnp.zeros_like(c))


@jax.jit  # one program for an eager call (calibration), not one per operation
def divide_rows(w, c):
    """``w[..., k] / c[...]`` row by row, correctly rounded on every backend
    (:func:`~hnlq_jax._numerics.divide`), with both scaled by a power of two first (exact):
    XLA:CPU divides by multiplying with ``1 / c``, which flushes to zero for ``c`` above about
    8.5e37 in float32. Subnormal entries of ``w`` are zero (:func:`flush_subnormals`: the
    division counts them so, and ``jnp.ldexp`` of one depends on the program around it)."""
    e = jnp.frexp(c)[1][..., None]
    return divide(jnp.ldexp(flush_subnormals(w), -e), jnp.ldexp(c[..., None], -e).astype(w.dtype))


def check_finite_weight(w, fn: str, what: str = "the weight"):
    """Raises a ``ValueError`` with the count and first position of NaN/Inf entries of a
    concrete ``w`` (a traced one is not checked: its bad blocks are marked at run time)."""
    if concrete_all(w, jnp.isfinite):
        return
    bad = ~np.isfinite(np.asarray(w))
    first = [int(i) for i in np.argwhere(bad)[0]]
    raise ValueError(f"{fn}: {what} has {int(np.sum(bad))} NaN or Inf entries (the first at "
                     f"{first}); expected finite values")


def calibrate_rows(w, config: HNLQConfig):
    """The per-layer beta of the row format: the paper's grid search on row-normalized blocks.

    The one calibration routine of the quantized layers (Flax ``QDense`` / ``QuantDotGeneral``,
    PyTorch ``QLinear`` / ``quantize_model``): the same weights give the same beta everywhere.
    It searches :data:`CALIBRATION_BLOCKS` blocks of ``w / rms(row)`` taken at evenly spaced
    positions (every block when fewer, repeated to the fixed size); traced, a block with a
    NaN or Inf entry is sampled as a zero block (it fails when coded).

    Args:
      w: ``[..., k]`` weight rows (traceable).
      config: the quantizer (its beta is ignored).

    Returns:
      ``[]`` float32 beta, relative to each row's RMS.

    Raises:
      ValueError: an empty ``w`` (nothing to calibrate on), or a concrete ``w`` with NaN or
        Inf (the message names the first bad block).
    """
    if jnp.size(w) == 0:
        raise ValueError(f"calibrate_rows: the weight is empty (shape {tuple(jnp.shape(w))}); "
                         "a layer needs at least one input and one output feature")
    # The raw weight's NaN/Inf: after row normalization one bad entry would spoil its whole
    # row, and the search repeats blocks to its fixed sample size.
    check_finite_weight(w, "calibrate_rows")
    w = w.astype(jnp.promote_types(w.dtype, jnp.float32))
    blocks = to_blocks(divide_rows(w, row_rms(w)), config.d).reshape(-1, config.d)
    # Traced, a NaN/Inf block (it fails when coded) joins the sample as a zero block: as
    # itself it counted as overloading at every beta, and one doubled a layer's beta
    blocks = jnp.where(jnp.all(jnp.isfinite(blocks), axis=-1, keepdims=True), blocks, 0)
    idx = (jnp.arange(CALIBRATION_BLOCKS) * blocks.shape[0]) // CALIBRATION_BLOCKS
    # The search itself is compiled for the fixed sample shape: once per config, not per layer.
    # scale=1: the rows are normalized already, and beta is relative to each row's RMS.
    return search_beta(blocks[idx], config, scale=1.0).astype(jnp.float32)


def rows_codes(w, config: HNLQConfig, beta, implementation: str = "xla") -> Codes:
    """Row codes of ``w[..., k]`` with per-row scales ``c = beta * rms`` (``beta`` may be traced).

    Traced (under ``jit``), one program. Eager, three: the row scales and blocks, the encoder
    on the blocks padded to their :func:`hnlq_jax.ops.bucket` (compiled once per bucket: the
    encoder's compile takes seconds, so a model's layer shapes share it), and the codes'
    assembly; the first and last compile in a fraction of a second per new shape.

    Returns:
      Row :class:`Codes` with blocks ``[..., ceil(k/d)]``, ``scale = c`` (float32 or wider) and
      config ``unit(config)``.

    Raises:
      ValueError: ``beta`` is not a scalar.
    """
    if jnp.ndim(beta) != 0:  # an array would broadcast against the rows, or fail in XLA
        raise ValueError(f"rows_codes: beta must be a scalar (one beta per layer), got shape "
                         f"{jnp.shape(beta)}")
    if not (is_concrete(w) and is_concrete(beta)):
        return _rows_codes(w, config, beta, implementation)
    blocks, c = _scaled_blocks_jit(w, config, beta)
    index, T = ops.encode_padded(blocks, unit(config), implementation,
                                 ops.resolve_interpret(implementation, None, w))
    return _assemble_jit(index, T, c, config, w.shape[-1])


def _scaled_blocks(w, config: HNLQConfig, beta):
    """``(blocks [..., ceil(k/d), d], c [...])``: the rows of ``w`` over ``c = beta * rms``,
    and the scales to store (:func:`zero_rows_scale`)."""
    w = w.astype(jnp.promote_types(w.dtype, jnp.float32))  # half precision: code in float32
    c = row_scale(beta, row_rms(w))
    return to_blocks(divide_rows(w, c), config.d), zero_rows_scale(w, c)


def _assemble(index, T, c, config: HNLQConfig, n: int) -> Codes:
    """Row codes from the first ``prod(c.shape) * ceil(n/d)`` blocks' ``index [.., M]`` and
    ``T [..]`` (a bucket's, or exactly those)."""
    ucfg = unit(config)
    lead = c.shape + (-(-n // config.d),)
    N = int(np.prod(lead, dtype=np.int64))
    # A scale beyond the float range (beta times a row RMS near the largest float) cannot
    # decode its row: its blocks fail (T = -1), as blocks beyond the overload reach do.
    T = jnp.where(jnp.isfinite(c)[..., None], T[:N].reshape(lead), -1)
    codes = Codes(index[:N].reshape(lead + (config.M,)), pack_t(T, ucfg), ucfg)
    return codes.with_rows(scale=c, n=n)


_scaled_blocks_jit = jax.jit(_scaled_blocks, static_argnums=1)
_assemble_jit = jax.jit(_assemble, static_argnums=(3, 4))


@functools.partial(jax.jit, static_argnums=(1, 3))
def _rows_codes(w, config: HNLQConfig, beta, implementation: str) -> Codes:
    """:func:`rows_codes` as one program (inlined under an outer trace)."""
    blocks, c = _scaled_blocks(w, config, beta)
    index, T = ops.encode_flat(blocks.reshape(-1, config.d), unit(config), implementation, None)
    return _assemble(index, T, c, config, w.shape[-1])


def _all_fit(codes: Codes):
    return codes.T >= 0


def check_row_failures(codes: Codes, failures: str, fn: str):
    """Applies ``failures`` to concrete row codes: ``"raise"`` a ``ValueError`` naming the
    blocks that still overload at ``max_T`` (``T = -1``), ``"mark"`` nothing to do."""
    if failures not in ops.FAILURES:
        raise ValueError(f"{fn}: failures must be one of {ops.FAILURES}, got {failures!r}")
    # One compiled reduction in the common case (every block fits): the T array is only
    # brought to the host to name the failed blocks.
    if failures == "mark" or concrete_all(codes, _all_fit):
        return
    failed = np.asarray(codes.T) < 0
    if failed.any():
        first = [int(i) for i in np.argwhere(failed)[0]]
        raise ValueError(
            f"{fn}: {int(failed.sum())} block(s) still overload at max_T = "
            f"{codes.config.max_T} (the first at block {first}): an entry far above its row's "
            "RMS for beta (relative to the row RMS), or a row scale beta * RMS beyond the float "
            "range. Raise config.beta (see "
            "hnlq_jax.rows.calibrate_rows) or max_T, clip the outliers, or pass "
            "failures='mark' to mark such blocks T = -1 (they decode to NaN)")


def encode_rows(w, config: HNLQConfig, *, implementation=None, failures: str = "raise") -> Codes:
    """Quantizes the rows of ``w[..., k]`` with a per-row scale ``c = config.beta * rms(row)``.

    This is the weight format of the quantized layers: ``beta`` is relative to each row's RMS
    (:func:`hnlq_jax.gaussian_beta` is a good default); a scale below the smallest normal float
    is raised to it (:func:`row_scale`).

    Args:
      w: ``[..., k]`` floating array (e.g. a weight ``[out, in]``).
      config: the quantizer; ``config.beta`` multiplies each row's RMS.
      implementation: ``None``, ``"xla"`` or ``"pallas"`` (the encoder).
      failures: as for :func:`hnlq_jax.encode`: an eager call raises on blocks that still
        overload at ``max_T`` (``"raise"``, default) or marks them ``T = -1`` (``"mark"``).

    Returns:
      Row :class:`~hnlq_jax.Codes`: ``decode(codes)`` is ``[..., k]``, ``matmul(x, codes)`` is
      ``x @ w_hat^T`` for a 2-D ``w``.

    Raises:
      ValueError, TypeError: as :func:`hnlq_jax.encode` (non-finite or non-floating ``w``, an
        entry too far above its row's RMS for ``beta 2^(alpha max_T)``).
    """
    check_config(config, "encode_rows")  # before w: swapped arguments get this error
    given = getattr(w, "dtype", None)
    w = jnp.asarray(w)
    if w.ndim == 0:
        raise ValueError("encode_rows: expected an array with a row axis [..., k]")
    blocks = check_x(to_blocks(w, config.d), config, "encode_rows", given)
    check_beta_fits(config.beta, blocks.dtype, "encode_rows")
    impl = ops.resolve(implementation, config, "encode", w)
    codes = rows_codes(w, config, config.beta, impl)
    check_row_failures(codes, failures, "encode_rows")
    return codes

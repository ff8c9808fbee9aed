"""Rate statistics of codes and the paper's beta grid search (``docs/math.md``, "Choosing beta")."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax._numerics import flush_subnormals, mean_square, sqrt, sum_of_squares
from hnlq_jax.codec import check_x, decode_blocks, encode_blocks
from hnlq_jax.codes import Codes, check_codes, is_concrete
from hnlq_jax.config import HNLQConfig, check_config, is_integer

__all__ = ["RateStats", "rate_stats", "calibrate_beta", "gaussian_beta", "search_beta", "BetaSearch"]


class RateStats(NamedTuple):
    """Statistics of the overload steps T of a batch of codes.

    Attributes:
      overload_rate: fraction of blocks with ``T > 0`` (rescaled at least once).
      failure_rate: fraction of blocks with ``T = -1`` (not encodable).
      histogram: ``[max_T + 1]`` counts of T = 0..max_T.
      entropy_T: ``H(T)`` in bits per block (``T = -1`` counts as a symbol).
      rate: effective rate ``M log2 q + H(T)/d`` in bits per dimension.
    """

    overload_rate: jax.Array
    failure_rate: jax.Array
    histogram: jax.Array
    entropy_T: jax.Array
    rate: jax.Array

    def __repr__(self) -> str:
        if not all(is_concrete(v) for v in self):  # traced: the fields' own reprs
            return f"RateStats({', '.join(f'{k}={v!r}' for k, v in zip(self._fields, self))})"
        return (f"RateStats(overload_rate={float(self.overload_rate):.4g}, failure_rate="
                f"{float(self.failure_rate):.4g}, histogram={np.asarray(self.histogram).tolist()}, "
                f"entropy_T={float(self.entropy_T):.4g}, rate={float(self.rate):.4g})")


def t_counts(T, config: HNLQConfig):
    """``[max_T + 2]`` counts of the overload steps ``T`` (any shape; index 0 counts T = -1)."""
    return jnp.bincount(T.reshape(-1).astype(jnp.int32) + 1, length=config.max_T + 2)


def entropy_bits(counts):
    """Entropy in bits of the empirical distribution ``counts[..., S]`` (over the last axis;
    traceable)."""
    p = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1)
    # -p log p term by term: a negated sum would print an empty distribution's 0 as -0.
    return jnp.sum(jnp.where(p > 0, -p * jnp.log2(jnp.where(p > 0, p, 1)), 0), axis=-1)


def _rate_stats(T, config: HNLQConfig) -> RateStats:
    n = max(T.size, 1)
    counts = t_counts(T, config)
    H = entropy_bits(counts)
    return RateStats(
        overload_rate=jnp.sum(counts[2:]) / n,
        failure_rate=counts[0] / n,
        histogram=counts[1:],
        entropy_T=H,
        rate=config.rate + H / config.d,
    )


def rate_stats(codes: Codes) -> RateStats:
    """Overload rate, histogram and entropy of T, and the effective rate.

    Args:
      codes: :class:`~hnlq_jax.Codes` of any leading shape.

    Returns:
      :class:`RateStats` (scalars and a ``[max_T + 1]`` histogram).
    """
    check_codes(codes, "rate_stats")
    return jax.jit(_rate_stats, static_argnums=1)(codes.T, codes.config)


class BetaSearch(NamedTuple):
    """The table :func:`calibrate_beta` searched, one entry per beta on the grid (numpy).

    Attributes:
      beta, mse, entropy_T, rate, f, overload_rate: ``[num]`` float64 arrays; ``mse`` is per
        dimension, ``f = mse * 2^(2 rate)`` (linear; ``10 log10 f`` is the distance in dB above
        the Gaussian bound), ``rate`` includes ``H(T)/d``. A beta at which some block could not
        be encoded has ``mse = f = inf``.
      best: index of the chosen beta.
    """

    beta: np.ndarray
    mse: np.ndarray
    entropy_T: np.ndarray
    rate: np.ndarray
    f: np.ndarray
    overload_rate: np.ndarray
    best: int


def _top_exponent(x):
    """``e`` with the largest ``|x|`` in ``[2^(e-1), 2^e)`` (1 for all-zero ``x``): dividing by
    ``2^e`` is exact and brings the data near 1."""
    top = jnp.max(jnp.abs(x))
    return jnp.frexp(jnp.where(top > 0, top, 1))[1]


def _searched(config: HNLQConfig) -> HNLQConfig:
    """The config a search compiles for: its beta, which the search replaces, at 1 (one
    program, and one cached :func:`gaussian_beta`, for every beta)."""
    return config.replace(beta=1.0)


@functools.partial(jax.jit, static_argnums=1)
def _beta_grid(x, config, betas):
    """Per beta: ``(mse, counts)``, the MSE in units of ``4^e`` (``e``, returned second; NaN
    where a block failed) and the ``[max_T + 2]`` counts of T (:func:`t_counts`). ``x`` and
    the betas are first scaled by the power of two ``2^-e`` that brings the largest entry of
    ``x`` into [0.5, 1): ``x / beta`` is unchanged bit for bit (up to entries 2^126 times
    smaller than the largest, which may flush to zero), and the squared errors of tiny or huge
    data neither underflow nor overflow float32. The codes are the same on every backend
    (``docs/math.md``, tie rule), and so are the errors' sums (:func:`sum_of_squares`, where
    ``jnp.mean`` sums in the backend's order: float32 sums of 10^4 squares differ in about
    the sixth digit, while neighbouring betas' criteria can lie 3·10^-5 apart)."""
    e = _top_exponent(x)
    x, betas = jnp.ldexp(x, -e), jnp.ldexp(betas, -e)

    def one(beta):
        index, T = encode_blocks(x, config, beta)
        # IEEE's differences: the invalid blocks' select stands between decode's last product
        # and the subtraction, so no compiler fuses them into a multiply-add
        err = (x - decode_blocks(index, T + 1, config, None, x.dtype, beta)).reshape(-1)
        return (sum_of_squares(err) * np.asarray(1 / err.size, x.dtype),
                t_counts(T, config))

    return jax.lax.map(one, betas, batch_size=8), e


def _entropy(counts) -> float:
    """``H`` in bits of the distribution ``counts`` (integers), in float64 on the host: the
    same on every machine (``math.log2``, ``math.fsum``)."""
    n = int(sum(counts))
    return math.fsum(c / n * math.log2(n / c) for c in map(int, counts) if c > 0)


def calibrate_beta(x, config: HNLQConfig, criterion: str = "f", num: int = 40,
                   step: float = 0.05, scale="rms") -> tuple[float, BetaSearch]:
    """The paper's grid search for beta: ``s * beta_min * (1 + step k)``, ``k < num``.

    The search and its criterion are described in ``docs/math.md`` ("Choosing beta"). The
    paper's grid (``s = 1``) is meant for unit-variance data; by default it is scaled by the
    sample's RMS ``s``, so that data of any magnitude gets the beta its normalized form would
    (times ``s``) instead of a grid that is orders of magnitude off.

    Every grid point encodes and decodes all of ``x``; the grid is mapped on device.

    Args:
      x: ``[..., d]`` sample of the data to quantize (e.g. 4000 iid N(0,1) d-vectors).
      config: the quantizer (its ``beta`` is ignored).
      criterion: ``"f"`` minimizes ``MSE 2^(2R)`` with R including ``H(T)/d`` (the paper's
        figure of merit); ``"mse"`` minimizes the MSE alone.
      num: number of grid points.
      step: relative grid step.
      scale: the grid's unit ``s``: ``"rms"`` (the RMS of ``x`` over all its entries) or a
        positive number (``1.0``: the paper's grid, to reproduce its numbers).

    Returns:
      ``(beta, table)``: the chosen beta (a Python float, ready for
      ``config.replace(beta=...)``) and the :class:`BetaSearch` table.

    Raises:
      ValueError: unknown criterion, bad grid or scale, all-zero ``x`` with ``scale="rms"``,
        no beta on the grid that encodes every block, or invalid ``x`` (see
        :func:`hnlq_jax.encode`).
    """
    x, grid, scale = _grid_args(x, config, criterion, num, step, scale, "calibrate_beta")
    remedy = ("the sample has blocks far beyond its RMS" if scale == "rms" else
              "the data may be far from the given scale: try scale='rms'")
    if isinstance(scale, str):
        scale = float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))
        if scale == 0:
            raise ValueError("calibrate_beta: x is all zero, so its RMS gives the grid no "
                             "scale; pass scale=1.0 (zeros are coded exactly at any beta)")
    betas = scale * grid
    (mse, counts), e = _beta_grid(x, _searched(config), jnp.asarray(betas, x.dtype))
    counts = np.asarray(counts, np.int64)
    # The criterion on the host in float64 from the MSE and the exact counts, alike on every
    # backend; the MSE back in the data's units (exact: a power of two).
    mse = np.where(counts[:, 0] > 0, np.inf, np.ldexp(np.asarray(mse, np.float64), 2 * int(e)))
    entropy = np.array([_entropy(c) for c in counts])
    rate = config.rate + entropy / config.d
    f = np.array([m * 2.0 ** (2 * r) for m, r in zip(mse.tolist(), rate.tolist())])
    overload = counts[:, 2:].sum(axis=1) / counts.sum(axis=1)
    key = f if criterion == "f" else mse
    best = int(np.argmin(key))
    if not np.isfinite(key[best]):
        raise ValueError(
            f"calibrate_beta: no beta on the grid [{betas[0]:.4g}, {betas[-1]:.4g}] encodes "
            f"every block ({remedy}): raise max_T (now "
            f"{config.max_T}), or extend the grid with a larger num or step")
    table = BetaSearch(betas, mse, entropy, rate, f, overload, best=best)
    return float(betas[best]), table


def _grid_args(x, config, criterion, num, step, scale, fn: str):
    """Validates the grid search's arguments; returns the blocks ``[N, d]``, the grid for
    unit scale and the scale (``"rms"`` or a float)."""
    if criterion not in ("f", "mse"):
        raise ValueError(f"{fn}: criterion must be 'f' or 'mse', got {criterion!r}")
    if not (is_integer(num) and num >= 1 and math.isfinite(step) and step > 0):
        raise ValueError(f"{fn}: need num >= 1 and step > 0, got {num}, {step}")
    if not (isinstance(scale, str) and scale == "rms"):
        try:  # a Python, NumPy or concrete JAX real scalar
            value = (math.nan if isinstance(scale, (bool, np.bool_, str)) or np.ndim(scale)
                     else float(scale))
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{fn}: scale must be 'rms' or a positive finite number, got "
                             f"{scale!r}")
        scale = value
    # subnormals are zero (the codes count them so; jnp.ldexp of one depends on the program)
    x = flush_subnormals(check_x(x, config, fn).reshape(-1, config.d))
    if x.shape[0] == 0:
        raise ValueError(f"{fn}: x holds no block")
    b0 = config.beta_min()
    return x, np.array([b0 * (1 + step * k) for k in range(num)]), scale


def search_beta(x, config: HNLQConfig, criterion: str = "f", num: int = 40, step: float = 0.05,
                scale="rms"):
    """:func:`calibrate_beta` as a traceable function: the chosen beta as a 0-d array.

    Usable under ``jit`` and inside ``flax`` initializers, where ``x`` is traced. Where no
    beta on the grid encodes every block, the last one is returned (the largest); all-zero
    ``x`` with ``scale="rms"`` searches the unit grid.

    Args:
      x, config, criterion, num, step, scale: as :func:`calibrate_beta`.

    Returns:
      ``[]`` array in x's dtype (at least float32).
    """
    x, grid, scale = _grid_args(x, config, criterion, num, step, scale, "search_beta")
    if isinstance(scale, str):
        # Relative to the power of two of the largest entry (exact: the RMS of ordinary data is
        # unchanged bit for bit), else squares of tiny or huge data under- or overflow float32;
        # mean_square: the same beta eager and under jit; sqrt: on a CPU and a GPU.
        e = _top_exponent(x)
        rms = jnp.ldexp(sqrt(mean_square(jnp.ldexp(x, -e).reshape(-1))), e)
        scale = jnp.where(rms > 0, rms, 1)
    betas = scale * jnp.asarray(grid, x.dtype)
    (mse, counts), _ = _beta_grid(x, _searched(config), betas)
    # The device's log2 and exp2 in f (a GPU's are approximate): unlike calibrate_beta's, a
    # choice between betas whose criteria agree to about 10^-7 may differ between backends.
    key = jnp.where(counts[:, 0] > 0, jnp.inf, mse)
    if criterion == "f":
        key = key * 2 ** (2 * (config.rate + entropy_bits(counts) / config.d))
    return jnp.where(jnp.isfinite(jnp.min(key)), betas[jnp.argmin(key)], betas[-1])


def gaussian_beta(config: HNLQConfig) -> float:
    """beta of the paper's grid search on 4000 iid N(0,1) d-vectors (``default_rng(0)``).

    The default beta for data normalized to unit RMS (activations per token, gradient chunks).

    Raises:
      TypeError: ``config`` is not an :class:`~hnlq_jax.HNLQConfig` (e.g. a lattice name).
      ValueError: no beta of the grid encodes every sample within ``config.max_T``.
    """
    config = check_config(config, "gaussian_beta")
    try:
        return _gaussian_beta(_searched(config))
    except ValueError as e:  # calibrate_beta's advice (its scale and grid) is not ours to give
        raise ValueError(f"gaussian_beta: no beta of the paper's grid encodes all 4000 Gaussian "
                         f"samples with {config.lattice} q={config.q} M={config.M} within max_T "
                         f"= {config.max_T}; raise max_T (the default is 14)") from e


@functools.lru_cache(maxsize=None)  # after the check: the cache needs a hashable config
def _gaussian_beta(config: HNLQConfig) -> float:
    x = np.random.default_rng(0).standard_normal((4000, config.d)).astype(np.float32)
    with jax.ensure_compile_time_eval():  # a constant, also when first asked for under jit
        return calibrate_beta(x, config, scale=1.0)[0]


# The cache stays reachable from the public name (e.g. to empty it in a test).
gaussian_beta.cache_clear = _gaussian_beta.cache_clear

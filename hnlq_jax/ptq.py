"""Post-training quantization: Hessian-aware compensated lattice rounding (GPTQ / LDLQ).

Given a weight ``w[out, in]`` and the Hessian ``H = X^T X`` of the layer's inputs (summed over
tokens), :func:`gptq_rows` quantizes ``w`` d-block-column by d-block-column, in exactly the blocks
of the row format (:mod:`hnlq_jax.rows`), and feeds each block column's rounding error forward to
the columns not yet quantized, through the upper Cholesky factor of the damped inverse Hessian.
The result is ordinary row :class:`~hnlq_jax.Codes` (``scale = c``, ``n = in``): decode them with
:func:`hnlq_jax.decode`, multiply with :func:`hnlq_jax.matmul`, save them like any codes.

The math, the choices (damping, dead columns, activation order, the beta search, clipping of
blocks that would not encode) and the costs are in ``docs/ptq.md``. The pieces:

* :func:`hessian`, :func:`hessian_update`: ``H = sum x^T x`` of a layer's inputs, in one go or
  streamed batch by batch;
* :func:`gptq_rows`: the compensated quantizer (optionally after an incoherence rotation,
  :class:`hnlq_jax.incoherence.Rotation`), returning a :class:`PTQResult`;
* :func:`proxy_loss`: ``tr((w_hat - w) H (w_hat - w)^T)``, the quantity it minimizes.

Computation is float32, or float64 when JAX's x64 mode is on; the loop is one compiled program
per (shape, config, options), vectorized over rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

from hnlq_jax import ops
from hnlq_jax.codec import decode_blocks, default_float, from_blocks
from hnlq_jax.codes import Codes, index_dtype, pack_t
from hnlq_jax.config import HNLQConfig, check_beta, check_config, is_integer, pow2_table
from hnlq_jax.incoherence import Rotation
from hnlq_jax.rows import (calibrate_rows, check_finite_weight, divide_rows, row_rms,
                           row_scale, unit, zero_rows_scale)
from hnlq_jax.stats import entropy_bits, t_counts

__all__ = ["CALIBRATION_OPTIONS", "DAMP", "DEFAULT_GRID", "GROUP_COLUMNS", "PTQResult",
           "RECOMMENDED", "check_calibration_options", "gptq_rows", "hessian", "hessian_update",
           "layer_context", "layer_name", "proxy_loss", "recommended", "vocabulary_sentences"]

# Damping, relative to the mean of diag(H) (GPTQ's default).
DAMP = 0.01
# The beta search: multiples of calibrate_rows' beta tried on the compensated problem.
DEFAULT_GRID = (0.8, 0.9, 1.0, 1.1, 1.2)
# Columns per lazy-update group: within a group the error is fed forward inside a panel of this
# width; the rest of the matrix gets one matrix product per group.
GROUP_COLUMNS = 128
# A block that does not encode even at max_T is shrunk by this factor until it does.
_SHRINK = 2.0**-0.25
_MAX_SHRINK = 64
_HI = jax.lax.Precision.HIGHEST


def _dtype():
    return jnp.dtype(default_float())


# The options of the model-level front doors (torch_bridge.quantize_model,
# hnlq_jax.flax.quantize_params) that only compensated rounding uses, at their defaults (None:
# the RECOMMENDED value).
CALIBRATION_OPTIONS = {"act_order": None, "damp": None, "criterion": None,
                       "grid": DEFAULT_GRID, "t_budget": None, "sequential": False}
# What those front doors do, given calibration, for each option left at None: the setting
# measured best on a pretrained model (docs/ptq.md, "Which setting"). Without calibration
# (round-to-nearest) rotate=None is False.
RECOMMENDED = {"rotate": True, "act_order": True, "criterion": "f", "damp": DAMP}


def check_calibration_options(fn: str, calibration, **options):
    """Raises a ``ValueError`` when options of :data:`CALIBRATION_OPTIONS` are set away from
    their defaults but ``calibration`` is ``None`` (round-to-nearest would silently ignore
    them)."""
    if calibration is not None:
        return
    changed = [k for k, v in options.items() if not _is_default(v, CALIBRATION_OPTIONS[k])]
    if changed:
        raise ValueError(f"{fn}: {', '.join(changed)} appl{'ies' if len(changed) == 1 else 'y'} "
                         f"only to compensated rounding, and no calibration was given: pass "
                         f"calibration=run, or leave {'it' if len(changed) == 1 else 'them'} "
                         f"at the default for round-to-nearest")


def recommended(fn: str, calibration, rotate, act_order, damp, criterion) -> tuple:
    """``(rotate, act_order, damp, criterion)`` with each ``None`` replaced by its
    :data:`RECOMMENDED` value when ``calibration`` is given; without it ``rotate=None`` is
    ``False`` (round-to-nearest uses none of the others).

    Raises:
      TypeError: ``rotate`` or ``act_order`` neither a bool nor ``None`` (naming ``fn``).
    """
    for name, flag in (("rotate", rotate), ("act_order", act_order)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{fn}: {name} must be a bool, got {flag!r} (or None: the "
                            "recommended setting)")
    if calibration is None:
        return bool(rotate), act_order, damp, criterion
    given = {"rotate": rotate, "act_order": act_order, "damp": damp, "criterion": criterion}
    return tuple(RECOMMENDED[k] if v is None else v for k, v in given.items())


def vocabulary_sentences(vocab, n: int, *, words: int = 12, seed: int = 0) -> list[str]:
    """``n`` sentences of ``words`` words drawn uniformly (seeded) from a tokenizer's
    vocabulary: calibration text that reaches embedding rows the model's own data may not.

    Calibration data decides which input directions compensated rounding protects; a few
    hundred sentences of a few topics leave most of a language model's vocabulary unseen, and
    text of other topics then comes out worse. Mixed into the calibration (as many sentences as
    the model's own), these keep the quantizer from fitting the calibration topics alone: on
    all-MiniLM-L6-v2 calibrated on other topics than the scored ones, the mean embedding cosine
    rose from 0.992 to 0.995 (docs/ptq.md, "Calibration data").

    Args:
      vocab: the tokenizer's vocabulary: any iterable of token strings (e.g. a Hugging Face
        ``tokenizer.get_vocab()``); its alphabetic entries of 3 or more letters are drawn
        (word pieces such as ``##ing``, special tokens, digits and punctuation are not).
      n: number of sentences, >= 0.
      words: words per sentence, >= 1.
      seed: the draw's seed.

    Returns:
      ``n`` strings, each ``words`` words joined by spaces with a final period.

    Raises:
      ValueError: bad ``n`` / ``words``, or a vocabulary without such entries.
    """
    for name, v, low in (("n", n, 0), ("words", words, 1)):
        if not is_integer(v) or v < low:
            raise ValueError(f"vocabulary_sentences: {name} must be an int >= {low}, got {v!r}")
    pool = sorted({w for w in vocab if isinstance(w, str) and w.isalpha() and len(w) > 2})
    if not pool:
        raise ValueError("vocabulary_sentences: the vocabulary has no alphabetic entries of 3 "
                         "or more letters (pass the tokenizer's vocabulary, e.g. "
                         "tokenizer.get_vocab())")
    draw = np.random.default_rng(seed).integers(0, len(pool), size=(n, words))
    return [" ".join(pool[i] for i in row) + "." for row in draw]


def _is_default(value, default) -> bool:
    """Whether an option equals its default by value: a list or NumPy scalar spelling of the
    default is the default (``damp=np.float64(0.01)``, ``grid=[...]``)."""
    if default is None or isinstance(default, str):
        return value is default or (isinstance(value, str) and value == default)
    try:
        return np.array_equal(np.asarray(value, np.float64), np.asarray(default, np.float64))
    except (TypeError, ValueError):
        return False


def layer_name(name: str) -> str:
    """A layer's name as messages show it: quoted (``'encoder.2'``), ``(root)`` for the model
    itself (its path is empty)."""
    return repr(name) if name else "(root)"


@contextlib.contextmanager
def layer_context(fn: str, name: str):
    """Re-raises a ``ValueError`` or ``TypeError`` raised while coding one layer of a model
    with the model-level function and the layer's name (:func:`layer_name`) in front of its
    message (a model has many layers, and the inner message cannot know which one it was)."""
    try:
        yield
    except (ValueError, TypeError) as e:
        kind = ValueError if isinstance(e, ValueError) else TypeError
        raise kind(f"{fn}: layer {layer_name(name)}: {e}") from e


# ------------------------------------------------------------------------------- Hessians


def hessian(x, dtype=None):
    """``H = sum x^T x`` over every leading axis of ``x[..., in]``.

    Args:
      x: the inputs of a linear layer, ``[..., in]`` (any floating dtype).
      dtype: accumulation dtype; default float64 under x64, float32 otherwise.

    Returns:
      ``[in, in]`` symmetric positive semi-definite matrix (traceable).
    """
    x = jnp.asarray(x)
    if x.ndim == 0 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"hessian: expected a floating array [..., in], got "
                        f"{x.dtype}{list(x.shape)}")
    dt = _dtype() if dtype is None else jnp.dtype(dtype)
    x = x.reshape(-1, x.shape[-1]).astype(dt)
    return jnp.matmul(x.T, x, precision=_HI)


def hessian_update(H, x, count=0):
    """One streaming step: ``(H + sum x^T x, count + rows of x)``.

    Start with ``H=None`` (zeros). ``H / count`` is the mean (the scale of ``H`` does not change
    what :func:`gptq_rows` does, only the value of the proxy loss).

    Args:
      H: ``[in, in]`` accumulated so far, or ``None``.
      x: ``[..., in]`` a batch of the layer's inputs.
      count: rows accumulated so far.

    Returns:
      ``(H, count)``.
    """
    h = hessian(x, None if H is None else jnp.asarray(H).dtype)
    if H is not None:
        if jnp.shape(H) != h.shape:
            raise ValueError(f"hessian_update: H is {list(jnp.shape(H))} but x has "
                             f"in-features {h.shape[0]}")
        h = H + h
    rows = int(np.prod(jnp.shape(x)[:-1], dtype=np.int64))
    return h, count + rows


def proxy_loss(w, w_hat, H):
    """``tr((w_hat - w) H (w_hat - w)^T)``: the output error ``sum ||X (w_hat - w)^T||^2`` of a
    layer whose inputs ``X`` have ``H = X^T X``.

    Args:
      w, w_hat: ``[out, in]``.
      H: ``[in, in]``.

    Returns:
      ``[]`` array (float64 under x64, float32 otherwise); traceable.
    """
    w, w_hat, H = (jnp.asarray(a) for a in (w, w_hat, H))
    if w.ndim != 2 or w_hat.shape != w.shape or H.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"proxy_loss: expected w and w_hat [out, in] and H [in, in], got "
                         f"{list(w.shape)}, {list(w_hat.shape)}, {list(H.shape)}")
    return jnp.sum(_row_losses(w, w_hat, H.astype(_dtype())))


def _row_losses(w, w_hat, H):
    delta = w_hat.astype(H.dtype) - w.astype(H.dtype)
    return jnp.sum(jnp.matmul(delta, H, precision=_HI) * delta, axis=-1)


# --------------------------------------------------------------------------------- result


@dataclasses.dataclass(frozen=True, eq=False)
class PTQResult:
    """What :func:`gptq_rows` returns.

    Attributes:
      codes: row :class:`~hnlq_jax.Codes` of the (rotated, when ``rotation``) weight: blocks
        ``[out, ceil(in/d)]`` in natural column order, ``scale = beta * rms(row)``, ``n = in``.
      beta: ``[out]`` the beta each row was coded with (``scale / rms(row)``).
      loss: the proxy loss ``tr(dW H dW^T)`` of the result (of the rotated problem, which has
        the same value as the unrotated one).
      clipped: blocks that did not encode even at ``max_T`` and were shrunk until they did (0
        normally; ``docs/ptq.md``).
      rotation: the :class:`~hnlq_jax.incoherence.Rotation` applied to the input side, or
        ``None``. With one, the layer computes ``matmul(rotation.apply(x), codes)``.
      t_bits: the entropy of the codes' T per weight (``H(T) / d``, about what the packed T
        stream costs), the quantity ``t_budget`` bounds.
    """

    codes: Codes
    beta: jax.Array
    loss: float
    clipped: int
    rotation: Rotation | None = None
    t_bits: float = 0.0

    def weight(self, dtype=None):
        """The quantized weight ``[out, in]`` in the original basis (rotated back)."""
        w = ops.decode(self.codes, dtype=dtype)
        return w if self.rotation is None else self.rotation.inverse(w)

    def matmul(self, x, **kwargs):
        """``x @ weight().T`` for ``x[..., in]``, through the codes (``hnlq_jax.matmul``)."""
        if self.rotation is not None:
            x = self.rotation.apply(x)
        return ops.matmul(x, self.codes, **kwargs)


# ---------------------------------------------------------------------------- validation


def _check_float(a, name: str, fn: str):
    a = jnp.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{fn}: {name} must be a floating-point array, got dtype {a.dtype}")
    return a


def _check_inputs(w, H, config, fn: str):
    check_config(config, fn)
    w = _check_float(w, "w", fn)
    H = _check_float(H, "H", fn)
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"{fn}: w must be a 2-D weight [out, in] with out, in >= 1, got shape "
                         f"{list(w.shape)}")
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"{fn}: H must be a square matrix [in, in] (X^T X of the layer's inputs),"
                         f" got shape {list(H.shape)}")
    if H.shape[0] != w.shape[1]:
        raise ValueError(f"{fn}: H is {list(H.shape)} but w {list(w.shape)} has in-features "
                         f"{w.shape[1]}: H must be X^T X of this layer's inputs, [in, in] = "
                         f"[{w.shape[1]}, {w.shape[1]}]")
    dt = _dtype()
    w, H = w.astype(dt), H.astype(dt)
    wn, Hn = np.asarray(w), np.asarray(H)
    check_finite_weight(wn, fn, "w")
    if not np.all(np.isfinite(Hn)):
        raise ValueError(f"{fn}: H has {int(np.sum(~np.isfinite(Hn)))} NaN or Inf entries: the "
                         "layer's calibration inputs have NaN or Inf, or X^T X overflowed "
                         "(accumulate it in float32 or wider)")
    dg = np.diag(Hn)
    if np.any(dg < 0):
        bad = np.nonzero(dg < 0)[0]
        raise ValueError(f"{fn}: H is not positive semi-definite: {bad.size} negative diagonal "
                         f"entries (first at {int(bad[0])}: {dg[bad[0]]:.3g}); H must be X^T X "
                         "of the layer's inputs")
    top = float(np.max(np.abs(dg))) if dg.size else 0.0
    asym = float(np.max(np.abs(Hn - Hn.T)))
    if asym > 1e-4 * max(top, np.finfo(Hn.dtype).tiny):
        raise ValueError(f"{fn}: H is not symmetric (max |H - H^T| = {asym:.3g} against a "
                         f"largest diagonal entry {top:.3g}); H must be X^T X")
    return w, (H + H.T) / 2


def _real(v) -> float | None:
    """``v`` as a float where it is a real number (a Python, NumPy or 0-d array scalar; not a
    bool), else ``None``."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, numbers.Real):
        return float(v)
    if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number) and \
            not np.issubdtype(np.asarray(v).dtype, np.complexfloating):
        return float(np.asarray(v))
    return None


def _check_options(damp, grid, fn: str):
    real = _real(damp)
    if real is None or not (math.isfinite(real) and real >= 0):
        raise ValueError(f"{fn}: damp must be a finite number >= 0, got {damp!r}")
    try:
        g = tuple(float(v) for v in grid)
    except TypeError:
        raise ValueError(f"{fn}: grid must be a sequence of positive numbers, got {grid!r}") \
            from None
    if not g or not all(math.isfinite(v) and v > 0 for v in g):
        raise ValueError(f"{fn}: grid must be a non-empty sequence of positive numbers, got {g}")
    return real, g


def _check_scales(betas, rms, what: str, fn: str):
    """Refuses candidate betas ``[K, out]`` (in the weight's dtype) that are not normal
    numbers of it, or whose row scales ``betas * rms`` overflow it: a finite float64 beta or
    grid can be either (1e39 or 1e-46 in float32), and an infinite scale made the compensation
    NaN, reported as a bad H."""
    betas, rms = np.asarray(betas), np.asarray(rms)
    fi = np.finfo(betas.dtype)
    with np.errstate(over="ignore"):
        ok = (betas >= fi.tiny) & np.isfinite(betas * rms)
    if not ok.all():
        k, r = (int(i) for i in np.argwhere(~ok)[0])
        raise ValueError(f"{fn}: {what} is {float(betas[k, r]):.4g} in {betas.dtype} for row "
                         f"{r}, whose RMS is {float(rms[r]):.4g}: beta and its scale beta * RMS "
                         f"must be normal {betas.dtype} numbers ({fi.tiny:.4g} .. "
                         f"{fi.max:.4g}); pass a beta (grid) within range")


# ----------------------------------------------------------------------------- the core


def _check_budget(t_budget, fn: str) -> float:
    if t_budget is None:
        return math.inf
    real = _real(t_budget)
    if real is None or not (math.isfinite(real) and real >= 0):
        raise ValueError(f"{fn}: t_budget must be None or a finite number >= 0 (bits per "
                         f"weight), got {t_budget!r}")
    return real


def _group_blocks(config: HNLQConfig, nb: int) -> int:
    return max(1, min(nb, GROUP_COLUMNS // config.d))


@functools.partial(jax.jit, static_argnames=("d", "G", "act_order"))
def _factor(w, H, damp, *, d: int, G: int, act_order: bool):
    """Dead columns, damping, block order, padding and the feed-forward matrix.

    Returns ``(Wp [out, N], A [N, N], perm [nb], ok)``: ``Wp`` the weight with dead columns
    zeroed, padded to ``nb d`` columns, its block columns in processing order, and padded with
    zero blocks to a multiple of ``G`` blocks (``N`` columns); ``A = blockdiag(U_bb)^-1 U`` with
    ``U`` the upper Cholesky factor of the inverse of the damped, permuted, padded ``H``
    (``A[b, b] = I``); ``perm[j]`` the natural index of the j-th processed block; ``ok`` False
    when the Cholesky factorization failed.
    """
    n = H.shape[0]
    nb = -(-n // d)
    nbp = -(-nb // G) * G
    N = nbp * d
    dg = jnp.diagonal(H)
    dead = dg == 0
    # A dead column's H_ii: the live columns' mean (1 if none), not GPTQ's 1, which would make
    # the damping and act_order's order depend on the scale of H
    live = jnp.sum(~dead)
    fill = jnp.where(live > 0, jnp.sum(dg) / jnp.maximum(live, 1), 1).astype(H.dtype)
    H = H + jnp.diag(jnp.where(dead, fill, 0).astype(H.dtype))
    w = jnp.where(dead[None, :], 0, w)
    dg = jnp.diagonal(H)
    H = H + jnp.diag(jnp.full((n,), damp * jnp.mean(dg), H.dtype))
    if act_order:
        sums = jnp.pad(dg, (0, nb * d - n)).reshape(nb, d).sum(-1)
        perm = jnp.argsort(-sums, stable=True)
    else:
        perm = jnp.arange(nb)
    cols = (perm[:, None] * d + jnp.arange(d)[None, :]).reshape(-1)  # into the nb*d padding
    Hpad = jnp.eye(N, dtype=H.dtype).at[:n, :n].set(H)
    Wpad = jnp.zeros((w.shape[0], N), w.dtype).at[:, :n].set(w)
    cols = jnp.concatenate([cols, jnp.arange(nb * d, N)])
    Hp = Hpad[cols][:, cols]
    Wp = Wpad[:, cols]
    # U upper with U^T U = Hp^-1: with Hp = L~ L~^T (L~ = J chol(J Hp J) J upper), U = L~^-1.
    L2 = jnp.linalg.cholesky(Hp[::-1, ::-1])
    ok = jnp.all(jnp.isfinite(L2))
    Uf = jsl.solve_triangular(L2, jnp.eye(N, dtype=H.dtype), lower=True)
    U = Uf[::-1, ::-1]
    rows = U.reshape(nbp, d, N)
    diag = U.reshape(nbp, d, nbp, d)[jnp.arange(nbp), :, jnp.arange(nbp), :]  # [nbp, d, d]
    A = jsl.solve_triangular(diag, rows, lower=False).reshape(N, N)
    return Wp, A, perm, ok


def _round_blocks(y, ucfg: HNLQConfig, impl: str):
    """Codes of the blocks ``y[R, d]`` (unit scale) and their decoded values.

    A block that does not encode at ``max_T`` (``T = -1``) is brought inside the norm bound and
    then shrunk by ``_SHRINK`` until it encodes (one encoder in the loop, so it compiles once).
    Returns ``(index, T, yhat, shrunk [R] bool)``.
    """
    R = y.shape[0]
    limit = ucfg.overload_radius * float(pow2_table(ucfg.alpha, ucfg.max_T)[-1])

    def cond(s):
        return jnp.any(s[3]) & (s[5] <= _MAX_SHRINK)

    def body(s):
        y, index, T, need, shrunk, i = s
        i2, T2 = ops.encode_flat(y, ucfg, impl, None)
        T2 = T2.astype(jnp.int32)
        index = jnp.where(need[:, None], i2, index)
        T = jnp.where(need, T2, T)
        failed = need & (T2 < 0)
        norm = jnp.sqrt(jnp.sum(y * y, axis=-1, keepdims=True))
        f = _SHRINK * jnp.minimum(1, limit / jnp.maximum(norm, limit * 1e-30))
        y = jnp.where(failed[:, None], y * f.astype(y.dtype), y)
        return y, index, T, failed, shrunk | failed, i + 1

    init = (y, jnp.zeros((R, ucfg.M), jnp.dtype(index_dtype(ucfg))), jnp.full((R,), -1, jnp.int32),
            jnp.ones((R,), bool), jnp.zeros((R,), bool), 0)
    _, index, T, _, shrunk, _ = jax.lax.while_loop(cond, body, init)
    yhat = decode_blocks(index, T + 1, ucfg, None, y.dtype, 1.0)
    return index, T, yhat, shrunk & (T >= 0)


def _compensate(Wp, c, A, ucfg: HNLQConfig, G: int, impl: str):
    """The GPTQ / LDLQ loop over block columns with lazy group updates.

    Returns ``(index [R, nbp, M], T [R, nbp], yhat [R, nbp, d], shrunk [R])`` in processing
    order: the codes, their decoded blocks at unit scale, and the blocks per row that had to be
    shrunk to encode.
    """
    d = ucfg.d
    R, N = Wp.shape
    Gd = G * d
    ngroups = N // Gd
    cc = c[:, None]

    def group(W, xs):
        g, Arows = xs  # Arows [Gd, N]: the rows of A of this group
        start = g * Gd
        P = jax.lax.dynamic_slice_in_dim(W, start, Gd, axis=1)
        Apan = jax.lax.dynamic_slice_in_dim(Arows, start, Gd, axis=1)

        def block(P, b):
            x = jax.lax.dynamic_slice_in_dim(P, b * d, d, axis=1)
            index, T, yhat, shrunk = _round_blocks(divide_rows(x, c), ucfg, impl)  # as rows_codes
            E = x - yhat * cc
            Ab = jax.lax.dynamic_slice_in_dim(Apan, b * d, d, axis=0)
            P = P - jnp.matmul(E, Ab, precision=_HI)
            return P, (E, index, T, yhat, shrunk)

        P, (E, index, T, yhat, shrunk) = jax.lax.scan(block, P, jnp.arange(G))
        Eg = jnp.transpose(E, (1, 0, 2)).reshape(R, Gd)
        W = W - jnp.matmul(Eg, Arows, precision=_HI)
        return W, (index, T, yhat, jnp.sum(shrunk, axis=0))

    _, (index, T, yhat, shrunk) = jax.lax.scan(group, Wp,
                                               (jnp.arange(ngroups), A.reshape(ngroups, Gd, N)))
    index = jnp.transpose(index, (2, 0, 1, 3)).reshape(R, ngroups * G, ucfg.M)
    T = jnp.transpose(T, (2, 0, 1)).reshape(R, ngroups * G)
    yhat = jnp.transpose(yhat, (2, 0, 1, 3)).reshape(R, ngroups * G, d)
    return index, T, yhat, jnp.sum(shrunk, axis=0)


@functools.partial(jax.jit, static_argnames=("ucfg", "G", "impl"))
def _search(w, H, Wp, A, perm, betas, rms, mode, budget, *, ucfg: HNLQConfig, G: int,
            impl: str):
    """Runs the compensation at every candidate ``betas[K, R]`` (scales ``betas * rms``) and
    keeps the best: per row (``mode`` 0), or for the layer by the loss (1) or by ``"f"`` (2),
    among the candidates whose T entropy per weight is at most ``budget`` (layer modes; ``inf``:
    all). ``mode`` and ``budget`` are traced, so the options share one compiled program.

    Returns ``(index [R, nb, M], T [R, nb], beta [R], c [R], row_losses [R], shrunk [R],
    t_bits [K], chosen_t_bits [])``, blocks in natural order; ``t_bits`` is each candidate's T
    entropy per weight, ``chosen_t_bits`` that of the codes returned.
    """
    n = w.shape[1]
    nb = perm.shape[0]
    inv = jnp.argsort(perm)

    def one(beta):
        c = row_scale(beta, rms)
        index, T, yhat, shrunk = _compensate(Wp, c, A, ucfg, G, impl)
        index, T, yhat = index[:, :nb][:, inv], T[:, :nb][:, inv], yhat[:, :nb][:, inv]
        # the scales stored: an all-zero row decodes to 0 (with a dither, its blocks do not)
        w_hat = from_blocks(yhat, n) * zero_rows_scale(w, c)[:, None]
        return index, T, c, shrunk, _row_losses(w, w_hat, H)

    index, T, c, shrunk, losses = jax.lax.map(one, betas)  # [K, ...]
    # a row with a NaN (should not happen) is never preferred
    losses = jnp.where(jnp.isnan(losses), jnp.inf, losses)
    total = jnp.sum(losses, axis=1)
    # "f": loss 2^(2 H(T) / d), H(T) the entropy of the layer's overload steps
    t_bits = entropy_bits(jax.vmap(lambda t: t_counts(t, ucfg))(T)) / ucfg.d
    score = jnp.where(mode == 2, total * 2 ** (2 * t_bits), total)
    layer = jnp.argmin(jnp.where(t_bits <= budget, score, jnp.inf))
    k = jnp.where(mode == 0, jnp.argmin(losses, axis=0), layer)
    rows = jnp.arange(losses.shape[1])
    T = T[k, rows]
    # per row, the rows mix candidates; layer-wide, the compared value itself
    chosen = jnp.where(mode == 0, entropy_bits(t_counts(T, ucfg)) / ucfg.d, t_bits[layer])
    return (index[k, rows], T, betas[k, rows], c[k, rows], losses[k, rows], shrunk[k, rows],
            t_bits, chosen)


# ----------------------------------------------------------------------------- front door


def gptq_rows(w, H, config: HNLQConfig, *, damp: float = DAMP, act_order: bool = False,
              beta=None, grid=DEFAULT_GRID, criterion: str = "loss", t_budget=None,
              per_row: bool | None = None, rotation: Rotation | None = None,
              implementation=None) -> PTQResult:
    """Row codes of ``w`` by compensated rounding against the input Hessian ``H``.

    Block column ``b`` (columns ``b d .. b d + d - 1``, the row format's blocks) of every row is
    divided by the row scale ``c_r = beta_r rms(w_r)`` and encoded at unit beta; its error ``E``
    is fed forward as ``W[:, later] -= E U_bb^-1 U_b,later`` (``U`` the upper Cholesky factor of
    the damped ``H^-1``), which minimizes ``tr(dW H dW^T)`` over the later columns given the
    rounding so far. ``docs/ptq.md`` has the math.

    Args:
      w: ``[out, in]`` floating weight (the layer computes ``x @ w.T``).
      H: ``[in, in]`` ``X^T X`` of the layer's inputs (summed or averaged over tokens;
        :func:`hessian` / :func:`hessian_update`).
      config: the quantizer; its ``beta`` is ignored (the row scales carry beta).
      damp: ``damp * mean(diag H)`` is added to the diagonal before factoring.
      act_order: quantize block columns in decreasing order of their ``diag(H)`` sums. The
        codes come back in natural order either way (blocks are kept whole), so the format and
        the decoder do not change.
      beta: ``None``: search (below); a number or an ``[out]`` array: code with these.
      grid: the search's candidates, multiples of :func:`hnlq_jax.rows.calibrate_rows`'s beta;
        each is run through the full compensation and the one with the lowest proxy loss kept.
      criterion: what the search minimizes: ``"loss"``, the proxy loss; ``"f"``, the proxy loss
        times ``2^(2 H(T) / d)`` with ``H(T)`` the entropy of the layer's overload steps (the
        figure of merit of ``docs/math.md``, "Choosing beta", for entropy-coded T: smaller
        betas lower the loss but raise ``H(T)``).
      t_budget: a rate constraint: the most bits per weight the entropy of the layer's T may
        take (``H(T) / d``, what the packed T stream costs, within about 0.03 bits per block);
        the search keeps the best candidate (by ``criterion``) within it. Larger betas overload
        less, so a tight budget needs a ``grid`` reaching above 1 (``docs/ptq.md``, "Fitting a
        bit budget"). ``None``: no limit.
      per_row: pick the best candidate per row (the proxy loss is a sum over rows, and each row
        keeps its own scale in the format); ``False``: one beta for the layer. Default: True
        for ``"loss"`` without ``t_budget``; ``"f"`` and ``t_budget`` (layer-wide rates) need
        False.
      rotation: an :class:`~hnlq_jax.incoherence.Rotation` of size ``in``: quantize
        ``w R`` against ``R^T H R`` (the layer then computes ``matmul(rotation.apply(x),
        codes)``; :meth:`PTQResult.matmul` does it).
      implementation: the encoder, as for :func:`hnlq_jax.encode` (same codes bit for bit).

    Returns:
      :class:`PTQResult`: ``codes`` (row codes, natural order), ``beta [out]``, ``loss``,
      ``clipped``, ``rotation``, ``t_bits``.

    Raises:
      TypeError: a config that is not an ``HNLQConfig``; a non-floating ``w`` or ``H``.
      ValueError: ``w`` not 2-D; ``H`` not square or not ``[in, in]``; NaN/Inf in ``w`` or
        ``H``; ``H`` not symmetric or not positive semi-definite (a negative diagonal entry, or
        the Cholesky factorization of the damped ``H`` fails); bad ``damp``, ``grid``,
        ``beta``, ``t_budget`` or ``rotation``; no candidate within ``t_budget``.
    """
    fn = "gptq_rows"
    w, H = _check_inputs(w, H, config, fn)
    damp, grid = _check_options(damp, grid, fn)
    if criterion not in ("loss", "f"):
        raise ValueError(f"{fn}: criterion must be 'loss' or 'f', got {criterion!r}")
    budget = _check_budget(t_budget, fn)
    per_row = criterion == "loss" and t_budget is None if per_row is None else bool(per_row)
    if per_row and (criterion == "f" or t_budget is not None):
        raise ValueError(f"{fn}: criterion='f' and t_budget score a whole layer (its T "
                         "entropy); use per_row=False")
    out, n = w.shape
    if beta is not None:
        b64 = check_beta(beta, fn, ((), (out,)), "None, a positive number or a positive [out] "
                         f"= [{out}] array")
    if rotation is not None:
        if not isinstance(rotation, Rotation) or rotation.n != n:
            raise ValueError(f"{fn}: rotation must be an incoherence.Rotation of size in = {n}, "
                             f"got {rotation!r}")
        w, H = rotation.rotate_weight(w), rotation.rotate_hessian(H)
    d = config.d
    nb = -(-n // d)
    G = _group_blocks(config, nb)
    Wp, A, perm, ok = _factor(w, H, jnp.asarray(damp, w.dtype), d=d, G=G,
                              act_order=bool(act_order))
    if not bool(ok):
        raise ValueError(f"{fn}: H is not positive definite after damping: the Cholesky "
                         f"factorization of H + {damp:g} mean(diag H) I failed; H must be X^T X "
                         "of the layer's inputs (if it is, raise damp)")
    rms = row_rms(w)
    if beta is None:
        b0 = calibrate_rows(w, config).astype(w.dtype)
        with np.errstate(over="ignore", under="ignore"):  # out of range: refused below
            g = jnp.asarray(grid, w.dtype)
        betas = jnp.broadcast_to(g[:, None] * b0, (len(grid), out))
        _check_scales(betas, rms, "grid times the calibrated beta", fn)
    else:
        with np.errstate(over="ignore", under="ignore"):
            betas = jnp.broadcast_to(jnp.asarray(b64, w.dtype), (1, out))
        _check_scales(betas, rms, "beta", fn)
    ucfg = unit(config)
    impl = ops.resolve(implementation, config, "encode", w)
    mode = jnp.asarray(0 if per_row else (2 if criterion == "f" else 1), jnp.int32)
    budget_arr = jnp.asarray(budget, w.dtype)  # compared as _search compares it
    index, T, beta, c, losses, shrunk, t_bits, chosen = _search(
        w, H, Wp, A, perm, betas, rms, mode, budget_arr, ucfg=ucfg, G=G, impl=impl)
    if not bool(jnp.any(t_bits <= budget_arr)):
        t_bits = np.asarray(t_bits, np.float64)
        raise ValueError(f"{fn}: no beta of the grid keeps T within t_budget = {budget:g} bits "
                         f"per weight (the candidates take {t_bits.min():.4f} .. "
                         f"{t_bits.max():.4f}); add larger multiples to grid (larger betas "
                         "overload less) or raise t_budget")
    if not bool(jnp.all(T >= 0)):
        raise ValueError(f"{fn}: the compensation produced non-finite values (H is badly "
                         "conditioned?); raise damp")
    codes = Codes(index, pack_t(T, ucfg), ucfg).with_rows(scale=zero_rows_scale(w, c), n=n)
    return PTQResult(codes, beta, float(jnp.sum(losses)), int(jnp.sum(shrunk)), rotation,
                     abs(float(chosen)))  # abs: no -0.0

"""Numerics shared by the XLA path, the Pallas kernels and the layers, defined once.

* the overload scale ``2^(alpha T)`` of a block, from its T field value ``u = T + 1``;
* the level weights ``q^m``;
* the dtype decoded weights are held and products summed in (:func:`wide_dtype`);
* the straight-through estimator (forward: the quantized value; backward: the incoming
  gradient, optionally masked);
* a mean of squares (row scales) and a sum of squares (the beta search's errors) that do not
  depend on the program or backend they run in (:func:`mean_square`, :func:`sum_of_squares`);
* a product by a power of two, and the binary exponent, that fuse (:func:`times_pow2`,
  :func:`exponent`);
* a division and a square root that are IEEE's on every backend (:func:`divide`,
  :func:`sqrt`): the encoder's ``x / s`` and the row scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax.config import HNLQConfig, pow2_table

__all__ = ["divide", "sqrt", "mean_square", "sum_of_squares", "pow2", "overload_scale",
           "level_weights", "straight_through", "times_pow2", "exponent", "wide_dtype",
           "flush_subnormals"]


def pow2(config: HNLQConfig, dtype) -> jax.Array:
    """``[max_T + 1]`` table ``2^(alpha t)`` in ``dtype`` (the reference's float64 values)."""
    return jnp.asarray(pow2_table(config.alpha, config.max_T), dtype)


def times_pow2(x, e):
    """``x 2^e`` for float32 ``x`` and int32 ``e`` (``|e| <= 252``, broadcast) as two products by
    exact powers of two, ``2^floor(e/2)`` then ``2^ceil(e/2)`` from their bits: correctly
    rounded, as ``jnp.ldexp``, wherever ``x`` and ``x 2^floor(e/2)`` are not subnormal; inf,
    NaN and 0 pass through. On a GPU it fuses into the operations around it, where ``jnp.ldexp``'s
    ``frexp`` and ``pow`` make kernels of their own."""
    a = e >> 1

    def exact(k):  # 2^k, |k| <= 126: the exponent field alone
        return jax.lax.bitcast_convert_type((k + 127).astype(jnp.int32) << 23, jnp.float32)

    return x * exact(a) * exact(e - a)


def _parts(v):
    """``(bits, S, e)`` of a float ``v >= 0``: its bits (the unsigned integer of its width), and
    its significand ``S`` (an integer below ``2^(nmant + 1)``, of that type) and exponent ``e``
    (int32), ``v = S 2^e`` where ``v`` is finite."""
    info = jnp.finfo(v.dtype)
    u = jnp.dtype(f"uint{info.bits}")
    bits = jax.lax.bitcast_convert_type(v, u)
    E = (bits >> info.nmant).astype(jnp.int32)
    S = (bits & u.type((1 << info.nmant) - 1)) | jnp.where(E > 0, u.type(1 << info.nmant),
                                                            u.type(0))
    return bits, S, jnp.maximum(E, 1) - (info.maxexp - 1) - info.nmant


def _step(bits, up, down):
    """The float with ``bits`` (normal, ``>= 0``), or its neighbour towards the exact value
    ``x``: ``up`` and ``down`` have the signs of ``x`` less the midpoints above and below it.
    A quotient or square root of floats is never on a midpoint of their precision (its odd
    significand would need more bits than the operands hold): no ties to break."""
    return jnp.where(up > 0, bits + 1, jnp.where(down < 0, bits - 1, bits))


def _binade_start(S, e, info) -> jax.Array:
    """Whether ``S 2^e`` is a binade's first normal float above the smallest: the spacing of
    the floats below it is half that above."""
    return (S == S.dtype.type(1 << info.nmant)) & (e > info.minexp - info.nmant)


def _quotient_step(a, b, bits):
    """:func:`_step` towards ``a / b`` (normal, positive) from a float a few units in the last
    place from it. The sides of the midpoints are the signs of the integer residual
    ``R = (a - g b) / 2^(e + eB)``, within ``3 SB`` near the quotient, so computed modulo the
    width (the products' high bits drop out): ``a - (g + ulp / 2) b`` is ``2R - SB`` in units
    of ``2^(e + eB - 1)``."""
    info = jnp.finfo(a.dtype)
    _, SA, eA = _parts(a)
    _, SB, eB = _parts(b)
    _, S, e = _parts(jax.lax.bitcast_convert_type(bits, a.dtype))
    i = jnp.dtype(f"int{info.bits}")
    # the shift is 22 to 26 near the quotient (float64: 51 to 55)
    R = jax.lax.bitcast_convert_type((SA << (eA - e - eB).astype(bits.dtype)) - S * SB, i)
    SB = SB.astype(i)
    down = jnp.where(_binade_start(S, e, info), 4 * R, 2 * R) + SB  # below: g - ulp / 4
    return _step(bits, 2 * R - SB, down)


def _root_step(v, bits):
    """:func:`_step` towards ``sqrt(v)`` (normal, positive) from a float a few units in the
    last place from it: ``v - ((2S + 1) 2^(e - 1))^2`` is ``SV 2^(eV - 2e + 2) - (2S + 1)^2``
    in units of ``2^(2e - 2)``, within ``2^30`` near the root (float64: ``2^59``), so computed
    modulo the width."""
    info = jnp.finfo(v.dtype)
    _, SV, eV = _parts(v)
    _, S, e = _parts(jax.lax.bitcast_convert_type(bits, v.dtype))
    i = jnp.dtype(f"int{info.bits}")
    u, one = bits.dtype, bits.dtype.type(1)
    k = (eV - 2 * e + 2).astype(u)  # 24 to 27 near the root (float64: 53 to 56)

    def side(shift, m):  # the sign of v - (m 2^(e - 1 - shift / 2))^2, m odd
        return jax.lax.bitcast_convert_type((SV << (k + shift)) - m * m, i)

    first = _binade_start(S, e, info)
    down = jnp.where(first, side(u.type(2), 4 * S - one), side(u.type(0), 2 * S - one))
    return _step(bits, side(u.type(0), 2 * S + one), down)


def _corrected(q, steps, dtype):
    """The backend's ``q`` (within 2 units in the last place of the exact value) after two
    exact ``steps(bits)`` where it is normal and below ``2^(maxexp - 1)`` (elsewhere the
    integer steps run on whatever bits there are, and are dropped)."""
    info = jnp.finfo(dtype)
    g = jnp.abs(q)
    bits = _parts(g)[0]
    for _ in range(2):
        bits = steps(bits)
    ok = (g >= info.tiny) & (g < 2.0 ** (info.maxexp - 1))
    g = jax.lax.bitcast_convert_type(bits, dtype)
    return jnp.where(ok, jnp.where(q < 0, -g, g), q)


def _flushed(x, tiny):
    """``x`` with its values below ``tiny`` in magnitude zero (sign kept)."""
    return jnp.where(jnp.abs(x) < tiny, x * 0, x)


def flush_subnormals(x):
    """``x`` with its subnormal values zero (sign kept), alike in every program and on every
    backend. XLA's CPU flushes subnormals in its float arithmetic but not in bit operations,
    which ``jnp.frexp`` and ``jnp.ldexp`` use: a subnormal entry scaled by ``jnp.ldexp`` came
    out as another value depending on how the program around it was fused (a row's RMS 1600x
    too large in one jitted program, right in another); a GPU keeps subnormals."""
    return _flushed(x, jnp.finfo(x.dtype).tiny)


def _exact(steps_then, plain, dtype, cpu_exact: bool):
    """``plain()``, the backend's result, where it is IEEE's (on a CPU where ``cpu_exact``),
    else ``steps_then()``; results below twice the smallest normal float zero either way."""
    tiny = jnp.finfo(dtype).tiny
    if cpu_exact:
        out = jax.lax.platform_dependent(cpu=plain, default=steps_then)
    else:
        out = steps_then()
    return _flushed(out, 2 * tiny)


def divide(a, b, quotient=None, *, exact: bool = False, cpu_exact: bool = False):
    """``a / b`` correctly rounded, IEEE's quotient, alike on every backend (float32 or float64,
    broadcast): what the codes of ``x / s`` are defined by.

    A plain ``a / b`` is not: XLA's CPU compiler multiplies by ``1 / b`` where ``b`` is
    broadcast (a fifth of float32 quotients one unit in the last place off), and XLA and
    Triton divide approximately on a GPU (``div.full.f32``: up to 2 units). The backend's
    quotient is corrected here by two exact steps (:func:`_quotient_step`: integer arithmetic
    on the floats' bits, which no compiler rewrites). So that the backends also agree where
    XLA's CPU flushes subnormals to zero, subnormal ``a`` and ``b`` count as zero and
    quotients below twice the smallest normal float are zero (sign kept). Quotients from
    ``2^(maxexp - 1)`` (2^127 in float32) on, and non-finite ones, are the backend's (no code
    depends on them: such blocks are beyond the clamp radius).

    Args:
      a, b: float arrays (broadcast against each other).
      quotient: the division to start from, ``(a, b) -> q`` (default ``/``), within 2 units
        in the last place.
      exact: ``quotient`` is correctly rounded (a GPU kernel's ``div.rn``): no steps.
      cpu_exact: ``b`` is not a broadcast in the program (the encoder's gathered scales), so
        that XLA's CPU divides exactly (it runs with subnormals flushed): the steps run on
        other backends only. They cost several times the division where XLA fuses them into
        each of the quotient's consumers.
    """
    dtype = jnp.result_type(a, b)
    info = jnp.finfo(dtype)
    a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    div = (lambda a, b: a / b) if quotient is None else quotient

    def steps_then():
        fa, fb = _flushed(a, info.tiny), _flushed(b, info.tiny)
        q = div(fa, fb)
        if exact:
            return q

        return _corrected(q, lambda bits: _quotient_step(jnp.abs(fa), jnp.abs(fb), bits), dtype)

    return _exact(steps_then, lambda: div(a, b), dtype, cpu_exact)


def sqrt(v, root=None):
    """``sqrt(v)`` correctly rounded, alike on every backend (float32 or float64): XLA's GPU
    compiler takes an approximate square root (``sqrt.approx.f32``). As :func:`divide`: the
    backend's root (or ``root(v)``), on a CPU as it is, elsewhere corrected by two exact
    steps (:func:`_root_step`) from ``v`` with its subnormals zero; roots below twice the
    smallest normal float zero; negative ``v`` gives NaN."""
    v = jnp.asarray(v)
    tiny = jnp.finfo(v.dtype).tiny
    root = jnp.sqrt if root is None else root

    def steps_then():
        fv = _flushed(v, tiny)
        return _corrected(root(fv), lambda bits: _root_step(fv, bits), v.dtype)

    return _exact(steps_then, lambda: root(v), v.dtype, cpu_exact=root is jnp.sqrt)


def exponent(x):
    """``frexp``'s exponent of float32 ``x >= 0`` (``x = m 2^e``, ``m`` in ``[1/2, 1)``), from its
    bits; ``-125`` for 0 and subnormals (whose ``2^e`` it overstates). Like :func:`times_pow2`,
    a few integer operations that fuse, where ``jnp.frexp`` makes a kernel of its own."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.maximum((bits >> 23) & 255, 1) - 126


def overload_scale(u, config: HNLQConfig, table):
    """``2^(alpha T)`` per block from ``u = T + 1`` (int32) through ``table`` (``pow2`` or a
    kernel's table ref); failed blocks (``u = 0``) read entry 0 and are masked by the caller."""
    return table[jnp.clip(u - 1, 0, config.max_T)]


def level_weights(config: HNLQConfig, dtype=None):
    """``q^m`` for m = 0..M-1: a float array in ``dtype``, or Python ints when ``dtype`` is None
    (the exact integer path)."""
    w = [config.q**m for m in range(config.M)]
    return w if dtype is None else jnp.asarray(np.asarray(w, np.float64), dtype)


@jax.jit  # eager callers (calibration) run one program, not one per slice and add
def mean_square(x):
    """The mean over the last axis of ``x[..., k]``'s squares, the same bits in every program.

    ``jnp.mean(jnp.square(x))`` is not: XLA picks the summation order from the program around
    it (on AVX-512 a row's sum differed in the last bit between ``w`` and a transpose fused
    into the reduction under ``jit``), contracts a square and an add into one fused
    multiply-add inside a fusion but not between eager ops, and divides by ``k`` differently
    for a constant and an argument. Here each entry is first rounded to half its dtype's
    significant bits (12 of float32's 24, 26 of float64's 53), so its square is exact and a
    fused multiply-add gives the same sum; the sum halves the zero-padded power-of-two length
    (entries ``i`` and ``i + k'/2``) until one is left, a fixed order; the mean multiplies by
    ``1/k``. The rounding moves a float32 result by at most ~2^-11 relative (float64: 2^-25):
    a row scale is that close to the exact RMS, and the same everywhere.
    """
    x = _half_precision(x)
    return _halving_sum(x * x) * np.asarray(1 / max(x.shape[-1], 1), x.dtype)


@jax.jit
def sum_of_squares(x):
    """The sum over the last axis of ``x[..., k]``'s squares, the same bits on every backend
    and in every program, within the float rounding of a sum (no entry rounded).

    Each entry is split into ``h + l``, ``h`` rounded to half its dtype's significant bits
    (as :func:`mean_square` rounds), so that ``h^2``, ``2 h l`` and ``l^2`` are exact
    products: a fused multiply-add gives the same sums. Each of the three is summed in
    :func:`mean_square`'s fixed order, then ``sum(h^2) + (sum(2 h l) + sum(l^2))``. Entries
    below ``2^-40`` in magnitude (float64: ``2^-459``) count as zero, so that no product is
    subnormal (XLA's CPU flushes subnormals, a GPU keeps them); a NaN gives NaN. Meant for
    float32 or float64 data of magnitude about 1 (the beta search scales its errors so):
    squares overflow from ``2^64`` (float64: ``2^512``).

    Raises:
      TypeError: ``x`` is neither float32 nor float64 (the threshold and the split are
        worked out for them).
    """
    if x.dtype not in (jnp.float32, jnp.float64):
        raise TypeError(f"sum_of_squares: expected float32 or float64, got {x.dtype}")
    info = jnp.finfo(x.dtype)
    x = jnp.where(jnp.abs(x) < 2.0 ** (info.minexp // 2 + info.nmant), 0, x).astype(x.dtype)
    h = _half_precision(x)
    l = x - h  # noqa: E741  exact: h is x rounded to fewer bits
    return _halving_sum(h * h) + (_halving_sum(2 * h * l) + _halving_sum(l * l))


def _half_precision(x):
    """``x`` rounded to half its dtype's significant bits (12 of float32's 24, 26 of float64's
    53): the product of two such values is exact."""
    info = jnp.finfo(x.dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp,
                                    mantissa_bits=(info.nmant - 1) // 2)


def _halving_sum(x):
    """The sum over the last axis in a fixed order: zero-padded to a power-of-two length
    ``k'``, entries ``i`` and ``i + k'/2`` added until one is left."""
    k = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << max(k - 1, 0).bit_length()) - k)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


@jax.custom_vjp
def straight_through(x, x_hat, mask):
    """``x_hat`` forward; the gradient goes to ``x`` unchanged (times ``mask`` if not None).

    Args:
      x: the real value.
      x_hat: its quantized value (same shape); gets no gradient.
      mask: ``None`` or an array broadcastable to ``x`` (e.g. 0 in clipped blocks).
    """
    return x_hat


def _st_fwd(x, x_hat, mask):
    return x_hat, mask


def _st_bwd(mask, g):
    gx = g if mask is None else g * mask.astype(g.dtype)
    return gx, jnp.zeros_like(g), None if mask is None else jnp.zeros_like(mask)


straight_through.defvjp(_st_fwd, _st_bwd)


def saturating_cast(x, dtype):
    """``x`` in ``dtype``, values beyond a narrower dtype's range clipped to its largest finite
    value (NaN stays NaN): a block near a half-precision input's maximum can decode just beyond
    it, where a plain cast gives Inf."""
    if jnp.finfo(dtype).bits < jnp.finfo(x.dtype).bits:
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def wide_dtype(dtype):
    """The dtype a matmul decodes its weight in and sums in, for activations of ``dtype``:
    float32, or float64 for float64 activations (under x64)."""
    return jnp.promote_types(dtype, jnp.float32)

"""hnlq_jax._numerics: the products by powers of two and the exponents the GPU kernels' glue
uses in place of jnp.ldexp / jnp.frexp (which do not fuse); the division and square root that
are IEEE's on every backend."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import sum_of_squares_in_numpy

from hnlq_jax import _numerics
from hnlq_jax.rows import row_rms

FINITE = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(st.lists(FINITE, min_size=1, max_size=32), st.integers(-252, 252))
def test_times_pow2_is_ldexp(xs, e):
    """x 2^e correctly rounded (NumPy's ldexp) wherever x, x 2^floor(e/2) and the result are
    not subnormal (XLA's CPU flushes subnormals to zero), for every exponent the kernels pass
    (|e| <= 252): a factor built from wrong bits, or the two factors' halves swapped, moves
    the result by a power of two."""
    x = np.asarray(xs, np.float32)
    got = np.asarray(_numerics.times_pow2(jnp.asarray(x), jnp.int32(e)))
    with np.errstate(over="ignore"):
        want = np.ldexp(x, e)
    tiny = np.finfo(np.float32).tiny
    normal = [v == 0 or min(abs(v), abs(v * 2.0 ** (e // 2)), abs(w)) >= tiny
              for v, w in zip(x.astype(np.float64), want)]
    np.testing.assert_array_equal(got[normal], want[normal])


def test_times_pow2_passes_nonfinite_and_zero_through():
    x = jnp.asarray([np.inf, -np.inf, np.nan, 0.0, -0.0], jnp.float32)
    for e in (-200, -1, 0, 3, 200):
        got = np.asarray(_numerics.times_pow2(x, jnp.int32(e)))
        np.testing.assert_array_equal(got, np.asarray(x))
        assert np.signbit(got[4])


@given(st.floats(min_value=0, width=32, allow_infinity=False))
def test_exponent_is_frexps(x):
    """frexp's exponent for normal x, -125 for 0 and subnormals (an exponent whose 2^e is
    at least x, as the kernels' scaling needs)."""
    got = int(_numerics.exponent(jnp.float32(x)))
    if x >= np.finfo(np.float32).tiny:
        assert got == np.frexp(np.float32(x))[1]
    else:
        assert got == -125 and x <= 2.0**got


def _nudged(q, k: int):
    """A start ``k`` units in the last place from IEEE's result ``q`` (NumPy's, so the same on
    every backend), as a GPU's approximate division or root (up to 2 units) or XLA:CPU's
    product with a reciprocal give; zeros and infinities as they are."""
    r = q
    for _ in range(abs(k)):
        r = np.nextafter(r, np.asarray(np.inf if k > 0 else -np.inf, q.dtype))
    r = np.where(np.isfinite(q) & (q != 0), r, q)
    return lambda *args: jnp.asarray(r)


NUDGES = (-2, -1, 1, 2)


def _quotients(dtype, n: int, seed: int):
    """Operands whose quotients span the normal range, a fifth of them within a few units
    of a power of two (a binade's edge, where the spacing of the floats changes)."""
    rng = np.random.default_rng(seed)
    b = np.exp2(rng.uniform(-60, 60, n)).astype(dtype)
    q = np.exp2(rng.uniform(-120, 120, n)) * rng.choice([-1, 1], n)
    edge = rng.random(n) < 0.2
    q[edge] = np.exp2(rng.integers(-120, 120, edge.sum())) * (1 + rng.integers(-3, 4, edge.sum())
                                                              * np.finfo(dtype).eps)
    with np.errstate(over="ignore", under="ignore"):
        a = (q * b).astype(dtype)
    ok = np.isfinite(a) & (np.abs(a) >= np.finfo(dtype).tiny)
    return a[ok], b[ok]


@pytest.mark.parametrize("k", NUDGES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_divide_corrects_a_quotient_units_off(dtype, k):
    """From a quotient k units in the last place off (a GPU's div.full, up to 2), the steps
    give IEEE's quotient (NumPy's), across binades and at their edges: a wrong residual
    shift, the halved spacing below a binade's first float, or one step where two are
    needed, each leaves quotients off."""
    with jax.enable_x64(dtype == np.float64):
        a, b = _quotients(dtype, 20000, seed=k + 10)
        want = a / b
        got = np.asarray(jax.jit(lambda a, b: _numerics.divide(a, b, _nudged(want, k)))(a, b))
        normal = np.abs(want) >= 2 * np.finfo(dtype).tiny
        np.testing.assert_array_equal(got[normal], want[normal])


def test_divide_by_a_broadcast_row_scale_is_ieee():
    """XLA:CPU divides by a broadcast divisor by multiplying with its reciprocal (a fifth of
    float32 quotients one unit off): the row scales' division is IEEE's anyway."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 4096)).astype(np.float32)
    c = rng.uniform(0.1, 3.0, 64).astype(np.float32)
    got = np.asarray(jax.jit(lambda w, c: _numerics.divide(w, c[:, None]))(w, c))
    np.testing.assert_array_equal(got, w / c[:, None])


@given(st.lists(FINITE, min_size=1, max_size=16), st.floats(1e-3, 1e3))
@example([8.461460517132543e-41, -1e-38, 3e38], 2.0**-9)  # a subnormal x, a normal quotient
def test_divide_gathered_scales_on_the_cpu(xs, s):
    """With ``cpu_exact`` (the encoder's per-block scales) the CPU's own division, which is
    IEEE's there, and the same rules for subnormal operands and tiny quotients."""
    x = np.asarray(xs, np.float32)
    s = np.float32(s)
    scales = jnp.asarray([s, 2 * s], jnp.float32)
    # indices from the data, as the encoder's steps are (constant ones would fold the gather
    # into a broadcast, which XLA:CPU divides by with a reciprocal)
    got = np.asarray(jax.jit(lambda x: _numerics.divide(
        x, scales[(x != x).astype(jnp.int32)], cpu_exact=True))(x))
    tiny = np.finfo(np.float32).tiny
    with np.errstate(over="ignore", under="ignore"):  # subnormal x as zero
        want = np.where(np.abs(x) < tiny, np.copysign(0, x), x) / s
    want = np.where(np.abs(want) < 2 * tiny, np.copysign(0, want), want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_divide_tiny_and_nonfinite():
    """Subnormal operands count as zero and quotients below twice the smallest normal float
    are zero, sign kept (as XLA's CPU flushes them, so that a GPU agrees); a zero divisor,
    infinities and NaN give IEEE's results; beyond the largest float, inf."""
    t = np.finfo(np.float32).tiny
    a = np.float32([0, -0.0, 1, -1, np.inf, np.nan, t / 2, -t / 2, 1e-30, 1.5 * t, 3e38, 5])
    b = np.float32([3, 3, 0, 0, 2, 2, 1e-3, 1e-3, 1e10, 1, 1e-3, t / 4])
    want = np.float32([0, -0.0, np.inf, -np.inf, np.inf, np.nan, 0, -0.0, 0, 0, np.inf, np.inf])
    def flushed(v):
        return np.where(np.abs(v) < t, np.copysign(0, v), v)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        exact = flushed(a) / flushed(b)  # what the division starts from
    for quotient in (None, _nudged(exact, 1)):
        got = np.asarray(_numerics.divide(jnp.asarray(a), jnp.asarray(b), quotient))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("k", NUDGES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sqrt_corrects_a_root_units_off(dtype, k):
    """From a square root k units off (XLA's GPU takes an approximate one), IEEE's root,
    across binades and next to perfect squares."""
    with jax.enable_x64(dtype == np.float64):
        rng = np.random.default_rng(k + 20)
        v = np.exp2(rng.uniform(-120, 120, 20000)).astype(dtype)
        r = np.exp2(rng.integers(-60, 60, 4000)).astype(dtype)
        v[:4000] = r * r * (1 + rng.integers(-3, 4, 4000) * np.finfo(dtype).eps)
        want = np.sqrt(v)
        got = np.asarray(jax.jit(lambda v: _numerics.sqrt(v, _nudged(want, k)))(v))
        np.testing.assert_array_equal(got, want)


def test_sqrt_tiny_and_nonfinite():
    t = np.finfo(np.float32).tiny
    v = np.float32([0, -0.0, 4, -1, np.inf, np.nan, t / 2, 2 * t, 1e-38 * 1.1])
    want = np.float32([0, -0.0, 2, np.nan, np.inf, np.nan, 0, np.sqrt(2 * t), 0])
    with np.errstate(invalid="ignore"):
        exact = np.sqrt(np.where(np.abs(v) < t, np.copysign(0, v), v))  # from v flushed
    for root in (None, _nudged(exact, -1)):
        got = np.asarray(_numerics.sqrt(jnp.asarray(v), root))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(xs=st.lists(st.floats(-2.0**40, 2.0**40, allow_nan=False), min_size=1, max_size=300),
       scale=st.sampled_from([1.0, 2.0**-30, 2.0**-41]))
@example(xs=[1.0 + 2**-20, -1.5], scale=2.0**-41)  # every entry below the threshold: 0
@example(xs=[1.0 + 2**-20, 3.0], scale=2.0**-39)  # h^2 normal, l^2 near the smallest normal
def test_sum_of_squares_is_its_fixed_order(dtype, xs, scale):
    """The sum of squares the beta search compares is its definition's bits (the NumPy twin's)
    eager, under jit, and with a transpose fused into it: no backend's summation order or
    fused multiply-adds, and no subnormal product (flushed on a CPU, kept on a GPU), enter;
    and it is the exact sum within the rounding of its halvings."""
    with jax.enable_x64(dtype == np.float64):
        x = (np.asarray(xs, np.float64) * scale).astype(dtype)
        want = sum_of_squares_in_numpy(x)
        assert np.asarray(_numerics.sum_of_squares(x)) == want
        two = np.stack([x, -x])
        np.testing.assert_array_equal(
            np.asarray(jax.jit(lambda t: _numerics.sum_of_squares(t.T))(two.T)), [want, want])
        info = np.finfo(dtype)
        kept = x.astype(np.float64)[np.abs(x) >= 2.0 ** (info.minexp // 2 + info.nmant)]
        exact = math.fsum(v * v for v in kept.tolist())  # exact squares for float32 entries
        assert abs(float(want) - exact) <= 2 * len(x).bit_length() * info.eps * exact
        assert np.isnan(_numerics.sum_of_squares(np.append(x, dtype(np.nan))))  # a failed block


def test_sum_of_squares_takes_float32_and_float64_only():
    with pytest.raises(TypeError, match="expected float32 or float64, got float16"):
        _numerics.sum_of_squares(jnp.ones(3, jnp.float16))


def test_flush_subnormals():
    x = jnp.asarray(np.array([1e-40, -1e-40, 1.2e-38, -3.0, 0.0, np.inf], np.float32))
    out = np.asarray(_numerics.flush_subnormals(x))
    np.testing.assert_array_equal(out, [0, 0, np.float32(1.2e-38), -3, 0, np.inf])
    assert np.signbit(out[1]) and not np.signbit(out[0])


@pytest.mark.parametrize("scale", [1e-5, 1e-36])
def test_row_rms_of_subnormal_entries_is_alike_in_every_program(scale):
    """A row with a subnormal entry (1e-5 data), or of RMS 1e-36: fused with a jnp.ldexp of
    the same rows (the wire encoder's program), the jitted RMS came out 1600x too large
    (or Inf): jnp.ldexp read the subnormal's bits where XLA:CPU's arithmetic flushes it."""
    w = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)
    w = w * np.float32(scale)
    w[0, 10] = 1e-40

    def program(w):
        rms = row_rms(w)
        y = jnp.ldexp(w, -jnp.frexp(rms)[1][:, None])
        return rms, jnp.max(jnp.sum(y * y, -1))

    # compiled as users' programs are (the suite's fast compile fuses otherwise)
    users = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}
    rms = np.asarray(jax.jit(program).lower(w).compile(users)(w)[0])
    np.testing.assert_array_equal(rms, row_rms(w))
    ref = np.sqrt(np.mean(w.astype(np.float64) ** 2, axis=1))
    np.testing.assert_allclose(rms, ref, rtol=1e-3)

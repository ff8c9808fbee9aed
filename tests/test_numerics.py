"""hnlq_jax._numerics: the products by powers of two and the exponents the GPU kernels' glue
uses in place of jnp.ldexp / jnp.frexp (which do not fuse)."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from hnlq_jax import _numerics

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

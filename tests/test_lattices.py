"""Nearest-point routines against an independent brute force with the exact tie rule."""

import itertools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hnlq_jax import closest_point, lattice
from hnlq_jax.lattices import columns, nearest_float, nearest_int

ALL = ["Z2", "A2", "D4", "E8", "Z3", "D3", "D5"]


def brute_P(N, D, lat):
    """Q_L(N/D) for integer P-coordinate numerators by enumeration, ties by max <u, x>.

    Distances are integer quadratic forms of N - D*c, so the comparison is exact.
    """
    N = np.asarray(N, dtype=np.int64)
    d = lat.d
    if lat.kind == "A2":
        base = np.floor_divide(N, D)
        offs = np.array(list(itertools.product(range(-1, 3), repeat=2)))
        cands = base[:, None, :] + offs[None]  # basis coordinates
        v = N[:, None, :] - D * cands
        dist = 2 * v[..., 0] ** 2 + 2 * v[..., 0] * v[..., 1] + 2 * v[..., 1] ** 2
        cart = cands @ lat.G.T
    else:
        scale = 2 if lat.kind == "E8" else 1  # P = scale * Cartesian
        y = N / (scale * D)
        grids = []
        for shift in ((0.0, 0.5) if lat.kind == "E8" else (0.0,)):
            lo = np.floor(y - shift) - 1
            offs = np.array(list(itertools.product(range(3), repeat=d)))
            grids.append(lo[:, None, :] + offs[None] + shift)
        cart = np.concatenate(grids, axis=1)
        s = np.rint(2 * cart).astype(np.int64)  # doubled Cartesian
        if lat.kind == "D":
            ok = np.sum(cart, -1) % 2 == 0
        elif lat.kind == "E8":
            same = np.all(s % 2 == s[..., :1] % 2, -1)
            ok = same & (np.sum(s, -1) % 4 == 0)
        else:
            ok = np.ones(cart.shape[:-1], bool)
        cands = np.rint(cart * scale).astype(np.int64)
        v = N[:, None, :] - D * cands
        dist = np.where(ok, np.sum(v * v, -1), np.iinfo(np.int64).max)
    best = dist == dist.min(axis=1, keepdims=True)
    pref = np.where(best, cart @ lat.u, -np.inf)
    return cands[np.arange(len(N)), np.argmax(pref, axis=1)]


def to_cart(P, lat):
    P = np.asarray(P, np.float64)
    if lat.kind == "E8":
        return P / 2
    if lat.kind == "A2":
        return P @ lat.G.T
    return P


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("D", [1, 2, 3, 4, 8])
def test_nearest_int_matches_brute_force(name, D):
    lat = lattice(name)
    rng = np.random.default_rng([D, lat.d, 3])
    # Small numerators over a small denominator: exact ties on faces are frequent.
    N = rng.integers(-4 * D, 4 * D + 1, size=(100 if lat.d > 5 else 400, lat.d))
    got = np.stack([np.asarray(c) for c in nearest_int(columns(jnp.asarray(N, jnp.int32)), D,
                                                        lat)], -1)
    np.testing.assert_array_equal(got, brute_P(N, D, lat))


@pytest.mark.parametrize("name", [n for n in ALL if n != "A2"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("D", [2, 4, 8])
def test_closest_point_exact_ties(name, dtype, D):
    """Dyadic inputs sit exactly on faces; float32 and float64 (+eps) both obey the rule."""
    lat = lattice(name)
    scale = 2 if lat.kind == "E8" else 1
    rng = np.random.default_rng([D, lat.d, 5])
    N = rng.integers(-5 * D, 5 * D + 1, size=(100 if lat.d > 5 else 400, lat.d))
    y = N / (scale * D)
    with jax.enable_x64(dtype == "float64"):
        got = np.asarray(closest_point(jnp.asarray(y, dtype), lat))
    np.testing.assert_array_equal(got, to_cart(brute_P(N, D, lat), lat))


def exact_e8(y):
    """Q_E8(y) of one float vector, exactly: every candidate of both cosets within one of
    round(y) compared in integers (y scaled by its common power-of-two denominator), ties by
    max <u, x>. Returns P coordinates (doubled Cartesian)."""
    lat = lattice("E8")
    fr = [Fraction(float(v)) for v in y]
    k = max(f.denominator for f in fr).bit_length() - 1
    Y = np.array([int(f * 2**k) for f in fr], dtype=object)  # y = Y / 2^k
    offs = np.array(list(itertools.product((-1, 0, 1), repeat=8)), dtype=object)
    best = None
    for half in (0, 1):  # D8, D8 + 1/2: P = 2c + half
        base = np.array([round(f - Fraction(half, 2)) for f in fr], dtype=object)
        c = base[None] + offs
        c = c[np.sum(c, axis=1) % 2 == 0]
        P = 2 * c + half
        dist = np.sum((2 * Y[None] - P * 2**k) ** 2, axis=1)
        for Pi, di in zip(P, dist):
            key = (-di, float(np.asarray(Pi, np.float64) @ lat.u))
            if best is None or key > best[0]:
                best = (key, Pi)
    return np.asarray(best[1], np.int64)


def e8_coset_ties(rng, n, dtype):
    """Points y = (a, 1/2 - a, b, 1/2 - b, 1/4, 1/4, 1/4, 1/4) with many-bit a, b in
    [1/4, 1/2) (1/2 - a exact): equidistant from 0 and the all-1/2 point, and farther from the
    rest of E8. Permuted."""
    a = rng.uniform(0.25, 0.49, n).astype(dtype)
    b = rng.uniform(0.25, 0.49, n).astype(dtype)
    y = np.stack([a, dtype(0.5) - a, b, dtype(0.5) - b] + [np.full(n, 0.25, dtype)] * 4, 1)
    return np.take_along_axis(y, np.argsort(rng.random((n, 8)), axis=1), axis=1)


def test_e8_float32_coset_ties_follow_the_rule():
    """Exact ties between E8's cosets whose squared distances are not representable: a float
    comparison of sums of squares decided 630 of 5000 of these by rounding (FMA or not)."""
    y = e8_coset_ties(np.random.default_rng(0), 2000, np.float32)
    # |y|^2 = |y - 1/2|^2 exactly: sum(y) = 2.
    assert all(sum(map(Fraction, map(float, row))) == 2 for row in y)
    got = np.asarray(closest_point(jnp.asarray(y), "E8"))
    u = lattice("E8").u
    want = np.zeros(8) if u @ np.zeros(8) > u @ np.full(8, 0.5) else np.full(8, 0.5)
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_e8_level0_exact_on_near_ties(dtype):
    """Coset ties nudged by one ulp, by a tiny coordinate (2^-30 .. 2^-100: the decision needs
    up to six digits of the exact sign), or moved by a lattice vector; nearest_float (and so
    every encoder's level 0) equals an exact brute force. float64 adds the reference's eps
    first, so the brute force sees y + eps."""
    rng = np.random.default_rng([8, len(dtype)])
    np_dtype = np.dtype(dtype).type
    y = e8_coset_ties(rng, 48, np_dtype)
    y[:16, 0] = np.nextafter(y[:16, 0], rng.choice([-1, 1], 16).astype(np_dtype))
    tiny = 2.0 ** -rng.choice([30, 60, 100], 16) * rng.choice([-1, 1], 16)
    y[16:32] = np.concatenate([y[16:32, :7], tiny[:, None].astype(np_dtype)], 1)
    y[16:32, 6] = 0.5  # the 7 others sum to 2: the tiny coordinate decides
    y[32:] += np.where(np.arange(8) < 2, 2, 0) * rng.choice([-1, 1], (16, 1))
    with jax.enable_x64(dtype == "float64"):
        got = np.stack(nearest_float(columns(jnp.asarray(y)), lattice("E8")), -1)
    if dtype == "float64":
        y = y + lattice("E8").u * 2.0**-41
    want = np.stack([exact_e8(v) for v in y])
    np.testing.assert_array_equal(np.asarray(got, np.int64), want)


@pytest.mark.parametrize("name", ALL)
def test_closest_point_random_is_nearest(name, x64):
    lat = lattice(name)
    rng = np.random.default_rng(lat.d)
    y = rng.normal(size=(100 if lat.d > 5 else 400, lat.d)) * 3
    got = np.asarray(closest_point(y, lat))
    # Compare distances with a brute force on a fine rational approximation of y.
    D = 2**20
    N = np.rint(y * D * (2 if lat.kind == "E8" else 1)).astype(np.int64)
    if lat.kind == "A2":
        N = np.rint((y @ np.linalg.inv(lat.G).T) * D).astype(np.int64)
    ref = to_cart(brute_P(N, D, lat), lat)
    dg = np.sum((got - y) ** 2, -1)
    dr = np.sum((ref - y) ** 2, -1)
    np.testing.assert_allclose(dg, dr, atol=1e-12)
    # Points are in the lattice: integer basis coordinates.
    k = got @ np.linalg.inv(lat.G).T
    np.testing.assert_allclose(k, np.rint(k), atol=1e-9)


@given(
    name=st.sampled_from(ALL),
    shift=st.lists(st.integers(-50, 50), min_size=8, max_size=8),
    seed=st.integers(0, 2**31 - 1),
    D=st.sampled_from([2, 3, 5, 7]),
)
def test_nearest_int_translation_equivariant(name, shift, seed, D):
    """Q(N/D + lambda) = Q(N/D) + lambda for every lattice vector lambda."""
    lat = lattice(name)
    lam = lat.P_from_basis @ np.array(shift[: lat.d])
    N = np.random.default_rng(seed).integers(-3 * D, 3 * D + 1, size=(64, lat.d))
    f = lambda n: np.stack(nearest_int(columns(jnp.asarray(n, jnp.int32)), D, lat), -1)  # noqa
    np.testing.assert_array_equal(f(N + D * lam), f(N) + lam)


def test_generators_and_constants():
    np.testing.assert_array_equal(
        lattice("D4").G,
        [[-1, 1, 0, 0], [-1, -1, 1, 0], [0, 0, -1, 1], [0, 0, 0, -1]],
    )
    assert lattice("E8").G[0, 0] == 2 and lattice("E8").G[7, 7] == 0.5
    np.testing.assert_allclose(
        lattice("D4").u,
        [-0.21995767065481447, 0.5949816371721085, -0.6767255347849194, 0.3737084761122904],
        rtol=0, atol=1e-15,
    )
    np.testing.assert_allclose(lattice("A2").u, [-0.34675160227191165, 0.9379569959874824],
                               atol=1e-15)
    assert lattice("Z7").d == 7 and lattice("D6").d == 6
    assert lattice("D4") is lattice("D4")


@pytest.mark.parametrize(
    "name,sigma2", [("Z2", 1 / 12), ("A2", 5 / 72), ("D4", 13 / 120), ("E8", 929 / 12960),
                    ("D3", 1 / 8), ("D5", 1 / 12 + 1 / 60)]
)
def test_second_moment_monte_carlo(name, sigma2):
    """y - Q(y) is uniform on V for y uniform on a large box: E|e|^2/d = sigma^2."""
    lat = lattice(name)
    y = np.random.default_rng(1).uniform(-50, 50, size=(200_000, lat.d))
    e = y - np.asarray(closest_point(jnp.asarray(y, jnp.float32), lat), np.float64)
    assert math.isclose(np.mean(e**2), sigma2, rel_tol=0.01)
    assert np.max(np.linalg.norm(e, axis=-1)) <= lat.covering_radius + 1e-4


@pytest.mark.parametrize("bad, hint", [("E7", None), ("Z1", None), ("D1", None), ("X4", None),
                                       ("", None), ("z2", "Z2"), ("e8", "E8"), (" a2", "A2"),
                                       ("d16", "D16"), ("d1", None), ("Z02", None),
                                       ("D004", None)])
def test_unknown_lattice(bad, hint):
    """Names are exact; one in another case or with spaces is named with the lattice it
    resembles, where that is one."""
    with pytest.raises(ValueError, match="unknown lattice") as e:
        lattice(bad)
    assert ("did you mean" in str(e.value)) == (hint is not None)
    if hint:
        assert f"(did you mean {hint!r}?)" in str(e.value)


def test_closest_point_bad_input():
    with pytest.raises(ValueError, match="d=4"):
        closest_point(jnp.zeros((3, 5)), "D4")
    with pytest.raises(TypeError, match="floating"):
        closest_point(jnp.zeros((3, 4), jnp.int32), "D4")


def test_closest_point_half_precision():
    y = jnp.asarray([[0.4, 1.6, -0.2, 0.9]], jnp.bfloat16)
    out = closest_point(y, "D4")
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, closest_point(y.astype(jnp.float32), "D4"))

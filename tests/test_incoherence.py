"""The randomized Hadamard-type rotation (hnlq_jax.incoherence)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hnlq_jax as hq
from hnlq_jax import incoherence
from hnlq_jax.incoherence import Rotation

SIZES = [384, 1536, 96, 7, 64, 12, 40, 1, 6]


@pytest.mark.parametrize("n, split", [(384, (5, 12, True)), (1536, (7, 12, True)),
                                      (96, (3, 12, True)), (7, (0, 7, False)),
                                      (64, (6, 1, True)), (40, (1, 20, True)),
                                      (1000, (3, 125, False)), (1, (0, 1, True))])
def test_split_size(n, split):
    k, m, _ = incoherence.split_size(n)
    assert (k, m, incoherence.split_size(n)[2]) == split and (1 << k) * m == n


@pytest.mark.parametrize("p", [4, 8, 12, 20, 24, 44, 60])
def test_paley_hadamard(p):
    h = incoherence.paley_hadamard(p).astype(np.int64)
    assert set(np.unique(h)) == {-1, 1}
    np.testing.assert_array_equal(h @ h.T, p * np.eye(p, dtype=np.int64))


def test_paley_refuses_other_orders():
    with pytest.raises(ValueError, match="prime"):
        incoherence.paley_hadamard(28)


@pytest.mark.parametrize("n", SIZES)
def test_orthogonal_and_matches_dense(n):
    rot = Rotation(n, seed=3)
    R = rot.matrix()
    if n <= 384:  # (the float32 check below covers 1536)
        np.testing.assert_allclose(R @ R.T, np.eye(n), atol=1e-12)
    # the fast transform is the dense one, float32 through apply
    R32 = np.asarray(rot.apply(jnp.eye(n, dtype=jnp.float32)))
    np.testing.assert_allclose(R32, R, atol=1e-6)
    R32 = R32.astype(np.float64)  # the product in float64: the error is R32's own
    np.testing.assert_allclose(R32 @ R32.T, np.eye(n), atol=1e-6)
    x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
    y = rot.apply(x)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y), x @ R, atol=1e-5)
    np.testing.assert_allclose(np.asarray(rot.inverse(y)), x, atol=1e-5)
    np.testing.assert_allclose(np.asarray(rot.inverse(x)), x @ R.T, atol=1e-5)


@pytest.mark.parametrize("n", [384, 7, 96])
def test_exact_inverse_in_float64(x64, n):
    rot = Rotation(n, seed=11)
    x = np.random.default_rng(0).standard_normal((4, n))
    y = rot.apply(x)
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(rot.inverse(y)), x, rtol=0, atol=1e-13)
    np.testing.assert_allclose(np.asarray(rot.apply(rot.inverse(x))), x, rtol=0, atol=1e-13)
    R = np.asarray(rot.apply(jnp.eye(n)))
    np.testing.assert_allclose(R @ R.T, np.eye(n), rtol=0, atol=1e-12)


def test_apply_is_fast():
    """O(n (k + m)) per vector: no dense n x n matrix, and the flops of a butterfly plus the
    12 x 12 mixer."""
    n, rows = 1536, 4
    rot = Rotation(n, seed=1)
    x = jnp.zeros((rows, n), jnp.float32)
    assert f"{n},{n}" not in str(jax.make_jaxpr(lambda v: rot.apply(v, "xla"))(x))
    cost = jax.jit(lambda v: rot.apply(v, "xla")).lower(x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    k, m, _ = incoherence.split_size(n)
    assert 0 < cost["flops"] <= rows * n * (k + 2 * m + 2)  # dense: 2 n^2 = 3e6 per row


def test_signs_are_deterministic():
    # pinned: the recipe (raw PCG64 words, least significant bit first) must not change
    np.testing.assert_array_equal(
        Rotation(16, seed=0).signs,
        [-1, -1, -1, -1, -1, 1, -1, 1, 1, -1, 1, 1, 1, 1, 1, -1])
    np.testing.assert_array_equal(
        incoherence.signs(16, 12345),
        [-1, 1, -1, -1, -1, 1, 1, -1, -1, 1, 1, 1, 1, 1, -1, -1])
    a, b = Rotation(384, 5).signs, Rotation(384, 6).signs
    assert not np.array_equal(a, b) and set(np.unique(a)) == {-1.0, 1.0}
    assert abs(a.mean()) < 0.2
    # longer sign vectors extend shorter ones (a prefix of the same bit stream)
    np.testing.assert_array_equal(Rotation(100, 5).signs, Rotation(384, 5).signs[:100])
    # the random mixer (no Paley order) is fixed by the seed too
    np.testing.assert_allclose(incoherence.mixer(7, 0)[0, :3],
                               [0.03986832918850802, -0.2692204886692393, -0.34376709836028685],
                               rtol=1e-12)
    assert not np.allclose(incoherence.mixer(7, 0), incoherence.mixer(7, 1))


@pytest.mark.parametrize("n", [24, 14, 384])  # Paley mixers, a seeded random one
def test_cached_tables_are_read_only(n):
    """The signs and mixers are cached and shared: a caller's edit of ``R.signs`` in place
    changed every later rotation of that size and seed (its inverse no longer undid it)."""
    R = Rotation(n, 5)
    for a in (R.signs, hq.incoherence.mixer(n, 5), hq.incoherence.paley_hadamard(4)):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 0
    x = np.random.default_rng(0).standard_normal((2, n)).astype(np.float32)
    np.testing.assert_allclose(Rotation(n, 5).inverse(R.apply(x)), x, atol=1e-5)


def test_layer_output_is_unchanged():
    rng = np.random.default_rng(0)
    n = 384
    rot = Rotation(n, seed=2)
    w = rng.standard_normal((16, n)).astype(np.float32)
    x = rng.standard_normal((5, n)).astype(np.float32)
    y = np.asarray(rot.apply(x)) @ np.asarray(rot.rotate_weight(w)).T
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-4, atol=1e-4)
    X = rng.standard_normal((50, n)).astype(np.float32)
    H = X.T @ X
    Xr = np.asarray(rot.apply(X))
    Hr = np.asarray(rot.rotate_hessian(H))
    np.testing.assert_allclose(Hr, Xr.T @ Xr, rtol=1e-4, atol=1e-2)
    R = rot.matrix()
    np.testing.assert_allclose(Hr, R.T @ H @ R, rtol=1e-4, atol=1e-2)
    np.testing.assert_array_equal(Hr, Hr.T)


def test_outliers_are_spread():
    """What incoherence is for: a spike becomes flat (|entries| = 1/sqrt(n) for Hadamard n)."""
    n = 384
    x = np.zeros((1, n), np.float32)
    x[0, 17] = 1.0
    y = np.asarray(Rotation(n, 0).apply(x))
    np.testing.assert_allclose(np.abs(y), 1 / np.sqrt(n), rtol=1e-5)


def test_jit_dtypes_and_static():
    rot = Rotation(96, seed=4)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 96)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(rot.apply)(x)), np.asarray(rot.apply(x)))
    f = jax.jit(lambda x, r: r.inverse(r.apply(x)), static_argnums=1)
    np.testing.assert_allclose(np.asarray(f(x, rot)), np.asarray(x), atol=1e-5)
    assert rot.apply(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert hash(rot) == hash(Rotation(96, 4)) and rot == Rotation(96, 4)


@pytest.mark.parametrize("n", [24, 14])  # a Paley mixer, a seeded random one
def test_eager_rotations_share_one_program_per_bucket(n, compiles):
    """Rotations of one size differ only in data: after one call per bucket, other seeds and
    new batch sizes in the bucket compile nothing, and padded rows give the unpadded values."""
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(s).astype(np.float32) for s in [(18, n), (3, 6, n), (19, n)]]
    xs[2] = jnp.asarray(xs[2])
    warm = np.ones((17, n), np.float32)  # bucket 20
    Rotation(n, 0).apply(warm), Rotation(n, 0).inverse(warm)
    compiles.clear()
    for seed in (1, 2**40):
        rot = Rotation(n, seed)
        for x in xs:
            y = rot.apply(x)
            np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ rot.matrix(), atol=1e-5)
            np.testing.assert_allclose(np.asarray(rot.inverse(y)), x, atol=1e-5)
    assert compiles == []
    x = xs[0]
    np.testing.assert_array_equal(np.asarray(rot.apply(x)), np.asarray(jax.jit(rot.apply)(x)))


def test_save_and_load():
    rot = Rotation(1536, seed=2**40 + 1)
    state = json.loads(json.dumps(rot.to_dict()))
    assert state == {"kind": "randomized_hadamard", "version": 1, "n": 1536, "seed": 2**40 + 1}
    assert Rotation.from_dict(state) == rot
    # A checkpoint may restore the integers as NumPy scalars or 0-d arrays.
    assert Rotation.from_dict({**state, "n": np.int64(1536), "seed": np.asarray(2**40 + 1)}) == rot
    for bad, match in [({**state, "version": 2}, "version"), ({**state, "kind": "dct"}, "kind"),
                       ({"n": 4}, "expected a dict"), ([], "expected a dict"),
                       ({**state, "n": 0}, "invalid"),
                       # never truncated into another rotation
                       ({**state, "n": 1536.5}, "expected integers n and seed, got 1536.5"),
                       ({**state, "seed": 2.7}, r"expected integers n and seed, got 1536, 2\.7"),
                       ({**state, "n": "1536"}, "expected integers n and seed, got '1536'"),
                       ({**state, "version": True}, "version True")]:
        with pytest.raises(ValueError, match=match):
            Rotation.from_dict(bad)


@pytest.mark.parametrize("make, err, match", [
    (lambda: Rotation(0), ValueError, "n must be >= 1"),
    (lambda: Rotation(8, -1), ValueError, "seed"),
    (lambda: Rotation(8.0), TypeError, "int"),
    (lambda: Rotation(True), TypeError, "int"),
    (lambda: Rotation(8).apply(np.ones((2, 9), np.float32)), ValueError, "n=8"),
    (lambda: Rotation(8).apply(np.ones(8, np.int32)), TypeError, "floating"),
    (lambda: Rotation(8).inverse(np.float32(1)), ValueError, "n=8"),
    (lambda: Rotation(8).rotate_hessian(np.eye(9)), ValueError, "H \\[8, 8\\]"),
])
def test_errors(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_default_implementation_and_refusals(x64):
    """None takes the native kernel on a CPU where it is built (float32/half, a Paley mixer),
    XLA for float64 and for a random mixer above MAX_MIXER; an unknown implementation and the
    kernel on float64 are refused."""
    built = hq.kernels.cpu.available()
    assert incoherence.default_implementation(384, np.float32, "cpu") == (
        "native" if built else "xla")
    assert incoherence.default_implementation(384, jnp.bfloat16, "cpu") == (
        "native" if built else "xla")
    assert incoherence.default_implementation(384, np.float32, "gpu") == "xla"
    assert incoherence.default_implementation(384, np.float64, "cpu") == "xla"
    assert incoherence.default_implementation(1000, np.float32, "cpu") == "xla"  # m = 125
    rot = Rotation(384, 2)
    x = np.random.default_rng(0).standard_normal((5, 384)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(rot.apply(x)),
                                  np.asarray(rot.apply(x, "native" if built else "xla")))
    x64_in = x.astype(np.float64)
    np.testing.assert_array_equal(np.asarray(rot.apply(x64_in)),
                                  np.asarray(rot.apply(x64_in, "xla")))
    with pytest.raises(ValueError, match="implementation must be one of"):
        rot.apply(x, "pallas")
    with pytest.raises(ValueError, match="no native kernel"):
        rot.apply(x64_in, "native")

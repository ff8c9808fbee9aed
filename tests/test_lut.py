"""Lookup-table products against the golden ip_* arrays, decode-then-dot and exact integers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, golden_config, load_golden
from hypothesis import given, settings
from hypothesis import strategies as st

import hnlq_jax as hq
from hnlq_jax import lut

# One dithered config per lattice, with q small enough for the two-sided table.
CONFIGS = [
    hq.HNLQConfig("Z2", 3, 2, beta=0.3),
    hq.HNLQConfig("A2", 4, 2, beta=0.25, dither=(0.1, -0.2)),
    hq.HNLQConfig("D4", 4, 2, beta=0.2, dither=(0.25, -0.125, 0.0625, 0.3)),
    hq.HNLQConfig("E8", 2, 2, beta=0.5),
]
IDS = [f"{c.lattice}q{c.q}M{c.M}" for c in CONFIGS]


def _codes(g, key):
    return hq.Codes(jnp.asarray(g[f"ip_labels_{key}"]).astype(jnp.uint8),
                    jnp.asarray(g[f"ip_T_{key}"]).astype(jnp.int8))


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_inner_products(name, x64):
    g = load_golden(name)
    # The reference's inner-product arrays ignore the dither (their labels are the undithered
    # codes), so the dither file is checked without it.
    cfg = golden_config(g, dither=None)
    cx, cy = _codes(g, "X"), _codes(g, "Y")
    np.testing.assert_array_equal(hq.encode(hq.to_blocks(g["ip_X"], cfg.d), cfg).labels,
                                  g["ip_labels_X"])
    if "lut" in g:
        np.testing.assert_array_equal(lut.two_sided(cfg), g["lut"])
    if cfg.q ** (2 * cfg.d) <= lut.MAX_TWO_SIDED:
        est = np.asarray(lut.dot(cx, cy, cfg))
        np.testing.assert_allclose(est, g["ip_lut_estimate"], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(est, g["ip_decoded_exact"], rtol=1e-13, atol=1e-13)
        first = hq.Codes(cy.labels[:1], cy.T[:1])
        np.testing.assert_allclose(np.asarray(lut.matmul(cx, first, cfg))[:, 0],
                                   np.asarray(lut.dot(cx, first, cfg)), rtol=1e-13, atol=1e-13)
    one = np.asarray(lut.dot_one_sided(cx, g["ip_Y"], cfg))
    np.testing.assert_allclose(one, g["ip_one_sided"], rtol=1e-13, atol=1e-13)


def _table_configs():
    for name, qs in (("Z2", (2, 3, 4, 8, 16)), ("A2", (2, 3, 4, 8)), ("D4", (2, 3, 4)),
                     ("E8", (2,))):
        for q in qs:
            yield hq.HNLQConfig(name, q, 1)


@pytest.mark.parametrize("cfg", list(_table_configs()), ids=lambda c: f"{c.lattice}q{c.q}")
def test_two_sided_is_codebook_gram(cfg, x64):
    """SPEC §6 (7): LUT = codebook codebook^T, for every pair of labels, in the smallest dtype."""
    table = np.asarray(lut.two_sided(cfg))
    cb = np.asarray(hq.codebook(cfg))
    gram = lut.table_den(cfg) * (cb @ cb.T)
    np.testing.assert_array_equal(table, np.rint(gram))
    np.testing.assert_allclose(gram, np.rint(gram), atol=1e-9)  # integers (halves for A2)
    lo, hi = table.min(), table.max()
    fits = [t for t in (np.int8, np.int16, np.int32)
            if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max]
    assert table.dtype == fits[0]
    assert lut.table_den(cfg) == (2 if cfg.lattice == "A2" else 1)


def test_two_sided_d4_q4_is_int8():
    t = lut.two_sided(hq.HNLQConfig("D4", 4, 2))
    assert t.shape == (256, 256) and t.dtype == jnp.int8 and t.nbytes == 65536
    assert (int(t.min()), int(t.max())) == (-9, 16)


def _random_codes(cfg, shape, rng, max_T=3):
    """Uniform labels (every label combination, not only encoder outputs) and random T."""
    labels = rng.integers(0, cfg.q, size=shape + (cfg.M, cfg.d)).astype(np.uint8)
    T = rng.integers(0, max_T + 1, size=shape).astype(np.int8)
    return hq.Codes(jnp.asarray(labels), jnp.asarray(T))


def _decoded(codes, cfg):
    """``[..., n]`` decode of vector codes ``[..., nb, M, d]``, as float64."""
    x = np.asarray(hq.decode(codes, cfg), np.float64)
    return x.reshape(x.shape[:-2] + (-1,))


def _lattice_points(codes, cfg):
    """``[..., nb, d]`` exact lattice points (times 2 for E8) from the codebook, int64."""
    P = hq.codec.codebook_table(cfg.lattice, cfg.q).astype(np.int64)
    idx = np.sum(np.asarray(codes.labels, np.int64) * cfg.q ** np.arange(cfg.d - 1, -1, -1), -1)
    return np.sum(P[idx] * (cfg.q ** np.arange(cfg.M))[:, None], axis=-2)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_dot_integer_part_is_exact(cfg, x64):
    """beta = 1, T = 0, no dither: dot returns the exact integer <c_x, c_y> summed over blocks."""
    cfg = cfg.replace(beta=1.0, dither=None)
    rng = np.random.default_rng(1)
    cx, cy = _random_codes(cfg, (64, 8), rng, 0), _random_codes(cfg, (64, 8), rng, 0)
    Px, Py = _lattice_points(cx, cfg), _lattice_points(cy, cfg)
    K, den = lut._gram_P(cfg.lat)
    exact = np.einsum("...i,ij,...j->...", Px, K, Py).sum(-1)  # den * <c_x, c_y>
    np.testing.assert_array_equal(np.asarray(lut.dot(cx, cy, cfg)) * den, exact)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("use_x64", [True, False])
def test_products_equal_decode_then_dot(cfg, use_x64):
    rng = np.random.default_rng(2)
    nb, k = 6, 6 * cfg.d - 1  # a zero-padded tail block
    with jax.enable_x64(use_x64):
        cx, cy = _random_codes(cfg, (5, nb), rng), _random_codes(cfg, (5, nb), rng)
        W = _random_codes(cfg, (7, nb), rng)
        y = rng.normal(size=(5, k))
        dx, dy, dW = _decoded(cx, cfg), _decoded(cy, cfg), _decoded(W, cfg)
        tol = dict(rtol=1e-12, atol=1e-12) if use_x64 else dict(rtol=2e-5, atol=2e-5)
        scale = np.abs(dx).max() * np.abs(dy).max() * dx.shape[-1]
        yp = np.pad(y, [(0, 0), (0, 1)])
        np.testing.assert_allclose(np.asarray(lut.dot(cx, cy, cfg)) / scale,
                                   np.sum(dx * dy, -1) / scale, **tol)
        np.testing.assert_allclose(np.asarray(lut.dot_one_sided(cx, y, cfg)) / scale,
                                   np.sum(dx * yp, -1) / scale, **tol)
        np.testing.assert_allclose(np.asarray(lut.matmul(cx, W, cfg)) / scale,
                                   dx @ dW.T / scale, **tol)
        np.testing.assert_allclose(np.asarray(lut.matmul_one_sided(W, y, cfg)) / scale,
                                   yp @ dW.T / scale, **tol)
        t = np.asarray(lut.one_sided(y, cfg))
        cb = np.asarray(hq.codebook(cfg), np.float64)
        np.testing.assert_allclose(t, yp.reshape(5, nb, cfg.d) @ cb.T, **tol)
        assert t.dtype == (np.float64 if use_x64 else np.float32)


def test_encoded_data_and_leading_shapes(x64):
    """Real codes (with overloads), broadcast leading shapes, a 3-D activation batch."""
    cfg = CONFIGS[2]
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(3, 1, 32)) * 2, rng.normal(size=(4, 32))
    cx, cy = hq.encode(hq.to_blocks(x, 4), cfg), hq.encode(hq.to_blocks(y, 4), cfg)
    assert int(jnp.max(cx.T)) > 0
    dx, dy = _decoded(cx, cfg), _decoded(cy, cfg)
    np.testing.assert_allclose(lut.dot(cx, cy, cfg), np.sum(dx * dy, -1), rtol=1e-12)
    np.testing.assert_allclose(lut.dot_one_sided(cx, y, cfg), np.sum(dx * y, -1), rtol=1e-12)
    np.testing.assert_allclose(lut.matmul(cx, cy, cfg), dx @ dy.T, rtol=1e-12)
    a = rng.normal(size=(2, 3, 32))
    np.testing.assert_allclose(lut.matmul_one_sided(cy, a, cfg), a @ dy.T, rtol=1e-12)
    assert lut.matmul(cx, cy, cfg).shape == (3, 1, 4)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), which=st.sampled_from(range(len(CONFIGS))))
def test_dot_symmetric_and_matmul_consistent(seed, which):
    cfg = CONFIGS[which]
    rng = np.random.default_rng(seed)
    cx, cy = _random_codes(cfg, (4, 3), rng), _random_codes(cfg, (4, 3), rng)
    np.testing.assert_array_equal(lut.dot(cx, cy, cfg), lut.dot(cy, cx, cfg))
    m = np.asarray(lut.matmul(cx, cy, cfg))
    np.testing.assert_allclose(np.diagonal(m), lut.dot(cx, cy, cfg), rtol=1e-5, atol=1e-5)


def test_invalid_blocks_give_nan():
    cfg = CONFIGS[0]
    cx = _random_codes(cfg, (2, 3), np.random.default_rng(4))
    cx = hq.Codes(cx.labels, cx.T.at[0, 1].set(-1))
    out = np.asarray(lut.dot(cx, cx, cfg))
    assert np.isnan(out[0]) and np.isfinite(out[1])
    assert np.isnan(np.asarray(lut.dot_one_sided(cx, np.ones((2, 6)), cfg))[0])
    m = np.asarray(lut.matmul(cx, cx, cfg))
    assert np.isnan(m[0]).all() and np.isnan(m[:, 0]).all() and np.isfinite(m[1, 1])


def test_jit_and_vmap():
    cfg = CONFIGS[2]
    rng = np.random.default_rng(5)
    cx, cy = _random_codes(cfg, (3, 4), rng), _random_codes(cfg, (3, 4), rng)
    y = rng.normal(size=(3, 16)).astype(np.float32)
    np.testing.assert_array_equal(jax.jit(lut.dot, static_argnums=2)(cx, cy, cfg),
                                  lut.dot(cx, cy, cfg))
    f = jax.vmap(lambda c, v: lut.dot_one_sided(c, v, cfg))
    np.testing.assert_allclose(f(cx, y), lut.dot_one_sided(cx, y, cfg), rtol=1e-6)


def test_table_size_errors():
    for cfg in (hq.HNLQConfig("E8", 3, 1), hq.HNLQConfig("D4", 8, 2)):
        with pytest.raises(ValueError, match=r"q\^\(2d\) = .* one-sided"):
            lut.two_sided(cfg)
        c = _random_codes(cfg, (1, 1), np.random.default_rng(0))
        with pytest.raises(ValueError, match="two-sided table"):
            lut.dot(c, c, cfg)
        with pytest.raises(ValueError, match="two-sided table"):
            lut.matmul(c, c, cfg)
    with pytest.raises(ValueError, match=r"q\^d = 16,777,216 .* decode then dot"):
        lut.one_sided(np.zeros(8), hq.HNLQConfig("E8", 8, 1))
    with pytest.raises(ValueError, match="int32"):
        lut.dot(*[_random_codes(hq.HNLQConfig("Z2", 16, 5), (1, 1), np.random.default_rng(0))] * 2,
                hq.HNLQConfig("Z2", 16, 5))


def test_bad_input():
    cfg = CONFIGS[2]
    rng = np.random.default_rng(6)
    c = _random_codes(cfg, (2, 3), rng)
    with pytest.raises(ValueError, match="blocks; they must agree"):
        lut.dot(c, _random_codes(cfg, (2, 4), rng), cfg)
    with pytest.raises(ValueError, match="do not broadcast"):
        lut.dot(c, _random_codes(cfg, (3, 3), rng), cfg)
    with pytest.raises(ValueError, match=r"labels \[..., nb, M, d\]"):
        lut.dot(hq.Codes(c.labels[0, 0], c.T[0, 0]), c, cfg)
    with pytest.raises(ValueError, match="labels must be in 0..q-1"):
        lut.dot(hq.Codes(c.labels.at[0, 0, 0, 0].set(4), c.T), c, cfg)
    with pytest.raises(ValueError, match="T must be in"):
        lut.dot(hq.Codes(c.labels, c.T.at[0, 0].set(100)), c, cfg)
    with pytest.raises(ValueError, match=r"M=3, d=4\] .* got labels \(2, 3, 2, 4\)"):
        lut.dot(c, c, cfg.replace(M=3))
    with pytest.raises(TypeError, match="HNLQConfig"):
        lut.dot(c, c, "D4")
    with pytest.raises(ValueError, match=r"length 9..12"):
        lut.dot_one_sided(c, np.zeros((2, 13)), cfg)
    with pytest.raises(ValueError, match="NaN or Inf"):
        lut.dot_one_sided(c, np.full((2, 12), np.nan), cfg)
    with pytest.raises(TypeError, match="floating"):
        lut.one_sided(np.zeros((2, 12), np.int32), cfg)
    with pytest.raises(ValueError, match=r"labels \[n, nb, M, d\]"):
        lut.matmul(c, hq.Codes(c.labels[None], c.T[None]), cfg)
    with pytest.raises(ValueError, match="blocks per row"):
        lut.matmul(c, _random_codes(cfg, (2, 4), rng), cfg)
    with pytest.raises(ValueError, match=r"length 9..12"):
        lut.matmul_one_sided(c, np.zeros((5, 8)), cfg)

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
needs_native = pytest.mark.skipif(not hq.kernels.cpu.available(),
                                  reason=f"{hq.kernels.cpu.why_unavailable()}")


@pytest.mark.golden
@pytest.mark.parametrize("name", GOLDEN)
def test_golden_inner_products(name, x64):
    g = load_golden(name)
    # The reference's inner-product arrays ignore the dither (their labels are the undithered
    # codes), so the dither file is checked without it.
    cfg = golden_config(g, dither=None)
    cx = hq.Codes.from_labels(g["ip_labels_X"], g["ip_T_X"], cfg)
    cy = hq.Codes.from_labels(g["ip_labels_Y"], g["ip_T_Y"], cfg)
    enc = hq.encode(hq.to_blocks(g["ip_X"], cfg.d), cfg)
    np.testing.assert_array_equal(enc.labels, g["ip_labels_X"])
    np.testing.assert_array_equal(enc.index, cx.index)
    if "lut" in g:
        np.testing.assert_array_equal(lut.two_sided(cfg), g["lut"])
    if cfg.q ** (2 * cfg.d) <= lut.MAX_TWO_SIDED:
        est = np.asarray(lut.dot(cx, cy))
        np.testing.assert_allclose(est, g["ip_lut_estimate"], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(est, g["ip_decoded_exact"], rtol=1e-13, atol=1e-13)
        first = hq.Codes(cy.index[:1], cy.tfield[:1], cfg)  # vector 0 (blocks [1, nb])
        np.testing.assert_allclose(np.asarray(lut.matmul(cx, first))[:, 0],
                                   np.asarray(lut.dot(cx, first)), rtol=1e-13, atol=1e-13)
    one = np.asarray(lut.dot_one_sided(cx, g["ip_Y"]))
    np.testing.assert_allclose(one, g["ip_one_sided"], rtol=1e-13, atol=1e-13)


def _table_configs():
    for name, qs in (("Z2", (2, 3, 4, 8, 16)), ("A2", (2, 3, 4, 8)), ("D4", (2, 3, 4)),
                     ("E8", (2,))):
        for q in qs:
            yield hq.HNLQConfig(name, q, 1)


@pytest.mark.parametrize("cfg", list(_table_configs()), ids=lambda c: f"{c.lattice}q{c.q}")
def test_two_sided_is_codebook_gram(cfg, x64):
    """docs/math.md#identities (7): LUT = codebook codebook^T, for every pair of labels, in the
    smallest dtype."""
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
    return hq.Codes.from_labels(labels, T, cfg)


def _decoded(codes):
    """``[..., n]`` decode of vector codes (blocks ``[..., nb]``, or row codes), as float64."""
    x = np.asarray(hq.decode(codes), np.float64)
    return x if codes.n is not None else x.reshape(x.shape[:-2] + (-1,))


def _lattice_points(codes):
    """``[..., nb, d]`` exact lattice points (times 2 for E8) from the codebook, int64."""
    cfg = codes.config
    P = hq.codec.codebook_table(cfg.lattice, cfg.q).astype(np.int64)
    return np.sum(P[np.asarray(codes.index, np.int64)] * (cfg.q ** np.arange(cfg.M))[:, None],
                  axis=-2)


def _assert_products(got, ref, bound, atol):
    """``got == ref`` to ``atol`` relative to ``bound``, a per-entry bound of ``|ref|`` (e.g.
    the product of the two vectors' norms), so small products are checked as tightly as large."""
    np.testing.assert_allclose(np.asarray(got) / bound, np.asarray(ref) / bound, rtol=0,
                               atol=atol)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_dot_integer_part_is_exact(cfg, x64):
    """beta = 1, T = 0, no dither: dot returns the exact integer <c_x, c_y> summed over blocks."""
    cfg = cfg.replace(beta=1.0, dither=None)
    rng = np.random.default_rng(1)
    cx, cy = _random_codes(cfg, (64, 8), rng, 0), _random_codes(cfg, (64, 8), rng, 0)
    Px, Py = _lattice_points(cx), _lattice_points(cy)
    K, den = lut._gram_P(cfg.lat)
    exact = np.einsum("...i,ij,...j->...", Px, K, Py).sum(-1)  # den * <c_x, c_y>
    np.testing.assert_array_equal(np.asarray(lut.dot(cx, cy)) * den, exact)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("use_x64", [True, False])
def test_products_equal_decode_then_dot(cfg, use_x64):
    """An odd block count (the 4-bit T field pads its last byte) and a zero-padded tail block."""
    rng = np.random.default_rng(2)
    nb, k = 5, 5 * cfg.d - 1
    with jax.enable_x64(use_x64):
        cx, cy = _random_codes(cfg, (5, nb), rng), _random_codes(cfg, (5, nb), rng)
        W = _random_codes(cfg, (7, nb), rng)
        y = rng.normal(size=(5, k))
        dx, dy, dW = _decoded(cx), _decoded(cy), _decoded(W)
        tol = dict(rtol=1e-12, atol=1e-12) if use_x64 else dict(rtol=2e-5, atol=2e-5)
        scale = np.abs(dx).max() * np.abs(dy).max() * dx.shape[-1]
        yp = np.pad(y, [(0, 0), (0, 1)])
        np.testing.assert_allclose(np.asarray(lut.dot(cx, cy)) / scale,
                                   np.sum(dx * dy, -1) / scale, **tol)
        np.testing.assert_allclose(np.asarray(lut.dot_one_sided(cx, y)) / scale,
                                   np.sum(dx * yp, -1) / scale, **tol)
        np.testing.assert_allclose(np.asarray(lut.matmul(cx, W)) / scale, dx @ dW.T / scale,
                                   **tol)
        np.testing.assert_allclose(np.asarray(lut.matmul_one_sided(W, y)) / scale,
                                   yp @ dW.T / scale, **tol)
        t = np.asarray(lut.one_sided(y, cfg))
        cb = np.asarray(hq.codebook(cfg), np.float64)
        np.testing.assert_allclose(t, yp.reshape(5, nb, cfg.d) @ cb.T, **tol)
        assert t.dtype == (np.float64 if use_x64 else np.float32)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_row_codes_apply_row_scales(cfg, x64):
    """Row codes (hq.encode_rows) of rows whose magnitudes differ by 10^4: every product is
    scaled by the right rows' scales, on the right axes."""
    rng = np.random.default_rng(7)
    k = 5 * cfg.d - 1  # an odd block count and a zero-padded tail
    W = rng.normal(size=(6, k)) * np.array([1, 100, 0.01, 3, 1, 7])[:, None]
    A = rng.normal(size=(3, k)) * np.array([0.1, 50, 1])[:, None]
    cW, cA, cW3 = hq.encode_rows(W, cfg), hq.encode_rows(A, cfg), hq.encode_rows(W[:3], cfg)
    assert cW.n == k and cW.scale.shape == (6,) and cW.config == cfg.replace(beta=1.0)
    dW, dA, dW3 = _decoded(cW), _decoded(cA), _decoded(cW3)
    x, y = rng.normal(size=(2, 4, k)), rng.normal(size=(6, k))
    nW, nA, nx = (np.linalg.norm(v, axis=-1) for v in (dW, dA, x))
    _assert_products(lut.matmul_one_sided(cW, x), x @ dW.T, nx[..., None] * nW, 1e-12)
    _assert_products(lut.matmul(cA, cW), dA @ dW.T, nA[:, None] * nW, 1e-12)
    _assert_products(lut.dot(cA, cW3), np.sum(dA * dW3, -1), nA * nW[:3], 1e-12)
    _assert_products(lut.dot_one_sided(cW, y), np.sum(dW * y, -1),
                     nW * np.linalg.norm(y, axis=-1), 1e-12)
    # The same through the front door, which takes the LUT path on request.
    _assert_products(hq.matmul(x, cW, implementation="lut"), x @ dW.T, nx[..., None] * nW, 1e-12)


def test_encoded_data_and_leading_shapes(x64):
    """Real codes (with overloads), broadcast leading shapes, a 3-D activation batch."""
    cfg = CONFIGS[2]
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(3, 1, 32)) * 2, rng.normal(size=(4, 32))
    cx, cy = hq.encode(hq.to_blocks(x, 4), cfg), hq.encode(hq.to_blocks(y, 4), cfg)
    assert int(jnp.max(cx.T)) > 0
    dx, dy = _decoded(cx), _decoded(cy)
    np.testing.assert_allclose(lut.dot(cx, cy), np.sum(dx * dy, -1), rtol=1e-12)
    np.testing.assert_allclose(lut.dot_one_sided(cx, y), np.sum(dx * y, -1), rtol=1e-12)
    np.testing.assert_allclose(lut.matmul(cx, cy), dx @ dy.T, rtol=1e-12)
    a = rng.normal(size=(2, 3, 32))
    np.testing.assert_allclose(lut.matmul_one_sided(cy, a), a @ dy.T, rtol=1e-12)
    assert lut.matmul(cx, cy).shape == (3, 1, 4)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), which=st.sampled_from(range(len(CONFIGS))))
def test_dot_symmetric_and_matmul_consistent(seed, which):
    cfg = CONFIGS[which]
    rng = np.random.default_rng(seed)
    cx, cy = _random_codes(cfg, (4, 3), rng), _random_codes(cfg, (4, 3), rng)
    np.testing.assert_array_equal(lut.dot(cx, cy), lut.dot(cy, cx))
    m = np.asarray(lut.matmul(cx, cy))
    np.testing.assert_allclose(np.diagonal(m), lut.dot(cx, cy), rtol=1e-5, atol=1e-5)


def test_invalid_blocks_give_nan():
    cfg = CONFIGS[0]
    cx = _random_codes(cfg, (2, 3), np.random.default_rng(4))
    cx = hq.Codes.from_labels(cx.labels, cx.T.at[0, 1].set(-1), cfg)
    out = np.asarray(lut.dot(cx, cx))
    assert np.isnan(out[0]) and np.isfinite(out[1])
    assert np.isnan(np.asarray(lut.dot_one_sided(cx, np.ones((2, 6))))[0])
    m = np.asarray(lut.matmul(cx, cx))
    assert np.isnan(m[0]).all() and np.isnan(m[:, 0]).all() and np.isfinite(m[1, 1])
    assert np.isnan(np.asarray(lut.matmul_one_sided(cx, np.ones((3, 6))))[:, 0]).all()


@pytest.mark.parametrize("impl", ["xla", pytest.param("native", marks=needs_native)])
def test_real_nan_and_inf_reach_the_results_they_touch(impl):
    """NaN and Inf in the real operand propagate as in a float dot (no error: hq.matmul's
    "lut" route, jitted, and the eager lut functions agree), to their own rows only."""
    cfg = NATIVE[0]
    codes = hq.encode_rows(np.random.default_rng(6).normal(size=(5, 64)).astype(np.float32),
                           cfg)
    x = np.ones((3, 64), np.float32)
    x[0, 7], x[1, 40] = np.nan, np.inf
    y = np.asarray(lut.matmul_one_sided(codes, x, implementation=impl))
    assert not np.isfinite(y[:2]).any() and np.isfinite(y[2]).all()
    np.testing.assert_allclose(y, hq.matmul(x, codes, implementation="lut"), rtol=1e-5)
    assert np.isnan(np.asarray(lut.one_sided(x, cfg))[0, 1]).all()
    v = np.asarray(lut.dot_one_sided(hq.encode_rows(x[2:], cfg), x))
    assert not np.isfinite(v[:2]).any() and np.isfinite(v[2])


def test_jit_and_vmap():
    cfg = CONFIGS[2]
    rng = np.random.default_rng(5)
    cx, cy = _random_codes(cfg, (3, 4), rng), _random_codes(cfg, (3, 4), rng)
    y = rng.normal(size=(3, 16)).astype(np.float32)
    np.testing.assert_array_equal(jax.jit(lut.dot)(cx, cy), lut.dot(cx, cy))
    np.testing.assert_allclose(jax.vmap(lut.dot_one_sided)(cx, y), lut.dot_one_sided(cx, y),
                               rtol=1e-6)


def test_empty_inputs_give_empty_results():
    """No rows, no columns or no blocks: empty (or zero) results, not a ZeroDivisionError."""
    cfg = CONFIGS[2]
    rng = np.random.default_rng(8)
    A, W = _random_codes(cfg, (2, 3), rng), _random_codes(cfg, (5, 3), rng)
    assert lut.matmul(_random_codes(cfg, (0, 3), rng), W).shape == (0, 5)
    assert lut.matmul(A, _random_codes(cfg, (0, 3), rng)).shape == (2, 0)
    assert lut.matmul(_random_codes(cfg, (2, 0, 3), rng), W).shape == (2, 0, 5)
    np.testing.assert_array_equal(
        lut.matmul(_random_codes(cfg, (2, 0), rng), _random_codes(cfg, (5, 0), rng)),
        np.zeros((2, 5)))  # k = 0: empty sums
    assert lut.matmul_one_sided(W, np.zeros((0, 12), np.float32)).shape == (0, 5)
    assert lut.matmul_one_sided(W, np.zeros((2, 0, 12), np.float32)).shape == (2, 0, 5)
    assert lut.matmul_one_sided(_random_codes(cfg, (0, 3), rng),
                                np.ones((2, 12), np.float32)).shape == (2, 0)
    np.testing.assert_array_equal(
        lut.matmul_one_sided(_random_codes(cfg, (5, 0), rng), np.zeros((2, 0), np.float32)),
        np.zeros((2, 5)))
    assert lut.dot(_random_codes(cfg, (0, 3), rng), _random_codes(cfg, (0, 3), rng)).shape == (0,)
    assert lut.dot_one_sided(_random_codes(cfg, (0, 3), rng),
                             np.zeros((0, 12), np.float32)).shape == (0,)
    rows = hq.encode_rows(np.zeros((0, 12), np.float32), cfg)
    assert lut.matmul_one_sided(rows, np.ones((2, 12), np.float32)).shape == (2, 0)


def test_different_configs_are_refused():
    """Two codes of different configs do not combine; row codes (unit beta, the scale in their
    rows) do not combine with block codes of the config they were made from."""
    cfg = CONFIGS[2]
    rng = np.random.default_rng(9)
    c = _random_codes(cfg, (2, 3), rng)
    for other in (cfg.replace(dither=None), cfg.replace(q=3), cfg.replace(M=3),
                  cfg.replace(max_T=20), hq.encode_rows(np.ones((2, 12)), cfg).config):
        o = _random_codes(other, (2, 3), rng)
        with pytest.raises(ValueError, match="different configs"):
            lut.dot(c, o)
        with pytest.raises(ValueError, match="different configs"):
            lut.matmul(c, o)
        with pytest.raises(ValueError, match="different configs"):
            lut.matmul(o, c)


def test_table_size_errors():
    for cfg in (hq.HNLQConfig("E8", 3, 1), hq.HNLQConfig("D4", 8, 2)):
        with pytest.raises(ValueError, match=r"q\^\(2d\) = .* one-sided"):
            lut.two_sided(cfg)
        c = _random_codes(cfg, (1, 1), np.random.default_rng(0))
        with pytest.raises(ValueError, match="two-sided table"):
            lut.dot(c, c)
        with pytest.raises(ValueError, match="two-sided table"):
            lut.matmul(c, c)
    with pytest.raises(ValueError, match=r"q\^d = 16,777,216 .* decode then dot"):
        lut.one_sided(np.zeros(8), hq.HNLQConfig("E8", 8, 1))
    c = _random_codes(hq.HNLQConfig("Z2", 16, 5), (1, 1), np.random.default_rng(0))
    with pytest.raises(ValueError, match="int32"):
        lut.dot(c, c)
    with pytest.raises(ValueError, match="int32"):
        lut.matmul(c, c)
    # the table itself depends on lattice and q only (as documented): it is M = 1's
    np.testing.assert_array_equal(lut.two_sided(c.config),
                                  lut.two_sided(c.config.replace(M=1)))


def test_bad_input():
    cfg = CONFIGS[2]
    rng = np.random.default_rng(6)
    c = _random_codes(cfg, (2, 3), rng)
    with pytest.raises(ValueError, match="blocks; they must agree"):
        lut.dot(c, _random_codes(cfg, (2, 4), rng))
    with pytest.raises(ValueError, match="do not broadcast"):
        lut.dot(c, _random_codes(cfg, (3, 3), rng))
    with pytest.raises(ValueError, match=r"codes of vectors, blocks \[..., nb\]"):
        # one block: its T field is one whole byte u (here 1: T = 0)
        lut.dot(hq.Codes(c.index[0, 0], jnp.uint8(1), cfg), c)
    with pytest.raises(TypeError, match="expected hnlq_jax.Codes, got tuple"):
        lut.dot((c.labels, c.T), c)
    with pytest.raises(TypeError, match="codes carry no HNLQConfig"):
        lut.dot_one_sided(hq.Codes(c.index, c.tfield, "D4"), np.zeros((2, 12)))
    with pytest.raises(ValueError, match=r"expected index uint8\[..., M=2\]"):
        lut.dot(hq.Codes(c.index[..., :1], c.tfield, cfg), c)
    with pytest.raises(ValueError, match=r"uint8 T field of shape \[2, 2\]"):
        lut.matmul(c, hq.Codes(c.index, c.tfield[:, :1], cfg))
    # Corrupted codes: an index >= q^d = 9 (Z2 q=3), a T above max_T = 3 (4-bit field).
    z = _random_codes(CONFIGS[0], (2, 3), rng)
    with pytest.raises(ValueError, match="codebook index out of range: values up to 9 >= q\\^d"):
        lut.dot(hq.Codes(z.index.at[1, 2, 0].set(9), z.tfield, CONFIGS[0]), z)
    small = cfg.replace(max_T=3)
    s = _random_codes(small, (2, 3), rng)
    with pytest.raises(ValueError, match="T field holds values above max_T = 3"):
        lut.matmul_one_sided(hq.Codes(s.index, s.tfield.at[0, 1].set(5), small),
                             np.zeros((1, 12)))
    with pytest.raises(TypeError, match="HNLQConfig"):
        lut.one_sided(np.zeros((2, 12)), "D4")
    with pytest.raises(ValueError, match=r"length 9..12"):
        lut.dot_one_sided(c, np.zeros((2, 13)))
    with pytest.raises(TypeError, match="floating"):
        lut.one_sided(np.zeros((2, 12), np.int32), cfg)
    with pytest.raises(ValueError, match=r"B must be coded as n rows .* got blocks \[1, 2, 3\]"):
        lut.matmul(c, hq.Codes(c.index[None], c.tfield[None], cfg))
    with pytest.raises(ValueError, match="blocks per row"):
        lut.matmul(c, _random_codes(cfg, (2, 4), rng))
    with pytest.raises(ValueError, match=r"length 9..12"):
        lut.matmul_one_sided(c, np.zeros((5, 8)))


# The native sums (kernels.cpu.lut_matmul): 16 blocks a register with AVX-512 for two levels of
# uint8 indices (D4 q=4, E8 q=2, Z2 q=3), a block at a time otherwise (A2's two-sided table,
# three levels, E8 q=4's uint16 indices: one-sided only)
NATIVE = [hq.HNLQConfig("D4", 4, 2, beta=0.2), hq.HNLQConfig("D4", 3, 3, beta=0.3),
          hq.HNLQConfig("E8", 4, 2, beta=0.25)] + CONFIGS


@needs_native
@pytest.mark.parametrize("cfg", NATIVE, ids=lambda c: f"{c.lattice}q{c.q}M{c.M}")
@settings(max_examples=3, deadline=None)
@given(m=st.integers(1, 5), n=st.integers(1, 19), nb=st.integers(16, 40),
       seed=st.integers(0, 2**16))
def test_native_sums_equal_xla(cfg, m, n, nb, seed):
    """Both products' native sums against XLA's gathers, within float rounding (whole
    registers of 16 blocks, a ragged rest, several tiles of 8 columns), on the CPU's best
    instruction set and the portable loop."""
    rng = np.random.default_rng(seed)
    if cfg.lattice == "E8" and cfg.q == 4:
        nb = min(nb, 4)  # one-sided tables of 65,536 entries a block
    W, A = _random_codes(cfg, (n, nb), rng), _random_codes(cfg, (m, nb), rng)
    x = rng.normal(size=(m, nb * cfg.d)).astype(np.float32)
    pairs = [(lut.matmul_one_sided, (W, x))]
    if cfg.q**(2 * cfg.d) <= lut.MAX_TWO_SIDED:
        pairs.append((lut.matmul, (A, W)))
    for fn, args in pairs:
        want = np.asarray(fn(*args, implementation="xla"))
        for level in ("portable", hq.kernels.cpu.isa()):
            with hq.kernels.cpu.use_isa(level):
                got = np.asarray(fn(*args, implementation="native"))
            assert got.dtype == np.float32 and got.shape == want.shape == (m, n)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                       err_msg=level)
        np.testing.assert_array_equal(np.asarray(fn(*args)), got)  # None: native on a CPU


# Two levels of uint8 indices of 64 weight rows and more take the planes (AVX512-VBMI: 64 rows
# a register, spans of 8 tiles, steps of 64 blocks and a last shorter one, the tail rows as
# before; 4- and 8-bit T fields), unless steps past u = 31 are valid (max_T = 40)
PLANES = [hq.HNLQConfig("D4", 4, 2, beta=0.2, dither=(0.25, -0.125, 0.0625, 0.3)),
          hq.HNLQConfig("D4", 3, 2, beta=0.3), hq.HNLQConfig("E8", 2, 2, beta=0.5),
          hq.HNLQConfig("Z2", 16, 2, beta=0.1), hq.HNLQConfig("D4", 4, 2, beta=0.2, max_T=20),
          hq.HNLQConfig("D4", 4, 2, beta=0.2, max_T=40)]


@needs_native
@pytest.mark.parametrize("cfg", PLANES, ids=lambda c: f"{c.lattice}q{c.q}M{c.M}T{c.max_T}")
@settings(max_examples=3, deadline=None)
@given(m=st.integers(1, 3), n=st.integers(64, 600), nb=st.integers(1, 140),
       seed=st.integers(0, 2**16))
def test_native_sums_by_planes_equal_xla(cfg, m, n, nb, seed):
    """Both products' native sums against XLA's gathers at shapes the planes take: failed
    blocks (T = -1: NaN columns), T up to max_T, the two-sided table, within float rounding."""
    rng = np.random.default_rng(seed)
    W = _random_codes(cfg, (n, nb), rng, max_T=cfg.max_T)
    T = np.where(rng.random((n, nb)) < 0.002, -1, np.asarray(W.T))  # a few failed blocks
    W = hq.Codes.from_labels(W.labels, T, cfg)
    x = rng.normal(size=(m, nb * cfg.d)).astype(np.float32)
    pairs = [(lut.matmul_one_sided, (W, x))]
    if cfg.q**(2 * cfg.d) <= lut.MAX_TWO_SIDED:
        pairs.append((lut.matmul, (_random_codes(cfg, (m, nb), rng), W)))
    for fn, args in pairs:
        want = np.asarray(fn(*args, implementation="xla"))
        got = np.asarray(fn(*args, implementation="native"))
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        assert nan.any(axis=0).sum() == (T == -1).any(axis=1).sum()
        np.testing.assert_allclose(got[~nan], want[~nan], rtol=1e-5,
                                   atol=2e-5 * np.abs(want[~nan]).max())


@needs_native
@pytest.mark.parametrize("n, nb, bad", [(3, 20, 5), (70, 64, 40)])  # 16 blocks; the planes
def test_native_invalid_blocks_give_nan_under_jit(n, nb, bad):
    """A failed block (T = -1) in a whole register and an index >= q^d (D4 q=3: uint8 indices
    up to 255; only under jit, eager calls refuse them) make their columns NaN, as XLA's."""
    cfg = hq.HNLQConfig("D4", 3, 2, beta=0.3)
    rng = np.random.default_rng(7)
    W = _random_codes(cfg, (n, nb), rng)
    W = hq.Codes.from_labels(W.labels, W.T.at[0, 3].set(-1), cfg)
    for level, at in ((1, 200), (0, 81)):  # level 1 of row 2, level 0 of row n - 1
        row = 2 if level else n - 1
        W = hq.Codes(W.index.at[row, bad, level].set(at), W.tfield, cfg)
    x = rng.normal(size=(2, 4 * nb)).astype(np.float32)
    for impl in ("native", "xla"):
        y = np.asarray(jax.jit(lambda c, v, impl=impl: lut.matmul_one_sided(
            c, v, implementation=impl))(W, x))
        assert np.isnan(y[:, [0, 2, n - 1]]).all() and np.isfinite(y[:, 1]).all()
        assert np.isfinite(np.delete(y, [0, 2, n - 1], axis=1)).all()


@needs_native
def test_native_sums_differentiate_as_xla():
    """The native sums take the XLA path's VJP: gradients in x (one-sided) equal XLA's."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    rng = np.random.default_rng(9)
    W = _random_codes(cfg, (5, 20), rng)
    x = rng.normal(size=(3, 80)).astype(np.float32)
    g = rng.normal(size=(3, 5)).astype(np.float32)  # a linear loss: the same VJP, same bits
    grads = [jax.grad(lambda v, i=i: jnp.sum(g * lut.matmul_one_sided(
        W, v, implementation=i)))(x) for i in ("native", "xla")]
    np.testing.assert_array_equal(grads[0], grads[1])


def test_native_refusals():
    cfg = CONFIGS[2]
    W = _random_codes(cfg, (3, 4), np.random.default_rng(8))
    for x in (np.ones((1, 16), np.float32), np.ones((0, 16), np.float32)):  # empty: checked too
        with pytest.raises(ValueError, match="implementation must be one of"):
            lut.matmul_one_sided(W, x, implementation="lut")
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="the tables are float64"):
            lut.matmul(W, W, implementation="native")
        assert lut.matmul(W, W).dtype == jnp.float64  # None: XLA's float64 gathers
        if hq.kernels.cpu.available():  # float32 activations: float32 tables, native
            x = np.ones((1, 16), np.float32)
            np.testing.assert_array_equal(
                lut.matmul_one_sided(W, x, implementation="native"), lut.matmul_one_sided(W, x))

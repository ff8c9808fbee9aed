"""Rate statistics and the beta grid search against the reference's search."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import golden_config, load_golden

import hnlq_jax as hq
from hnlq_jax._numerics import mean_square, sum_of_squares
from hnlq_jax.stats import search_beta


def test_rate_stats_by_hand():
    cfg = hq.HNLQConfig("D4", 4, 2, max_T=5)
    T = jnp.asarray([[0, 0, 1, 1], [0, 0, 2, -1]], jnp.int8)
    codes = hq.Codes.from_labels(jnp.zeros((2, 4, 2, 4), jnp.uint8), T, cfg)
    s = hq.rate_stats(codes)
    p = np.array([1, 4, 2, 1]) / 8  # T = -1, 0, 1, 2
    H = -np.sum(p * np.log2(p))
    assert float(s.entropy_T) == pytest.approx(H)
    assert float(s.rate) == pytest.approx(4 + H / 4)
    assert float(s.overload_rate) == pytest.approx(3 / 8)
    assert float(s.failure_rate) == pytest.approx(1 / 8)
    np.testing.assert_array_equal(s.histogram, [4, 2, 1, 0, 0, 0])
    assert repr(s) == (f"RateStats(overload_rate=0.375, failure_rate=0.125, histogram=[4, 2, 1, "
                       f"0, 0, 0], entropy_T={H:.4g}, rate={4 + H / 4:.4g})")


def test_rate_stats_no_overload_is_nominal_rate():
    cfg = hq.HNLQConfig("E8", 4, 2)
    s = hq.rate_stats(hq.Codes.from_labels(jnp.zeros((7, 2, 8), jnp.uint8), jnp.zeros(7, jnp.int8),
                                           cfg))
    assert float(s.entropy_T) == 0 and float(s.rate) == 4.0
    # One symbol, or none at all: H = +0 (a negated sum would print as -0).
    empty = hq.rate_stats(hq.encode(np.zeros((0, 8), np.float32), cfg.replace(beta=0.2)))
    for st in (s, empty):
        assert not np.signbit(float(st.entropy_T)) and "entropy_T=0," in repr(st)


@pytest.mark.parametrize("max_T", [14, 20], ids=["4bit", "8bit"])
def test_rate_stats_odd_block_count(max_T):
    """Counts come from the T field's blocks only: an odd last axis (4-bit field: a pad nibble)
    adds no T = -1 or T = 0 block, and every T up to max_T lands in its bin."""
    cfg = hq.HNLQConfig("D4", 4, 2, max_T=max_T)
    L = -(-(max_T + 2) // 3) | 1  # odd, and 3 L >= the max_T + 2 values of T
    T = np.resize(np.arange(-1, max_T + 1), 3 * L).reshape(3, L)  # every value, some twice
    codes = hq.Codes.from_labels(np.zeros(T.shape + (2, 4), np.uint8), T, cfg)
    s = hq.rate_stats(codes)
    counts = np.bincount(T.reshape(-1) + 1, minlength=max_T + 2)
    np.testing.assert_array_equal(s.histogram, counts[1:])
    assert float(s.failure_rate) == pytest.approx(counts[0] / T.size)
    assert float(s.overload_rate) == pytest.approx(counts[2:].sum() / T.size)


def test_rate_stats_of_row_codes_and_bad_input():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    W = np.random.default_rng(1).normal(size=(5, 30)).astype(np.float32)
    rows = hq.encode_rows(W, cfg)
    s = hq.rate_stats(rows)
    T = np.asarray(rows.T)
    assert T.shape == (5, 8) and T.max() > 0 and int(np.sum(s.histogram)) == 5 * 8  # per block
    np.testing.assert_array_equal(s.histogram, np.bincount(T.ravel(), minlength=15))
    with pytest.raises(TypeError, match="expected hnlq_jax.Codes"):
        hq.rate_stats(np.zeros(4, np.int8))


@pytest.mark.golden
@pytest.mark.parametrize("name", ["D4_q4_M2.npz", "Z2_q3_M2.npz", "D4_q8_M1.npz"])
def test_calibrate_beta_reproduces_reference(name, x64):
    """The paper's grid search on default_rng(0) data picks the reference's beta and numbers."""
    g = load_golden(name)
    cfg = golden_config(g)
    x = np.random.default_rng(0).standard_normal((4000, cfg.d))
    assert cfg.beta_min() == pytest.approx(float(g["beta_min"]), rel=1e-15)
    beta, table = hq.calibrate_beta(x, cfg, scale=1.0)  # the reference's grid
    b, mse, H, R, f, p = g["beta_search_best"]
    assert beta == pytest.approx(b, rel=1e-12)
    i = table.best
    np.testing.assert_allclose([table.mse[i], table.entropy_T[i], table.rate[i], table.f[i],
                                table.overload_rate[i]], [mse, H, R, f, p], rtol=1e-9)
    assert table.beta.shape == (40,) and np.all(np.diff(table.beta) > 0)


def test_calibrate_beta_mse_criterion():
    cfg = hq.HNLQConfig("D4", 4, 2)
    x = np.random.default_rng(3).standard_normal((2000, 4)).astype(np.float32)
    beta, table = hq.calibrate_beta(x, cfg, criterion="mse", num=12, step=0.1)
    assert table.best == int(np.argmin(table.mse)) and beta == table.beta[table.best]
    beta_f, table_f = hq.calibrate_beta(x, cfg, num=12, step=0.1)
    assert table_f.best == int(np.argmin(table_f.f))
    # Calibrated beta gives a sensible quantizer: a few dB above the Gaussian bound.
    f_db = 10 * np.log10(table_f.f[table_f.best])
    assert 1.5 < f_db < 4.5


def test_calibrate_beta_table_is_alike_on_every_backend():
    """calibrate_beta's table comes from values with one value on every backend: the codes
    (the tie rule), the errors' sum of squares in a fixed order (sum_of_squares), and H(T),
    the rate and f in float64 on the host from the exact counts of T. A float32 sum in the
    backend's order moves the MSE in about the sixth digit, where for Gaussian data E8 q=4
    M=2's two best grid points lie 3e-5 apart."""
    cfg = hq.HNLQConfig("E8", 4, 2)
    x = np.random.default_rng(8).standard_normal((500, 8)).astype(np.float32)
    _, table = hq.calibrate_beta(x, cfg, num=6, step=0.1)
    e = int(np.frexp(np.max(np.abs(x)))[1])  # the search's errors are scaled by 2^-e
    for i, beta in enumerate(table.beta):
        codes = hq.encode(x, cfg.replace(beta=float(np.float32(beta))))
        err = np.ldexp(x - np.asarray(hq.decode(codes)), -e).reshape(-1)
        mse = float(np.asarray(sum_of_squares(err)) * np.float32(1 / err.size)) * 4.0**e
        counts = np.bincount(np.asarray(codes.T).reshape(-1) + 1, minlength=cfg.max_T + 2)
        H = math.fsum(c / 500 * math.log2(500 / c) for c in counts.tolist() if c)
        assert table.mse[i] == mse and table.entropy_T[i] == H
        assert table.f[i] == mse * 2.0 ** (2 * (cfg.rate + H / cfg.d))
        assert table.overload_rate[i] == np.sum(counts[2:]) / 500


@pytest.mark.parametrize("s", [2.0**-70, 2.0**-7, 2.0**9, 2.0**62])
def test_calibrate_beta_scales_with_the_data(s):
    """By default the grid follows the sample's RMS: data scaled by a power of two (exact in
    floating point) gets exactly that multiple of beta and the same codes, where the paper's
    unit grid would code 0.01-scale data as zeros or 100-scale data with constant overload.
    At 2^-70 and 2^62 float32 squares underflow and overflow: neither the search's errors nor
    the encoder's block norms may square the data as it is."""
    cfg = hq.HNLQConfig("D4", 4, 2)
    x = np.random.default_rng(5).standard_normal((1000, 4)).astype(np.float32)
    beta, table = hq.calibrate_beta(x, cfg, num=10, step=0.1)
    beta_s, table_s = hq.calibrate_beta(s * x, cfg, num=10, step=0.1)
    rms = float(np.sqrt(np.mean(np.square(x.astype(np.float64)))))
    np.testing.assert_allclose(table.beta, rms * cfg.beta_min() * (1 + 0.1 * np.arange(10)),
                               rtol=1e-12)
    assert beta_s == s * beta and table_s.best == table.best
    np.testing.assert_array_equal(table_s.mse, s * s * table.mse)
    np.testing.assert_array_equal(table_s.overload_rate, table.overload_rate)
    codes, codes_s = (hq.encode(v, cfg.replace(beta=b)) for v, b in ((x, beta), (s * x, beta_s)))
    np.testing.assert_array_equal(codes_s.index, codes.index)
    np.testing.assert_array_equal(codes_s.tfield, codes.tfield)
    # The unit grid is far off: small data decodes to zeros, large data overloads beyond max_T.
    if s < 1:
        unit = hq.calibrate_beta(s * x, cfg, num=10, step=0.1, scale=1.0)[1]
        assert unit.overload_rate.max() == 0
        assert unit.mse[unit.best] == pytest.approx(np.mean(np.square(s * x.astype(np.float64))),
                                                    rel=1e-5)
    else:
        with pytest.raises(ValueError, match="far from the given scale: try scale='rms'"):
            hq.calibrate_beta(s * x, cfg, num=10, step=0.1, scale=1.0)
    # search_beta (traceable, float32; its RMS within 2^-11 of the float64 one, see
    # hnlq_jax._numerics.mean_square) makes the same choice.
    traced = jax.jit(lambda v: search_beta(v, cfg, num=10, step=0.1))(s * x)
    assert float(traced) == pytest.approx(beta_s, rel=2**-11)


def test_calibrate_beta_bad_input():
    cfg = hq.HNLQConfig("D4", 4, 2)
    x = np.zeros((10, 4), np.float32)
    with pytest.raises(ValueError, match="criterion"):
        hq.calibrate_beta(x, cfg, criterion="snr")
    with pytest.raises(ValueError, match="num >= 1"):
        hq.calibrate_beta(x, cfg, num=0)
    with pytest.raises(ValueError, match="num >= 1"):
        hq.calibrate_beta(x, cfg, num=True)
    ones = np.ones((10, 4), np.float32)
    assert hq.calibrate_beta(ones, cfg, num=np.int64(3))[0] == \
        hq.calibrate_beta(ones, cfg, num=3)[0]
    with pytest.raises(ValueError, match="d=4"):
        hq.calibrate_beta(np.zeros((10, 3), np.float32), cfg)
    with pytest.raises(ValueError, match="no block"):
        hq.calibrate_beta(np.zeros((0, 4), np.float32), cfg)
    with pytest.raises(ValueError, match=r"x is all zero.*pass scale=1.0"):
        hq.calibrate_beta(x, cfg)
    for bad in (0, -1.0, float("nan"), "max", True, np.True_, np.ones(2), jnp.float32(-1)):
        with pytest.raises(ValueError, match="scale must be 'rms' or a positive"):
            hq.calibrate_beta(x, cfg, scale=bad)
    # NumPy and JAX scalars are numbers like Python's.
    ones = np.ones((10, 4), np.float32)
    betas = {hq.calibrate_beta(ones, cfg, scale=s, num=3)[0]
             for s in (0.5, np.float32(0.5), jnp.float32(0.5), np.asarray(0.5))}
    assert betas == {hq.calibrate_beta(ones, cfg, scale=0.5, num=3)[0]}
    outlier = np.zeros((1000, 4), np.float32)
    outlier[0] = 1e3  # 63 RMS units: beyond every beta of the grid at max_T = 0
    with pytest.raises(ValueError, match=r"no beta on the grid \[.*raise max_T \(now 0\)"):
        hq.calibrate_beta(outlier, cfg.replace(max_T=0), num=3)


def test_rate_stats_under_jit():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(500, 4)), jnp.float32)
    f = jax.jit(lambda x: hq.rate_stats(hq.encode(x, cfg)).rate)
    assert 4.0 <= float(f(x)) < 5.0


def test_gaussian_beta_first_called_under_jit():
    """A cold cache filled while tracing still yields a Python float (no leaked tracer)."""
    cfg = hq.HNLQConfig("Z2", 3, 1)
    hq.gaussian_beta.cache_clear()
    got = jax.jit(lambda v: v * hq.gaussian_beta(cfg))(jnp.float32(1.0))
    beta = hq.gaussian_beta(cfg)
    assert isinstance(beta, float) and float(got) == np.float32(beta)


def test_search_beta_rms_is_exact():
    """search_beta's default scale is the RMS of x by hnlq_jax._numerics.mean_square bit for
    bit, eager and under jit (the rescaling that guards tiny and huge data is by a power of
    two), so data scaled by 2^k gets exactly 2^k times the beta."""
    cfg = hq.HNLQConfig("D4", 4, 2)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((500, 4)), jnp.float32)
    rms = float(jnp.sqrt(mean_square(x.reshape(-1))))
    assert rms == pytest.approx(float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64))))),
                                rel=2**-11)
    beta = float(search_beta(x, cfg, num=8))
    assert beta == float(search_beta(x, cfg, num=8, scale=rms))
    assert beta == float(jax.jit(lambda x: search_beta(x, cfg, num=8))(x))
    for k in (-70, 62):
        assert float(search_beta(x * 2.0**k, cfg, num=8)) == beta * 2.0**k


def test_the_search_compiles_once_for_every_beta(compiles):
    """The search ignores config.beta (it replaces it): configs that differ only there share
    its compiled grid (each new beta compiled it anew, ~2 s) and gaussian_beta's cache."""
    cfg = hq.HNLQConfig("E8", 2, 1)
    x = np.random.default_rng(3).normal(size=(256, 8)).astype(np.float32)
    first = hq.calibrate_beta(x, cfg, num=4)[0]
    compiles.clear()
    assert hq.calibrate_beta(x, cfg.replace(beta=0.37), num=4)[0] == first
    assert "jit(_beta_grid)" not in compiles, compiles
    g = hq.gaussian_beta(cfg.replace(beta=0.5))
    compiles.clear()
    assert hq.gaussian_beta(cfg.replace(beta=0.25)) == g and compiles == []

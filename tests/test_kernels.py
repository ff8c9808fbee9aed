"""Pallas kernels (interpret mode on the CPU) against the XLA reference; CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_golden, golden_config
from hypothesis import given
from hypothesis import strategies as st

import hnlq_jax as hq
from hnlq_jax import kernels as K

PALLAS = dict(implementation="pallas")
CONFIGS = [
    hq.HNLQConfig("D4", 4, 2, beta=0.35),
    hq.HNLQConfig("E8", 3, 2, beta=0.4),
    hq.HNLQConfig("A2", 3, 3, beta=0.3),
    hq.HNLQConfig("Z2", 5, 2, beta=0.25, dither=(0.1, -0.2)),
]
IDS = [f"{c.lattice}-q{c.q}-M{c.M}" for c in CONFIGS]


def _data(cfg, n, seed=0, dtype=np.float32):
    """Gaussian blocks with a few far outliers (large T) and exact ties at every level.

    Ties: beta = 1/2, alpha = 1 keep ``x / (beta 2^t)`` exact, and coordinates on a half-integer
    grid scaled by q^m put points on Voronoi faces at level m.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, cfg.d)) * 2
    x[: n // 16] *= 60
    half = rng.integers(-6, 7, (n // 4, cfg.d)) / 2 * cfg.q ** rng.integers(0, cfg.M, (n // 4, 1))
    return np.concatenate([x, half * cfg.beta]).astype(dtype)


def _tie_config(cfg):
    return cfg.replace(beta=0.5, alpha=1.0)


def assert_codes_equal(a, b):
    np.testing.assert_array_equal(np.asarray(a.labels), np.asarray(b.labels))
    np.testing.assert_array_equal(np.asarray(a.T), np.asarray(b.T))
    assert a.labels.dtype == b.labels.dtype == jnp.uint8 and a.T.dtype == b.T.dtype == jnp.int8


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_encode_decode_bit_exact(cfg):
    """Gaussians, outliers and exact ties (alpha = 1/3 is covered by the golden and edge tests)."""
    c = _tie_config(cfg)
    x = _data(c, 400)
    ref = hq.encode(x, c)
    got = K.encode(x, c, **PALLAS)
    assert_codes_equal(got, ref)
    assert int(jnp.max(ref.T)) >= 3  # the overload loop ran several steps
    for levels in (None, 1):
        np.testing.assert_array_equal(K.decode(ref, c, levels, **PALLAS),
                                      hq.decode(ref, c, levels))


def test_encode_golden_x64(x64):
    """Level-0 ties that survive in float64 (the golden files' faces) in the kernel."""
    for name in ("D4_q4_M2.npz", "Z2_q4_M2.npz", "D4_q4_M2_dither.npz"):
        g = load_golden(name)
        cfg = golden_config(g)
        codes = K.encode(g["X"], cfg, **PALLAS)
        np.testing.assert_array_equal(codes.labels, g["labels"])
        np.testing.assert_array_equal(codes.T, g["T"])
        np.testing.assert_array_equal(K.decode(codes, cfg, **PALLAS), g["decoded"])


def test_encode_edge_cases():
    cfg = CONFIGS[0]
    # max_T = 0 marks overloads; leading axes; a ragged tail (300 rows, blocks of 256).
    x = _data(cfg, 300).reshape(3, -1, cfg.d)
    for c in (cfg, cfg.replace(max_T=0)):
        assert_codes_equal(K.encode(x, c, **PALLAS), hq.encode(x, c))
    # Beyond the cap, and NaN under jit: T = -1, decoding to NaN.
    far = jnp.full((2, 4), 1e30, jnp.float32)
    assert np.all(np.asarray(K.encode(far, cfg, **PALLAS).T) == -1)
    nan = jax.jit(lambda v: K.encode(v, cfg, **PALLAS))(jnp.array([[np.nan, 0, 0, 0], [1, 0, 0, 0]]))
    np.testing.assert_array_equal(nan.T, hq.encode(jnp.array([[1e30, 0, 0, 0], [1, 0, 0, 0]]),
                                                   cfg).T)
    assert np.all(np.isnan(K.decode(nan, cfg, **PALLAS)[0]))
    # bfloat16 input is encoded in float32, as the reference does.
    xb = jnp.asarray(_data(cfg, 64), jnp.bfloat16)
    assert_codes_equal(K.encode(xb, cfg, **PALLAS), hq.encode(xb, cfg))


@given(st.integers(0, 2**31 - 1), st.sampled_from([0.25, 1.0, 3.0]))
def test_encode_property(seed, spread):
    """Any input: the kernel's codes are the reference's (one compiled shape)."""
    cfg = _tie_config(CONFIGS[0])
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, 4)) * spread).astype(np.float32)
    x[::3] = np.round(x[::3] * 2) / 2 * cfg.beta  # faces and ties
    assert_codes_equal(K.encode(x, cfg, **PALLAS), hq.encode(x, cfg))


def test_decode_invalid_and_dtypes():
    cfg = CONFIGS[0]
    codes = hq.encode(_data(cfg, 100), cfg)
    T = codes.T.at[::7].set(-1)
    bad = hq.Codes(codes.labels, T)
    out = jax.jit(lambda c: K.decode(c, cfg, **PALLAS))(bad)
    np.testing.assert_array_equal(out, hq.decode(bad, cfg))
    assert np.all(np.isnan(out[::7]))
    for dtype in (jnp.bfloat16, jnp.float32):
        got = K.decode(codes, cfg, dtype=dtype, **PALLAS)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, hq.decode(codes, cfg, dtype=dtype))


def test_quantize_straight_through():
    cfg = CONFIGS[0]
    x = jnp.asarray(_data(cfg, 64))
    np.testing.assert_array_equal(K.quantize(x, cfg, **PALLAS), hq.quantize(x, cfg))
    g = jax.grad(lambda v: jnp.sum(K.quantize(v, cfg, **PALLAS) * 3.0))(x)
    np.testing.assert_array_equal(g, jnp.full_like(x, 3.0))


def _weights(cfg, n, k, seed=1):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((n, k)).astype(np.float32)
    return hq.encode(hq.to_blocks(W, cfg.d), cfg)


# E8's decoding is covered by test_encode_decode_bit_exact; the tiling does not depend on it.
@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.lattice != "E8"],
                         ids=[i for i in IDS if not i.startswith("E8")])
def test_decode_matmul_matches_reference(cfg):
    n, k = 40, 27 * cfg.d - 1  # ragged: rows and blocks are not tile multiples, k not d-aligned
    codes = _weights(cfg, n, k)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, k)), jnp.float32)
    scale = jnp.linspace(0.5, 2.0, n)
    ref = K.decode_matmul(x, codes, cfg, scale=scale, implementation="xla")
    got = K.decode_matmul(x, codes, cfg, scale=scale, block_n=16, block_k=16, **PALLAS)
    assert got.shape == (2, 3, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(ref))))
    # The reference itself is decode-then-matmul.
    w = hq.from_blocks(hq.decode(codes, cfg), k) * scale[:, None]
    np.testing.assert_allclose(ref, jnp.einsum("...k,nk->...n", x, w, precision="highest"),
                               rtol=1e-5, atol=1e-4)


def test_decode_matmul_float64_and_bf16():
    cfg = CONFIGS[0]
    codes = _weights(cfg, 24, 64)
    x = np.random.default_rng(3).standard_normal((5, 64))
    with jax.enable_x64(True):
        ref = K.decode_matmul(jnp.asarray(x), codes, cfg, implementation="xla")
        got = K.decode_matmul(jnp.asarray(x), codes, cfg, **PALLAS)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, ref, rtol=1e-6)  # the weights are decoded in float32
    xb = jnp.asarray(x, jnp.bfloat16)
    ref = K.decode_matmul(xb, codes, cfg, implementation="xla")
    got = K.decode_matmul(xb, codes, cfg, **PALLAS)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-2,
                               atol=5e-2)


def test_decode_matmul_gradients():
    cfg = CONFIGS[0]
    codes = _weights(cfg, 24, 40)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 40)), jnp.float32)
    scale = jnp.linspace(0.5, 1.5, 24)

    def loss(impl, x, s):
        y = K.decode_matmul(x, codes, cfg, scale=s, implementation=impl)
        return jnp.sum(jnp.sin(y))

    gx, gs = jax.grad(functools.partial(loss, "pallas"), argnums=(0, 1))(x, scale)
    w = hq.from_blocks(hq.decode(codes, cfg), 40)

    def dense(x, s):
        return jnp.sum(jnp.sin(jnp.einsum("bk,nk->bn", x, w * s[:, None], precision="highest")))

    ex, es = jax.grad(dense, argnums=(0, 1))(x, scale)
    np.testing.assert_allclose(gx, ex, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gs, es, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=[IDS[0], IDS[3]])
def test_lut_gemv_matches_reference(cfg):
    k = 33 * cfg.d
    codes = _weights(cfg, 50, k)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, k)), jnp.float32)
    ref = hq.lut.matmul_one_sided(codes, x, cfg)
    got = K.lut_gemv(codes, x, cfg, block_n=16, block_k=16, **PALLAS)
    assert got.shape == (2, 50)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    bad = hq.Codes(codes.labels, codes.T.at[3, 0].set(-1))
    assert np.all(np.isnan(K.lut_gemv(bad, x, cfg, **PALLAS)[:, 3]))


def test_modq_sum_bit_exact():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=1.0)
    x = np.random.default_rng(6).standard_normal((3, 5, 70, 4)).astype(np.float32) * 0.3
    codes = hq.encode(x, cfg)
    codes = hq.Codes(codes.labels, codes.T.at[0, 0, :5].set(1))  # differing T -> -1
    for axis in (0, 1, -2):
        assert_codes_equal(K.modq_sum(codes, cfg, axis, **PALLAS),
                           hq.modq.accumulate(codes, cfg, axis))
    assert_codes_equal(K.modq_sum(codes, cfg, 0, gpu_backend="mosaic_gpu", **PALLAS),
                       hq.modq.accumulate(codes, cfg, 0))


def test_implementation_choice_and_errors():
    cfg = CONFIGS[0]
    x = _data(cfg, 32)
    assert K.resolve(None, cfg, "f") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    assert_codes_equal(K.encode(x, cfg), K.encode(x, cfg, implementation="xla"))
    with pytest.raises(ValueError, match="implementation must be one of"):
        K.encode(x, cfg, implementation="triton")
    z3 = hq.HNLQConfig("Z3", 4, 2)
    with pytest.raises(ValueError, match="d = 3 is not a power of two"):
        K.encode(np.zeros((4, 3), np.float32), z3, **PALLAS)
    assert K.encode(np.zeros((4, 3), np.float32), z3).T.shape == (4,)  # None falls back to XLA
    with pytest.raises(ValueError, match="no Mosaic GPU kernel"):
        K.encode(x, cfg, gpu_backend="mosaic_gpu", **PALLAS)
    with pytest.raises(ValueError, match="power of two >= 16"):
        K.encode(x, cfg, block=100, **PALLAS)
    with pytest.raises(ValueError, match="last axis"):
        K.encode(np.zeros((4, 3), np.float32), cfg, **PALLAS)
    codes = _weights(cfg, 8, 32)
    with pytest.raises(ValueError, match="ceil\\(k/d\\) = 8 blocks"):
        K.decode_matmul(np.zeros((2, 40), np.float32), codes, cfg, **PALLAS)
    with pytest.raises(ValueError, match="scale must have shape"):
        K.decode_matmul(np.zeros((2, 32), np.float32), codes, cfg, scale=jnp.ones(3), **PALLAS)
    with pytest.raises(ValueError, match="labels \\[n, nb, M, d\\]"):
        K.lut_gemv(hq.encode(x, cfg), np.zeros(4, np.float32), cfg, **PALLAS)
    with pytest.raises(ValueError, match="labels must be in 0..q-1"):
        K.decode(hq.Codes(jnp.full((2, 2, 4), 9, jnp.uint8), jnp.zeros(2, jnp.int8)), cfg,
                 **PALLAS)
    with pytest.raises(ValueError, match="without dither"):
        K.modq_sum(hq.encode(np.zeros((2, 2), np.float32), CONFIGS[3]), CONFIGS[3], **PALLAS)
    if jax.default_backend() == "cpu":
        with pytest.raises(Exception, match="interpret mode"):
            K.encode(x, cfg, interpret=False, **PALLAS)


# CUDA lowering, without a GPU: every kernel through the real Pallas -> Triton (and, where the
# op allows, Mosaic GPU) lowering. A lowering error fails the test.
def _lowering_cases(cfg, all_ops):
    """Kernels to lower; ``all_ops=False``: only those whose code depends on the lattice."""
    x = jnp.zeros((1000, cfg.d), jnp.float32)
    c = hq.encode(x, cfg)
    cw = hq.encode(jnp.zeros((64, 32, cfg.d)), cfg)
    xa = jnp.zeros((2, 32 * cfg.d), jnp.float32)
    cm = hq.encode(jnp.zeros((3, 100, cfg.d)), cfg.replace(dither=None))
    gpu = dict(implementation="pallas", interpret=False)
    cases = {
        "encode": (lambda x: K.encode(x, cfg, **gpu), (x,)),
        "decode": (lambda lab, T: K.decode(hq.Codes(lab, T), cfg, **gpu), tuple(c)),
        "decode_matmul": (lambda x, lab, T: K.decode_matmul(x, hq.Codes(lab, T), cfg, **gpu),
                          (xa,) + tuple(cw)),
        "decode_matmul_bf16": (lambda x, lab, T: K.decode_matmul(x, hq.Codes(lab, T), cfg, **gpu),
                               (xa.astype(jnp.bfloat16),) + tuple(cw)),
        "quantize_grad": (jax.value_and_grad(lambda x: jnp.sum(K.quantize(x, cfg, **gpu))), (x,)),
        "modq_sum": (lambda lab, T: K.modq_sum(hq.Codes(lab, T), cfg.replace(dither=None), **gpu),
                     tuple(cm)),
    }
    if cfg.q**cfg.d <= 2**16:
        cases["lut_gemv"] = (lambda x, lab, T: K.lut_gemv(hq.Codes(lab, T), x, cfg, **gpu),
                             (xa,) + tuple(cw))
    if not all_ops:  # decode_matmul's lattice-dependent part is decode's
        cases = {k: cases[k] for k in ("encode", "decode")}
    return cases


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_lowers_for_cuda_triton(cfg):
    cases = _lowering_cases(cfg, all_ops=cfg.lattice == "D4")
    assert len(cases) >= 2
    for name, (f, args) in cases.items():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "custom_call @__gpu$xla.gpu.triton" in text, name


def test_lowers_for_cuda_mosaic_gpu():
    cfg = CONFIGS[0]
    cm = hq.encode(jnp.zeros((3, 1000, 4)), cfg)
    f = functools.partial(K.modq_sum, config=cfg, implementation="pallas", interpret=False,
                          gpu_backend="mosaic_gpu")
    text = jax.jit(lambda lab, T: f(hq.Codes(lab, T))).trace(*cm).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text

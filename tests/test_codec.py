"""The codec against the golden vectors, the identities of docs/math.md, and bad input."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, golden_config, load_golden
from hypothesis import given, settings
from hypothesis import strategies as st

import hnlq_jax as hq
from hnlq_jax.codec import (codebook_table, encode_at, encoder_states, index_from_digits,
                            lattice_sum, packed_codebook)
from hnlq_jax.codes import index_from_labels, labels_of_index
from hnlq_jax.lattices import columns


def level_reps(labels, cfg):
    """r(b_m) per level via the codebook, [..., M, d]."""
    q, d = cfg.q, cfg.d
    idx = np.sum(np.asarray(labels, np.int64) * q ** np.arange(d - 1, -1, -1), axis=-1)
    return np.asarray(hq.codebook(cfg))[idx]


@pytest.mark.golden
@pytest.mark.parametrize("name", GOLDEN)
def test_golden_x64(name, x64):
    g = load_golden(name)
    cfg = golden_config(g)
    codes = hq.encode(g["X"], cfg)
    np.testing.assert_array_equal(codes.labels, g["labels"])
    np.testing.assert_array_equal(codes.T, g["T"])
    assert codes.labels.dtype == jnp.uint8 and codes.T.dtype == jnp.int8
    assert codes.config == cfg
    np.testing.assert_array_equal(hq.decode(codes), g["decoded"])
    for k in range(1, cfg.M + 1):
        np.testing.assert_array_equal(hq.decode(codes, levels=k), g["decoded_depth"][:, k - 1])
    # Codes made elsewhere (the reference) hold the same fields.
    ref = hq.Codes.from_labels(g["labels"], g["T"], cfg)
    np.testing.assert_array_equal(ref.index, codes.index)
    np.testing.assert_array_equal(ref.tfield, codes.tfield)
    np.testing.assert_array_equal(level_reps(codes.labels, cfg), g["level_reps"])
    np.testing.assert_array_equal(hq.codebook(cfg), g["codebook"])
    np.testing.assert_array_equal(hq.closest_point(g["X"], cfg.lattice), g["QL_X"])
    # Algorithm 1 at T = 0, without the overload loop.
    z = np.asarray(cfg.dither_array)
    y0 = g["X"] / cfg.beta + z
    labels0, over0 = _encode_at(jnp.asarray(y0), cfg)
    np.testing.assert_array_equal(labels0, g["labels_T0"])
    np.testing.assert_array_equal(over0, g["overload_T0"])
    np.testing.assert_array_equal(hq.closest_point(y0, cfg.lattice), g["QL_T0"])
    P0 = jnp.stack(lattice_sum(index_from_labels(jnp.asarray(g["labels_T0"]), cfg.q, jnp.uint32),
                               cfg), -1)
    np.testing.assert_array_equal(P0, g["decoded_T0_lattice"])
    # Encoder states at the final T.
    yT = g["X"] / (cfg.beta * 2.0 ** (cfg.alpha * g["T"].astype(np.float64)))[:, None] + z
    states = np.stack(_states(jnp.asarray(yT), cfg), axis=1)
    np.testing.assert_array_equal(states, g["g_seq"])
    # max_T = 0 marks exactly the rows that overload at T = 0.
    c0 = hq.encode(g["X"], cfg.replace(max_T=0), failures="mark")
    np.testing.assert_array_equal(np.asarray(c0.T) == -1, g["overload_T0"])


@pytest.mark.golden
@pytest.mark.parametrize("name", GOLDEN)
def test_golden_float32(name):
    """Rows of kind 0/1 agree in float32: no such input sits within rounding of a face."""
    g = load_golden(name)
    cfg = golden_config(g)
    rows = g["row_kind"] < 2
    codes = hq.encode(g["X"][rows].astype(np.float32), cfg)
    near_face = np.sum(np.any(np.asarray(codes.labels) != g["labels"][rows], axis=(1, 2))
                       | (np.asarray(codes.T) != g["T"][rows]))
    assert near_face == 0
    out = hq.decode(codes)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, g["decoded"][rows], rtol=2e-6, atol=2e-6 * cfg.beta)


# A fixed set of configs, each tested (parametrized); hypothesis draws the data.
CONFIG_LIST = [
    hq.HNLQConfig("Z2", 3, 2, beta=0.3),
    hq.HNLQConfig("Z2", 8, 1, beta=0.7),
    hq.HNLQConfig("A2", 4, 2, beta=0.25),
    hq.HNLQConfig("A2", 5, 1, beta=1.1),
    hq.HNLQConfig("D4", 4, 2, beta=0.2),
    hq.HNLQConfig("D4", 3, 3, beta=0.15),
    hq.HNLQConfig("E8", 2, 2, beta=0.5),
    hq.HNLQConfig("E8", 4, 1, beta=0.9),
]
# Leading shapes of one size: encode and decode compile once per config (they flatten).
SHAPES = st.sampled_from([(12,), (3, 4), (2, 3, 2), (1, 12)])
@functools.partial(jax.jit, static_argnums=1)
def _encode_at(y, cfg):
    digits, over = encode_at(columns(y), cfg)
    return labels_of_index(jnp.stack(index_from_digits(digits, cfg), -1), cfg), over
_states = jax.jit(encoder_states, static_argnums=1)
_lattice_sum = jax.jit(lattice_sum, static_argnums=(1, 2, 3))


def _data(cfg, seed, shape):
    return np.random.default_rng(seed).normal(size=shape + (cfg.d,)) * cfg.q ** cfg.M * 0.3 * (
        cfg.beta)


@pytest.mark.parametrize("cfg", CONFIG_LIST, ids=str)
@settings(max_examples=2)
@given(seed=st.integers(0, 2**31 - 1), shape=SHAPES)
def test_identities(cfg, seed, shape):
    """Identities 1-4: exact reconstruction, telescoping, no overload after the loop, labels."""
    with jax.enable_x64(True):
        _check_identities(cfg, _data(cfg, seed, shape), shape)


def _check_identities(cfg, x, shape):
    codes = hq.encode(x, cfg)
    T = np.asarray(codes.T)
    assert codes.labels.shape == shape + (cfg.M, cfg.d) and T.shape == shape
    assert np.all(T >= 0)
    assert np.all(np.asarray(codes.labels) < cfg.q)
    scale = cfg.beta * 2.0 ** (cfg.alpha * T.astype(np.float64))
    y = x / scale[..., None]
    xhat = np.asarray(hq.decode(codes))
    # (1) decode = beta_T * Q_L(x / beta_T) exactly (in lattice units: x_hat = g_0). The
    # reference helpers take the blocks flat: one compile per config, not one per shape.
    states = [np.asarray(s).reshape(y.shape)
              for s in _states(jnp.asarray(y.reshape(-1, cfg.d)), cfg)]
    np.testing.assert_array_equal(xhat, (cfg.beta * states[0]) * 2.0 ** (cfg.alpha * T[..., None]))
    # (3) g_M = 0 after the loop; T is minimal: at T - 1 the block overloads.
    assert np.all(states[-1] == 0)
    prev = T > 0
    if np.any(prev):
        yp = x[prev] / (cfg.beta * 2.0 ** (cfg.alpha * (T[prev] - 1.0)))[:, None]
        k = len(yp)  # padded to one size per shape: one compile, not one per count
        yp = np.concatenate([yp, np.zeros((T.size - k, cfg.d))])
        assert np.all(np.asarray(_encode_at(jnp.asarray(yp), cfg)[1])[:k])
    # (2) telescoping: sum_{m >= j} q^m r(b_m) = q^j g_j.
    for j in range(cfg.M):
        P = np.stack([np.asarray(c) for c in _lattice_sum(codes.index.reshape(-1, cfg.M), cfg, j)],
                     -1).reshape(y.shape)
        cart = P / 2 if cfg.lattice == "E8" else (P @ cfg.lat.G.T if cfg.lattice == "A2" else P)
        np.testing.assert_allclose(cart, cfg.q**j * states[j], rtol=0, atol=1e-9)


@pytest.mark.parametrize("cfg", CONFIG_LIST, ids=str)
def test_codebook_identities(cfg):
    """Identities 4-5: Q_L(r(b)/q) = 0, distinct representatives, coset consistency."""
    cfg = cfg.replace(M=1, q=min(cfg.q, 4) if cfg.lattice == "E8" else cfg.q)
    with jax.enable_x64(True):
        cb = np.asarray(hq.codebook(cfg))
        assert np.all(np.asarray(hq.closest_point(cb / cfg.q, cfg.lattice)) == 0)
    assert len(np.unique(cb, axis=0)) == cfg.q**cfg.d
    labels = np.random.default_rng(cfg.q).integers(0, cfg.q, size=(50, 1, cfg.d))
    index = index_from_labels(jnp.asarray(labels), cfg.q, jnp.uint32)
    a = np.stack(lattice_sum(index, cfg, use_table=False), -1)
    # r(b) = G b - q Q_L(G b / q) depends on b mod q only (coset consistency).
    shifted = labels + cfg.q * np.random.default_rng(1).integers(-3, 4, size=labels.shape)
    P = cfg.lat.P_from_basis @ shifted[:, 0].T.astype(np.int64)  # P coordinates of G b
    from hnlq_jax.lattices import nearest_int
    Pc = [jnp.asarray(c, jnp.int32) for c in P]
    r = np.stack([np.asarray(p - cfg.q * c) for p, c in zip(Pc, nearest_int(Pc, cfg.q, cfg.lat))],
                 -1)
    np.testing.assert_array_equal(a, r)
    # The table lookup of the decoder equals the computed representatives.
    c = np.stack(lattice_sum(index, cfg, use_table=True), -1)
    np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("cfg", CONFIG_LIST, ids=str)
@settings(max_examples=2)
@given(seed=st.integers(0, 2**31 - 1))
def test_idempotence(cfg, seed):
    """Identity 5: re-encoding a decoded non-overloaded point (beta = 1) is a fixed point."""
    with jax.enable_x64(True):
        _check_idempotence(cfg.replace(beta=1.0), seed)


def _check_idempotence(cfg, seed):
    x = _data(cfg, seed, (12,))
    c1 = hq.encode(x, cfg)
    keep = np.asarray(c1.T) == 0
    x1 = np.asarray(hq.decode(c1))[keep]
    c2 = hq.encode(x1, cfg)
    np.testing.assert_array_equal(c2.labels, np.asarray(c1.labels)[keep])
    np.testing.assert_array_equal(c2.T, 0)


@pytest.mark.parametrize("lat,q", [("Z2", 3), ("A2", 3), ("D4", 3), ("D4", 4), ("E8", 2)])
def test_sandwich(lat, q, x64):
    """Identity 6 (sandwich): lattice points well inside q^M(1-r)V are in the constellation; every
    constellation point lies within q^M(1+r) covering radii."""
    M = 2
    cfg = hq.HNLQConfig(lat, q, M, beta=1.0, max_T=0)
    r = (1 - q ** (1 - M)) / (q - 1)
    L = cfg.lat
    k = np.array(np.meshgrid(*[np.arange(-10, 11)] * L.d)).reshape(L.d, -1).T if L.d <= 4 else (
        np.random.default_rng(0).integers(-6, 7, size=(20000, L.d)))
    pts = k @ L.G.T
    # Packing radius: half the minimal norm (Z2 1/2, A2 1/2, D4 sqrt2/2, E8 sqrt2/2).
    rpack = {"Z2": 0.5, "A2": 0.5, "D4": 2**0.5 / 2, "E8": 2**0.5 / 2}[lat]
    inner = pts[np.linalg.norm(pts, axis=1) < q**M * (1 - r) * rpack - 1e-9]
    # In pieces of the smallest eager bucket (up to 12,633 points): above 4096 blocks the
    # encoder compiles its compacting T search, which max_T = 0 never enters.
    for i in range(0, max(len(inner), 1), 1024):
        codes = hq.encode(inner[i : i + 1024], cfg)
        assert np.all(np.asarray(codes.T) == 0)
        np.testing.assert_allclose(hq.decode(codes), inner[i : i + 1024], atol=1e-12)
    allcodes = np.array(np.meshgrid(*[np.arange(q)] * (M * L.d))).reshape(M * L.d, -1).T
    allcodes = allcodes[:: max(1, len(allcodes) // 5000)].reshape(-1, M, L.d)
    xs = np.asarray(hq.decode(hq.Codes.from_labels(allcodes, np.zeros(len(allcodes), np.int8),
                                                   cfg)))
    assert np.max(np.linalg.norm(xs, axis=1)) <= q**M * (1 + r) * L.covering_radius + 1e-9


def test_new_batch_sizes_reuse_compiled_programs():
    """Eager calls pad to a bucket: sizes within one bucket compile nothing new."""
    from hnlq_jax import ops

    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    assert [ops.bucket(n) for n in (1, 1024, 1025, 2048, 2049, 5000)] == [
        1024, 1024, 2048, 2048, 4096, 8192]
    hq.decode(hq.encode(np.zeros((1100, 4), np.float32), cfg))
    before = (ops._encode_bucket._cache_size(), ops._decode._cache_size())
    for n in (1030, 1500, 2047):
        x = np.random.default_rng(n).normal(size=(n, 4)).astype(np.float32)
        c = hq.encode(x, cfg)
        np.testing.assert_array_equal(hq.decode(c), jax.jit(hq.decode)(c))
    assert (ops._encode_bucket._cache_size(), ops._decode._cache_size()) == before


def test_new_size_in_a_compiled_bucket_compiles_only_small_glue(compiles):
    """A new batch size in a compiled bucket compiles a few small per-shape programs (the
    finiteness and range checks, padding in, slicing out), not one per jnp operation."""
    cfg = hq.HNLQConfig("D4", 3, 2, beta=0.2)  # a config of its own: nothing cached yet
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1300, 4)), jnp.float32)
    hq.decode(hq.encode(x[:1100], cfg))
    hq.quantize(x[:1100], cfg)
    counts = []
    for call in (lambda: hq.encode(x, cfg), lambda: hq.decode(codes),
                 lambda: hq.quantize(x, cfg)):
        compiles.clear()
        codes = call()
        counts.append(len(compiles))
    n_encode, n_decode, n_quantize = counts
    # encode: finite check, pad, slice; decode: index and T range check, pad, slice;
    # quantize: finite check (compiled by encode), pad (likewise), slice.
    assert (n_encode, n_decode, n_quantize) == (3, 3, 1)


def _first_attempt_overloads(x, cfg):
    """Share of the blocks of ``x`` that overload at the encoder's first step, the norm bound
    t0."""
    from hnlq_jax import codec

    _, thresholds = codec.scale_tables(cfg, cfg.beta, jnp.float32)
    t0 = np.sum(np.asarray(thresholds)[None] < np.linalg.norm(x, axis=1)[:, None], axis=1)
    return np.mean(np.asarray(hq.encode(x, cfg).T) > t0)


@pytest.mark.parametrize("near", [0.0, 0.25, 1.0])
def test_batch_shape_independence(near):
    """Same codes whatever the batch. A batch above 4096 blocks gathers the blocks left after
    the first attempt into a buffer of a quarter (Gaussian data: 24 % left) or a half (a
    quarter of the blocks near the bound: 43 %) of the batch, or loops over all of it (every
    block near the bound, where none fits at its first step t0)."""
    from hnlq_jax import codec

    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    rng = np.random.default_rng(0)
    n = 16384  # a bucket of its own: the search sees exactly these blocks
    x = rng.normal(size=(n, 4)).astype(np.float32)
    # Norms just below the bound of step 2, along a minimal vector: step t0 never fits.
    th = np.asarray(codec.scale_tables(cfg, cfg.beta, jnp.float32)[1])
    k = int(near * n)
    x[:k] = rng.uniform(0.6, 0.95, size=(k, 1)) * th[2] * np.array([1, 1, 0, 0]) / np.sqrt(2)
    x = rng.permutation(x)
    share = _first_attempt_overloads(x, cfg)
    assert {0.0: 0.15 < share <= 0.25, 0.25: 0.3 < share <= 0.5, 1.0: share > 0.5}[near]
    big = hq.encode(x, cfg)
    parts = [hq.encode(x[i : i + 1024], cfg) for i in range(0, n, 1024)]
    np.testing.assert_array_equal(big.labels, np.concatenate([p.labels for p in parts]))
    np.testing.assert_array_equal(big.T, np.concatenate([p.T for p in parts]))
    one = hq.encode(x[123], cfg)
    np.testing.assert_array_equal(one.labels, big.labels[123])
    stacked = hq.encode(x.reshape(16, 32, 32, 4), cfg)
    np.testing.assert_array_equal(stacked.T.reshape(-1), big.T)


def test_chunked_encode_matches(monkeypatch):
    """Inputs above one chunk are encoded in even chunks (padded to a multiple): same codes."""
    from hnlq_jax import codec

    monkeypatch.setattr(codec, "_CHUNK", 4096)
    cfg = hq.HNLQConfig("E8", 4, 2, beta=0.23)  # a config of its own: traced anew
    x = np.random.default_rng(5).normal(size=(9001, 8)).astype(np.float32)  # 3 x 3001 - 2
    x[17] = np.nan
    enc = jax.jit(codec.encode_blocks, static_argnums=1)
    big_index, big_T = enc(jnp.asarray(x), cfg, cfg.beta)
    parts = [enc(jnp.asarray(x[i : i + 1000]), cfg, cfg.beta) for i in range(0, 9001, 1000)]
    np.testing.assert_array_equal(big_index, np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(big_T, np.concatenate([p[1] for p in parts]))
    assert int(big_T[17]) == -1 and np.mean(np.asarray(big_T) > 0) > 0.3


@pytest.mark.parametrize("n", [1, 33, 1024, 1025, 5000, 32768])
@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
def test_active_index_is_nonzero(n, share):
    """The search's compaction equals jnp.nonzero: order, truncation at cap and fill.

    Sizes straddle the 32-bit words and the 1024-block rows of the prefix sum (a rank or
    offset off by one moves an index); shares include an empty and a full mask (fill and
    truncation)."""
    from hnlq_jax.codec import active_index

    mask = jnp.asarray(np.random.default_rng(n).random(n) < share)
    for cap in sorted({1, max(n // 8, 1), n // 2 + 1, n}):
        np.testing.assert_array_equal(active_index(mask, cap),
                                      jnp.nonzero(mask, size=cap, fill_value=n)[0])


def test_jit_vmap_and_grad():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(6, 5, 4)), jnp.float32)
    ref = hq.encode(x, cfg)
    jitted = jax.jit(hq.encode, static_argnums=1)(x, cfg)
    vmapped = jax.vmap(lambda v: hq.encode(v, cfg))(x)
    for c in (jitted, vmapped):
        np.testing.assert_array_equal(c.labels, ref.labels)
        np.testing.assert_array_equal(c.T, ref.T)
    np.testing.assert_array_equal(jax.jit(hq.decode)(ref), hq.decode(ref))
    g = jax.grad(lambda v: jnp.sum(hq.quantize(v, cfg) * 3.0))(x)
    np.testing.assert_array_equal(g, jnp.full_like(x, 3.0))
    np.testing.assert_array_equal(hq.quantize(x, cfg), hq.decode(ref))


def test_quantize_dtypes():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(9, 4)), jnp.bfloat16)
    out = hq.quantize(x, cfg)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, hq.quantize(x.astype(jnp.float32), cfg).astype(jnp.bfloat16))
    assert hq.decode(hq.encode(x, cfg), dtype=jnp.float16).dtype == jnp.float16


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_decode_to_float64_without_x64_is_float32(impl):
    """dtype=float64 with x64 off is float32, as every JAX array of it (Pallas failed inside
    its kernel; XLA warned eight times)."""
    assert not jax.config.jax_enable_x64
    codes = hq.encode(np.random.default_rng(2).normal(size=(9, 4)).astype(np.float32),
                      hq.HNLQConfig("D4", 4, 2, beta=0.2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = hq.decode(codes, dtype=jnp.float64, implementation=impl)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, hq.decode(codes, implementation=impl))


def test_half_precision_output_saturates():
    # float16 inputs up to its maximum: a block there can decode just beyond 65504, which a
    # plain cast turns into Inf; the output saturates instead, eagerly and under jit.
    cfg = hq.HNLQConfig("D4", 4, 2, beta=hq.gaussian_beta(hq.HNLQConfig("D4", 4, 2)) * 2e4)
    x = np.random.default_rng(0).uniform(-65504, 65504, (2000, 4)).astype(np.float16)
    wide = np.asarray(hq.quantize(x.astype(np.float32), cfg))
    assert np.abs(wide).max() > 65504  # the case: some block decodes beyond float16's range
    want = np.clip(wide, -65504, 65504).astype(np.float16)
    codes = hq.encode(x, cfg)
    for out in (hq.quantize(x, cfg), jax.jit(lambda v: hq.quantize(v, cfg))(x),
                hq.decode(codes, dtype=jnp.float16),
                jax.jit(lambda c: hq.decode(c, dtype=jnp.float16))(codes)):
        np.testing.assert_array_equal(np.asarray(out), want)


def test_dither_roundtrip(x64):
    g = load_golden("D4_q4_M2_dither.npz")
    cfg = golden_config(g)
    assert cfg.dither is not None
    codes = hq.encode(g["X"], cfg)
    np.testing.assert_array_equal(hq.decode(codes), g["decoded"])


def test_blocks_helpers():
    x = jnp.arange(2 * 3 * 10, dtype=jnp.float32).reshape(2, 3, 10)
    b = hq.to_blocks(x, 4)
    assert b.shape == (2, 3, 3, 4)
    np.testing.assert_array_equal(b[..., -1, 2:], 0)
    np.testing.assert_array_equal(hq.from_blocks(b, 10), x)
    np.testing.assert_array_equal(hq.to_blocks(x, 5).reshape(2, 3, 10), x)
    with pytest.raises(ValueError, match="does not match"):
        hq.from_blocks(b, 13)
    with pytest.raises(ValueError, match="d must be a positive int"):
        hq.to_blocks(x, 0)
    cfg = hq.HNLQConfig("E8", 2, 2, beta=0.3)
    v = np.random.default_rng(0).normal(size=(3, 21)).astype(np.float32)
    out = hq.from_blocks(hq.quantize(hq.to_blocks(v, 8), cfg), 21)
    assert out.shape == (3, 21)


# ---------------------------------------------------------------- bad input and marking


def test_nonfinite_eager_error_and_jit_marking():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    x[1, 2] = np.nan
    x[3, 0] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf in 2 block"):
        hq.encode(x, cfg)
    with pytest.raises(ValueError, match="NaN or Inf"):
        hq.quantize(x, cfg)
    codes = jax.jit(hq.encode, static_argnums=1)(x, cfg)
    np.testing.assert_array_equal(np.asarray(codes.T) == -1, [False, True, False, True, False])
    out = np.asarray(hq.decode(codes))
    assert np.all(np.isnan(out[[1, 3]])) and np.all(np.isfinite(out[[0, 2, 4]]))


def test_overload_beyond_cap_is_marked():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2, max_T=3)
    x = np.array([[0.1, 0.2, 0.3, 0.4], [1e4, -1e4, 3e3, 0.0], [300.0, 0, 0, 0]], np.float32)
    with pytest.raises(ValueError, match="2 block\\(s\\) still overload at max_T = 3.*failures='mark'"):
        hq.encode(x, cfg)
    codes = hq.encode(x, cfg, failures="mark")
    np.testing.assert_array_equal(codes.T, [0, -1, -1])
    out = np.asarray(hq.decode(codes))
    assert np.all(np.isnan(out[1:])) and np.all(np.isfinite(out[0]))
    assert float(hq.rate_stats(codes).failure_rate) == pytest.approx(2 / 3)


@pytest.mark.parametrize("max_T", [3, 14])
def test_minimal_T_exactly_max_T(max_T):
    """A block whose minimal T is exactly max_T > 0 is encoded (max_T is inclusive), one step
    less marks it failed: catches ``t <= max_T`` -> ``t < max_T`` in the search."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2, max_T=127)
    x = np.random.default_rng(7).normal(size=(4096, 4)).astype(np.float32)
    x *= 2.0 ** (cfg.alpha * max_T)  # pushes typical blocks to T near max_T
    T = np.asarray(hq.encode(x, cfg).T)
    pick = x[T == max_T][:8]
    assert len(pick)
    np.testing.assert_array_equal(hq.encode(pick, cfg.replace(max_T=max_T)).T, max_T)
    np.testing.assert_array_equal(
        hq.encode(pick, cfg.replace(max_T=max_T - 1), failures="mark").T, -1)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_minimal_T_where_the_thresholds_overflow(impl):
    """With alpha = 1, max_T = 127 the largest thresholds overflow float32: blocks of 2^64
    times unit data took T = 126 (decoding to about 0) for the minimal T + 64, as the
    thresholds' unit was taken from the infinite last one and the norms overflowed. With
    alpha = 1 a power of two shifts T exactly and keeps the index (where T > 0 before)."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2, alpha=1.0, max_T=127)
    x = np.random.default_rng(8).normal(size=(64, 4)).astype(np.float32) * np.float32(2.0**8)
    small = hq.encode(x, cfg, implementation=impl)
    big = hq.encode(x * np.float32(2.0**56), cfg, implementation=impl)
    assert np.all(np.asarray(small.T) > 0)
    np.testing.assert_array_equal(np.asarray(big.T), np.asarray(small.T) + 56)
    np.testing.assert_array_equal(big.index, small.index)


def test_beta_beyond_float32_computes_in_float64(x64):
    """A beta beyond float32's range is refused for float32 values (there it is Inf: every
    block decoded to NaN; tests/test_bad_input.py) but codes float64 values as any other: a
    power of two scales the values exactly, so the codes are those of beta = 1."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=1.0)
    big = cfg.replace(beta=2.0**130)
    x = np.random.default_rng(9).normal(size=(64, 4))
    small = hq.encode(x, cfg)
    codes = hq.encode(x * 2.0**130, big)
    np.testing.assert_array_equal(codes.index, small.index)
    np.testing.assert_array_equal(codes.T, small.T)
    np.testing.assert_array_equal(hq.decode(codes), np.asarray(hq.decode(small)) * 2.0**130)
    np.testing.assert_array_equal(hq.quantize(x * 2.0**130, big), hq.decode(codes))


@pytest.mark.parametrize(
    "kw,err,msg",
    [
        (dict(q=1), ValueError, "q must be in 2..256"),
        (dict(q=300), ValueError, "q must be in 2..256"),
        (dict(q=2.0), TypeError, "q must be an int"),
        (dict(M=0), ValueError, "M must be >= 1"),
        (dict(beta=0.0), ValueError, "beta must be finite and > 0"),
        (dict(beta=-1.0), ValueError, "beta must be finite and > 0"),
        (dict(beta=float("nan")), ValueError, "beta must be finite"),
        (dict(alpha=0.0), ValueError, "alpha must be finite and > 0"),
        (dict(beta=np.array([0.2])), TypeError, r"beta must be a real number, got array\(\[0\.2\]\)"),
        (dict(lattice="E7"), ValueError, "unknown lattice"),
        (dict(max_T=-1), ValueError, "max_T must be in 0..127"),
        (dict(max_T=200), ValueError, "max_T must be in 0..127"),
        (dict(alpha=10.0, max_T=127), ValueError, "alpha \\* max_T = 1270 must be below 1024"),
        (dict(q=256, M=3), ValueError, "exceeds 2\\*\\*20"),
        (dict(lattice="E8", q=32, M=1), ValueError, "exceed 2\\*\\*32"),
        (dict(dither=(0.1, 0.2)), ValueError, "length d=4"),
        (dict(dither=(0.9, 0.9, 0.0, 0.0)), ValueError, "outside the Voronoi cell"),
    ],
)
def test_invalid_config(kw, err, msg):
    with pytest.raises(err, match=msg):
        hq.HNLQConfig(**kw)


def test_config_hashable_static():
    a = hq.HNLQConfig("D4", 4, 2, beta=0.2, dither=[0.1, 0.0, 0.0, 0.0])
    b = hq.HNLQConfig("D4", 4, 2, beta=0.2, dither=(0.1, 0.0, 0.0, 0.0))
    assert a == b and hash(a) == hash(b)
    assert a.replace(q=3).q == 3
    with pytest.raises(Exception):
        a.q = 5  # frozen
    # 0-d arrays (calibrate_rows returns one) become the same float, hash included
    for beta in (np.float32(0.25), np.array(0.25), jnp.asarray(0.25, jnp.float32)):
        c = a.replace(beta=beta)
        assert type(c.beta) is float and c == a.replace(beta=0.25) and hash(c) == hash(a.replace(beta=0.25))
    with pytest.raises(TypeError, match="beta must be a concrete number, got a traced value"):
        jax.jit(lambda b: a.replace(beta=b))(0.3)


def test_encode_bad_input():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    with pytest.raises(ValueError, match="d=4 for D4.*to_blocks"):
        hq.encode(np.zeros((3, 5), np.float32), cfg)
    with pytest.raises(ValueError, match="d=4"):
        hq.encode(np.float32(1.0), cfg)
    with pytest.raises(TypeError, match="floating"):
        hq.encode(np.zeros((3, 4), np.int32), cfg)
    with pytest.raises(TypeError, match="HNLQConfig"):
        hq.encode(np.zeros((3, 4), np.float32), "D4")


def test_decode_bad_input():
    cfg = hq.HNLQConfig("D4", 3, 2, beta=0.2)  # 81 of 256 index values used: room to corrupt
    codes = hq.encode(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32), cfg)
    bad = hq.Codes(codes.index.at[0, 0].set(81), codes.tfield, cfg)
    with pytest.raises(ValueError, match="index out of range.*81 >= q\\^d = 81"):
        hq.decode(bad)
    with pytest.raises(ValueError, match="T field holds values above max_T"):
        hq.decode(hq.Codes(codes.index, codes.tfield.at[0].set(0x70), cfg.replace(max_T=5)))
    with pytest.raises(ValueError, match="levels must be"):
        hq.decode(codes, levels=3)
    with pytest.raises(ValueError, match="levels must be"):
        hq.decode(codes, levels=np.bool_(True))
    np.testing.assert_array_equal(hq.decode(codes, levels=np.int64(1)),
                                  hq.decode(codes, levels=1))
    with pytest.raises(TypeError, match="hnlq_jax.Codes"):
        hq.decode((codes.labels, codes.T))
    with pytest.raises(TypeError, match="decode"):
        hq.decode(codes, cfg)  # the config travels with the codes
    with pytest.raises(ValueError, match="expected index uint8"):
        hq.decode(hq.Codes(codes.index.astype(jnp.uint16), codes.tfield, cfg))
    with pytest.raises(ValueError, match="T field of shape"):
        hq.decode(hq.Codes(codes.index, codes.tfield[:1], cfg))
    with pytest.raises(ValueError, match="labels must be in 0..q-1 = 0..2"):
        hq.Codes.from_labels(codes.labels.at[0, 0, 0].set(3), codes.T, cfg)
    with pytest.raises(ValueError, match="T must be in -1..max_T"):
        hq.Codes.from_labels(codes.labels, codes.T.at[0].set(-3), cfg)
    with pytest.raises(TypeError, match="integer"):
        hq.Codes.from_labels(codes.labels.astype(jnp.float32), codes.T, cfg)
    # Under jit the values are not known: an out-of-range block decodes to NaN.
    out = jax.jit(hq.decode)(bad)
    assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1:]))


@pytest.mark.parametrize("lattice, q, bits", [("E8", 2, 3), ("E8", 3, 4), ("E8", 4, 4),
                                              ("D4", 4, 3), ("D12", 3, None)])
def test_packed_codebook_holds_the_codebook(lattice, q, bits):
    """The encoder's packed rows (one uint32 per codebook row) unpack to the codebook exactly;
    a codebook whose d coordinates need more than 32 bits is not packed."""
    packed = packed_codebook(lattice, q)
    table = codebook_table(lattice, q)
    if bits is None:
        assert int(table.max() - table.min()).bit_length() * table.shape[1] > 32
        assert packed is None
        return
    words, b, low = packed
    assert b == bits and words.dtype == np.uint32 and low == table.min()
    unpacked = (words[:, None].astype(np.int64) >> (b * np.arange(table.shape[1]))) % 2**b + low
    np.testing.assert_array_equal(unpacked, table)


@pytest.mark.parametrize("lattice, q, bits", [("D4", 4, 8), ("E8", 2, 4), ("E8", 4, 4)])
def test_packed_codebook_with_given_bits(lattice, q, bits):
    """Fields of a given width (the GPU kernels' bytes and nibbles) unpack to the codebook;
    too narrow a field, or d fields past 32 bits, give no table."""
    words, b, low = packed_codebook(lattice, q, bits)
    table = codebook_table(lattice, q)
    assert b == bits and low == table.min()
    unpacked = (words[:, None].astype(np.int64) >> (b * np.arange(table.shape[1]))) % 2**b + low
    np.testing.assert_array_equal(unpacked, table)
    assert packed_codebook(lattice, q, int(table.max() - low).bit_length() - 1) is None
    assert packed_codebook(lattice, q, 32 // table.shape[1] + 1) is None

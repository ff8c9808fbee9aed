"""Mod-q sums: the coset identity, when they decode to the true sum, and the fallback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hnlq_jax as hq
from hnlq_jax import modq
from hnlq_jax.codec import all_labels, codebook_table
from hnlq_jax.codes import index_dtype
from hnlq_jax.lattices import columns, nearest_int

CONFIGS = [
    hq.HNLQConfig("Z2", 5, 1, beta=0.5),
    hq.HNLQConfig("A2", 4, 2, beta=0.25),
    hq.HNLQConfig("D4", 4, 2, beta=0.2),
    hq.HNLQConfig("E8", 2, 3, beta=0.5),
]
IDS = [f"{c.lattice}q{c.q}M{c.M}" for c in CONFIGS]


def _points(codes):
    """Exact lattice points ``sum_m q^m r(b_m)`` in P coordinates, int64 ``[..., d]``."""
    cfg = codes.config
    P = codebook_table(cfg.lattice, cfg.q).astype(np.int64)
    return np.sum(P[np.asarray(codes.index, np.int64)] * (cfg.q ** np.arange(cfg.M))[:, None],
                  axis=-2)


def _random_codes(cfg, shape, seed, T=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, cfg.q, size=shape + (cfg.M, cfg.d)).astype(np.uint8)
    return hq.Codes.from_labels(labels, np.full(shape, T, np.int8), cfg)


def _as(codes, cfg):
    """The same codes read with another config (e.g. beta = 1 for exact float decodes)."""
    return hq.Codes(codes.index, codes.tfield, cfg)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_label_sum_is_lattice_sum_mod_qL(cfg):
    """r((a + b) mod q) - r(a) - r(b) is in qL, for every pair of labels (one level)."""
    q, d = cfg.q, cfg.d
    labels = all_labels(q, d)
    rng = np.random.default_rng(0)
    a = labels if len(labels) <= 4096 else labels[rng.choice(len(labels), 4096, replace=False)]
    a, b = np.repeat(a, 16, axis=0), labels[rng.integers(0, len(labels), len(a) * 16)]
    one = cfg.replace(M=1)
    s = modq.add(hq.Codes.from_labels(a[:, None], np.zeros(len(a), np.int8), one),
                 hq.Codes.from_labels(b[:, None], np.zeros(len(b), np.int8), one))
    P = codebook_table(cfg.lattice, q).astype(np.int64)
    k = q ** np.arange(d - 1, -1, -1)
    carry = P[np.asarray(s.index[:, 0], np.int64)] - P[a @ k] - P[b @ k]
    back = jnp.stack(nearest_int(columns(jnp.asarray(carry, jnp.int32)), q, cfg.lat), -1)
    np.testing.assert_array_equal(q * np.asarray(back), carry)  # carry / q is a lattice point
    np.testing.assert_array_equal(s.labels[:, 0], (a + b) % q)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_validate_against_exact_sums(cfg, x64):
    """validate is true exactly where the accumulated labels decode to the true sum."""
    codes = _random_codes(cfg, (2, 2000), 1)
    acc = modq.accumulate(codes, axis=0)
    ok = np.asarray(modq.validate(codes, axis=np.int64(0)))  # NumPy ints are axes too
    expect = np.all(_points(acc) == _points(codes).sum(0), axis=-1)
    np.testing.assert_array_equal(ok, expect)
    assert ok.any() and not ok.all()  # both cases occur for uniform labels
    if cfg.lattice == "A2":
        return  # A2's Cartesian coordinates are not dyadic: the float check below needs exactness
    # Decoded (beta = 1, T = 0: exact floats): equal sums exactly where validate says so.
    one = cfg.replace(beta=1.0)
    dec = np.asarray(hq.decode(_as(acc, one)))
    total = np.asarray(hq.decode(_as(codes, one))).sum(0)
    np.testing.assert_array_equal(np.all(dec == total, axis=-1), ok)


def test_single_level_small_sums_are_exact(x64):
    """M = 1 and summands well inside the cell: no carry leaves the constellation."""
    cfg = hq.HNLQConfig("D4", 8, 1, beta=1.0)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 300, 4))
    codes = hq.encode(x, cfg)
    assert np.all(np.asarray(modq.validate(codes)))
    np.testing.assert_array_equal(hq.decode(modq.accumulate(codes)),
                                  np.asarray(hq.decode(codes)).sum(0))


@pytest.mark.parametrize("cfg", CONFIGS[1:3], ids=IDS[1:3])
def test_sum_with_fallback(cfg, x64):
    codes = _random_codes(cfg, (4, 200), 3, T=2)
    x, exact = modq.sum_with_fallback(codes, axis=0)
    np.testing.assert_array_equal(exact, modq.validate(codes, axis=0))
    assert not np.all(exact)
    np.testing.assert_allclose(x, np.asarray(hq.decode(codes)).sum(0), rtol=1e-13, atol=1e-13)


def test_differing_T_is_marked_not_summed():
    cfg = CONFIGS[2]
    a, b = _random_codes(cfg, (6,), 4), _random_codes(cfg, (6,), 5)
    b = hq.Codes.from_labels(b.labels, b.T.at[2].set(1).at[4].set(-1), cfg)
    s = modq.add(a, b)
    np.testing.assert_array_equal(s.T, [0, 0, -1, 0, -1, 0])
    stacked = hq.Codes.from_labels(jnp.stack([a.labels, b.labels]), jnp.stack([a.T, b.T]), cfg)
    assert not np.any(np.asarray(modq.validate(stacked))[[2, 4]])
    x, _ = modq.sum_with_fallback(stacked)
    assert np.isnan(np.asarray(x)[4]).all() and np.isfinite(np.asarray(x)[2]).all()


@pytest.mark.parametrize("max_T", [14, 20], ids=["4bit", "8bit"])
@pytest.mark.parametrize("shape,axis", [((3, 5), 0), ((2, 4, 7), 1), ((5, 3), 1), ((4, 3), -1)])
def test_accumulate_odd_block_counts(max_T, shape, axis):
    """Odd lengths of the last leading axis, in the summands or in the result (4-bit T field:
    the last byte holds one block and a zero pad), against a numpy reference; T differs from
    block to block so a nibble mix-up cannot pass."""
    cfg = CONFIGS[2].replace(max_T=max_T)
    rng = np.random.default_rng(sum(shape) + axis)
    ax = axis % len(shape)  # the labels have two more axes than T
    labels = rng.integers(0, cfg.q, size=shape + (cfg.M, cfg.d))
    T = np.broadcast_to(rng.integers(0, max_T + 1, size=shape[:ax] + (1,) + shape[ax + 1:]),
                        shape).copy()
    T.flat[0] = max_T if T.flat[0] != max_T else 0  # one block whose summands disagree
    codes = hq.Codes.from_labels(labels, T, cfg)
    acc = modq.accumulate(codes, axis=axis)
    lab = labels.sum(ax) % cfg.q
    first = np.take(T, 0, axis=ax)
    common = np.where(np.all(T == np.expand_dims(first, ax), axis=ax), first, -1)
    assert common.min() == -1 and common.max() >= 0
    ref = hq.Codes.from_labels(lab, common, cfg)
    np.testing.assert_array_equal(acc.index, ref.index)
    np.testing.assert_array_equal(acc.tfield, ref.tfield)  # the pad nibble included
    np.testing.assert_array_equal(acc.T, common)
    assert acc.config == cfg and acc.blocks_shape == common.shape


@settings(max_examples=15)
@given(seed=st.integers(0, 2**31 - 1), axis=st.sampled_from([0, 1, -1]))
def test_accumulate_is_repeated_add(seed, axis):
    cfg = CONFIGS[1]
    codes = _random_codes(cfg, (3, 3), seed)
    acc = modq.accumulate(codes, axis=axis)
    take = [hq.Codes.from_labels(jnp.take(codes.labels, i, axis=axis % 2),
                                 jnp.take(codes.T, i, axis=axis % 2), cfg) for i in range(3)]
    rep = modq.add(modq.add(take[0], take[1]), take[2])
    np.testing.assert_array_equal(acc.index, rep.index)
    np.testing.assert_array_equal(acc.tfield, rep.tfield)
    assert acc.index.dtype == index_dtype(cfg) and acc.tfield.dtype == jnp.uint8
    assert acc.labels.dtype == jnp.uint8 and acc.T.dtype == jnp.int8


def test_validate_where_int32_sums_wrap():
    """8192 summands of -2^19 per coordinate (Z2 q=32 M=4, the top level's label 16) sum to
    -2^32, which an int32 sum wraps to 0: the mod-q value of the labels (16 * 8192 = 0 mod
    32), so validate said exact and sum_with_fallback returned 0. Beside them a block of zero
    labels, whose mod-q sum is exact. (Without x64: with it jnp.sum of int32 is int64.)"""
    cfg = hq.HNLQConfig("Z2", 32, 4, beta=1.0)
    labels = np.zeros((8192, 2, cfg.M, cfg.d), np.uint8)
    labels[:, 0, 3] = 16
    codes = hq.Codes.from_labels(labels, np.zeros((8192, 2), np.int8), cfg)
    true = _points(codes).sum(0)
    assert np.all(np.abs(true[0]) == 2**32)
    expect = np.all(_points(modq.accumulate(codes)) == true, axis=-1)
    np.testing.assert_array_equal(expect, [False, True])
    np.testing.assert_array_equal(modq.validate(codes), expect)
    x, exact = modq.sum_with_fallback(codes)
    np.testing.assert_array_equal(exact, expect)
    np.testing.assert_array_equal(x, np.asarray(hq.decode(codes)).sum(0))


def test_corrupted_blocks_under_jit_sum_as_failed():
    """Under jit an index >= q^d (q = 3: the uint8 holds up to 255) cannot raise: its digits
    wrapped to a valid label and summed as a finite value; it is a failed block (NaN, not
    exact), as decode makes it. Eager calls refuse it."""
    cfg = hq.HNLQConfig("D4", 3, 1, beta=1.0)
    good = hq.encode(np.array([[[1.0, 0, 0, 1], [0, 0, 0, 0]]] * 2, np.float32), cfg)
    bad = hq.Codes(good.index.at[1, 0, 0].set(100), good.tfield, cfg)
    acc = jax.jit(modq.accumulate)(bad)
    np.testing.assert_array_equal(acc.T, [-1, 0])
    np.testing.assert_array_equal(jax.jit(hq.kernels.modq_sum)(bad).T, [-1, 0])  # its twin
    x, exact = jax.jit(modq.sum_with_fallback)(bad)
    np.testing.assert_array_equal(exact, [False, True])
    assert np.all(np.isnan(x[0])) and np.all(np.isfinite(x[1]))
    np.testing.assert_array_equal(jax.jit(modq.validate)(bad), [False, True])
    with pytest.raises(ValueError, match="index out of range"):
        modq.accumulate(bad)


def test_jit():
    cfg = CONFIGS[2]
    codes = _random_codes(cfg, (2, 5), 6)
    f = jax.jit(lambda c: modq.accumulate(c, axis=1))
    got, ref = f(codes), modq.accumulate(codes, axis=1)
    np.testing.assert_array_equal(got.index, ref.index)
    np.testing.assert_array_equal(got.tfield, ref.tfield)


def test_row_codes_keep_their_length():
    """Row codes without scales (n = 18 over 5 D4 blocks, the last padded) summed over rows
    stay row codes of n = 18, decoding to [..., 18] like their summands (n was dropped, and the
    sum decoded to 20 entries); summed over their blocks they are block codes."""
    cfg = CONFIGS[2]
    rows = _random_codes(cfg, (3, 2, 5), 10).with_rows(n=18)
    acc = modq.accumulate(rows, axis=0)
    assert acc.n == 18 and hq.decode(acc).shape == (2, 18)
    np.testing.assert_array_equal(acc.index, modq.accumulate(_as(rows, cfg), axis=0).index)
    assert modq.accumulate(rows, axis=-1).n is None
    one = hq.Codes(rows.index[0], rows.tfield[0], cfg).with_rows(n=18)
    assert modq.add(one, _random_codes(cfg, (2, 5), 11)).n == 18
    with pytest.raises(ValueError, match="different lengths n = 18 and 17"):
        modq.add(one, hq.Codes(one.index, one.tfield, cfg).with_rows(n=17))


def test_bad_input():
    cfg = CONFIGS[2]
    codes = _random_codes(cfg, (2, 5), 7)
    with pytest.raises(ValueError, match="without dither"):
        modq.accumulate(_as(codes, cfg.replace(dither=(0.1, 0, 0, 0))))
    with pytest.raises(ValueError, match="without row scales"):
        modq.accumulate(codes.with_rows(scale=np.ones(2, np.float32)))
    with pytest.raises(ValueError, match="axis must be an int"):
        modq.accumulate(codes, axis=2)
    with pytest.raises(ValueError, match="axis 0 .* is empty"):
        modq.accumulate(_random_codes(cfg, (0, 5), 7))
    with pytest.raises(ValueError, match="do not broadcast"):
        modq.add(codes, _random_codes(cfg, (3,), 8))
    with pytest.raises(ValueError, match="different configs"):
        modq.add(codes, _random_codes(cfg.replace(q=3), (2, 5), 8))
    with pytest.raises(TypeError, match="expected hnlq_jax.Codes, got tuple"):
        modq.validate((codes.labels, codes.T))
    z = _random_codes(CONFIGS[0], (2, 5), 9)  # Z2 q=5: indices 0..24 in uint8
    with pytest.raises(ValueError, match="codebook index out of range"):
        modq.validate(hq.Codes(z.index + 25, z.tfield, CONFIGS[0]))
    with pytest.raises(ValueError, match=r"expected index uint8\[..., M=2\]"):
        modq.sum_with_fallback(hq.Codes(codes.index[..., :1], codes.tfield, cfg))

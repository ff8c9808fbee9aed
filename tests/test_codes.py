"""Compact codes: memory, field layout, pytree behaviour, row codes and the matmul front door."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import hnlq_jax as hq
from hnlq_jax.codes import check_saved_header, index_dtype, pack_t, saved_header, t_bits, unpack_t

D4 = hq.HNLQConfig("D4", 4, 2, beta=0.2016)
E8 = hq.HNLQConfig("E8", 4, 2, beta=0.2)


@pytest.mark.parametrize("cfg,shape,limit", [(D4, (4096, 1024, 4), 5.0), (E8, (4096, 512, 8), 4.6)])
def test_memory_target(cfg, shape, limit):
    """Bytes of the codes' arrays for float32 x of the issue's shapes (eval_shape: no data)."""
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    codes = jax.eval_shape(lambda v: hq.encode(v, cfg, implementation="xla"), x)
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(codes))
    assert 8 * nbytes / np.prod(shape) <= limit
    # The same accounting on real (smaller) codes: 2048 (D4) or 1024 (E8) blocks, where an eager
    # encode does not compile the compacting search of batches above 4096 blocks.
    small = hq.encode(np.zeros((2,) + shape[1:], np.float32), cfg)
    assert small.bits_per_value() == pytest.approx(8 * nbytes / np.prod(shape))


@pytest.mark.parametrize("cfg,dtype", [
    (hq.HNLQConfig("D4", 4, 2), np.uint8), (hq.HNLQConfig("D4", 5, 2), np.uint16),
    (hq.HNLQConfig("A2", 16, 1), np.uint8), (hq.HNLQConfig("Z2", 17, 1), np.uint16),
    (hq.HNLQConfig("E8", 4, 2), np.uint16), (hq.HNLQConfig("E8", 5, 1), np.uint32),
])
def test_index_dtype(cfg, dtype):
    assert index_dtype(cfg) == dtype


@pytest.mark.parametrize("max_T,bits", [(0, 4), (14, 4), (15, 8), (127, 8)])
@pytest.mark.parametrize("L", [1, 6, 7])
def test_t_field_roundtrip(max_T, bits, L):
    """Every T in -1..max_T survives the field, at both widths and odd lengths (max_T = 14:
    u = 15 is the largest nibble; 15 needs the 8-bit field)."""
    cfg = hq.HNLQConfig("D4", 4, 2, max_T=max_T)
    assert t_bits(cfg) == bits
    T = np.random.default_rng(L).integers(-1, max_T + 1, size=(3, L))
    T[0, 0], T[-1, -1] = max_T, -1
    field = pack_t(jnp.asarray(T), cfg)
    assert field.dtype == jnp.uint8
    assert field.shape == ((3, -(-L // 2)) if bits == 4 else (3, L))
    np.testing.assert_array_equal(unpack_t(field, cfg, L) - 1, T)


def test_nibble_order():
    """Block 2j in the low nibble, 2j + 1 in the high one (docs/format.md)."""
    cfg = hq.HNLQConfig("D4", 4, 2)
    np.testing.assert_array_equal(pack_t(jnp.asarray([2, 5, -1]), cfg), [3 | 6 << 4, 0])


def test_padding_nibble_is_ignored_on_reading():
    """An odd last axis leaves the last byte's high nibble as padding: whatever it holds, every
    reader (eager and jitted decode, rate_stats, pack) gives what the clean codes give, while the
    same value in a real nibble is refused as corrupted."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2016, max_T=3)  # u <= 4: 15 is out of range
    codes = hq.encode(2 * np.random.default_rng(2).standard_normal((2, 3, 4)), cfg)
    dirty = hq.Codes(codes.index, codes.tfield.at[:, -1].add(15 << 4), cfg)
    np.testing.assert_array_equal(hq.decode(dirty), hq.decode(codes))
    np.testing.assert_array_equal(jax.jit(hq.decode)(dirty), hq.decode(codes))
    np.testing.assert_array_equal(hq.rate_stats(dirty).histogram, hq.rate_stats(codes).histogram)
    assert hq.pack(dirty).to_bytes() == hq.pack(codes).to_bytes()
    corrupt = hq.Codes(codes.index, codes.tfield.at[:, 0].set(15 << 4), cfg)
    with pytest.raises(ValueError, match="T field holds values above max_T = 3"):
        hq.decode(corrupt)


def test_codes_views_and_from_labels():
    x = np.random.default_rng(0).normal(size=(5, 7, 4)).astype(np.float32)
    c = hq.encode(x, D4)
    assert c.shape == (5, 7, 4) and c.blocks_shape == (5, 7) and c.n is None
    assert c.index.dtype == jnp.uint8 and c.index.shape == (5, 7, 2)
    k = np.sum(np.asarray(c.labels, np.int64) * 4 ** np.arange(3, -1, -1), axis=-1)
    np.testing.assert_array_equal(c.index, k)  # coordinate 0 most significant
    again = hq.Codes.from_labels(c.labels, c.T, D4)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(c)):
        np.testing.assert_array_equal(a, b)
    assert "D4 q=4 M=2" in repr(c)


def test_pytree_transforms():
    """Codes cross jit, vmap (over a non-last leading axis), scan and shard_map unchanged."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 6, 4)), jnp.float32)
    c = hq.encode(x, D4)
    ref = hq.decode(c)
    np.testing.assert_array_equal(jax.jit(hq.decode)(c), ref)
    np.testing.assert_array_equal(jax.vmap(hq.decode)(c), ref)
    vm = jax.vmap(lambda v: hq.encode(v, D4))(x)
    np.testing.assert_array_equal(vm.index, c.index)
    np.testing.assert_array_equal(vm.tfield, c.tfield)
    _, scanned = jax.lax.scan(lambda carry, ci: (carry, hq.decode(ci)), 0, c)
    np.testing.assert_array_equal(scanned, ref)
    mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    sm = jax.shard_map(lambda ci: hq.decode(ci), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    np.testing.assert_array_equal(jax.jit(sm)(c), ref)


def test_row_codes_decode_and_scale():
    W = np.random.default_rng(2).normal(size=(16, 30)).astype(np.float32)
    W[3] *= 100.0
    cfg = D4.replace(beta=hq.gaussian_beta(D4))
    rc = hq.encode_rows(W, cfg)
    assert rc.shape == (16, 30) and rc.blocks_shape == (16, 8) and rc.n == 30
    assert rc.config == cfg.replace(beta=1.0)
    rms = np.sqrt(np.mean(W.astype(np.float64) ** 2, axis=1))
    # within 2^-11: hnlq_jax._numerics.mean_square rounds the entries to 12 significant bits
    np.testing.assert_allclose(rc.scale, cfg.beta * rms, rtol=2**-11)
    blocks = hq.decode(hq.Codes(rc.index, rc.tfield, rc.config))  # unit-scale blocks
    expect = np.asarray(blocks).reshape(16, 32)[:, :30] * np.asarray(rc.scale)[:, None]
    np.testing.assert_array_equal(hq.decode(rc), expect)
    rel = np.linalg.norm(hq.decode(rc) - W, axis=1) / np.linalg.norm(W, axis=1)
    assert np.all(rel < 0.15)  # the 100x row is as accurate as the others
    # with_rows keeps what it is not given (n=... dropped the scale, scale=... the length)
    shorter = rc.with_rows(n=29)
    assert shorter.scale is rc.scale and shorter.n == 29
    np.testing.assert_array_equal(hq.decode(shorter), expect[:, :29])
    assert rc.with_rows(scale=np.ones(16, np.float32)).n == 30
    assert rc.with_rows(scale=None).scale is None and rc.with_rows(n=None).n == 32


@pytest.mark.parametrize("cfg", [D4, hq.HNLQConfig("E8", 2, 2)])
def test_eager_row_codes_share_the_encoder_across_shapes(cfg, compiles):
    """Eager row codes encode their blocks on a bucket (ops.bucket): weights of new shapes
    whose blocks fall in a compiled bucket compile only the small scale and assembly programs,
    never the encoder; the codes equal the one-program traced path's bit for bit, a row with
    no finite scale included (its blocks fail)."""
    rng = np.random.default_rng(7)
    shapes = [(40, 60), (60, 40), (33, 70), (3, 5, 41)]  # 165 to 600 blocks: one bucket, 1024
    for i, shape in enumerate(shapes):
        w = rng.normal(size=shape).astype(np.float32)
        if i == 2:  # a row of 3e38: beta * RMS overflows for E8 (beta > 1), not for D4
            w[0] = 3e38
        beta = jnp.float32(hq.gaussian_beta(cfg))
        compiles.clear()
        eager = hq.rows.rows_codes(w, cfg, beta)
        if i:  # the first shape compiled the bucket's encoder
            assert "jit(encode_flat)" not in compiles, compiles
        traced = jax.jit(hq.rows.rows_codes, static_argnums=1)(w, cfg, beta)
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(traced)):
            np.testing.assert_array_equal(a, b)
        assert eager.n == shape[-1] and eager.config == traced.config


@pytest.mark.parametrize("rows, k", [(1, 6), (16, 30), (5, 257)])
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1.0, 1e-30, 1e30]))
def test_row_scales_do_not_depend_on_the_program(rows, k, seed, scale):
    """The row RMS (and so the scales and codes) are the same bits eager and under jit, with
    the weight's transpose fused into the reduction: with jnp.mean(jnp.square(...)) they
    differed in the last bit on AVX-512 (summation order, fused multiply-adds; a jitted QDense
    and its export disagreed). It is within 2^-11 of the exact RMS (entries rounded to 12
    significant bits, hnlq_jax._numerics.mean_square)."""
    w = (np.random.default_rng(seed).normal(size=(rows, k)) * scale).astype(np.float32)
    eager = np.asarray(hq.rows.row_rms(w))
    np.testing.assert_array_equal(np.asarray(jax.jit(hq.rows.row_rms)(w)), eager)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda t: hq.rows.row_rms(t.T))(w.T)),
                                  eager)
    np.testing.assert_allclose(eager, np.sqrt(np.mean(w.astype(np.float64) ** 2, axis=1)),
                               rtol=2**-11)


@given(seed=st.integers(0, 2**31 - 1))
def test_rows_are_divided_as_ieee_divides(seed):
    """Row codes encode IEEE's quotients ``w / c``, on every backend
    (hnlq_jax._numerics.divide): XLA:CPU divided by the broadcast row scale by multiplying
    with its reciprocal (a fifth of the quotients a unit in the last place off) and a GPU
    divides approximately, so blocks near a rounding boundary coded differently. The row
    RMS's square root is IEEE's too (a GPU's is approximate)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 512)).astype(np.float32)
    c = rng.uniform(0.1, 10, 8).astype(np.float32)
    np.testing.assert_array_equal(hq.rows.divide_rows(w, c), w / c[:, None])
    m = np.max(np.abs(w), axis=1)
    mean = np.asarray(jax.jit(hq.rows.mean_square)(w / m[:, None]))
    np.testing.assert_array_equal(hq.rows.row_rms(w), m * np.sqrt(mean))


def test_extreme_entry_does_not_poison_its_row():
    """A 1e30 entry (its square overflows float32) gives a finite row scale; the other rows and
    the other entries of its row keep decoding to finite values."""
    W = np.random.default_rng(4).normal(size=(4, 16)).astype(np.float32)
    W[1, 3] = 1e30
    rc = hq.encode_rows(W, D4.replace(beta=hq.gaussian_beta(D4)))
    out = np.asarray(hq.decode(rc))
    assert np.all(np.isfinite(rc.scale)) and np.all(np.isfinite(out))
    np.testing.assert_allclose(out[[0, 2, 3]], W[[0, 2, 3]], rtol=0.5, atol=0.5)
    assert "Codes(" in repr(jax.tree.map(jnp.shape, rc))


@pytest.mark.parametrize("big", [1e38, 3e38])
def test_row_near_float32_max_keeps_its_scale(big):
    """Above about 8.5e37, XLA:CPU's reciprocal of the row maximum or scale flushed to zero: the
    row's RMS fell back to 1 and its blocks failed (NaN) or coded as zeros."""
    W = np.zeros((2, 8), np.float32)
    W[0, 0], W[0, 5], W[1] = big, big / 2, np.linspace(-1, 1, 8)
    rms = np.sqrt(np.mean(W.astype(np.float64) ** 2, axis=1))
    np.testing.assert_allclose(hq.rows.row_rms(jnp.asarray(W)), rms, rtol=2**-11)
    rc = hq.encode_rows(W, D4.replace(beta=hq.gaussian_beta(D4)))
    out = np.asarray(hq.decode(rc))
    assert np.all(rc.T >= 0) and np.all(np.isfinite(out))
    np.testing.assert_allclose(out[0, [0, 5]], W[0, [0, 5]], rtol=0.3)
    # a row RMS near the float range times beta > 1 has no finite scale: its blocks fail
    e8 = hq.HNLQConfig("E8", 2, 1)
    e8 = e8.replace(beta=hq.gaussian_beta(e8))
    assert e8.beta > 1
    top = np.full((1, 8), 3e38, np.float32)
    with pytest.raises(ValueError, match="row scale beta \\* RMS beyond the float range"):
        hq.encode_rows(top, e8)
    assert np.all(np.asarray(hq.encode_rows(top, e8, failures="mark").T) == -1)


@pytest.mark.parametrize("rms", [2e-38, 1e-37, 2e-36])
@pytest.mark.parametrize("beta", [0.05, 0.2])
def test_row_scale_never_goes_subnormal(rms, beta):
    """beta times a row RMS below the smallest normal float was a subnormal scale, zero to the
    division (XLA:CPU flushes it): every block of the row failed with an "overload" error. The
    scale is raised to the smallest normal float, which only codes the row more coarsely; rows
    whose scale is normal keep theirs exactly."""
    W = np.random.default_rng(5).standard_normal((3, 64))
    W = (W / np.sqrt(np.mean(W**2, axis=1, keepdims=True)) * rms).astype(np.float32)
    cfg = D4.replace(beta=beta)
    tiny = np.finfo(np.float32).tiny
    for codes in (hq.encode_rows(W, cfg), jax.jit(hq.encode_rows, static_argnums=1)(W, cfg)):
        scale = np.asarray(codes.scale)
        want = np.float32(beta) * np.asarray(hq.rows.row_rms(W))
        np.testing.assert_array_equal(scale, np.maximum(want, tiny))
        assert np.all(np.asarray(codes.T) >= 0)
        # within the row RMS (2e-38: the scale is 0.6 RMS, coarser than beta's), plus the
        # decoded entries below the smallest normal float XLA:CPU flushes
        err = np.abs(np.asarray(hq.decode(codes), np.float64) - W)
        assert err.max() < rms + 2 * tiny, err.max() / rms


def test_row_overload_raises_eagerly_or_is_marked():
    """An entry ~60x its row's RMS fails at max_T: an eager call says so (it used to return
    codes that decode to NaN), failures='mark' and jit mark the block T = -1."""
    cfg = D4.replace(beta=hq.gaussian_beta(D4))
    W = np.random.default_rng(0).standard_normal((2, 4096)).astype(np.float32)
    W[0, 5] = 150.0
    with pytest.raises(ValueError, match=r"encode_rows: 1 block\(s\) still overload at max_T = 14 "
                                         r"\(the first at block \[0, 1\]\)"):
        hq.encode_rows(W, cfg)
    for rc in (hq.encode_rows(W, cfg, failures="mark"), jax.jit(hq.encode_rows, static_argnums=1)(W, cfg)):
        T = np.asarray(rc.T)
        assert T[0, 1] == -1 and np.sum(T < 0) == 1
    W[0, 5] = 100.0  # within reach: encodes
    assert np.all(np.asarray(hq.encode_rows(W, cfg).T) >= 0)
    with pytest.raises(ValueError, match="failures must be one of"):
        hq.encode_rows(W, cfg, failures="nan")


@pytest.mark.parametrize("cfg", [D4, hq.HNLQConfig("E8", 2, 2, beta=0.3),
                                 D4.replace(dither=(0.01, -0.02, 0.03, 0.0))])
def test_matmul_front_door(cfg):
    """xla and lut agree with x @ decode(W)^T; gradients reach x and the row scale only."""
    rng = np.random.default_rng(3)
    W = rng.normal(size=(12, 37)).astype(np.float32)
    rc = hq.encode_rows(W, cfg.replace(beta=hq.gaussian_beta(cfg)))
    x = rng.normal(size=(2, 3, 37)).astype(np.float32)
    ref = np.einsum("...k,nk->...n", x.astype(np.float64), np.asarray(hq.decode(rc), np.float64))
    for impl in ("xla", "lut"):
        np.testing.assert_allclose(hq.matmul(x, rc, implementation=impl), ref, rtol=1e-5,
                                   atol=1e-5)
    gx, gc = jax.grad(lambda v, c: jnp.sum(hq.matmul(v, c) ** 2), argnums=(0, 1),
                      allow_int=True)(x, rc)
    y = np.asarray(hq.matmul(x, rc), np.float64)
    np.testing.assert_allclose(gx, 2 * np.einsum("...n,nk->...k", y, hq.decode(rc)), rtol=1e-4,
                               atol=1e-4)
    assert gc.index.dtype == jax.dtypes.float0 and gc.scale.shape == (12,)
    assert np.all(np.isfinite(gc.scale)) and np.any(np.asarray(gc.scale) != 0)


def test_matmul_bad_input_and_empty():
    rc = hq.encode_rows(np.ones((4, 8), np.float32), D4)
    with pytest.raises(ValueError, match="k = 8"):
        hq.matmul(np.ones((2, 9), np.float32), rc)
    with pytest.raises(TypeError, match="floating"):
        hq.matmul(np.ones((2, 8), np.int32), rc)
    with pytest.raises(ValueError, match="implementation must be one of"):
        hq.matmul(np.ones((2, 8), np.float32), rc, implementation="bogus")
    with pytest.raises(ValueError, match="blocks \\[n, nb\\]"):
        hq.matmul(np.ones((2, 4), np.float32), hq.encode(np.ones((4, 4), np.float32), D4))
    assert hq.matmul(np.ones((0, 8), np.float32), rc).shape == (0, 4)


@pytest.mark.parametrize("version", [hq.FORMAT_VERSION, np.int64(hq.FORMAT_VERSION),
                                     np.asarray(hq.FORMAT_VERSION), jnp.asarray(hq.FORMAT_VERSION)],
                         ids=["int", "numpy-int", "numpy-0d", "jax-0d"])
def test_saved_header_reads_integer_versions(version):
    """A checkpoint may hand the version back as a NumPy scalar or 0-d array: the integer."""
    cfg = hq.HNLQConfig("D4", 4, 2, dither=(0.1, 0.0, 0.0, 0.0))
    state = {**saved_header(cfg), "format_version": version}
    assert check_saved_header(state, cfg, "load", "") == cfg


@pytest.mark.parametrize("version", [1.0, "1", True, np.asarray([1])],
                         ids=["float", "str", "bool", "1d"])
def test_saved_header_refuses_other_versions(version):
    cfg = hq.HNLQConfig("D4", 4, 2)
    with pytest.raises(ValueError, match="load: the codes were saved in format version"):
        check_saved_header({**saved_header(cfg), "format_version": version}, cfg, "load", "")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nonfinite_entry_fails_its_block_not_its_row(bad):
    """Under jit (no eager check) a NaN or Inf entry marks its block failed (T = -1, a NaN
    block); the row's other blocks code at their own row scale, as without it (a non-finite
    RMS had made the scale beta x 1: rows of 1e-3 decoded to zeros with T = 0)."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2016)
    W = (np.random.default_rng(4).standard_normal((3, 16)) * 1e-3).astype(np.float32)
    W[1, 13] = 0  # the row's scale is its finite entries' RMS: that of the row with a 0 there
    clean = jax.jit(lambda w: hq.encode_rows(w, cfg))(W)
    W[1, 13] = bad
    codes = jax.jit(lambda w: hq.encode_rows(w, cfg))(W)
    T = np.asarray(codes.T)
    np.testing.assert_array_equal(T[1, 3], -1)
    np.testing.assert_array_equal(np.delete(T, [7]), np.delete(np.asarray(clean.T), [7]))
    decoded, want = np.asarray(hq.decode(codes)), np.asarray(hq.decode(clean))
    assert np.isnan(decoded[1, 12:]).all()
    np.testing.assert_array_equal(decoded[1, :12], want[1, :12])
    np.testing.assert_array_equal(np.delete(decoded, 1, 0), np.delete(want, 1, 0))
    assert np.abs(decoded[1, :12] - W[1, :12]).max() < 5e-4


def test_a_nonfinite_entry_leaves_the_traced_calibration_alone():
    """Under jit a NaN entry's block joins calibrate_rows' sample as a zero block: beta is
    about that of the weight with a 0 there (one block of 1024 differs), where as itself it
    overloaded at every beta and doubled beta (0.21 -> 0.46 on this weight)."""
    cfg = hq.HNLQConfig("D4", 4, 2)
    W = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    W[7, 9] = 0
    calibrate = jax.jit(lambda w: hq.rows.calibrate_rows(w, cfg))
    clean = float(calibrate(W))
    W[7, 9] = np.nan
    assert float(calibrate(W)) == pytest.approx(clean, rel=0.02)


@pytest.mark.parametrize("dither", [None, (0.1, -0.05, 0.02, 0.0)])
def test_all_zero_rows_decode_to_zero(dither):
    """An all-zero row (a pruned output) stores the scale 0 and decodes to exactly 0, with a
    dither too (its blocks decode to beta (Q(z) - z) != 0); the other rows as before; in the
    product, eager and under jit."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2016, dither=dither)
    W = np.random.default_rng(3).standard_normal((4, 10)).astype(np.float32)
    W[[0, 2]] = 0
    for codes in (hq.encode_rows(W, cfg), jax.jit(lambda w: hq.encode_rows(w, cfg))(W)):
        np.testing.assert_array_equal(np.asarray(codes.scale)[[0, 2]], 0)
        assert np.all(np.asarray(codes.scale)[[1, 3]] > 0)
        decoded = np.asarray(hq.decode(codes))
        np.testing.assert_array_equal(decoded[[0, 2]], 0)
        assert np.abs(decoded[[1, 3]] - W[[1, 3]]).max() < 0.5
        y = np.asarray(hq.matmul(np.ones((2, 10), np.float32), codes))
        np.testing.assert_array_equal(y[:, [0, 2]], 0)

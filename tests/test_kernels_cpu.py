"""hnlq_jax.kernels.cpu: the native CPU kernels against the XLA path, through hq.matmul and
hq.decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hnlq_jax as hq
from hnlq_jax import ops
from hnlq_jax.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"{cpu.why_unavailable()}")

# Every layout the kernel has (pairs: D4 q4 M2; int8 Horner: E8 q2; packed 4-bit words: E8
# q4; generic: the rest), with and without a dither (the register product folds the row's
# factors only without), both T field widths, a lattice of each dimension the kernel takes
CONFIGS = {
    "D4-q4-M2": hq.HNLQConfig("D4", 4, 2, beta=0.2016),
    "D4-q4-M2-T64": hq.HNLQConfig("D4", 4, 2, beta=0.2016, max_T=64),  # pairs, 8-bit T field
    "D4-q3-M3": hq.HNLQConfig("D4", 3, 3, beta=0.3),
    "D4-q5-M2-T64": hq.HNLQConfig("D4", 5, 2, beta=0.15, max_T=64),
    "E8-q4-M2": hq.HNLQConfig("E8", 4, 2, beta=0.25),
    "E8-q2-M3-dither": hq.HNLQConfig("E8", 2, 3, beta=0.4, dither=tuple(np.linspace(-.2, .2, 8))),
    "E8-q4-M3": hq.HNLQConfig("E8", 4, 3, beta=0.1),
    "E8-q2-M2": hq.HNLQConfig("E8", 2, 2, beta=0.3),
    "Z2-q8-M2": hq.HNLQConfig("Z2", 8, 2, beta=0.2),
    "D4-q4-M2-dither": hq.HNLQConfig("D4", 4, 2, beta=0.2016, dither=(0.01, -0.02, 0.03, 0.0)),
}


# The instruction sets this CPU runs the kernels with (each level is code of its own,
# csrc/decode_rows.h): the tests of decoded bits and of the product's paths run on each.
LEVELS = cpu.ISAS[:cpu.ISAS.index(cpu.isa()) + 1] if cpu.available() else ()


@pytest.fixture(params=LEVELS)
def isa(request):
    with cpu.use_isa(request.param):
        yield request.param


def _weight(cfg, n_out, k, seed=0):
    """Row codes of a Gaussian weight. A drawn seed's rare tail block may overload at max_T
    (E8 q=2 M=2 at beta 0.3: an entry of 4.6 RMS, seed 11127): it is marked, and its NaN
    row of the product compared as the reference's."""
    w = np.random.default_rng(seed).standard_normal((n_out, k)).astype(np.float32)
    return hq.encode_rows(w, cfg, failures="mark")


@pytest.mark.parametrize("name", CONFIGS)
def test_decoded_weights_bit_for_bit(name, isa):
    """One-hot rows of x read single decoded weights: equal to the XLA path's decode exactly
    (row scale applied, the padded tail of a ragged row dropped) on each of the product's
    paths (up to 4 rows: straight into the sums; more: through the buffer, or by planes four
    rows at a time; from GEMM_ROWS: the decode kernel, then a GEMM), in the whole steps of
    256 weights of the planes, the registers after them and the ragged end of the rows
    (jitted: exact row counts, no bucket padding)."""
    codes = _weight(CONFIGS[name], 13, 600)
    want = np.asarray(hq.decode(codes, implementation="xla")).T
    eye = jnp.eye(600, dtype=jnp.float32)
    native = jax.jit(lambda x, c: hq.matmul(x, c, implementation="native"))
    assert 600 >= cpu.GEMM_ROWS > 100
    np.testing.assert_array_equal(np.asarray(native(eye, codes)), want)
    for rows in (slice(0, 3), slice(250, 262), slice(560, 563), slice(590, 600),
                 slice(3, 103)):
        np.testing.assert_array_equal(np.asarray(native(eye[rows], codes)), want[rows])


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("k", [203, 1091])  # one chunk of the buffer, three
def test_a_row_does_not_depend_on_the_batch(name, k, isa):
    """A row of x gives the same bits in a batch of up to 4 rows (decoded registers straight
    into the sums) as in a larger one (through the buffer, 512 weights at a time): both paths
    fold the row's factors alike (or neither, with a dither) and sum in the same order, lane
    sums over the whole registers of the row, then the ragged end (beyond 512 weights the
    buffer path summed each chunk apart: the last bits differed)."""
    codes = _weight(CONFIGS[name], 13, k)
    x = np.random.default_rng(4).standard_normal((9, k)).astype(np.float32)
    native = jax.jit(lambda x, c: hq.matmul(x, c, implementation="native"))
    full = np.asarray(native(x, codes))
    for b in (1, 2, 4):
        np.testing.assert_array_equal(np.asarray(native(x[:b], codes)), full[:b])


@pytest.mark.parametrize("name", ["D4-q4-M2", "E8-q4-M2"])
@pytest.mark.parametrize("batch", [2, 5])  # registers; the buffer (and D4's planes)
def test_folded_sums_that_overflow_are_summed_unfolded(name, batch, isa):
    """Folded sums are of x (c 2^(alpha T)) before the row's factor: with row scales ~1e-20
    and x ~1e37 they overflowed to Inf where the reference's x w_hat are finite (~1e19): such
    tiles are summed again unfolded. A failed block's NaN stays NaN."""
    w = np.random.default_rng(1).standard_normal((6, 264)).astype(np.float32) * 1e-20
    codes = hq.encode_rows(w, CONFIGS[name])
    x = np.random.default_rng(2).standard_normal((batch, 264)).astype(np.float32) * 1e37
    want = np.asarray(hq.matmul(x, codes, implementation="xla"))
    got = np.asarray(hq.matmul(x, codes, implementation="native"))
    assert np.all(np.isfinite(want)) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    failed = hq.Codes(codes.index, codes.tfield.at[2, 0].set(0), codes.config,
                      scale=codes.scale, n=codes.n)
    got = np.asarray(hq.matmul(x, failed, implementation="native"))
    assert np.all(np.isnan(got[:, 2])) and np.all(np.isfinite(np.delete(got, 2, axis=1)))
    # only the results that were not finite are taken unfolded: an Inf in another row of x
    # leaves a row's bits as they are alone
    small = np.random.default_rng(3).standard_normal((batch, 264)).astype(np.float32)
    alone = np.asarray(hq.matmul(small, codes, implementation="native"))
    small[-1, 7] = np.inf
    mixed = np.asarray(hq.matmul(small, codes, implementation="native"))
    np.testing.assert_array_equal(mixed[:-1], alone[:-1])


@pytest.mark.parametrize("name", CONFIGS)
def test_decode_bit_for_bit(name, isa):
    """hq.decode's native kernel equals the XLA path exactly: row codes of a ragged row
    (scale applied; D4's pair codes by planes in its two whole steps of 256 weights, then
    registers, then the ragged end), block codes with leading axes, eagerly (a bucket's flat
    batch as rows of 64 blocks) and under jit, and half precision rounded from the same
    float32 values."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(5)
    rows = _weight(cfg, 13, 603)
    blocks = hq.encode(rng.standard_normal((3, 5, cfg.d)).astype(np.float32), cfg)
    for codes in (rows, blocks):
        want = np.asarray(hq.decode(codes, implementation="xla"))
        np.testing.assert_array_equal(np.asarray(hq.decode(codes, implementation="native")),
                                      want)
        jitted = jax.jit(lambda c: hq.decode(c, implementation="native"))(codes)
        np.testing.assert_array_equal(np.asarray(jitted), want)
    half = hq.decode(rows, dtype=jnp.bfloat16, implementation="native")
    np.testing.assert_array_equal(np.asarray(half, np.float32), np.asarray(
        hq.decode(rows, dtype=jnp.bfloat16, implementation="xla"), np.float32))


def test_decode_defaults_and_refusals():
    """None takes the native kernel on a CPU where it applies and XLA for fewer levels or
    float64; naming the kernel for those is refused with what to use instead."""
    codes = _weight(CONFIGS["D4-q3-M3"], 5, 8)
    assert ops.default_implementation("decode", codes.config, codes) == "native"
    np.testing.assert_array_equal(hq.decode(codes, levels=2),
                                  hq.decode(codes, levels=2, implementation="xla"))
    with pytest.raises(ValueError, match="all levels in float32.*implementation='xla'"):
        hq.decode(codes, levels=2, implementation="native")
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="all levels in float32"):
            hq.decode(codes, dtype=jnp.float64, implementation="native")
        assert hq.decode(codes, dtype=jnp.float64).dtype == jnp.float64  # None: XLA


@pytest.mark.parametrize("name", ["D4-q4-M2", "D4-q4-M2-T64", "D4-q4-M2-dither"])
def test_planes_a_row_does_not_depend_on_the_batch(name):
    """With VBMI, D4 q=4 M=2 products run by coordinate planes at every batch size, four
    activation rows at a time: a row gives the same bits in any batch, at any k (here two whole
    steps of 256 weights, registers after them and a ragged end)."""
    if cpu.isa() != "avx512vbmi":
        pytest.skip(f"this CPU runs the kernels with {cpu.isa()}, not avx512vbmi")
    codes = _weight(CONFIGS[name], 11, 601)
    x = np.random.default_rng(5).standard_normal((11, 601)).astype(np.float32)
    native = jax.jit(lambda x, c: hq.matmul(x, c, implementation="native"))
    full = np.asarray(native(x, codes))
    for rows in (slice(0, 1), slice(0, 3), slice(2, 7), slice(10, 11), slice(1, 10)):
        np.testing.assert_array_equal(np.asarray(native(x[rows], codes)), full[rows])


@pytest.mark.parametrize("name", CONFIGS)
@settings(max_examples=4, deadline=None)
@given(batch=st.integers(1, 19), k=st.one_of(st.integers(1, 90), st.integers(250, 700)),
       n_out=st.integers(1, 21), seed=st.integers(0, 2**16))
def test_matches_xla(name, batch, k, n_out, seed):
    codes = _weight(CONFIGS[name], n_out, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((batch, k)).astype(np.float32)
    want = hq.matmul(x, codes, implementation="xla")
    for level in LEVELS:
        with cpu.use_isa(level):
            got = hq.matmul(x, codes, implementation="native")
        assert got.shape == want.shape == (batch, n_out) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k), err_msg=level)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name, k", [("E8-q4-M2", 64), ("D4-q4-M2", 300)])
def test_half_precision_as_the_reference(dtype, name, k):
    """bfloat16: the reference's bfloat16-rounded weights (exact on one-hot rows; D4 at
    k = 300: a step of the planes); float16: float32 weights, the result rounded to
    float16."""
    codes = _weight(CONFIGS[name], 9, k)
    eye = jnp.eye(k, dtype=dtype)
    f = {i: jax.jit(lambda x, c, i=i: hq.matmul(x, c, implementation=i))
         for i in ("native", "xla")}
    for rows in (slice(0, 64), slice(k - 64, k), slice(0, 3)):  # under GEMM_ROWS: fused
        got, want = (f[i](eye[rows], codes) for i in ("native", "xla"))
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_block_codes_batch_shapes_and_empty():
    """Block codes (no row scale, k = nb d), leading batch axes, batch 0."""
    cfg = CONFIGS["D4-q4-M2"]
    w = np.random.default_rng(2).standard_normal((7, 10, 4)).astype(np.float32)
    codes = hq.encode(w, cfg)
    x = np.random.default_rng(3).standard_normal((2, 3, 40)).astype(np.float32)
    got = hq.matmul(x, codes, implementation="native")
    np.testing.assert_allclose(got, hq.matmul(x, codes, implementation="xla"), rtol=1e-5,
                               atol=1e-5)
    assert hq.matmul(x[:0], codes, implementation="native").shape == (0, 3, 7)


def test_failed_and_corrupted_blocks_give_nan_under_jit(isa):
    """A failed block (T = -1), a T field value above max_T + 1 and an index >= q^d (checked
    eagerly, so only under jit) make their rows' products and decoded blocks NaN, as the XLA
    path's."""
    # q^d = 81 < 256: uint8 indices can be out of range; max_T = 10: 4-bit u = 15 too
    cfg = hq.HNLQConfig("D4", 3, 3, beta=0.3, max_T=10)
    codes = _weight(cfg, 4, 16)
    T = np.asarray(codes.T).copy()
    T[0, 1] = -1
    index = np.asarray(codes.index).copy()
    index[2, 0, 1] = 200
    tfield = np.asarray(hq.Codes.from_labels(np.asarray(codes.labels), T, cfg).tfield).copy()
    tfield[3, 0] = 0xFF  # u = 15 > max_T + 1
    bad = hq.Codes(jnp.asarray(index), jnp.asarray(tfield), codes.config, scale=codes.scale,
                   n=codes.n)
    x = jnp.ones((2, 16), jnp.float32)
    for impl in ("native", "xla"):
        y = np.asarray(jax.jit(lambda x, c, impl=impl: hq.matmul(x, c, implementation=impl))(
            x, bad))
        assert np.isnan(y[:, 0]).all() and np.isnan(y[:, 2]).all() and np.isnan(y[:, 3]).all()
        assert np.isfinite(y[:, 1]).all()
        w = np.asarray(jax.jit(lambda c, impl=impl: hq.decode(c, implementation=impl))(bad))
        assert np.isnan(w[[0, 2, 3]]).any(axis=1).all() and np.isfinite(w[1]).all()
    np.testing.assert_array_equal(
        jax.jit(lambda c: hq.decode(c, implementation="native"))(bad),
        jax.jit(lambda c: hq.decode(c, implementation="xla"))(bad))
    with pytest.raises(ValueError, match="out of range"):
        hq.matmul(x, bad, implementation="native")


@pytest.mark.parametrize("name", ["D4-q4-M2", "D4-q4-M2-T64", "E8-q4-M2", "E8-q2-M2"])
@pytest.mark.parametrize("k", [64, 320])
def test_a_failed_block_in_whole_registers(name, k, isa):
    """A failed block (T = -1) in a row of whole registers (2 rows of x: decoded registers
    straight into the sums; the block shares its register with others; k = 320: D4's first
    64 blocks in a step of the planes) makes that row's products NaN and no other row's."""
    cfg = CONFIGS[name]
    codes = _weight(cfg, 3, k)
    T = np.asarray(codes.T).copy()
    T[1, 5] = -1
    tfield = hq.Codes.from_labels(np.asarray(codes.labels), T, cfg).tfield
    bad = hq.Codes(codes.index, tfield, cfg, scale=codes.scale, n=codes.n)
    y = np.asarray(jax.jit(lambda x, c: hq.matmul(x, c, implementation="native"))(
        np.ones((2, k), np.float32), bad))
    assert np.isnan(y[:, 1]).all() and np.isfinite(y[:, [0, 2]]).all()
    w = np.asarray(hq.decode(bad, implementation="native"))  # NaN in the failed block only
    np.testing.assert_array_equal(w, hq.decode(bad, implementation="xla"))
    block = k + np.arange(5 * cfg.d, 6 * cfg.d)  # row 1's block 5 in the flat weight
    assert np.isnan(w.ravel()[block]).all() and np.isfinite(np.delete(w, block)).all()


def test_isa_levels_and_refusals():
    best = cpu.isa()
    assert best in cpu.ISAS
    with cpu.use_isa("portable"):
        assert cpu.isa() == "portable"
        with cpu.use_isa("avx512vbmi"):  # a limit, not a demand: at most what the CPU has
            assert cpu.isa() == best
        with cpu.use_isa("avx2"):
            assert cpu.isa() == min("avx2", best, key=cpu.ISAS.index)
        assert cpu.isa() == "portable"
    assert cpu.isa() == best
    with pytest.raises(ValueError, match="one of"):
        with cpu.use_isa("sse4"):
            pass


def test_default_dispatch_and_clear_refusals():
    codes = _weight(CONFIGS["D4-q4-M2"], 5, 8)
    x = np.ones((1, 8), np.float32)
    assert ops.default_implementation("matmul", codes.config, x, codes) == "native"
    np.testing.assert_array_equal(hq.matmul(x, codes),
                                  hq.matmul(x, codes, implementation="native"))
    a2 = _weight(hq.HNLQConfig("A2", 4, 2, beta=0.3), 5, 8)
    assert ops.default_implementation("matmul", a2.config, x, a2) == "xla"
    with pytest.raises(ValueError, match="no native kernel for A2"):
        hq.matmul(x, a2, implementation="native")
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="float64"):
            hq.matmul(x.astype(np.float64), codes, implementation="native")
        assert hq.matmul(x.astype(np.float64), codes).dtype == jnp.float64  # None: XLA
    # with x64 off a NumPy float64 x is computed in float32, natively (it took XLA, 16x slower)
    x64 = x.astype(np.float64)
    assert ops.default_implementation("matmul", codes.config, x64, codes) == "native"
    np.testing.assert_array_equal(hq.matmul(x64, codes, implementation="native"),
                                  hq.matmul(x, codes))


def test_grad_and_vmap():
    codes = _weight(CONFIGS["E8-q4-M2"], 6, 24)
    x = np.random.default_rng(4).standard_normal((3, 24)).astype(np.float32)

    def loss(x, impl):
        return jnp.sum(hq.matmul(x, codes, implementation=impl) ** 2)

    np.testing.assert_allclose(jax.grad(loss)(x, "native"), jax.grad(loss)(x, "xla"),
                               rtol=1e-4, atol=1e-4)
    batched = jax.vmap(lambda x: hq.matmul(x, codes, implementation="native"))(x[:, None])
    np.testing.assert_allclose(batched[:, 0], hq.matmul(x, codes, implementation="xla"),
                               rtol=1e-5, atol=1e-5)


def test_eager_calls_compile_once_per_bucket(compiles):
    """After one call in a bucket, new batch sizes in it compile nothing (NumPy and JAX input,
    leading axes too)."""
    codes = _weight(CONFIGS["D4-q4-M2"], 6, 32)
    xs = [np.ones((b, 32), np.float32) for b in (18, 19, 20)] + [np.ones((3, 6, 32), np.float32)]
    xs += [jnp.asarray(x) for x in xs]
    hq.matmul(np.ones((17, 32), np.float32), codes)  # bucket 20
    compiles.clear()
    for x in xs:
        assert hq.matmul(x, codes).shape == x.shape[:-1] + (6,)
    assert compiles == []


# Rotation sizes: a power of two (no mixer: bit for bit the XLA path), the Paley mixers of
# common widths (12: 384, 1536; 20: 5120), a size without an instance of its own (24), a random
# odd mixer (7) and one above MAX_MIXER (125: not the default, still exact when asked for)
ROTATIONS = [4096, 384, 1536, 5120, 24, 7, 1000, 1]


@pytest.mark.parametrize("n", ROTATIONS)
@settings(max_examples=4, deadline=None)
@given(rows=st.integers(0, 40), seed=st.integers(0, 2**63 - 1), inverse=st.booleans())
def test_rotate_matches_xla(n, rows, seed, inverse):
    """Rotation.apply / inverse by the kernel against the XLA path: bit for bit when n is a
    power of two (the same butterflies in the same order), else within float32 rounding of the
    mixer's sums; eager (row buckets, leading axes), under jit and vmap, and half precision
    rounded from the same float32 values."""
    rot = hq.incoherence.Rotation(n, seed)
    fn = rot.inverse if inverse else rot.apply
    x = np.random.default_rng(seed % 2**32).standard_normal((rows, 2, n)).astype(np.float32)
    got, want = np.asarray(fn(x, "native")), np.asarray(fn(x, "xla"))
    assert got.shape == x.shape and got.dtype == np.float32
    if hq.incoherence.split_size(n)[1] == 1:
        np.testing.assert_array_equal(got, want)
    else:
        atol = 2e-6 * max(1.0, np.abs(x).max(initial=0))
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: fn(v, "native"))(x)), got)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda v: fn(v, "native"))(jnp.asarray(x))), got)
    half = np.asarray(fn(jnp.asarray(x, jnp.bfloat16), "native"))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        half, np.asarray(fn(jnp.asarray(x, jnp.bfloat16).astype(np.float32), "native"),
                         jnp.bfloat16))


def _rotate_in_order(x, k, s, B, inverse):
    """The rotation by signs s and mixer B of float32 rows x (n = 2^k m) by NumPy, the
    kernel's operations in its order, each rounded to float32 (no fused multiply-add): signs,
    butterflies, scale, mixer (the sums over j ascending from 0); the inverse reversed with
    B^T."""
    m = B.shape[0]
    v = x.reshape(-1, 1 << k, m).copy()

    def butterflies(v):
        for j in range(k):
            w = v.reshape(v.shape[0], -1, 2, 1 << j, m)
            a, b = w[:, :, 0].copy(), w[:, :, 1].copy()
            w[:, :, 0], w[:, :, 1] = a + b, a - b
        return v * np.float32(2.0 ** (-0.5 * k)) if k else v

    def mix(v, B):
        acc = np.zeros_like(v)
        for j in range(m):
            acc = acc + v[:, :, j:j + 1] * B[j][None, None, :]
        return acc

    if inverse:
        v = butterflies(mix(v, np.ascontiguousarray(B.T)) if m > 1 else v)
        return v.reshape(x.shape) * s
    v = butterflies((x * s).reshape(v.shape))
    return (mix(v, B) if m > 1 else v).reshape(x.shape)


@pytest.mark.parametrize("n, mixer_kind", [(n, kind) for n in (384, 1280, 1408, 1792)
                                            for kind in ("tables", "random")] + [(2048, "tables")])
def test_rotate_bits_are_its_operations_in_order(n, mixer_kind):
    """The kernel's bits on this CPU's instruction set are those of its operations in order,
    each rounded (no product and add fused where the product is inexact, which would make an
    AVX-512 CPU's bits differ from an AVX2 one's): mixers of 12 and 20 (instances of their own:
    Paley signs, fused multiply-adds of exact products), 44 (Paley) and 7 (any size), none
    (2048: all butterflies, two stages a pass and an odd one alone); the tables' mixers and
    random ones (not +-c: products and adds; 2048 has no mixer to vary)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((37, n)).astype(np.float32)
    signs, mixer = hq.incoherence.tables(n, 5, np.dtype(np.float32))
    if mixer_kind == "random":
        mixer = rng.standard_normal(mixer.shape).astype(np.float32)
    k = hq.incoherence.split_size(n)[0]
    for inverse in (False, True):
        y = np.empty_like(x)
        cpu.rotate_host(y.ctypes.data, x.ctypes.data, 37, signs, mixer, k, inverse)
        np.testing.assert_array_equal(y, _rotate_in_order(x, k, signs, mixer, inverse))


def test_rotate_host_is_the_ffi_kernel():
    """The direct call on host buffers (the torch bridge's) gives the FFI kernel's bits, in
    place too, on any thread count."""
    n, seed = 384, 3
    rot = hq.incoherence.Rotation(n, seed)
    x = np.random.default_rng(0).standard_normal((300, n)).astype(np.float32)
    signs, mixer = hq.incoherence.tables(n, seed, np.dtype(np.float32))
    k = hq.incoherence.split_size(n)[0]
    for inverse, threads in ((False, 1), (True, 2), (False, 8)):
        want = np.asarray((rot.inverse if inverse else rot.apply)(x, "native"))
        y = np.empty_like(x)
        cpu.rotate_host(y.ctypes.data, x.ctypes.data, 300, signs, mixer, k, inverse, threads)
        np.testing.assert_array_equal(y, want)
        z = x.copy()
        cpu.rotate_host(z.ctypes.data, z.ctypes.data, 300, signs, mixer, k, inverse, threads)
        np.testing.assert_array_equal(z, want)
    with pytest.raises(TypeError, match="float32"):
        cpu.rotate_host(y.ctypes.data, x.ctypes.data, 300, signs.astype(np.float64), mixer, k,
                        False)
    with pytest.raises(ValueError, match="shapes"):  # n = 384 is not 2^4 * 12
        cpu.rotate_host(y.ctypes.data, x.ctypes.data, 300, signs, mixer, k - 1, False)

"""Pallas kernels (interpret mode on the CPU) against the XLA path, bit for bit; CUDA lowering.

The kernels are reached through the front doors (``implementation="pallas"`` against
``"xla"``) except where a test needs what only the kernel entry points expose: ragged tiles
(the front doors pad eager batches), ``use_table=``, tile sizes, the GPU backend.
"""

import contextlib
import functools
import importlib.util
import pathlib
import subprocess
import sys
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import experiment, golden_config, load_golden
from hypothesis import given
from hypothesis import strategies as st
from jax.extend.core import ClosedJaxpr, Jaxpr

import hnlq_jax as hq
from hnlq_jax import codec
from hnlq_jax import kernels as K
from hnlq_jax.codes import t_bits
from hnlq_jax.kernels import gpu_tiles

ROOT = pathlib.Path(__file__).parent.parent
PALLAS = dict(implementation="pallas")
XLA = dict(implementation="xla")
D4 = hq.HNLQConfig("D4", 4, 2, beta=0.35)
WIDE_T = hq.HNLQConfig("D4", 3, 2, beta=0.35, max_T=20)  # 8-bit T field, q not a power of two
CONFIGS = [
    D4,  # codebook table, 4-bit T
    hq.HNLQConfig("E8", 4, 2, beta=0.4),  # packed codebook of two words an entry (65,536)
    hq.HNLQConfig("A2", 3, 3, beta=0.3),
    hq.HNLQConfig("Z2", 5, 2, beta=0.25, dither=(0.1, -0.2)),
    WIDE_T,
]
IDS = [f"{c.lattice}-q{c.q}-M{c.M}-T{c.max_T}" + ("-dither" if c.dither else "") for c in CONFIGS]


def _data(cfg, n, seed=0):
    """``n + n // 4`` Gaussian blocks with far outliers (large T) and exact ties at every level.

    Ties: beta = 1/2, alpha = 1 keep ``x / (beta 2^t)`` exact, and coordinates on a half-integer
    grid scaled by q^m put points on Voronoi faces at level m.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, cfg.d)) * 2
    x[: n // 16] *= 60
    half = rng.integers(-6, 7, (n // 4, cfg.d)) / 2 * cfg.q ** rng.integers(0, cfg.M, (n // 4, 1))
    return np.concatenate([x, half * cfg.beta]).astype(np.float32)


def _tie_config(cfg):
    return cfg.replace(beta=0.5, alpha=1.0)


def assert_codes_equal(a, b):
    assert a.config == b.config and a.index.dtype == b.index.dtype == hq.codes.index_dtype(a.config)
    np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b.index))
    np.testing.assert_array_equal(np.asarray(a.tfield), np.asarray(b.tfield))


def _jit_decode(codes, **kw):
    """Decode under jit: the kernel sees the codes' own layout (eager calls flatten them)."""
    return jax.jit(lambda c: hq.decode(c, **kw))(codes)


# ------------------------------------------------------------------------- encode and decode


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_encode_decode_bit_exact(cfg):
    """Gaussians, outliers and ties; blocks [5, 81]: the 4-bit T field pairs along an odd axis."""
    c = _tie_config(cfg)
    x = _data(c, 324).reshape(5, 81, c.d)
    ref = hq.encode(x, c, **XLA)
    assert_codes_equal(hq.encode(x, c, **PALLAS), ref)
    assert int(jnp.max(ref.T)) >= 3  # the overload loop ran several steps
    for levels in (None, 1):
        np.testing.assert_array_equal(_jit_decode(ref, levels=levels, **PALLAS),
                                      _jit_decode(ref, levels=levels, **XLA))


def _near_boundaries(beta: float, n: int, seed: int = 0):
    """``[n, 4]`` float32 blocks whose coordinates x / beta lie within 3 units in the last
    place of a rounding boundary (k + 1/2), the places an approximate division moves codes."""
    rng = np.random.default_rng(seed)
    x = ((rng.integers(-3, 3, (n, 4)) + 0.5) * beta).astype(np.float32)
    k = rng.integers(-3, 4, (n, 4))
    for _ in range(3):
        x = np.where(k > 0, np.nextafter(x, np.float32(np.inf)), x)
        x = np.where(k < 0, np.nextafter(x, np.float32(-np.inf)), x)
        k = k - np.sign(k)
    return x


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_codes_on_the_default_device_are_the_cpus(implementation):
    """Codes of x / beta near rounding boundaries on the default device (natively on a GPU:
    the Triton encoder's div.rn.f32, XLA's corrected division) equal those XLA computes on
    the CPU. The data tells an approximate division apart: quotients by a reciprocal
    (XLA:CPU's for a broadcast divisor, about as often off as a GPU's div.full) code a tenth
    of the blocks differently."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.37, alpha=1.0)  # alpha 1: every scale beta 2^t
    x = _near_boundaries(cfg.beta, 2000)
    with jax.default_device(jax.devices("cpu")[0]):
        ref = hq.encode(jnp.asarray(x), cfg, implementation="xla")
    got = hq.encode(jax.device_put(x, jax.devices()[0]), cfg, implementation=implementation)
    assert_codes_equal(got, ref)
    rough = hq.encode(x * (np.float32(1) / np.float32(cfg.beta)), cfg.replace(beta=1.0), **XLA)
    assert np.mean(np.any(np.asarray(rough.index) != np.asarray(ref.index), axis=-1)) > 0.05


def test_front_doors_take_interpret_mode_from_where_the_inputs_live(monkeypatch):
    """On a GPU machine (its default backend made "gpu" here, in kernels.pallas alone) the
    "pallas" front doors on CPU-committed inputs run the kernels in interpret mode: inside
    their jit the kernels saw tracers, took the default backend's mode and were compiled for
    the GPU ("Only interpret mode is supported on CPU backend")."""
    fake = types.SimpleNamespace(**{k: getattr(jax, k) for k in dir(jax)
                                    if not k.startswith("__")})
    fake.default_backend = lambda: "gpu"
    monkeypatch.setattr(K.pallas, "jax", fake)
    monkeypatch.setattr(K.pallas, "gpu_target", lambda: ("sm90", 132))
    modes = []
    real = K.pallas.interpret_mode
    monkeypatch.setattr(K.pallas, "interpret_mode",
                        lambda interpret, *a: modes.append(real(interpret, *a)) or modes[-1])
    cpu = jax.devices("cpu")[0]
    w = jax.device_put(np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32),
                       cpu)
    codes = jax.device_put(hq.encode_rows(w, D4), cpu)
    x = jax.device_put(jnp.ones((1, 32), jnp.float32), cpu)
    blocks = jax.device_put(jnp.asarray(_data(D4, 8)), cpu)
    hq.matmul(x, codes, **PALLAS)
    hq.decode(codes, **PALLAS)
    hq.encode(blocks, D4, **PALLAS)
    hq.quantize(blocks, D4, **PALLAS)
    hq.encode_rows(w, D4, **PALLAS)
    assert modes and all(modes)


@pytest.mark.golden
def test_encode_golden_x64(x64):
    """The reference's golden codes (8-bit T field: max_T = 64) in float64, in the kernels."""
    for name in ("D4_q4_M2.npz", "D4_q4_M2_dither.npz", "D4_q3_M3.npz", "Z2_q4_M2.npz"):
        g = load_golden(name)
        cfg = golden_config(g)
        codes = hq.encode(g["X"], cfg, failures="mark", **PALLAS)
        np.testing.assert_array_equal(codes.labels, g["labels"], err_msg=name)
        np.testing.assert_array_equal(codes.T, g["T"], err_msg=name)
        np.testing.assert_array_equal(hq.decode(codes, **PALLAS), g["decoded"], err_msg=name)


def test_encode_edge_cases():
    cfg = D4
    x = _data(cfg, 240)  # 300 blocks: a ragged last tile of the kernel (block 256)
    for c in (cfg, cfg.replace(max_T=0), cfg.replace(max_T=3)):
        index, T = K.encode(jnp.asarray(x), c)
        ref_index, ref_T = codec.encode_blocks(jnp.asarray(x), c, c.beta)
        np.testing.assert_array_equal(index, ref_index)
        np.testing.assert_array_equal(T, ref_T)
        assert index.shape == (300, c.M) and T.dtype == jnp.int32
        if c.max_T == 3:  # blocks whose least T is max_T itself, and blocks beyond it
            assert np.any(np.asarray(T) == 3) and np.any(np.asarray(T) == -1)
    # NaN under jit: T = -1, decoding to NaN.
    v = jnp.array([[np.nan, 0, 0, 0], [1, 0, 0, 0]], jnp.float32)
    nan = jax.jit(lambda v: hq.encode(v, cfg, **PALLAS))(v)
    np.testing.assert_array_equal(nan.T, [-1, 0])
    assert np.all(np.isnan(hq.decode(nan, **PALLAS)[0]))
    # Data and beta scaled by 2^62: the same codes (block norms would overflow float32 squared).
    big = 2.0**62
    scaled = hq.encode(big * x, cfg.replace(beta=big * cfg.beta), failures="mark", **PALLAS)
    ref = hq.encode(x, cfg, failures="mark", **XLA)
    np.testing.assert_array_equal(scaled.index, ref.index)
    np.testing.assert_array_equal(scaled.tfield, ref.tfield)
    # bfloat16 input is encoded in float32, as the reference does.
    xb = jnp.asarray(_data(cfg, 64), jnp.bfloat16)
    assert_codes_equal(hq.encode(xb, cfg, failures="mark", **PALLAS),
                       hq.encode(xb, cfg, failures="mark", **XLA))


@pytest.mark.parametrize("spread,share", [(0.0, 0), (0.5, 1), (0.7, 2), (8.0, 3)],
                         ids=["none-left", "under-a-quarter", "under-half", "most-and-failed"])
def test_encode_second_pass(spread, share):
    """Past four tiles the kernel makes one attempt over every block, then runs the overload
    loop over the blocks still unresolved, their rows gathered in the kernel (``share``: how
    many this data leaves, none, under a quarter, under a half, more): the reference's codes
    in each, with a NaN block and blocks failing at max_T. No conditional in the program (on
    a GPU an XLA conditional copies its branch index to the host: a sync a call), and no XLA
    pass over the blocks to list those left."""
    cfg = D4
    x = np.random.default_rng(3).standard_normal((2048, 4)) * spread * 8 * cfg.beta
    x[5] = np.nan
    x = jnp.asarray(x, jnp.float32)
    index, T = K.encode(x, cfg, block=64)
    ref_index, ref_T = codec.encode_blocks(x, cfg, cfg.beta)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_array_equal(T, ref_T)
    # the share left after one attempt: a block whose T is past the first step its norm allows
    _, thresholds = codec.scale_tables(cfg, cfg.beta, jnp.float32)
    unit = codec.norm_unit(thresholds)
    t0 = np.asarray(jnp.sum(thresholds * unit < jnp.linalg.norm(x * unit, axis=1)[:, None],
                            axis=1))
    T = np.asarray(T)
    left = np.sum((T > t0) | ((T == -1) & (t0 < cfg.max_T) & np.isfinite(x).all(axis=1)))
    assert share == (0 if left == 0 else 1 + (left > 512) + (left > 1024))
    assert (share < 3) or (T == -1).sum() > 1  # failures besides the NaN block
    program = jax.make_jaxpr(lambda x: K.encode(x, cfg, block=64))(x)
    [call] = program.eqns  # the jitted encode
    names = [e.primitive.name for e in call.params["jaxpr"].eqns]
    assert names.count("pallas_call") == 2 and "cond" not in names and "while" not in names
    # the blocks left are listed by the first kernel (an atomic count), not by XLA passes
    assert not {"cumsum", "scatter", "scatter-add", "dot_general", "reduce_sum"} & set(names)


@given(st.integers(0, 2**31 - 1), st.sampled_from([0.25, 1.0, 3.0]))
def test_encode_property(seed, spread):
    """Any input: the kernel's codes are the reference's (one compiled shape)."""
    cfg = _tie_config(D4)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, 4)) * spread).astype(np.float32)
    x[::3] = np.round(x[::3] * 2) / 2 * cfg.beta  # faces and ties
    assert_codes_equal(hq.encode(x, cfg, **PALLAS), hq.encode(x, cfg, **XLA))


@pytest.mark.parametrize("cfg", [D4, WIDE_T], ids=["4-bit-T", "8-bit-T"])
def test_decode_layouts_tables_and_invalid(cfg):
    """Every leading shape the T field packs differently; the codebook as table and as digits;
    failed and corrupted blocks give NaN."""
    x = _data(cfg, 96)
    for shape in ((), (7,), (3, 6), (3, 5, 5)):
        n = int(np.prod(shape))
        codes = hq.encode(x[:n].reshape(shape + (cfg.d,)), cfg, failures="mark")
        np.testing.assert_array_equal(_jit_decode(codes, **PALLAS), _jit_decode(codes, **XLA),
                                      err_msg=str(shape))
    codes = hq.encode(x.reshape(15, 8, cfg.d), cfg, failures="mark")
    ref = _jit_decode(codes, **XLA)
    for use_table in (True, False):
        got = jax.jit(lambda c: K.decode(c, None, jnp.float32, use_table=use_table))(codes)
        np.testing.assert_array_equal(got, ref)
    T = codes.T.astype(jnp.int32).at[::4, 1].set(-1)
    bad = hq.Codes.from_labels(codes.labels, T, cfg)
    bad = hq.Codes(bad.index.at[1, 2, 0].set(255), bad.tfield, cfg)  # index >= q^d (D4 q=3)
    got = _jit_decode(bad, **PALLAS)
    np.testing.assert_array_equal(got, _jit_decode(bad, **XLA))
    assert np.all(np.isnan(got[::4, 1]))
    assert np.all(np.isnan(got[1, 2])) == (cfg.q**cfg.d < 256)
    assert np.isfinite(got[0, 0]).all()


def test_quantize_straight_through():
    x = jnp.asarray(_data(D4, 64))  # includes blocks beyond max_T: both mark them NaN
    np.testing.assert_array_equal(hq.quantize(x, D4, failures="mark", **PALLAS),
                                  hq.quantize(x, D4, failures="mark", **XLA))
    g = jax.grad(lambda v: jnp.sum(hq.quantize(v, D4, **PALLAS) * 3.0))(x)
    np.testing.assert_array_equal(g, jnp.full_like(x, 3.0))


# ----------------------------------------------------------------------------- decode-matmul


def _weights(cfg, n, k, rows=True, seed=1):
    W = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if rows:
        return hq.encode_rows(W, cfg)  # row codes with per-row scales
    return hq.encode(hq.to_blocks(W, cfg.d), cfg, failures="mark")


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.lattice != "E8"],
                         ids=[i for i in IDS if not i.startswith("E8")])
def test_matmul_matches_xla(cfg):
    """Row codes (scaled) and block codes; rows, blocks and batch not tile multiples."""
    n, k = 40, 27 * cfg.d - 1
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, k)), jnp.float32)
    eye = jnp.eye(k, dtype=jnp.float32)  # 1-hot rows: each output is one weight, exactly
    for rows in (True, False):  # with and without row scales
        codes = _weights(cfg, n, k, rows)
        if not rows:
            codes = codes.with_rows(n=k)
        ref = hq.matmul(x, codes, **XLA)
        got = hq.matmul(x, codes, **PALLAS)
        assert got.shape == (2, 3, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(ref))))
        # The decoded (and scaled) weights are the reference's bit for bit.
        np.testing.assert_array_equal(hq.matmul(eye, codes, **PALLAS), hq.matmul(eye, codes, **XLA))


def test_matmul_digits_small_tiles_and_dtypes():
    codes = _weights(D4, 24, 64)
    eye = jnp.eye(64, dtype=jnp.float32)
    ref = hq.matmul(eye, codes, **XLA)
    for use_table in (True, False):
        got = K.decode_matmul(eye, codes, jnp.float32, jnp.float32, use_table=use_table,
                              block_n=16, block_k=16)
        np.testing.assert_array_equal(got, ref)
    # split-K (3 shares of 16 blocks asked, 1 step each: 1 share is empty and dropped), and
    # launch parameters: one-hot rows still give each weight exactly; a full x its sums
    x = jnp.asarray(np.random.default_rng(6).standard_normal((20, 64)), jnp.float32)
    xref = _decoded_product(x, codes)
    square = _weights(D4, 32, 64)  # tiles that cover it exactly: no masks in the kernel
    for splits in (1, 3):
        got = K.decode_matmul(eye, codes, jnp.float32, jnp.float32, block_n=16, block_k=16,
                              splits=splits, num_warps=2, num_stages=2)
        np.testing.assert_array_equal(got, ref)
        got = K.decode_matmul(eye, square, jnp.float32, jnp.float32, block_n=16, block_k=16,
                              splits=splits)
        np.testing.assert_array_equal(got, hq.matmul(eye, square, **XLA))
        got = K.decode_matmul(x, codes, jnp.float32, jnp.float32, block_n=16, block_k=16,
                              splits=splits)
        np.testing.assert_allclose(got, xref, rtol=1e-5, atol=1e-5 * np.abs(xref).max())
    blocks = _weights(D4, 24, 64, rows=False)  # block codes [24, 16]: k = nb d
    np.testing.assert_array_equal(K.decode_matmul(eye, blocks, jnp.float32, jnp.float32),
                                  hq.matmul(eye, blocks.with_rows(n=64), **XLA))
    x = np.random.default_rng(3).standard_normal((5, 64))
    with jax.enable_x64(True):
        # float64 activations: the weight decoded and the products summed in float64 (not
        # float32) on every path, as decode gives it.
        w64 = np.asarray(hq.decode(codes, dtype=jnp.float64))
        np.testing.assert_array_equal(hq.matmul(jnp.eye(64), codes, **PALLAS), w64.T)
        for impl in (XLA, PALLAS, {"implementation": "lut"}):
            got = hq.matmul(jnp.asarray(x), codes, **impl)
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(got, x @ w64.T, rtol=1e-12, atol=1e-12)
    # bfloat16: the scaled float32 weight rounded to bfloat16, as the reference does.
    eb = eye.astype(jnp.bfloat16)
    got = hq.matmul(eb, codes, **PALLAS)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, hq.matmul(eb, codes, **XLA))
    # float16: a float32 product rounded back, as the output of a half-precision layer.
    xh = jnp.asarray(x, jnp.float16)
    for impl in (PALLAS, XLA, {"implementation": "lut"}):
        got = hq.matmul(xh, codes, **impl)
        assert got.dtype == jnp.float16
        np.testing.assert_allclose(got.astype(np.float32),
                                   hq.matmul(xh.astype(jnp.float32), codes, **XLA), rtol=2e-3,
                                   atol=2e-3)
    xb = jnp.asarray(x, jnp.bfloat16)
    np.testing.assert_allclose(hq.matmul(xb, codes, **PALLAS).astype(np.float32),
                               hq.matmul(xb, codes, **XLA).astype(np.float32), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("cfg", [D4, CONFIGS[1], hq.HNLQConfig("A2", 4, 1, beta=0.3),
                                 hq.HNLQConfig("Z2", 4, 4, beta=0.2)],
                         ids=["D4", "E8", "M1", "M4"])
def test_decode_matmul_reads_words(cfg):
    """The tensor-core kernel with the codes read as words (2, 1 + a stride, 4 and 1 blocks a
    word): the reference's decoded weights bit for bit (one-hot rows), a full x's sums, and
    the word views are what the kernel reads."""
    parts = K.pallas.word_view(cfg)[1]
    codes = _weights(cfg, 32, 64 * cfg.d)
    f = functools.partial(K.decode_matmul, codes=codes, compute_dtype=jnp.float32,
                          out_dtype=jnp.float32, block_n=16, block_k=16 * parts, splits=2)
    eye = jnp.eye(64 * cfg.d, dtype=jnp.float32)
    assert f"u32[32,{64 // K.pallas.word_view(cfg)[0]}]" in str(jax.make_jaxpr(f)(eye))
    np.testing.assert_array_equal(f(eye), hq.matmul(eye, codes, **XLA))
    x = np.random.default_rng(8).standard_normal((5, 64 * cfg.d)).astype(np.float32)
    ref = _decoded_product(x, codes)
    np.testing.assert_allclose(f(jnp.asarray(x)), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # 3 shares past the blocks (masked), and past the rows
    for ragged in (codes, _weights(cfg, 21, 64 * cfg.d)):
        np.testing.assert_array_equal(f(eye, codes=ragged, splits=3),
                                      hq.matmul(eye, ragged, **XLA))
    # with 8 blocks a part the dot would be too narrow: the blocks one by one
    narrow = functools.partial(f, block_k=8 * parts, splits=1)
    assert "u32[32," not in str(jax.make_jaxpr(narrow)(eye))


F16_ATOL = 5e-4  # float16 operands: about 2^-11 a weight and a plane
BIG_T = hq.HNLQConfig("D4", 4, 2, beta=0.35, alpha=1.0, max_T=14)  # 2^(alpha T) up to 2^14


@pytest.mark.parametrize("cfg", [D4, CONFIGS[1], WIDE_T, BIG_T,
                                 hq.HNLQConfig("D4", 4, 2, beta=0.3, dither=(.1, -.2, .05, .3)),
                                 hq.HNLQConfig("A2", 8, 2, beta=0.7)],
                         ids=["D4", "E8", "q3-8bitT", "halved", "dither", "A2"])
def test_decode_matmul_f16_operands(cfg):
    """``f16``: the product of the decoded weights within float16 rounding, finer than the
    bfloat16 product's (words and block by block, split-K, ragged rows, x padded); the
    operands really are float16; a failed block's or a corrupt index's NaN row; rows of x of
    any magnitude; float32 x ignores it (the exact path, bit for bit)."""
    codes = _weights(cfg, 40, 64 * cfg.d)
    if cfg is BIG_T:  # steps whose 2^(alpha T) P passes float16's range: halved 6 times
        T = codes.T.astype(jnp.int32).at[::3].set(BIG_T.max_T)
        codes = hq.Codes.from_labels(codes.labels, T, cfg, scale=codes.scale, n=codes.n)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 64 * cfg.d)), jnp.bfloat16)
    ref = _decoded_product(x, codes)
    f = functools.partial(K.decode_matmul, compute_dtype=jnp.bfloat16, out_dtype=jnp.float32,
                          block_n=16, block_k=32)
    bf16 = np.abs(np.asarray(f(x, codes, splits=2)) - ref).max()
    for words, splits in ((True, 1), (True, 3), (False, 2)):
        y = np.asarray(f(x, codes, splits=splits, words=words, f16=True))
        err = np.abs(y - ref).max()
        assert err <= F16_ATOL * np.abs(ref).max() and err < bf16 / 4, (err, bf16)
    def float16s(**kw):  # float16 arrays in the call's program (bfloat16's excluded)
        text = str(jax.make_jaxpr(lambda x: f(x, codes, **kw))(x))
        return text.count("f16[") - text.count("bf16[")

    assert float16s(f16=True) and not float16s()
    # rows of any magnitude (each row its own power of two), and a NaN that stays in its row
    big = x * jnp.asarray([2.0**100, 1.0, 2.0**-100, 1.0, 1.0], jnp.bfloat16)[:, None]
    y = np.asarray(f(big.at[3, 7].set(jnp.nan), codes, f16=True))
    ref = _decoded_product(big, codes)
    for r in (0, 1, 2, 4):
        np.testing.assert_allclose(y[r], ref[r], rtol=0, atol=F16_ATOL * np.abs(ref[r]).max())
    assert np.isnan(y[3]).all()
    # a failed block (T = -1) and, where an index byte can pass q^d, a corrupt index
    T = codes.T.astype(jnp.int32).at[3, 5].set(-1)
    bad = hq.Codes.from_labels(codes.labels, T, cfg, scale=codes.scale, n=codes.n)
    nan_rows = [3]
    if K.pallas.unsupported(cfg) is None and cfg.q**cfg.d < 256 and cfg.lattice == "D4":
        bad = hq.Codes(bad.index.at[7, 2, 1].set(200), bad.tfield, cfg, scale=bad.scale,
                       n=bad.n)
        nan_rows.append(7)
    y = np.asarray(jax.jit(lambda x, c: f(x, c, f16=True))(x, bad))
    assert np.isnan(y[:, nan_rows]).all() and np.isfinite(np.delete(y, nan_rows, 1)).all()
    # float32 x: the exact path whatever f16 says
    x32 = x.astype(jnp.float32)
    g = functools.partial(K.decode_matmul, x32, codes, jnp.float32, jnp.float32, block_n=16,
                          block_k=32)
    np.testing.assert_array_equal(g(f16=True), g(f16=False))


def test_f16_fits_and_the_overload_table(monkeypatch):
    """Where ``f16`` applies, and its float16 overload table: the float32 one halved e_A
    times, rounded once; steps past float16's range even halved are left to the exact path
    (bit for bit); hq.matmul takes it where the tuning table's entry says so."""
    assert K.pallas.f16_exponent(BIG_T) == 6 and K.pallas.f16_exponent(D4) == 0
    want = np.ldexp(K.pallas.overload_table(BIG_T).astype(np.float64), -6).astype(np.float16)
    np.testing.assert_array_equal(K.pallas.f16_overload_table(BIG_T), want)
    assert K.pallas.f16_fits(D4, jnp.bfloat16)
    assert not K.pallas.f16_fits(D4, jnp.float32) and not K.pallas.f16_fits(D4, jnp.bfloat16,
                                                                              table=False)
    assert K.pallas.f16_fits(BIG_T.replace(max_T=22), jnp.bfloat16)  # 2^22: 14 halvings
    wide = BIG_T.replace(max_T=23)
    assert not K.pallas.f16_fits(wide, jnp.bfloat16)
    codes = _weights(wide, 16, 64)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 64)), jnp.bfloat16)
    f = functools.partial(K.decode_matmul, x, codes, jnp.bfloat16, jnp.float32, block_n=16,
                          block_k=16)
    np.testing.assert_array_equal(f(f16=True), f(f16=False))
    # more rows than a program's tile (130: 3 tiles of 64, x's planes padded past them)
    codes = _weights(D4, 32, 128)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((130, 128)), jnp.bfloat16)
    ref = _decoded_product(x, codes)
    y = K.decode_matmul(x, codes, jnp.bfloat16, jnp.float32, block_n=16, block_k=16, f16=True)
    np.testing.assert_allclose(y, ref, rtol=0, atol=F16_ATOL * np.abs(ref).max())
    # the front door: the decode_matmul entry's f16 for its batch class
    x = jnp.asarray(np.random.default_rng(8).standard_normal((12, 128)), jnp.bfloat16)
    monkeypatch.setattr(K.pallas, "gpu_target", lambda: ("cpu", 132))
    for f16 in (True, False):
        monkeypatch.setattr(gpu_tiles, "TILES", {"cpu": {"decode_matmul": {"D4": {
            "batch<=16": {"f16": f16}}}}})
        y = jax.jit(lambda x, c: hq.matmul(x, c, **PALLAS))(x, codes)
        np.testing.assert_array_equal(y, K.decode_matmul(x, codes, jnp.bfloat16, jnp.bfloat16,
                                                         f16=f16))
        assert (y != K.decode_matmul(x, codes, jnp.bfloat16, jnp.bfloat16,
                                     f16=not f16)).any()


def _equations(jaxpr: Jaxpr):
    """Every equation of a jaxpr and its sub-jaxprs, outside Pallas kernel bodies."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, ClosedJaxpr):
                    yield from _equations(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    yield from _equations(sub)


@pytest.mark.parametrize("case", ["scaled", "unscaled", "odd"])
def test_matmul_reads_codes_in_place(case):
    """No transpose or copy of a code array: the kernel takes their word views (D4: two
    blocks a word), reinterpreted, not copied, or where a row ends in half a T byte (an odd
    number of blocks) the index and T field as stored."""
    codes = {"scaled": lambda: _weights(D4, 24, 63, rows=True),
             "unscaled": lambda: _weights(D4, 24, 64, rows=False).with_rows(n=64),
             "odd": lambda: _weights(D4, 24, 60, rows=True)}[case]()
    x = jnp.zeros((3, codes.shape[-1]), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.jit(lambda x, c: hq.matmul(x, c, **PALLAS)))(x, codes)
    eqns = list(_equations(jaxpr.jaxpr))
    code_dtypes = {codes.index.dtype, codes.tfield.dtype}
    moved = [e for e in eqns if e.primitive.name in ("transpose", "pad", "concatenate", "gather",
                                                      "copy", "copy_p", "dynamic_slice", "slice")
             and any(getattr(v, "aval", None) is not None and v.aval.dtype in code_dtypes
                     for v in e.invars)]
    assert not moved, [str(e) for e in moved]
    calls = [e for e in eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1
    ins = {(tuple(v.aval.shape), v.aval.dtype) for v in calls[0].invars}
    nb = codes.blocks_shape[1]
    if nb % 2 == 0:  # 2 blocks a word: index uint32 [24, nb / 2], T a byte for the two
        assert {((24, nb // 2), jnp.dtype(jnp.uint32)), ((24, nb // 2), jnp.dtype(jnp.uint8))} \
            <= ins
        return
    assert (codes.index.shape, codes.index.dtype) in ins
    assert ((codes.tfield.size,), codes.tfield.dtype) in ins  # unpacked in the kernel


# ------------------------------------------------------------------------------------ mod-q


def _decoded_product(x, codes):
    """x @ W_hat^T in float64 on the host, from the reference's decoded, scaled weights."""
    w = np.asarray(hq.matmul(jnp.eye(codes.n, dtype=jnp.float32), codes, **XLA))
    return np.asarray(x, np.float64) @ w.astype(np.float64)


@given(a=st.integers(0, 2**32 - 1), b=st.integers(0, 2**32 - 1),
       picks=st.lists(st.integers(0, 7), min_size=4, max_size=4))
def test_prmt_picks_bytes_of_b_then_a(a, b, picks):
    """The interpret-mode prmt (what the CPU tests run where the GPU kernels have the
    instruction): byte i of the result is byte picks[i] of a (0-3) or b (4-7); the magic
    selector gives the float 2^23 + byte i of b."""
    selector = sum(k << 4 * i for i, k in enumerate(picks))
    got = int(K.pallas.prmt(jnp.uint32(a), jnp.uint32(b), selector))
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    assert got == int.from_bytes(bytes(src[k] for k in picks), "little")
    for i in range(4):
        magic = K.pallas.prmt(jnp.uint32(0x4B000000), jnp.uint32(b), K.pallas.magic_selector(i))
        assert float(jax.lax.bitcast_convert_type(magic, jnp.float32)) == 2**23 + src[4 + i]


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("parts", [None, 2], ids=["plain", "parts-2"])
def test_gemv_activations_are_the_folded_planes(cfg, parts):
    """The gemv kernels' x planes: beta C^T x per block in planes 0..d-1, the offsets (the
    dither's beta x.z) in plane d, rows padded to a power of two and blocks to nbp, blocks
    split into parts: against a float64 NumPy fold (a coefficient left out, a plane out of
    order, the offsets in the wrong plane or part all fail)."""
    rng = np.random.default_rng(3)
    B, nb, nbp = 3, 6, 8
    x = rng.standard_normal((B, nb * cfg.d)).astype(np.float32)
    got = np.asarray(K.pallas.gemv_activations(jnp.asarray(x), cfg, nbp, parts))
    C = np.stack([np.asarray(cfg.lat.cart_from_P(list(e)), np.float64)
                  for e in np.eye(cfg.d)], axis=1)
    xb = np.zeros((4, nbp, cfg.d))
    xb[:B, :nb] = x.reshape(B, nb, cfg.d)
    xt = np.einsum("bld,di->ibl", xb, C * cfg.beta)
    off = np.zeros((4, nbp)) if cfg.dither is None else cfg.beta * xb @ cfg.dither_array
    want = np.concatenate([xt, off[None]])
    if parts:
        want = want.reshape(cfg.d + 1, 4, nbp // parts, parts).transpose(3, 0, 1, 2)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


_GEMV_METHODS = {"table": {}, "digits": dict(use_table=False), "lut": dict(lut_tables=True)}


@pytest.mark.parametrize("cfg,method", [(c, m) for c in CONFIGS for m in _GEMV_METHODS
                                        if not (c.lattice == "E8" and m == "lut")],
                         ids=[f"{i}-{m}" for c, i in zip(CONFIGS, IDS) for m in _GEMV_METHODS
                              if not (c.lattice == "E8" and m == "lut")])
def test_gemv_matches_decoded_weights(cfg, method):
    """Rows, blocks and batch not tile multiples, split-K with a ragged last share; the sums of
    the exact decoded weights to float32 rounding, through the packed codebook (D4, E8, A2, Z2
    q <= 5), the int32 table, the digits and x's one-sided tables (E8's, 65,536 entries a
    block, are not tried)."""
    n, k = 37, 45 * cfg.d - 1
    codes = _weights(cfg, n, k)
    rng = np.random.default_rng(4)
    how = _GEMV_METHODS[method]
    for batch, splits in ((1, 1), (3, 4), (K.GEMV_ROWS, 2)):
        x = rng.standard_normal((batch, k)).astype(np.float32)
        ref = _decoded_product(x, codes)
        got = K.gemv(jnp.asarray(x), codes, jnp.float32, block_n=8, block_k=16, splits=splits,
                     **how)
        assert got.shape == (batch, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # tiles that cover the weight exactly (no masks or clamps in the kernel), the blocks one by
    # one and as words (M = 3 and the LUT method take the blocks one by one)
    exact = _weights(cfg, 32, 64 * cfg.d)
    x = rng.standard_normal((2, 64 * cfg.d)).astype(np.float32)
    ref = _decoded_product(x, exact)
    for words in (False, True):
        f = functools.partial(K.gemv, codes=exact, out_dtype=jnp.float32, block_n=8,
                              block_k=16, splits=2, words=words, **how)
        np.testing.assert_allclose(f(jnp.asarray(x)), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())
        view = K.pallas.word_view(cfg)  # the kernel reads the index as words [32, 64 / g]
        as_words = view is not None and f"u32[32,{64 // view[0]}]" in str(jax.make_jaxpr(f)(x))
        assert as_words == (words and method != "lut" and view is not None), (words, method)
    # bfloat16 in and out: the float32 sum rounded once
    x = x[:, :k]
    xb = jnp.asarray(x, jnp.bfloat16)
    got = K.gemv(xb, codes, jnp.bfloat16, block_n=4, block_k=16, **how)
    ref = _decoded_product(np.asarray(xb, np.float32), codes)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=1e-2,
                               atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("cfg", [hq.HNLQConfig("A2", 4, 1, beta=0.3),
                                 hq.HNLQConfig("Z2", 4, 4, beta=0.2, max_T=20),
                                 hq.HNLQConfig("Z2", 4, 4, beta=0.2)], ids=["M1", "M4", "M4-T4"])
def test_gemv_words_of_4_1_and_half_blocks(cfg):
    """Words of 4 blocks (one level of index bytes, T in 16 bits), of 1 block (4 levels; 8-bit
    T) and of 1 block whose T byte holds two (two index words a T byte, read at a stride of
    2): the same products as block by block, batch 1 and 3 (x's rows one by one), tiles
    that cover the weight and tiles past its rows and blocks (a failed-looking T of 0 there
    would make the rows NaN)."""
    view = K.pallas.word_view(cfg)
    assert view[0] == {1: 4, 4: 1}[cfg.M] and view[1] == max(view[0], 8 // t_bits(cfg))
    # 16 rows in tiles of 8, 2 shares of 64 blocks; 13 rows and 3 shares: the edges masked
    for n, splits in ((16, 2), (13, 3)):
        codes = _weights(cfg, n, 64 * cfg.d)
        for batch in (1, 3):
            x = np.random.default_rng(7).standard_normal((batch, 64 * cfg.d)).astype(np.float32)
            f = functools.partial(K.gemv, codes=codes, out_dtype=jnp.float32, block_n=8,
                                  block_k=16, splits=splits, words=True)
            assert f"u32[{n},{64 // view[0]}]" in str(jax.make_jaxpr(f)(x))
            ref = _decoded_product(x, codes)
            np.testing.assert_allclose(f(jnp.asarray(x)), ref, rtol=1e-5,
                                       atol=1e-5 * np.abs(ref).max())


def test_products_of_nonfinite_x_rows():
    """A row of x with an inf or a NaN gives a row of y with no finite value in every GPU
    product (x is folded into beta C^T x and the fields' bias before the sum, so inf meets
    -inf: NaN, where the reference gives +-inf at nonzero weights; docs/kernels.md); the
    other rows are the product of the decoded weights."""
    codes = _weights(D4, 12, 64)
    x = np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32)
    ref = _decoded_product(x, codes)
    x[1, 5], x[3, 40] = np.inf, np.nan
    for f in [*(functools.partial(K.gemv, block_n=4, **how) for how in _GEMV_METHODS.values()),
              functools.partial(K.decode_matmul, compute_dtype=jnp.float32)]:
        y = np.asarray(f(jnp.asarray(x), codes, out_dtype=jnp.float32))
        assert not np.isfinite(y[[1, 3]]).any()
        np.testing.assert_allclose(y[[0, 2]], ref[[0, 2]], rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())


def test_gemv_failed_blocks_bias_and_front_door():
    """A failed block (T = -1) or an index past q^d gives a NaN row and leaves the others; the
    packed fields' bias is exact for one-hot activations; matmul takes gemv for a few rows."""
    codes = _weights(WIDE_T, 12, 64)  # D4 q=3: indices up to 255 in a byte, 81 valid
    T = codes.T.astype(jnp.int32).at[3, 5].set(-1)
    bad = hq.Codes.from_labels(codes.labels, T, WIDE_T, scale=codes.scale, n=codes.n)
    bad = hq.Codes(bad.index.at[7, 2, 1].set(200), bad.tfield, WIDE_T, scale=bad.scale,
                   n=bad.n)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 64)), jnp.float32)
    for how in [*_GEMV_METHODS.values(), dict(words=True, block_k=16, splits=1)]:
        y = np.asarray(jax.jit(lambda x, c, how=how: K.gemv(  # jit: the codes are not
            x, c, jnp.float32, block_n=4, **how))(x, bad))  # checked, as in a model
        assert np.isnan(y[:, [3, 7]]).all() and np.isfinite(np.delete(y, [3, 7], 1)).all()
    eye = jnp.eye(64, dtype=jnp.float32)[:8]  # each output one weight: exact
    D4e = _weights(D4, 12, 64)
    np.testing.assert_array_equal(K.gemv(eye, D4e, jnp.float32),
                                  hq.matmul(eye, D4e, **XLA))
    with mock_gemv() as calls:
        hq.matmul(x, D4e, **PALLAS)
        hq.matmul(jnp.ones((K.GEMV_ROWS + 1, 64)), D4e, **PALLAS)
    assert calls == [2]


def test_matmul_takes_tensor_cores_for_few_rows_where_the_table_says(monkeypatch):
    """Where the tuning table's gemv entry says "triton_mma", hq.matmul takes Triton's
    decode_matmul for 2-8 rows of bfloat16 x (its product, as from 9 rows on), and gemv for
    float32 x, for another batch class, and where the entry says nothing."""
    codes = _weights(D4, 32, 128)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, 128)), jnp.bfloat16)
    monkeypatch.setattr(K.pallas, "gpu_target", lambda: ("cpu", 132))
    monkeypatch.setattr(gpu_tiles, "TILES", {"cpu": {"gemv": {"D4": {
        "batch<=1": {}, "batch<=8": {"backend": "triton_mma"}}}}})
    dm_calls, real_dm = [], K.decode_matmul

    def dm_spy(x, *args, **kwargs):
        dm_calls.append(int(np.prod(x.shape[:-1])))
        return real_dm(x, *args, **kwargs)

    monkeypatch.setattr(K, "decode_matmul", dm_spy)
    fresh = lambda: jax.jit(lambda x, c: hq.matmul(x, c, **PALLAS))  # the table: at tracing
    with mock_gemv() as gemv_calls:
        y = fresh()(x, codes)
        fresh()(x.astype(jnp.float32), codes)
        fresh()(x[:1], codes)
    assert dm_calls == [4] and gemv_calls == [4, 1]
    np.testing.assert_array_equal(y, K.decode_matmul(x, codes, jnp.bfloat16, jnp.bfloat16))
    assert K.pallas.few_rows_on_tensor_cores(codes, 8, jnp.bfloat16)
    assert not K.pallas.few_rows_on_tensor_cores(codes, 8, jnp.float16)
    assert not K.pallas.few_rows_on_tensor_cores(codes, 9, jnp.bfloat16)


@contextlib.contextmanager
def mock_gemv():
    """Records the rows of x each kernels.gemv call gets (the kernel still runs)."""
    calls, real = [], K.gemv
    def spy(x, *args, **kwargs):
        calls.append(int(np.prod(x.shape[:-1])))
        return real(x, *args, **kwargs)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(K, "gemv", spy)
        yield calls


def test_packed_codebook():
    """Each packed entry, one word, holds the codebook row plus the bias in byte fields (E8:
    4-bit fields); the levels' fields add without carries up to the largest M that fits, and
    no table is claimed beyond it."""
    for lattice, M_max, bits in (("D4", 3, 8), ("E8", 2, 4)):
        table, c = K.pallas.packed_codebook(hq.HNLQConfig(lattice, 4, M_max))
        r = codec.codebook_table(lattice, 4)
        rows, d = r.shape
        assert table.shape == (rows,) and table.dtype == np.uint32
        fields = np.stack([(table >> (bits * j)) & ((1 << bits) - 1) for j in range(d)], 1)
        np.testing.assert_array_equal(fields.astype(np.int64) - c, r)
        assert (r.max() + c) * sum(4**m for m in range(M_max)) <= 255
        assert K.pallas.packed_codebook(hq.HNLQConfig(lattice, 4, M_max + 1)) is None


def test_launch_params_and_errors(monkeypatch):
    cfg, params = D4, K.pallas.launch_params
    monkeypatch.setattr(gpu_tiles, "TILES", {})  # the defaults, whatever the sweeps wrote
    default = params("gemv", cfg, 64, 512, 1)
    assert default["block_n"] == gpu_tiles.DEFAULT["gemv"]["block_n"]
    # 4 programs of 16 rows: split until ~waves x 132 programs, at most one step each
    assert default["splits"] == 512 // default["block_k"]
    # decode_matmul: 1 wave; 4096 rows in 128 programs of 32 -> 2 shares; 8192 rows: none
    assert params("decode_matmul", cfg, 4096, 1024, 16)["splits"] == 2
    assert params("decode_matmul", cfg, 8192, 1024, 16)["splits"] == 1
    assert params("decode_matmul", cfg, 4096, 1024, 65)["splits"] == 1  # 2 row tiles of 64
    monkeypatch.setattr(gpu_tiles, "TILES", {"sm90": {"gemv": {"D4": {
        "batch<=1": dict(block_n=8, block_k=32, num_warps=2, num_stages=2, waves=1),
        "batch<=8": dict(block_n=32, block_k=64, num_warps=8, num_stages=1, waves=1)}}}})
    one = params("gemv", cfg, 8192, 1024, 1)
    assert one == dict(block_n=8, block_k=32, num_warps=2, num_stages=2, words=True, splits=1)
    assert params("gemv", cfg, 1024, 1024, 4)["block_n"] == 32
    assert params("gemv", cfg, 1024, 1024, 4)["splits"] == 5  # ceil(132 / 32)
    assert params("gemv", hq.HNLQConfig("E8", 4, 2), 64, 64, 1)["block_n"] == 16
    assert params("decode_matmul", cfg, 64, 64, 16)["block_n"] == 32  # no entry: defaults
    # words where the T elements divide the rows (D4: 2 blocks a T byte), ragged shares too
    t = dict(block_n=16, block_k=256, num_warps=4, num_stages=1, words=True)
    assert K.pallas.reads_words(cfg, 2048, dict(t, splits=2))
    assert K.pallas.reads_words(cfg, 2048, dict(t, splits=3))  # 3 x 3 x 256 > 2048: masked
    assert not K.pallas.reads_words(cfg, 2047, dict(t, splits=2))  # half a T byte at the end
    assert not K.pallas.reads_words(cfg, 2048, dict(t, splits=2, lut_tables=True))
    assert not K.pallas.reads_words(cfg, 2048, dict(t, splits=2, words=False))
    assert not K.pallas.reads_words(hq.HNLQConfig("A2", 3, 3), 2048, dict(t, splits=2))
    codes = _weights(D4, 8, 64)
    x = jnp.ones((K.GEMV_ROWS + 1, 64))
    with pytest.raises(ValueError, match="at most 8 rows of x, got 9"):
        K.gemv(x, codes, jnp.float32)
    for bad in (dict(words="yes"), dict(lut_tables=1)):
        with pytest.raises(TypeError, match=f"{next(iter(bad))} must be a bool"):
            K.gemv(x[:1], codes, jnp.float32, **bad)
    with pytest.raises(TypeError, match="f16 must be a bool"):
        K.decode_matmul(x, codes, jnp.bfloat16, jnp.float32, f16="yes")
    for bad in (dict(splits=0), dict(num_warps=1.5), dict(block_n=6), dict(block_k=8)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            K.gemv(x[:1], codes, jnp.float32, **bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            K.decode_matmul(x, codes, jnp.float32, jnp.float32, **bad)


@pytest.mark.parametrize("cfg", [D4, WIDE_T], ids=["4-bit-T", "8-bit-T"])
def test_modq_sum_bit_exact(cfg):
    x = np.random.default_rng(6).standard_normal((3, 5, 7, cfg.d)).astype(np.float32) * 0.3
    codes = hq.encode(x, cfg)
    T = codes.T.astype(jnp.int32).at[0, 0, :5].set(1)  # differing T -> -1
    codes = hq.Codes.from_labels(codes.labels, T, cfg)
    for axis in (0, 1, -1):  # -1: the axis along which the 4-bit field pairs blocks
        assert_codes_equal(K.modq_sum(codes, axis), hq.modq.accumulate(codes, axis))
    if "modq_sum" in K.MOSAIC_GPU_OPS:  # jax < 0.11
        assert_codes_equal(K.modq_sum(codes, 1, gpu_backend="mosaic_gpu"),
                           hq.modq.accumulate(codes, 1))
    else:
        with pytest.raises(ValueError, match="no longer lowers pl.pallas_call through Mosaic"):
            K.modq_sum(codes, 1, gpu_backend="mosaic_gpu")


def test_empty_inputs():
    index, T = K.encode(jnp.zeros((0, 4), jnp.float32), D4)
    assert index.shape == (0, 2) and index.dtype == jnp.uint8 and T.shape == (0,)
    empty = hq.encode(np.zeros((3, 0, 4), np.float32), D4)
    assert K.decode(empty, None, jnp.float32).shape == (3, 0, 4)
    codes = _weights(D4, 8, 32)
    for x in (jnp.zeros((0, 32)), jnp.zeros((2, 0, 32))):
        assert K.decode_matmul(x, codes, jnp.float32, jnp.float32).shape == x.shape[:-1] + (8,)
        assert K.gemv(x, codes, jnp.float32, lut_tables=True).shape == x.shape[:-1] + (8,)
    no_rows = _weights(D4, 0, 32)
    assert K.decode_matmul(jnp.ones((2, 32)), no_rows, jnp.float32, jnp.float32).shape == (2, 0)
    assert K.gemv(jnp.ones((2, 32)), no_rows, jnp.float32, lut_tables=True).shape == (2, 0)
    out = K.modq_sum(empty, 0)
    assert out.index.shape == (0, 2) and out.tfield.shape == (0,)
    with pytest.raises(ValueError,
                       match="summed axis 1 of the codes \\(blocks \\(3, 0\\)\\) is empty"):
        K.modq_sum(empty, 1)


def test_errors():
    x = jnp.asarray(_data(D4, 32))
    z3 = hq.HNLQConfig("Z3", 4, 2)
    with pytest.raises(ValueError, match="d = 3 is not a power of two"):
        K.encode(jnp.zeros((4, 3), jnp.float32), z3)
    with pytest.raises(ValueError, match="d = 3 is not a power of two"):
        hq.encode(np.zeros((4, 3), np.float32), z3, **PALLAS)
    with pytest.raises(ValueError, match="blocks \\[N, d=4\\]"):
        K.encode(x.reshape(2, -1, 4), D4)
    with pytest.raises(ValueError, match="no Mosaic GPU kernel"):
        K.encode(x, D4, gpu_backend="mosaic_gpu")
    with pytest.raises(ValueError, match="gpu_backend must be one of"):
        K.modq_sum(hq.encode(np.zeros((2, 4), np.float32), D4), gpu_backend="cuda")
    with pytest.raises(ValueError, match="^kernels.encode: block must be a power of two >= 16"):
        K.encode(x, D4, block=100)
    codes = _weights(D4, 8, 32)
    with pytest.raises(ValueError, match="^kernels.decode_matmul: block_k must be a power of two"):
        K.decode_matmul(jnp.ones((2, 32)), codes, jnp.float32, jnp.float32, block_k=8)
    with pytest.raises(ValueError, match="^kernels.gemv: block_n must be a power of two, got 3"):
        K.gemv(jnp.ones((1, 32)), codes, jnp.float32, block_n=3)
    with pytest.raises(ValueError, match="^kernels.gemv: splits must be a positive int, got True"):
        K.gemv(jnp.ones((1, 32)), codes, jnp.float32, splits=True)
    with pytest.raises(ValueError, match="^kernels.reads_words: block_k must be a power of two"):
        K.pallas.reads_words(D4, 8, {"block_k": 8, "words": True})
    with pytest.raises(ValueError, match="expected block codes"):
        K.decode(codes, None, jnp.float32)
    with pytest.raises(TypeError, match="float32 or float64"):
        K.decode(hq.encode(x, D4, failures="mark"), None, jnp.bfloat16)
    with pytest.raises(ValueError, match="x must be \\[..., k\\] with k = 32"):
        K.decode_matmul(jnp.ones((2, 40)), codes, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="blocks \\[n, nb\\]"):
        K.gemv(jnp.ones(4), hq.encode(x, D4, failures="mark"), jnp.float32)
    with pytest.raises(ValueError, match="one-sided table of E8 q=5"):  # 390,625 entries
        K.gemv(jnp.ones((1, 8)), hq.encode_rows(jnp.ones((2, 8)), hq.HNLQConfig("E8", 5, 1)),
               jnp.float32, lut_tables=True)
    with pytest.raises(ValueError, match="use_table=True needs q\\^d <= 65536"):
        K.decode(hq.encode(np.zeros((2, 8), np.float32), hq.HNLQConfig("E8", 5, 1)), None,
                 jnp.float32, use_table=True)
    with pytest.raises(TypeError, match="expected hnlq_jax.Codes"):
        K.decode((x, x), None, jnp.float32)
    with pytest.raises(ValueError, match="without dither"):
        K.modq_sum(hq.encode(np.zeros((2, 2), np.float32), CONFIGS[3]))
    if jax.default_backend() == "cpu":
        with pytest.raises(Exception, match="interpret mode"):
            K.encode(x, D4, interpret=False)


def test_cpu_inputs_take_the_cpu_path_on_a_gpu_machine(monkeypatch):
    """With a GPU as JAX's default backend, arrays on the CPU (a DLPack import of a CPU tensor,
    ``device_put``) still run XLA, and the kernels interpret mode: a kernel lowered for the GPU
    fails on them ("Only interpret mode is supported on CPU backend", seen on an H200)."""
    x = np.random.default_rng(5).standard_normal((64, 4)).astype(np.float32)
    want = hq.encode(x, D4, **XLA)
    cpu = jax.devices("cpu")[0]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    # uncommitted arrays, or none: the default backend's choice
    assert K.platform() == K.platform(jnp.asarray(x)) == "gpu"
    assert hq.ops.default_implementation("encode", D4) == "pallas"
    xc = jax.device_put(x, cpu)
    assert K.platform(xc) == "cpu" and hq.ops.default_implementation("encode", D4, xc) == "xla"
    codes = hq.encode(xc, D4)
    assert_codes_equal(codes, want)
    np.testing.assert_array_equal(hq.decode(codes), hq.decode(want, **XLA))
    index, T = K.encode(xc, D4)  # interpret mode
    np.testing.assert_array_equal(index, want.index)
    np.testing.assert_array_equal(T, want.T)
    with jax.default_device(cpu):
        on_cpu = "native" if hq.kernels.cpu.available() else "xla"  # the native decode kernel
        assert K.platform() == "cpu" and hq.ops.default_implementation("decode", D4) == on_cpu


# CUDA lowering, without a GPU: every kernel through the real Pallas -> Triton (and, for the
# mod-q sum, Mosaic GPU) lowering. A lowering error fails the test.
def _lowering_cases(cfg, all_ops):
    """Kernels to lower; ``all_ops=False``: only those whose code depends on the lattice."""
    gpu = dict(interpret=False)
    x = jnp.zeros((1000, cfg.d), jnp.float32)
    c = hq.encode(jnp.zeros((5, 81, cfg.d)), cfg)
    cases = {
        "encode": (lambda x: K.encode(x, cfg, **gpu), (x,)),
        # past four tiles: one attempt, then the loop over the blocks left (a start per block)
        "encode_two_passes": (lambda x: K.encode(x, cfg, block=64, **gpu), (x,)),
        "decode": (lambda c: K.decode(c, None, jnp.float32, **gpu), (c,)),
        "decode_digits": (lambda c: K.decode(c, 1, jnp.float32, use_table=False, **gpu), (c,)),
    }
    if not all_ops:
        return cases
    k = 27 * cfg.d - 1
    xa = jnp.zeros((3, k), jnp.float32)
    cw = hq.encode_rows(jnp.ones((40, k)), cfg)
    mm = functools.partial(hq.matmul, implementation="pallas", interpret=False)
    cases.update({
        "matmul": (mm, (xa, cw)),
        "matmul_bf16": (mm, (xa.astype(jnp.bfloat16), cw)),  # 3 rows: gemv
        "matmul_rows": (mm, (jnp.zeros((K.GEMV_ROWS + 1, k), jnp.bfloat16), cw)),
        "gemv_digits_split": (lambda x, c: K.gemv(x, c, jnp.float32, splits=2,
                                                  use_table=False, **gpu), (xa, cw)),
        "gemv_exact_tiles": (lambda x, c: K.gemv(x, c, jnp.float32, block_n=16,
                                                 block_k=16, **gpu),
                             (jnp.zeros((2, 64 * cfg.d)), hq.encode_rows(
                                 jnp.ones((32, 64 * cfg.d)), cfg))),
        "gemv_words": (lambda x, c: K.gemv(x, c, jnp.float32, block_n=16, block_k=32,
                                           words=True, **gpu),
                       (jnp.zeros((1, 64 * cfg.d)), hq.encode_rows(
                           jnp.ones((32, 64 * cfg.d)), cfg))),
        # 3 shares of one step: tables of a length no power of two
        "gemv_lut_split": (lambda x, c: K.gemv(x, c, jnp.float32, splits=3, block_k=16,
                                               lut_tables=True, **gpu), (xa, cw)),
        "quantize_grad": (jax.value_and_grad(
            lambda x: jnp.sum(hq.quantize(x, cfg, implementation="pallas", interpret=False))),
            (x,)),
        "modq_sum": (lambda c: K.modq_sum(c, -1, **gpu), (c,)),
    })
    return cases


def _lower_for_cuda(f, *args) -> str:
    """The StableHLO text of ``f(*args)`` lowered for CUDA, on a machine without a GPU too.

    jax >= 0.11 asks the device for its GPU generation while lowering a Triton kernel; without a
    GPU it wants an abstract mesh, under which every eager constant (``jnp.asarray`` of a table)
    is refused. So the lookup answers "H100" instead (jax's own table; jax 0.10 had no lookup).
    """
    with contextlib.ExitStack() as stack:
        if jax.default_backend() != "gpu" and importlib.util.find_spec(
                "jax._src.pallas.triton.gpu_info") is not None:
            from jax._src.pallas.triton import gpu_info
            patch = stack.enter_context(pytest.MonkeyPatch.context())
            patch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(
                gpu_info.GpuVersion.H100))
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_lowers_for_cuda_triton(cfg):
    cases = _lowering_cases(cfg, all_ops=cfg in (D4, WIDE_T))
    for name, (f, args) in cases.items():
        text = _lower_for_cuda(f, *args)
        assert "custom_call @__gpu$xla.gpu.triton" in text, name
        # IEEE's x / s, where Triton's "/" is div.full.f32 (up to 2 units in the last place)
        assert ("div.rn.f32" in text) == name.startswith(("encode", "quantize")), name
    if cfg is D4:  # float64 products: a sum of products in the kernel, not Triton's dot
        with jax.enable_x64(True):
            f, (xa, cw) = cases["matmul"]
            text = _lower_for_cuda(f, xa.astype(jnp.float64), cw)
        assert "custom_call @__gpu$xla.gpu.triton" in text and "f64" in text


def test_lowers_for_cuda_mosaic_gpu(monkeypatch):
    cm = hq.encode(jnp.zeros((3, 1000, 4)), D4)
    f = functools.partial(K.modq_sum, interpret=False, gpu_backend="mosaic_gpu")
    with monkeypatch.context() as m:  # jax >= 0.11: refused before any lowering
        m.setattr(K.pallas, "MOSAIC_GPU_OPS", ())
        with pytest.raises(ValueError, match="modq_sum: no Mosaic GPU kernel .jax .* no longer"):
            f(cm)
    if "modq_sum" not in K.MOSAIC_GPU_OPS:
        return  # jax >= 0.11: the refusal above is the behaviour
    with warnings.catch_warnings():
        # JAX deprecates pl.pallas_call for Mosaic GPU (plgpu.kernel replaces it); the warning
        # comes only from a lowering that is not cached yet, so it is filtered, not expected.
        warnings.filterwarnings("ignore", "Using ``pl.pallas_call`` for Mosaic GPU",
                                DeprecationWarning)
        text = _lower_for_cuda(f, cm)
    assert "custom_call @mosaic_gpu" in text


def test_gpu_check_peak_bandwidth_of_each_kind():
    """The longer names first: a GH200 is not an H200 (two memory configurations: no figure),
    an H100 NVL not an H100 SXM."""
    peak = experiment("gpu_check").peak_bandwidth
    assert peak("NVIDIA H200") == 4.8e12 and peak("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak("NVIDIA H100 NVL") == 3.9e12 and peak("NVIDIA H100 PCIe") == 2.0e12
    assert peak("NVIDIA GH200 480GB") is None and peak("NVIDIA A100-SXM4-80GB") is None


def test_gpu_check_picks_the_faster_backend():
    """The sweep names a Mosaic GPU kernel the backend only where its winner beat what
    hq.matmul would run instead (or that had none, having failed; not where it was never
    timed): up to 8 rows, Mosaic's gemv against
    Triton's and the tensor-core kernel against both; beyond, the tensor-core kernel against
    Triton's decode_matmul. The report still finds each winner's time (the entry with a
    backend is Triton's tiles)."""
    gpu_check = experiment("gpu_check")
    tri = dict(block_n=16, block_k=256, num_warps=4, num_stages=1, waves=4)
    mos = dict(block_n=64, block_w=32, stages=4, waves=4, resident=2)
    t = {("gemv", 1): 50, ("gemv_mosaic", 1): 20, ("decode_matmul_mosaic", 1): 30,
         ("gemv", 4): 50, ("gemv_mosaic", 4): 40, ("decode_matmul_mosaic", 4): 30,
         ("gemv", 8): 60, ("gemv_mosaic", 8): 90, ("decode_matmul_mosaic", 8): 70,
         ("decode_matmul", 16): 70, ("decode_matmul_mosaic", 16): 30,
         ("decode_matmul", 64): 80, ("decode_matmul_mosaic", 64): 99}
    rows = [dict(op=op, lattice="D4", batch=b, entry=mos if "mosaic" in op else tri,
                 seconds=us * 1e-6) for (op, b), us in t.items()]
    rows.append(dict(op="decode_matmul_mosaic", lattice="E8", batch=16, entry=mos, seconds=1.0))
    # E8's Triton decode_matmul ran and failed every candidate; its gemv was never reached (a
    # sweep cut short): no backend is named against a kernel that was not timed
    rows.append(dict(op="decode_matmul", lattice="E8", batch=16, entry=tri, error="ptxas"))
    rows.append(dict(op="gemv_mosaic", lattice="E8", batch=1, entry=mos, seconds=1e-6))
    # Triton's decode_matmul at up to 8 rows: Z2 from its time at 16 (x padded to 16 rows
    # either way), A2 from its own time at 8 (at 16 it would lose), at 8 rows and at 1 (the
    # nearest class above it: its tiles run there); slower rows do not count
    for lat, op, b, us in (("Z2", "gemv", 8, 200), ("Z2", "decode_matmul", 16, 80),
                           ("A2", "gemv", 1, 100),
                           ("A2", "gemv", 8, 100), ("A2", "decode_matmul", 8, 90),
                           ("A2", "decode_matmul", 8, 95), ("A2", "decode_matmul", 16, 200)):
        rows.append(dict(op=op, lattice=lat, batch=b, entry=tri, seconds=us * 1e-6))
    best = {"gemv": {"D4": {f"batch<={b}": dict(tri) for b in (1, 4, 8)},
                     "Z2": {"batch<=8": dict(tri)},
                     "A2": {"batch<=1": dict(tri), "batch<=8": dict(tri)}},
            "gemv_mosaic": {"D4": {"batch<=1": dict(mos), "batch<=8": dict(mos)}},
            "decode_matmul": {"D4": {"batch<=16": dict(tri), "batch<=64": dict(tri)}}}
    gpu_check.pick_backends(best, gpu_check.winners_of(rows), gpu_check.attempted_of(rows))
    assert "E8" not in best["gemv"]
    assert best["gemv"]["D4"] == {"batch<=1": dict(tri, backend="mosaic_gpu"),
                                  "batch<=4": dict(tri, backend="mosaic_gpu_mma"),
                                  "batch<=8": tri}  # (Triton's decode_matmul: 70 at 16)
    assert best["gemv"]["Z2"] == {"batch<=8": dict(tri, backend="triton_mma")}
    assert best["gemv"]["A2"] == {"batch<=1": dict(tri, backend="triton_mma"),
                                  "batch<=8": dict(tri, backend="triton_mma")}
    assert {lat: best["decode_matmul"][lat] for lat in ("D4", "E8")} == {
        "D4": {"batch<=16": dict(tri, backend="mosaic_gpu"), "batch<=64": tri},
        "E8": {"batch<=16": {"backend": "mosaic_gpu"}}}  # Triton had no winner there
    env = dict(device="H100", backend="gpu", jax="0", python="3", generation="sm90")
    md = gpu_check.markdown({"environment": env, "sweep": {"n": 8192, "rows": rows,
                                                           "best": best}})
    # a row naming a backend shows that backend's time (at the batch its time stands for),
    # then the entry's tiles' in the op's own kernel
    assert "'backend': 'mosaic_gpu'}` | 20.0 µs (at 1 rows); `gemv`'s tiles 50.0 µs |" in md
    assert "'backend': 'mosaic_gpu_mma'}` | 30.0 µs (at 4 rows); `gemv`'s tiles 50.0 µs |" in md
    assert "'backend': 'triton_mma'}` | 80.0 µs (at 16 rows); `gemv`'s tiles 200.0 µs |" in md
    assert "| `gemv` | D4 | batch<=8 | `" + str(tri) + "` | 60.0 µs |" in md


@pytest.mark.parametrize("pct,flagged", [(83.6, False), (55.0, True), (None, True)])
def test_gpu_check_flags_ratios_against_a_weak_baseline(pct, flagged):
    """On a GPU the report flags the ratios where the bfloat16 GEMV read outside 70-90 % of
    the HBM peak (or no peak is known), and names int4's bits as measured."""
    gpu_check = experiment("gpu_check")
    gemv = {"n": 8192, "seconds": 4.8e-5, "GBps": 2800.0}
    if pct is not None:
        gemv["pct_peak"] = pct
    ceilings = {"copy": {"bytes": 2e9, "seconds": 7e-4, "GBps": 2900.0}, "bf16_gemv": gemv}
    env = dict(device="H100", backend="gpu", jax="0", python="3")
    out = {"environment": env, "ceilings": ceilings}
    assert gpu_check.baseline_ok(out) is not flagged
    assert ("not to be believed" in gpu_check.markdown(out)) is flagged
    W = jax.random.normal(jax.random.key(0), (16, 256))
    q4 = gpu_check.quantize_int4(W)
    assert 8 * gpu_check._nbytes(q4) / W.size == 4 + 16 / 128  # int4 packs 2 a byte


def test_gpu_check_merges_winners_per_batch_class():
    """A sweep's winners replace the table's entries class by class: a quick run (batch 16
    only) keeps a full run's batch-64 class, other lattices and other ops."""
    gpu_check = experiment("gpu_check")
    table = {"decode_matmul": {"D4": {"batch<=16": {"block_n": 32},
                                      "batch<=64": {"block_n": 64, "backend": "mosaic_gpu"}},
                               "E8": {"batch<=16": {"block_n": 16}}},
             "gemv": {"D4": {"batch<=1": {"block_n": 8}}}}
    best = {"decode_matmul": {"D4": {"batch<=16": {"block_n": 128}}},
            "decode_matmul_mosaic": {"D4": {"batch<=16": {"block_w": 64}}}}
    merged = gpu_check.merged_tiles(table, best)
    assert merged == {
        "decode_matmul": {"D4": {"batch<=16": {"block_n": 128},
                                 "batch<=64": {"block_n": 64, "backend": "mosaic_gpu"}},
                          "E8": {"batch<=16": {"block_n": 16}}},
        "gemv": {"D4": {"batch<=1": {"block_n": 8}}},
        "decode_matmul_mosaic": {"D4": {"batch<=16": {"block_w": 64}}}}
    assert table["decode_matmul"]["D4"]["batch<=16"] == {"block_n": 32}  # not modified


def test_gpu_check_sweep_table_and_report_run(monkeypatch):
    """What a GPU lease runs, end to end at the smoke size (interpret mode; the Mosaic GPU
    kernels where this jax has them): the quick sweep with each op's first candidate, the
    backend choice, the product table with the winners, the report. Every candidate runs
    and matches the float32 product (a lease is too short to find gpu_check's own bugs)."""
    gpu_check = experiment("gpu_check")
    real = gpu_check.sweep_candidates
    monkeypatch.setattr(gpu_check, "sweep_candidates",
                        lambda *a, **k: (real(*a, **k)[0][:1], []))
    monkeypatch.setattr(gpu_check, "_timed", functools.partial(gpu_check._timed, iterations=1))
    clock = gpu_check.Clock(3600)
    sw = gpu_check.sweep(clock, small=True, quick=True)
    assert [r for r in sw["rows"] if "error" in r or r["rel_diff"] > 1e-2] == []
    timed = {r["op"] for r in sw["rows"]}
    mosaic = {"gemv_mosaic", "decode_matmul_mosaic"} if K.mosaic_gpu.available() else set()
    assert timed == {"gemv", "decode_matmul"} | mosaic
    tiles = {"cpu": gpu_check.merged_tiles({}, sw["best"])}
    monkeypatch.setattr(gpu_tiles, "TILES", tiles)
    monkeypatch.setattr(K.pallas, "gpu_target", lambda: ("cpu", 132))
    rows = gpu_check.matmul_table(clock, None, True, (1, 16))
    assert [r["batch"] for r in rows] == [1, 16]
    assert all(r[lat]["fused"]["rel_diff"] < 1e-2 for r in rows for lat in gpu_check.CONFIGS)
    env = dict(device="cpu", backend="cpu", jax=jax.__version__, python="3")
    md = gpu_check.markdown({"environment": env, "sweep": sw, "matmul": rows})
    assert "| 256 x 256 | 16 |" in md and "0 failed to run" in md
    assert "device time goes" not in md  # wall clock on the CPU: no split by kernel
    rows[0]["D4"]["fused"]["kernels"] = {"loop_fusion": 1e-6, "gemv": 4e-5, "sum": 2e-6}
    md = gpu_check.markdown({"environment": env, "matmul": rows})
    assert "| 256 x 256 | 1 | D4 | 3 | `gemv` 40.0 µs | 3.0 µs |" in md


def test_gpu_check_watchdog_fires_once_for_an_overrun():
    """A guarded step past its limit calls on_expiry with its label (once: the run ends
    there), an outer limit bounding an inner one; steps in time do not."""
    gpu_check = experiment("gpu_check")
    fired = []
    dog = gpu_check.Watchdog(fired.append)
    with dog.guard("part", 30):
        with dog.guard("candidate in time", 5):
            pass
        time.sleep(0.5)
    assert fired == []
    with dog.guard("part", 0.2):
        with dog.guard("candidate", 30):  # the part's limit still holds
            end = time.monotonic() + 10  # (a loaded machine may wake the thread late)
            while not fired and time.monotonic() < end:
                time.sleep(0.05)
    assert fired == ["candidate"]
    time.sleep(0.5)
    assert fired == ["candidate"]


def test_gpu_check_stops_at_a_broken_device_context(monkeypatch):
    """A candidate whose error shows a broken CUDA context ends the sweep (nothing after it
    runs in that process), its rows in the caller's dict as they come; a fault in the native
    tests, or --no-mosaic, leaves the Mosaic GPU kernels out of the sweep."""
    gpu_check = experiment("gpu_check")
    calls = []

    def timed(fn, x, ws, peak, nbytes, ref=None, iterations=10):
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access "
                               "was encountered")
        return {"seconds": 1e-3, "rel_diff": 0.0}

    monkeypatch.setattr(gpu_check, "_timed", timed)
    monkeypatch.setattr(gpu_check, "sweep_candidates",
                        lambda *a, **k: ([dict(block_n=8, block_k=32)] * 3, []))
    into = {}  # what the watchdog writes if the sweep never returns
    sw = gpu_check.sweep(gpu_check.Clock(3600), small=True, quick=True, out=into)
    assert sw is into and len(calls) == 2 and len(sw["rows"]) == 2
    assert "ILLEGAL_ADDRESS" in sw["fault"] and sw["rows"][1]["error"] == sw["fault"]
    assert gpu_check.device_fault("FAILED test_x - AssertionError: 0.1 > 0.01") is None
    assert gpu_check.device_fault("[gw1] node down: Not properly terminated") == "node down"
    # a failing test's echoed source spells the signs out: only pytest's own lines count
    run = ["    raise RuntimeError('CUDA_ERROR_ILLEGAL_ADDRESS')", "E   AssertionError",
           "FAILED tests/x.py::t - AssertionError"]
    assert gpu_check.device_fault("\n".join(run)) is None
    run[-1] = "FAILED tests/x.py::t - XlaRuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS"
    assert gpu_check.device_fault("\n".join(run)) == "ILLEGAL_ADDRESS"

    calls.clear()
    monkeypatch.setattr(gpu_check, "_timed",
                        lambda *a, **k: calls.append(1) or {"seconds": 1e-3, "rel_diff": 0.0})
    sw = gpu_check.sweep(gpu_check.Clock(3600), small=True, quick=True, skip_mosaic="--no-mosaic")
    assert {r["op"] for r in sw["rows"]} == {"gemv", "decode_matmul"}
    assert sw["mosaic_skipped"] == "--no-mosaic" and "fault" not in sw
    # the time the parts after the sweep need stays theirs: with 100 s left and 90 reserved
    # no candidate starts, with 10 reserved they do
    for reserve, timed_any in ((90, False), (10, True)):
        calls.clear()
        gpu_check.sweep(gpu_check.Clock(100), small=True, quick=True, reserve=reserve,
                        skip_mosaic="--no-mosaic")
        assert bool(calls) == timed_any
    env = dict(device="cpu", backend="cpu", jax=jax.__version__, python="3")
    md = gpu_check.markdown({"environment": env, "sweep": sw, "fault": "RuntimeError: x",
                             "skipped": ["matmul"]})
    assert "Mosaic GPU kernels not timed: --no-mosaic" in md and "context broke" in md


def test_gpu_check_quick_sweep_times_every_first_candidate_first(monkeypatch):
    """--quick times the first candidate of every lattice, op and batch class before any
    other, so that a lease's budget, which ends the sweep where it is, still leaves every
    kernel compared at every batch class (D4's candidates used to take it all: E8 and the
    Triton baselines at 8 and 16 rows went untimed); then the rest, each phase B around its
    winner."""
    gpu_check = experiment("gpu_check")
    calls = []

    def timed(fn, x, ws, peak, nbytes, ref=None, iterations=10):
        calls.append(fn)
        return {"seconds": 1e-3 * len(calls), "rel_diff": 0.0}  # the first is fastest

    def candidates(op, lattice, batch, quick, generation):
        return [dict(block_n=8, block_k=32), dict(block_n=16, block_k=32)], [dict(num_warps=8)]

    monkeypatch.setattr(gpu_check, "_timed", timed)
    monkeypatch.setattr(gpu_check, "sweep_candidates", candidates)
    sw = gpu_check.sweep(gpu_check.Clock(3600), small=True, quick=True,
                         skip_mosaic="--no-mosaic")
    assert not [r for r in sw["rows"] if "error" in r]
    keys = [(r["op"], r["lattice"], r["batch"]) for r in sw["rows"]]
    classes = list(dict.fromkeys(keys))
    assert len(classes) == 2 * 5 and {k[1] for k in classes} == set(gpu_check.CONFIGS)
    assert keys[:len(classes)] == classes  # every class's first candidate, then the others
    assert [r["entry"] for r in sw["rows"][:len(classes)]] == [
        dict(block_n=8, block_k=32)] * len(classes)
    assert len(keys) == 3 * len(classes)
    # phase B varies the winner (the first candidate, timed in the first round)
    assert all(r["entry"] == dict(block_n=8, block_k=32, num_warps=8)
               for r in sw["rows"][2 * len(classes):] if "num_warps" in r["entry"])
    assert all(sw["best"][op][lat][f"batch<={b}"] == dict(block_n=8, block_k=32)
               for op, lat, b in classes)


@pytest.mark.parametrize("script,fault", [
    ("print('3 passed')", None),
    ("import sys; print('Fatal Python error: Aborted'); sys.exit(134)", "Fatal Python error"),
    ("import time; print('[gw0] PASSED t1', flush=True); time.sleep(30)", None),
    ("import time; print('[gw0] PASSED t1 Timeout (0:01:00)!', flush=True); time.sleep(30)",
     "a test hung: the run passed 2 s")])
def test_gpu_check_tests_report_a_fault_or_hang(monkeypatch, tmp_path, script, fault):
    """The native tests' process: a crash's sign, or a run past the limit with a test stuck
    (faulthandler's dump), is a fault (the sweep then leaves the Mosaic GPU kernels out); a
    run past the limit whose tests were all moving (slow first compiles), or that only ends
    the budget, is not. The whole output goes to the log, a hang's too (what it left running
    follows its last line)."""
    gpu_check = experiment("gpu_check")
    monkeypatch.setattr(gpu_check, "pytest_command", lambda *t: [sys.executable, "-c", script])
    r = gpu_check.run_tests(["t"], gpu_check.Clock(3600), limit=2, log=tmp_path / "t.txt")
    assert r["fault"] == fault and r["log"] == "t.txt"
    log = (tmp_path / "t.txt").read_text()
    if script == "print('3 passed')":
        assert r["returncode"] == 0 and r["summary"] == ["3 passed"] and log == "3 passed\n"
    elif fault and "hung" in fault:
        assert log == "[gw0] PASSED t1 Timeout (0:01:00)!\n(stopped after 2 s)\n"
    elif fault is None:
        assert r["returncode"] is None
        assert log == "[gw0] PASSED t1\n(stopped after 2 s, no test stuck: slow, not a fault)\n"


def test_gpu_check_test_summary_keeps_every_failure():
    """The JSON keeps each FAILED / ERROR line of a run and its last line, not the durations
    around them (the log has everything)."""
    gpu_check = experiment("gpu_check")
    text = "\n".join(["[gw0] PASSED a", "==== slowest 40 durations ====", "1.0s call a",
                      "FAILED tests/x.py::b - AssertionError: 0.2 > 0.1",
                      "ERROR tests/x.py::c - RuntimeError: ptxas", "0.5s call d",
                      "1 failed, 1 passed, 1 error in 3.0s"])
    assert gpu_check._summary(text) == [
        "FAILED tests/x.py::b - AssertionError: 0.2 > 0.1",
        "ERROR tests/x.py::c - RuntimeError: ptxas", "1 failed, 1 passed, 1 error in 3.0s"]
    cmd = gpu_check.pytest_command("tests/t.py")
    assert "-x" not in cmd and "--maxfail=10" in cmd and cmd[-1] == "tests/t.py"


def test_gpu_check_splits_the_tests_folder_too():
    """The Mosaic GPU tests run first in a process of their own, named by file or node id, or
    inside a folder (which a plain substring test of the targets missed: it ran them last)."""
    gpu_check = experiment("gpu_check")
    split = gpu_check.split_tests(["tests"])
    assert split["tests_mosaic"] == ["tests/test_kernels_mosaic_gpu.py"]
    assert "tests/test_kernels.py" in split["tests"]
    assert not any("mosaic" in t for t in split["tests"])
    node = "tests/test_kernels_mosaic_gpu.py::test_x"
    assert gpu_check.split_tests([node, "tests/test_kernels.py::t"]) == {
        "tests_mosaic": [node], "tests": ["tests/test_kernels.py::t"]}


def test_gpu_check_a_failing_case_loses_only_itself(monkeypatch, tmp_path):
    """A product-table cell or codec row that raises holds its error, its row and the part's
    other rows are kept (each saved as it comes) and the report says what failed; an error
    that broke the device context ends the part."""
    gpu_check = experiment("gpu_check")
    real = functools.partial(gpu_check._timed, iterations=1)

    def timed(fn, x, ws, *a, **k):
        if fn is gpu_check.int4_weight_only:
            raise RuntimeError("INTERNAL: ptxas out of resource")
        return real(fn, x, ws, *a, **k)

    monkeypatch.setattr(gpu_check, "_timed", timed)
    rows, saved = [], []
    got = gpu_check.matmul_table(gpu_check.Clock(3600), None, True, (1, 16), rows=rows,
                                 on_row=lambda: saved.append(len(rows)))
    assert got is rows and [r["batch"] for r in rows] == [1, 16] and saved == [1, 2]
    assert all("ptxas" in r["int4"]["error"] and "seconds" in r["D4"]["fused"] for r in rows)
    env = dict(device="cpu", backend="cpu", jax=jax.__version__, python="3")
    md = gpu_check.markdown({"environment": env, "matmul": rows})
    assert "256 x 256 batch 16 int4 failed: `RuntimeError: INTERNAL: ptxas" in md
    assert "| 256 x 256 | 1 |" in md
    png = tmp_path / "t.png"  # the chart too: no bar where a cell failed
    gpu_check.plot({"environment": env, "matmul": rows}, png)
    assert png.stat().st_size > 0
    monkeypatch.setattr(gpu_check, "_timed", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")))
    with pytest.raises(RuntimeError, match="ILLEGAL_ADDRESS"):
        gpu_check.matmul_table(gpu_check.Clock(3600), None, True, (1,))
    assert gpu_check.timing_of({"matmul": rows}) == "wall clock"
    assert gpu_check.timing_of({"a": [{"b": {"method": "cupti"}}]}) == "CUPTI"
    assert gpu_check.timing_of({"matmul": [{"error": "x"}]}).startswith("n/a")


def test_gpu_check_codec_set_up_that_fails_loses_only_its_rows(monkeypatch):
    """The codec part's set-up (encoding what the decode rows decode) failing for E8 leaves
    one row holding the error; D4's rows and the queued encode's are measured."""
    gpu_check = experiment("gpu_check")
    encode = gpu_check.hq.encode

    def e8_fails(x, cfg, **kw):
        if cfg.lattice == "E8":
            raise RuntimeError("INTERNAL: ptxas out of resource")
        return encode(x, cfg, **kw)

    monkeypatch.setattr(gpu_check.hq, "encode", e8_fails)
    monkeypatch.setattr(gpu_check, "_timed", lambda *a, **k: {"seconds": 1e-3, "GBps": 1.0})
    rows = gpu_check.codec_bandwidth(None, True)
    failed = [r for r in rows if "error" in r]
    assert [r["op"] for r in failed] == ["decode E8 (set-up)"] and "ptxas" in failed[0]["error"]
    assert sum(r["op"].startswith("decode (") or r["op"] == "decode" for r in rows) == 4
    assert rows[-1]["op"].endswith("(wall clock a call, 20 queued)")
    env = dict(device="cpu", backend="cpu", jax=jax.__version__, python="3")
    assert "| decode E8 (set-up) | pallas | 4e+03 | failed: `RuntimeError" in gpu_check.markdown(
        {"environment": env, "codec": rows})


def test_sass_profile_unpacks_riegeli_and_snappy():
    """sass_profile's reading of a serialized executable: a Riegeli file (24-byte block
    headers every 64 KiB, here inside the record) holding a snappy stream whose length is
    written twice; the stream's literals and back references (1- and 2-byte offsets) come
    back as they were written."""
    sp = experiment("sass_profile")
    data = np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8).tobytes()

    def varint(n):
        out = b""
        while n >= 0x80:
            out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
        return out + bytes([n])
    # a literal of the random bytes (its length in 4 bytes), then copies of 7 bytes from 300
    # back (2-byte offset) and of 5 from 6 back (1-byte offset)
    want = data + data[-300:-293] + (data + data[-300:-293])[-6:-1]
    size = varint(len(want))
    stream = (size + bytes([63 << 2]) + (len(data) - 1).to_bytes(4, "little") + data
              + bytes([(7 - 1) << 2 | 2]) + (300).to_bytes(2, "little")
              + bytes([(5 - 4) << 2 | 1, 6]))
    logical = bytes(sp._RIEGELI) + bytes(56) + b"\x0a" + size + stream
    blocked = logical[:65536] + b"".join(bytes(24) + logical[a:a + 65512]
                                         for a in range(65536, len(logical), 65512))
    assert sp._inner_stream(b"header" + blocked) == want
    with pytest.raises(ValueError, match="snappy"):
        sp._inner_stream(b"header" + logical[:-2] + bytes([(5 - 4) << 2 | 1, 0]))  # back 0
    with pytest.raises(ValueError, match="runs past"):
        sp._inner_stream(b"header" + logical[:70_000])


def test_gpu_check_command_parses():
    """experiments/gpu_check.py runs this file through pytest: its command line must parse
    with the project's pytest options (collection only here)."""
    cmd = experiment("gpu_check").pytest_command(
        "tests/test_kernels.py::test_gpu_check_command_parses")
    r = subprocess.run(cmd + ["--collect-only", "-q"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_gpu_check_exit_status():
    """0 for a whole run; 1 where a part, a product-table case, a codec row or a test failed;
    4 where nothing failed but parts were skipped, a test run stopped at its limit, or the
    GEMV baseline (on a GPU) is not to be believed."""
    gpu_check = experiment("gpu_check")
    gemv = {"n": 8192, "seconds": 4.8e-5, "GBps": 2800.0, "pct_peak": 83.6}
    cell = {"seconds": 1e-5}
    row = {"bf16": cell, "int4": cell, "D4": {"fused": cell, "decode_then_dot": cell},
           "E8": {"fused": cell, "decode_then_dot": cell}}
    whole = {"environment": {"backend": "gpu"}, "ceilings": {"bf16_gemv": gemv},
             "matmul": [row], "codec": [{"op": "decode", "seconds": 1e-3}],
             "tests_mosaic": {"returncode": 0}, "tests": {"returncode": 0}}
    assert gpu_check.exit_status(whole) == 0
    failed = {"errors": {"torch": "ModuleNotFoundError"}, "fault": "ILLEGAL_ADDRESS",
              "tests_mosaic": {"returncode": None, "fault": "test_gemv stuck"},
              "matmul": [dict(row, E8={"fused": {"error": "ptxas"}, "decode_then_dot": cell})],
              "codec": [{"op": "encode", "error": "OOM"}], "tests": {"returncode": 1}}
    for key, value in failed.items():
        assert gpu_check.exit_status({**whole, key: value}) == 1, key
    partial = {"skipped": ["matmul"], "tests": {"returncode": None},
               "ceilings": {"bf16_gemv": dict(gemv, pct_peak=55.0)}}
    for key, value in partial.items():
        assert gpu_check.exit_status({**whole, key: value}) == 4, key
    cpu = {**whole, "environment": {"backend": "cpu"}, "ceilings": {"bf16_gemv": {}}}
    assert gpu_check.exit_status(cpu) == 0  # no baseline to believe off a GPU

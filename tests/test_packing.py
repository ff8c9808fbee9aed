"""The storage form: exact round trips, bit layouts, the rate target, corrupt or foreign data."""

import json
import math
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hnlq_jax as hq
from hnlq_jax import packing
from hnlq_jax.codes import pack_t


@pytest.mark.parametrize(
    "lat,q,M,bits",
    [("D4", 4, 2, 16), ("E8", 4, 2, 32), ("Z2", 2, 1, 2), ("D4", 8, 3, 36), ("E8", 2, 3, 24),
     ("D4", 3, 2, 8 * 27 / 17), ("E8", 3, 2, 16 * 27 / 17), ("A2", 5, 2, 4 * 7 / 3),
     ("Z2", 256, 2, 32)],
)
def test_bits_per_block(lat, q, M, bits):
    cfg = hq.HNLQConfig(lat, q, M)
    assert hq.bits_per_block(cfg) == pytest.approx(bits, rel=1e-12)
    # Never below the information rate, at most 0.015 bits per digit above it for q <= 8;
    # exactly the rate for q a power of two.
    ideal = M * cfg.d * math.log2(q)
    assert ideal <= hq.bits_per_block(cfg) <= ideal + 0.015 * M * cfg.d * (q <= 8) + 1e-9 * (q > 8)
    for n in (1, 5, 17, 1000):
        k, B = packing.label_chunk(q)
        assert packing.label_bits(cfg, n) <= math.ceil(n * hq.bits_per_block(cfg)) + B


CONFIGS = [hq.HNLQConfig("D4", 4, 2), hq.HNLQConfig("E8", 3, 2), hq.HNLQConfig("A2", 5, 1),
           hq.HNLQConfig("Z2", 256, 2), hq.HNLQConfig("D4", 2, 3, max_T=40),
           hq.HNLQConfig("E8", 4, 1, max_T=127), hq.HNLQConfig("Z2", 3, 3, max_T=0)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.lattice}q{c.q}M{c.M}T{c.max_T}")
@settings(max_examples=12)
@given(shape=st.sampled_from([(), (1,), (3,), (2, 5), (4, 1, 3), (700,)]),
       spread=st.sampled_from([0, 1, 3, None]), seed=st.integers(0, 2**31 - 1))
def test_roundtrip(cfg, shape, spread, seed):
    """Random indices and T (including -1 and max_T), each T distribution shape."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, cfg.q, size=shape + (cfg.M, cfg.d))
    if spread is None:  # uniform over -1..max_T
        T = rng.integers(-1, cfg.max_T + 1, size=shape)
    else:  # mostly small, as real T
        T = np.minimum(rng.geometric(0.7, size=shape) - 1, spread)
        T = np.where(rng.random(shape) < 0.02, -1, np.minimum(T, cfg.max_T))
    codes = hq.Codes.from_labels(labels, T, cfg)
    packed = hq.pack(codes)
    out = hq.unpack(packed)
    assert out.config == cfg and out.n is None and out.scale is None
    np.testing.assert_array_equal(out.index, codes.index)
    np.testing.assert_array_equal(out.tfield, codes.tfield)
    assert out.index.dtype == codes.index.dtype
    n = int(np.prod(shape))
    assert packed.labels.shape == (-(-packing.label_bits(cfg, n) // 8),)
    assert packed.rice.shape[0] == (int(np.where(T < 0, cfg.max_T + 1, T).max()) if n else 0)


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_row_codes_roundtrip_and_bytes(scale_dtype):
    """Row scales keep their dtype through bytes (bfloat16, which NumPy names '<V2', is
    written by name)."""
    cfg = hq.HNLQConfig("D4", 4, 2)
    w = np.random.default_rng(0).standard_normal((6, 37)).astype(np.float32)
    codes = hq.encode_rows(w, cfg)
    codes = hq.Codes(codes.index, codes.tfield, cfg, scale=codes.scale.astype(scale_dtype),
                     n=codes.n)
    packed = hq.pack(codes)
    for p in (packed, hq.Packed.from_bytes(packed.to_bytes())):
        out = hq.unpack(p)
        assert out.n == 37 and out.config == codes.config
        np.testing.assert_array_equal(out.index, codes.index)
        np.testing.assert_array_equal(out.tfield, codes.tfield)
        assert out.scale.dtype == scale_dtype
        np.testing.assert_array_equal(out.scale, codes.scale)
        np.testing.assert_array_equal(hq.decode(out), hq.decode(codes))


@pytest.mark.parametrize("cfg", CONFIGS[:2] + CONFIGS[4:5],
                         ids=lambda c: f"{c.lattice}q{c.q}M{c.M}")
def test_roundtrip_under_x64(cfg, x64):
    """With jax_enable_x64 sums default to int64: the stream loops must keep their int32 carry
    (a failure here is a while_loop type error), and the bytes are those of float32 mode."""
    rng = np.random.default_rng(1)
    T = np.minimum(rng.geometric(0.5, size=300) - 1, cfg.max_T)
    codes = hq.Codes.from_labels(rng.integers(0, cfg.q, size=(300, cfg.M, cfg.d)), T, cfg)
    packed = hq.pack(codes)
    out = hq.unpack(hq.Packed.from_bytes(packed.to_bytes()))
    np.testing.assert_array_equal(out.index, codes.index)
    np.testing.assert_array_equal(out.tfield, codes.tfield)
    with jax.enable_x64(False):
        assert hq.pack(codes).to_bytes() == packed.to_bytes()


def test_big_endian_scales_read_exactly():
    """Another writer may store the row scales big-endian ('>f4' in the header): they read as
    the same values, held in native order (a JAX array cannot hold a non-native dtype)."""
    codes = hq.encode_rows(np.random.default_rng(4).standard_normal((5, 12)), hq.HNLQConfig())
    b = hq.pack(codes).to_bytes()
    (hlen,) = struct.unpack("<I", b[8:12])
    header = json.loads(b[12:12 + hlen])
    assert header["scale"] == ["<f4", [5]]
    header["scale"][0] = ">f4"
    head = json.dumps(header, sort_keys=True).encode()
    swapped = np.asarray(codes.scale, "<f4").astype(">f4").tobytes()
    out = b[:8] + struct.pack("<I", len(head)) + head + b[12 + hlen:-4 - 20] + swapped
    out += struct.pack("<I", zlib.crc32(out))
    back = hq.unpack(hq.Packed.from_bytes(out))
    assert back.scale.dtype == np.float32
    np.testing.assert_array_equal(back.scale, codes.scale)
    np.testing.assert_array_equal(hq.decode(back), hq.decode(codes))


def test_bfloat16_scales_named_as_numpy_void_read_back():
    """Before the header named bfloat16, it wrote NumPy's '<V2' for it: such files read too."""
    codes = hq.encode_rows(np.random.default_rng(4).standard_normal((5, 12)), hq.HNLQConfig())
    codes = hq.Codes(codes.index, codes.tfield, codes.config,
                     scale=codes.scale.astype(jnp.bfloat16), n=codes.n)
    b = hq.pack(codes).to_bytes()
    (hlen,) = struct.unpack("<I", b[8:12])
    header = json.loads(b[12:12 + hlen])
    assert header["scale"] == ["bfloat16", [5]]
    header["scale"][0] = "<V2"
    head = json.dumps(header, sort_keys=True).encode()
    out = b[:8] + struct.pack("<I", len(head)) + head + b[12 + hlen:-4]
    out += struct.pack("<I", zlib.crc32(out))
    back = hq.unpack(hq.Packed.from_bytes(out))
    assert back.scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(back.scale, codes.scale)


def test_label_bits_known():
    """Little-endian digits: labels (1, 2, 3, 0) at q = 4 pack to 0b00111001 = 57; at q = 3
    the 17-digit chunk (1, 2, 0, ...) is 1 + 2*3 = 7 in 27 bits."""
    cfg = hq.HNLQConfig("D4", 4, 1)
    idx = hq.Codes.from_labels([[[1, 2, 3, 0]]], [0], cfg).index
    np.testing.assert_array_equal(packing.pack_labels(idx, cfg), [57])
    cfg3 = hq.HNLQConfig("D4", 3, 1)
    idx = hq.Codes.from_labels([[[1, 2, 0, 0]]], [0], cfg3).index
    np.testing.assert_array_equal(packing.pack_labels(idx, cfg3), [7])  # 4 digits: 7 bits


def test_t_stream_known_bits():
    """Symbols (0, 1, 0, 0): plane 0 has runs 1 (then the one) and 2 (then the end).

    k = 0: unary 01 then 001, bits 1 and 4: 0b00010010 = 18.
    k = 1: quotients 0, 1 -> unary 1 then 01 (bits 0, 2); remainders 1 then 0, written
    backward from bit 8: bit 7 = 1, bit 6 = 0. 0b10000101 = 133.
    """
    v = jnp.asarray([0, 1, 0, 0], jnp.int32)
    for k, byte, used in ((0, 18, 5), (1, 133, 5)):
        ks = jnp.asarray([k], jnp.int32)
        data, bits = packing.encode_stream(v, ks, 1, 8, 1)
        np.testing.assert_array_equal(data, [byte])
        assert int(bits) == used
        back, ok = packing.decode_stream(data, ks, 1, 8, 4, 4)
        np.testing.assert_array_equal(back, v)
        assert bool(ok)


# hq.gaussian_beta of each config (the calibrated beta for unit-variance data), rounded: its
# grid search costs seconds per config.
CALIBRATED = {("D4", 4, 2): 0.2016, ("E8", 4, 2): 0.2297, ("D4", 3, 2): 0.3721,
              ("A2", 4, 2): 0.2683}


# Eager encodes pad to a power-of-two bucket of at least 1024 blocks; above 4096 blocks the
# encoder compiles its compacting T search, seconds more per config. Codes do not depend on
# batching (test_codec.py::test_batch_shape_independence), so larger sets are encoded in pieces
# of the smallest bucket, the one the other tests here compile.
PIECE = 1024


def _gaussian_codes(key, n, seed=0):
    cfg = hq.HNLQConfig(*key, beta=CALIBRATED[key])
    x = np.random.default_rng(seed).standard_normal((n, cfg.d)).astype(np.float32)
    parts = [hq.encode(x[i : i + PIECE], cfg) for i in range(0, n, PIECE)]
    if len(parts) == 1:
        return parts[0]
    T = jnp.concatenate([p.T for p in parts])
    return hq.Codes(jnp.concatenate([p.index for p in parts]), pack_t(T, cfg), cfg)


@pytest.mark.parametrize("key", list(CALIBRATED), ids=lambda k: "{}q{}M{}".format(*k))
def test_rate_target(key):
    """pack <= M log2 q + H(T)/d + 0.05 bits per value, Gaussian data at the calibrated beta;
    the T stream is within 0.05 bits per block of H(T)."""
    n = 20_000
    codes = _gaussian_codes(key, n)
    cfg = codes.config
    packed = hq.pack(codes)
    H = float(hq.rate_stats(codes).entropy_T)
    assert 0.5 < H < 2  # T does carry information here
    assert packed.bits_per_value() <= cfg.rate + H / cfg.d + 0.05
    assert H <= 8 * packed.tcode.shape[0] / n <= H + 0.05
    np.testing.assert_array_equal(hq.unpack(packed).tfield, codes.tfield)


def test_all_zero_T_costs_nothing_and_empty_codes():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=10.0)
    codes = hq.encode(np.full((50, 4), 0.1, np.float32), cfg)
    assert int(jnp.max(codes.T)) == 0
    packed = hq.pack(codes)
    assert packed.tcode.shape == (0,) and packed.rice.shape == (0,)
    for unpack in (hq.unpack, jax.jit(hq.unpack)):  # jit sees the empty stream unpadded
        back = unpack(packed)
        np.testing.assert_array_equal(back.index, codes.index)
        np.testing.assert_array_equal(back.tfield, codes.tfield)
    empty = hq.encode(np.zeros((0, 4), np.float32), cfg)
    for unpack in (hq.unpack, jax.jit(hq.unpack)):
        out = unpack(hq.pack(empty))
        assert out.index.shape == (0, 2) and out.shape == (0, 4)


def test_unpack_under_jit_and_pack_refuses_jit():
    codes = _gaussian_codes(("D4", 4, 2), 300)
    packed = hq.pack(codes)
    back = jax.jit(hq.unpack)(packed)
    np.testing.assert_array_equal(back.index, codes.index)
    np.testing.assert_array_equal(back.tfield, codes.tfield)
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(hq.pack)(codes)
    # A corrupted stream under jit cannot raise: every block is marked failed (NaN), never
    # decoded to wrong values.
    bad = hq.Packed(packed.labels, packed.tcode[:-1], packed.rice, packed.config,
                    packed.blocks_shape)
    out = jax.jit(hq.unpack)(bad)
    assert bool(jnp.all(out.T == -1)) and bool(jnp.all(jnp.isnan(hq.decode(out))))


def test_unpack_bad_input():
    codes = _gaussian_codes(("D4", 3, 2), 200)
    p = hq.pack(codes)
    cfg = codes.config

    def with_(**kw):
        a = dict(labels=p.labels, tcode=p.tcode, rice=p.rice)
        a.update(kw)
        return hq.Packed(a["labels"], a["tcode"], a["rice"], cfg, p.blocks_shape,
                         version=kw.get("version", p.version))

    with pytest.raises(ValueError, match="expected labels uint8"):
        hq.unpack(with_(labels=p.labels[:-1]))
    with pytest.raises(ValueError, match="corrupted T stream"):
        hq.unpack(with_(tcode=p.tcode[:-1]))
    flipped = p.tcode.at[0].set(p.tcode[0] ^ 1)
    with pytest.raises(ValueError, match="corrupted T stream"):
        hq.unpack(with_(tcode=flipped))
    with pytest.raises(ValueError, match="corrupted label bitstream"):
        hq.unpack(with_(labels=jnp.full_like(p.labels, 255)))
    with pytest.raises(ValueError, match="T planes for max_T = 14"):  # T could never wrap
        hq.unpack(with_(rice=jnp.zeros(16, jnp.uint8)))
    with pytest.raises(ValueError, match="Rice parameter 31"):
        hq.unpack(with_(rice=p.rice.at[0].set(31)))
    with pytest.raises(ValueError, match="format version 0"):
        hq.unpack(with_(version=0))
    with pytest.raises(TypeError, match="expected hnlq_jax.Packed"):
        hq.unpack((p.labels, p.tcode))
    with pytest.raises(ValueError, match="labels must be in 0..q-1"):
        hq.Codes.from_labels(np.full((5, 2, 4), 3), np.zeros(5, int), cfg)


def test_bytes_form_records_version_and_config():
    codes = _gaussian_codes(("E8", 4, 2), 100)
    p = hq.pack(codes)
    buf = p.to_bytes()
    back = hq.Packed.from_bytes(buf, codes.config)
    assert back.config == codes.config and back.blocks_shape == (100,)
    np.testing.assert_array_equal(hq.decode(hq.unpack(back)), hq.decode(codes))
    other = codes.config.replace(q=3)
    with pytest.raises(ValueError, match=r"made with HNLQConfig\(lattice='E8', q=4.*not "
                                         r"HNLQConfig\(lattice='E8', q=3"):
        hq.Packed.from_bytes(buf, other)
    with pytest.raises(ValueError, match="CRC-32"):
        hq.Packed.from_bytes(buf[:-5] + buf[-4:])
    with pytest.raises(ValueError, match="CRC-32"):
        hq.Packed.from_bytes(buf[:40] + bytes([buf[40] ^ 4]) + buf[41:])
    with pytest.raises(ValueError, match="not HNLQ packed data"):
        hq.Packed.from_bytes(b"PK\x03\x04" + buf[4:])
    # Row codes: the config encode_rows was given matches, its beta lives in the scales.
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    rows = hq.pack(hq.encode_rows(np.random.default_rng(0).standard_normal((3, 16)), cfg))
    assert hq.Packed.from_bytes(rows.to_bytes(), cfg).config == cfg.replace(beta=1.0)
    with pytest.raises(ValueError, match="beta aside"):
        hq.Packed.from_bytes(rows.to_bytes(), cfg.replace(q=3))
    v2 = hq.Packed(p.labels, p.tcode, p.rice, p.config, p.blocks_shape, version=2).to_bytes()
    with pytest.raises(ValueError, match="format version 2, this hnlq_jax reads version 1"):
        hq.Packed.from_bytes(v2)

"""Bit-packing: exact round trips, sizes, and corrupt or mismatched input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hnlq_jax as hq
from hnlq_jax.packing import _chunks


@pytest.mark.parametrize(
    "lat,q,M,bits",
    [("D4", 4, 2, 16), ("E8", 4, 2, 32), ("Z2", 2, 1, 2), ("D4", 8, 3, 36), ("E8", 2, 3, 24),
     ("D4", 3, 2, 13), ("E8", 3, 2, 26), ("A2", 5, 2, 10), ("Z2", 256, 2, 32)],
)
def test_bits_per_block(lat, q, M, bits):
    cfg = hq.HNLQConfig(lat, q, M)
    assert hq.bits_per_block(cfg) == bits
    # Never below the entropy bound; power-of-two q meets it exactly.
    ideal = M * cfg.d * math.log2(q)
    assert ideal <= bits < ideal + len(_chunks(q, M * cfg.d))
    if q & (q - 1) == 0:
        assert bits == ideal


@given(
    q=st.sampled_from([2, 3, 4, 5, 7, 8, 16, 100, 256]),
    lat=st.sampled_from(["Z2", "A2", "D4", "E8"]),
    M=st.integers(1, 3),
    shape=st.sampled_from([(), (1,), (3,), (2, 5), (4, 1, 3)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_roundtrip(q, lat, M, shape, seed):
    if q**M > 2**20:
        M = 1
    cfg = hq.HNLQConfig(lat, q, M)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, q, size=shape + (M, cfg.d)).astype(np.uint8)
    T = rng.integers(-1, 5, size=shape).astype(np.int8)
    packed = hq.pack(hq.Codes(jnp.asarray(labels), jnp.asarray(T)), cfg)
    n = int(np.prod(shape))
    assert packed.data.dtype == jnp.uint8
    assert packed.data.shape == (-(-n * hq.bits_per_block(cfg) // 8),)
    out = hq.unpack(packed, cfg)
    np.testing.assert_array_equal(out.labels, labels)
    np.testing.assert_array_equal(out.T, T)
    assert out.labels.dtype == jnp.uint8 and out.T.dtype == jnp.int8


def test_pack_known_bits():
    """Little-endian digits: labels (1, 2, 3, 0) at q = 4 pack to 0b00111001 = 57."""
    cfg = hq.HNLQConfig("D4", 4, 1)
    packed = hq.pack(hq.Codes(jnp.asarray([[[1, 2, 3, 0]]], jnp.uint8), jnp.zeros(1, jnp.int8)),
                     cfg)
    np.testing.assert_array_equal(packed.data, [57])


def test_pack_real_codes_under_jit():
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    x = np.random.default_rng(0).normal(size=(100, 4)).astype(np.float32)
    codes = hq.encode(x, cfg)
    packed = jax.jit(hq.pack, static_argnums=1)(codes, cfg)
    assert packed.data.nbytes == 100 * 2  # 16 bits per block
    back = jax.jit(hq.unpack, static_argnums=1)(packed, cfg)
    np.testing.assert_array_equal(hq.decode(back, cfg), hq.decode(codes, cfg))


def test_unpack_bad_input():
    cfg = hq.HNLQConfig("D4", 3, 2)
    codes = hq.Codes(jnp.zeros((5, 2, 4), jnp.uint8), jnp.zeros(5, jnp.int8))
    packed = hq.pack(codes, cfg)
    with pytest.raises(ValueError, match="expected data uint8"):
        hq.unpack(hq.Packed(packed.data[:-1], packed.T), cfg)
    with pytest.raises(ValueError, match="expected data uint8"):
        hq.unpack(packed, hq.HNLQConfig("D4", 4, 2))
    with pytest.raises(ValueError, match="corrupt"):
        hq.unpack(hq.Packed(jnp.full_like(packed.data, 255), packed.T), cfg)
    with pytest.raises(ValueError, match="labels must be in 0..q-1"):
        hq.pack(hq.Codes(jnp.full((5, 2, 4), 3, jnp.uint8), codes.T), cfg)

"""The Mosaic GPU kernels (GPU interpret mode on a CPU, natively on a GPU) against the decoded
weights and the Triton kernel; their CUDA lowering; refusals; the tuning table's dispatch.

They need jax >= 0.11 (``plgpu.kernel`` with ``inline_mgpu`` and GPU interpret mode): CI's
second stage (the newest jax) runs this file; on jax 0.10 it is skipped as a whole.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hnlq_jax as hq
from hnlq_jax import kernels as K
from hnlq_jax.kernels import gpu_tiles
from hnlq_jax.kernels import mosaic_gpu as mg

pytestmark = pytest.mark.skipif(not mg.available(), reason=mg.unsupported(
    hq.HNLQConfig("D4", 4, 2)) or "")

D4 = hq.HNLQConfig("D4", 4, 2, beta=0.35)
D4_DITHER = hq.HNLQConfig("D4", 4, 2, beta=0.3, dither=(0.1, -0.2, 0.05, 0.3))
WIDE_T = hq.HNLQConfig("D4", 4, 2, beta=0.35, max_T=20)  # 8-bit T: a uint16 view a word
Q3 = hq.HNLQConfig("D4", 3, 2, beta=0.35)  # 81 codebook entries: a byte holds corrupt indices
SMALL = dict(block_w=16, stages=2)  # the smallest tiles: a [64 n, 128 k] weight
NATIVE = jax.default_backend() == "gpu"


def _weights(cfg, n, k, seed=1):
    W = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return hq.encode_rows(W, cfg)


def _x(b, k, seed=2, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((b, k)), dtype)


def _decoded_product(x, codes):
    W = hq.decode(codes, implementation="xla", dtype=jnp.float32)  # [n, k]: row codes
    return np.asarray(jnp.dot(x.astype(jnp.float32), W.T,
                              precision="highest"))


@pytest.mark.parametrize("cfg,batch,splits,programs", [
    (D4, 1, 1, None), (D4, 3, 2, 3), (D4_DITHER, 8, 2, None), (WIDE_T, 2, 4, 1),
    (Q3, 1, 2, None)], ids=["D4-b1", "D4-b3-split-3programs", "dither-b8",
                            "T8bit-b2-split4-1program", "q3-b1"])
def test_gemv_matches_decoded_weights_and_triton(cfg, batch, splits, programs):
    """float32 sums of the exact decoded weights (row scales, the dither, the packed fields'
    bias, 4- and 8-bit T views, split-K, padded batch rows, persistent programs taking several
    work items: 2 row tiles x splits), as the Triton kernel's."""
    codes = _weights(cfg, 128, 512)
    x = _x(batch, 512)
    y = np.asarray(mg.gemv(x, codes, jnp.float32, splits=splits, programs=programs, **SMALL))
    ref = _decoded_product(x, codes)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    tri = np.asarray(K.gemv(x, codes, jnp.float32))
    np.testing.assert_allclose(y, tri, rtol=0, atol=2e-6 * np.abs(ref).max())


def test_gemv_failed_block_corrupt_index_and_leading_axes():
    """A failed block (T = -1) and an index past q^d (D4 q=3: 81 entries in a byte) give NaN
    rows and leave the others; x's leading axes are kept; the output dtype is the one asked
    for."""
    for cfg in (D4, Q3):
        codes = _weights(cfg, 64, 256)
        T = codes.T.astype(jnp.int32).at[5, 9].set(-1)
        bad = hq.Codes.from_labels(codes.labels, T, cfg, scale=codes.scale, n=codes.n)
        nan_rows = [5]
        if cfg is Q3:
            bad = hq.Codes(bad.index.at[40, 3, 1].set(200), bad.tfield, cfg, scale=bad.scale,
                           n=bad.n)
            nan_rows.append(40)
        x = _x(4, 256).reshape(2, 2, 256)
        # under jit the codes' ranges are not checked (as in a model): the kernel sees them
        y = jax.jit(lambda x, c: mg.gemv(x, c, jnp.bfloat16, **SMALL))(x, bad)
        assert y.shape == (2, 2, 64) and y.dtype == jnp.bfloat16
        y = np.asarray(y, np.float32)
        assert np.isnan(y[..., nan_rows]).all() and np.isfinite(np.delete(y, nan_rows, -1)).all()


def test_gemv_refusals():
    codes = _weights(D4, 64, 256)
    x = _x(1, 256)
    e8 = hq.HNLQConfig("E8", 4, 2)
    assert "packed codebook" in mg.unsupported(e8)
    with pytest.raises(ValueError, match="no kernel for .*E8"):
        mg.gemv(jnp.ones((1, 64)), _weights(e8, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match="not tiled exactly"):
        mg.gemv(x, codes, jnp.float32, block_w=48)
    with pytest.raises(ValueError, match="not tiled exactly"):
        mg.gemv(_x(1, 252), _weights(D4, 64, 252), jnp.float32, **SMALL)
    with pytest.raises(ValueError, match="block_n must be a multiple of 64"):
        mg.gemv(x, codes, jnp.float32, block_n=32)
    with pytest.raises(ValueError, match="at most 8 rows"):
        mg.gemv(_x(9, 256), codes, jnp.float32)
    with pytest.raises(ValueError, match="stages must be a positive int"):
        mg.gemv(x, codes, jnp.float32, stages=0)
    with pytest.raises(ValueError, match="programs must be a positive int"):
        mg.gemv(x, codes, jnp.float32, programs=0)
    with pytest.raises(ValueError, match="shared memory"):
        mg.gemv(x, codes, jnp.float32, block_n=128, block_w=64, stages=8)


def test_launch_params_split_k():
    """splits grow until about ``waves`` programs a multiprocessor (132 without a GPU), never
    past a row's steps; an entry replaces the table's."""
    t = mg.launch_params(D4, 8192, 2048, 1, entry=dict(block_n=64, block_w=32, waves=4,
                                                        resident=3))
    assert t["splits"] == -(-4 * 132 // 128) and "waves" not in t
    assert t["programs"] == 3 * 132 and "resident" not in t
    t = mg.launch_params(D4, 64, 64, 1, entry=dict(block_w=16))
    assert t["splits"] == 2  # 32 words: two steps of 16


def test_gemv_more_splits_than_steps():
    """splits past a row's steps give a program a step (not one program for all)."""
    codes = _weights(D4, 64, 256)  # 32 words: 2 steps of 16
    x = _x(1, 256)
    calls = []
    real = mg._gemv_call
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mg, "_gemv_call", lambda *a: calls.append(a[6]) or real(*a))
        y = mg.gemv(x, codes, jnp.float32, splits=8, **SMALL)
    assert calls == [1]  # steps a program
    ref = _decoded_product(x, codes)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@contextlib.contextmanager
def _table_says_mosaic(batch_class="batch<=8"):
    """The tuning table's gemv entry for D4 on this GPU generation names Mosaic GPU, and its
    Mosaic entry the small tiles."""
    generation, _ = K.pallas.gpu_target()
    tiles = {generation: {"gemv": {"D4": {batch_class: {"backend": "mosaic_gpu"}}},
                          "gemv_mosaic": {"D4": {batch_class: dict(SMALL, waves=1)}}}}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gpu_tiles, "TILES", tiles)
        yield


def test_matmul_takes_mosaic_where_the_table_says():
    codes = _weights(D4, 64, 256)
    x = _x(2, 256, dtype=jnp.float32)
    calls, real = [], mg.gemv

    def spy(x, *args, **kwargs):
        calls.append(x.shape)
        return real(x, *args, **kwargs)

    # The table is read while tracing: each call traces anew (an eager call's compiled
    # program, cached per shape bucket, keeps the kernel of its first trace)
    fresh = lambda: jax.jit(lambda x, c: hq.matmul(x, c, implementation="pallas"))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mg, "gemv", spy)
        fresh()(x, codes)  # the table as committed: Triton
        assert calls == []
        with _table_says_mosaic():
            assert mg.chosen(codes, 2) and not mg.chosen(_weights(D4, 64, 252), 2)
            y = fresh()(x, codes)
    assert calls == [(2, 256)]
    np.testing.assert_allclose(np.asarray(y), _decoded_product(x, codes), rtol=0,
                               atol=2e-6 * np.abs(_decoded_product(x, codes)).max())


@pytest.mark.skipif(NATIVE, reason="natively compiled by the tests above")
@pytest.mark.parametrize("cfg,batch", [(D4, 1), (D4, 8), (WIDE_T, 2)],
                         ids=["D4-b1", "D4-b8", "T8bit-b2"])
def test_lowers_for_cuda(cfg, batch):
    """The kernel lowers for CUDA on a CPU machine: Pallas' Mosaic GPU lowering, layout
    inference and the inline shared-memory gathers (not run: no GPU)."""
    codes = _weights(cfg, 128, 512)
    f = lambda x, c: mg.gemv(x, c, jnp.float32, interpret=False, splits=2, **SMALL)
    text = jax.jit(f).trace(_x(batch, 512), codes).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text

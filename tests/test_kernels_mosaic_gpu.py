"""The Mosaic GPU kernels (GPU interpret mode on a CPU, natively on a GPU) against the decoded
weights and the Triton kernels; their CUDA lowering; refusals; the tuning table's dispatch.

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
# four index bytes a block: one block a word, its dither plane paired with zeros
ONE_BLOCK = hq.HNLQConfig("D4", 2, 4, beta=0.3, max_T=20, dither=(0.1, -0.2, 0.05, 0.3))
SMALL = dict(block_n=64, block_w=16, stages=2)  # the smallest tiles: a [64 n, 128 k] weight
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


# decode_matmul's products are of float16 operands (integer P coordinates times 2^(alpha T),
# x's planes scaled into float16's range): about 2^-11 relative error a term (measured about
# 1e-4 of max |y|); Triton's decode_matmul rounds its operands to bfloat16 (about 2e-3)
F16_ATOL = 5e-4
BF16_ATOL = 4e-3
BIG_T = hq.HNLQConfig("D4", 4, 2, beta=0.35, alpha=1.0, max_T=14)  # 2^(alpha T) up to 2^14


# The interpreter's wgmma is a NumPy matmul, which warns where inf meets a zero weight (the
# device gives the NaN silently)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kernel", ["gemv", "decode_matmul"])
def test_nonfinite_x_rows(kernel):
    """A row of x with an inf or a NaN gives a row of y with no finite value, as in the Triton
    kernels (x folded before the sum: inf meets -inf); the other rows are the product."""
    codes = _weights(D4, 64, 128)
    dtype = jnp.float32 if kernel == "gemv" else jnp.float16
    x = np.asarray(_x(4, 128, dtype=dtype)).copy()
    ref = _decoded_product(jnp.asarray(x), codes)
    x[1, 5], x[3, 40] = np.inf, np.nan
    y = np.asarray(getattr(mg, kernel)(jnp.asarray(x), codes, jnp.float32, **SMALL))
    assert not np.isfinite(y[[1, 3]]).any()
    atol = 2e-6 if kernel == "gemv" else F16_ATOL
    np.testing.assert_allclose(y[[0, 2]], ref[[0, 2]], rtol=0, atol=atol * np.abs(ref).max())


@pytest.mark.parametrize("cfg,batch,splits,programs,a_registers,block_w", [
    (D4, 16, 1, None, None, 16), (D4, 5, 2, 3, False, 16), (D4_DITHER, 40, 2, None, False, 16),
    (D4_DITHER, 12, 2, 2, None, 16),
    (WIDE_T, 9, 4, 1, None, 16), (Q3, 64, 1, None, True, 64),
    (ONE_BLOCK, 16, 2, None, None, 16)],
    ids=["D4-b16", "D4-b5-split-3programs", "dither-b40", "dither-b12-split-2programs",
         "T8bit-b9-split4-1program", "q3-b64-wide-step", "one-block-a-word-dither"])
def test_decode_matmul_matches_decoded_weights_and_triton(cfg, batch, splits, programs,
                                                          a_registers, block_w):
    """The tensor-core kernel: the product of the decoded weights in float16 precision (row
    scales, the dither's planes, the packed fields' bias, 4- and 8-bit T views, split-K, x's
    rows padded to 16, 64, persistent programs taking several work items, a step of 64
    words), as Triton's decode_matmul in bfloat16 up to its rounding; a_registers is moot in
    interpret mode (shared memory)."""
    codes = _weights(cfg, 128, 512)
    x = _x(batch, 512)
    # (64 rows with A in registers: 64-word steps, whose x tiles leave room for one stage)
    stages = 1 if block_w == 64 else SMALL["stages"]
    y = np.asarray(mg.decode_matmul(x, codes, jnp.float32, splits=splits, programs=programs,
                                    a_registers=a_registers,
                                    **dict(SMALL, block_w=block_w, stages=stages)))
    ref = _decoded_product(x, codes)
    np.testing.assert_allclose(y, ref, rtol=0, atol=F16_ATOL * np.abs(ref).max())
    tri = np.asarray(K.decode_matmul(x, codes, jnp.bfloat16, jnp.float32))
    np.testing.assert_allclose(y, tri, rtol=0, atol=BF16_ATOL * np.abs(ref).max())


def test_decode_matmul_float16_x():
    """float16 activations take the same float16 operands (leading axes kept, the output
    dtype the one asked for)."""
    codes = _weights(D4, 128, 512)
    x = _x(12, 512, dtype=jnp.float16).reshape(3, 4, 512)
    y = mg.decode_matmul(x, codes, jnp.float16, **SMALL)
    assert y.shape == (3, 4, 128) and y.dtype == jnp.float16
    ref = _decoded_product(x.reshape(12, 512), codes).reshape(3, 4, 128)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2**-10,
                               atol=F16_ATOL * np.abs(ref).max())


def test_decode_matmul_rows_of_any_magnitude():
    """x's planes are float16: each row of x is scaled by its own power of two, so rows near
    bfloat16's largest and smallest values neither overflow nor flush to zero and keep
    float16's precision; a NaN in x is its row's alone."""
    codes = _weights(D4, 64, 256)
    x = _x(4, 256) * jnp.asarray([2.0**100, 1.0, 2.0**-100, 1.0], jnp.bfloat16)[:, None]
    x = x.at[3, 7].set(jnp.nan)
    y = np.asarray(mg.decode_matmul(x, codes, jnp.float32, **SMALL))
    ref = _decoded_product(x, codes)
    for r in range(3):
        np.testing.assert_allclose(y[r], ref[r], rtol=0, atol=F16_ATOL * np.abs(ref[r]).max())
    assert np.isnan(y[3]).all()


@pytest.mark.parametrize("cfg", [D4, hq.HNLQConfig("A2", 8, 2, beta=0.7)], ids=["D4", "A2"])
def test_decode_matmul_planes_fill_float16(cfg):
    """x's planes, each row scaled by its own power of two: the row's largest |plane| lands in
    [2^14, 2^15) (float16's top binade below 65504), the exponents undo the scaling exactly,
    and the planes are beta C^T x rounded to float16 (A2: C is not the identity)."""
    nb = 128 // cfg.d
    x = _x(5, 128, dtype=jnp.float32) * jnp.asarray([1.0, 2.0**-30, 2.0**40, 3.0, 0.0])[:, None]
    xk, e = mg._mma_planes(x.astype(jnp.bfloat16), cfg, nb, 16, 16)
    big = np.max(np.abs(np.asarray(xk, np.float32)), axis=0)[:4]
    assert np.all((big >= 2**14) & (big < 2**15)), big
    assert np.all(np.asarray(xk, np.float32)[:, 4:] == 0)  # the zero row and the padding
    g = K.pallas.word_view(cfg)[0]
    xt = hq.kernels.pallas.gemv_activations(x.astype(jnp.bfloat16), cfg, nb, parts=g)
    want = np.max(np.abs(np.asarray(xt)[:, :cfg.d, :4, :]), axis=(0, 1, 3))
    np.testing.assert_allclose(big * 2.0 ** np.asarray(e)[:4], want, rtol=2**-11)


def test_decode_matmul_large_overload_steps():
    """2^(alpha T) past float16's range over the largest P (alpha 1, T up to 14): A is
    P 2^(alpha T - 6) and the product is scaled back (with no such halving the blocks at
    T = 14 would be inf); a config whose steps no halving fits (2^(max_T / 3) = 2^42) is
    refused with the reason, and gemv still takes it."""
    assert K.pallas.f16_exponent(BIG_T) == 6 and K.pallas.f16_exponent(D4) == 0
    codes = _weights(BIG_T, 64, 256)
    T = codes.T.astype(jnp.int32).at[::3].set(BIG_T.max_T)
    codes = hq.Codes.from_labels(codes.labels, T, BIG_T, scale=codes.scale, n=codes.n)
    x = _x(16, 256)
    y = np.asarray(mg.decode_matmul(x, codes, jnp.float32, **SMALL))
    ref = _decoded_product(x, codes)
    np.testing.assert_allclose(y, ref, rtol=0, atol=F16_ATOL * np.abs(ref).max())
    wide = hq.HNLQConfig("D4", 4, 2, beta=0.35, max_T=127)
    assert "float16 range" in mg.unsupported(wide, "decode_matmul")
    assert mg.unsupported(wide) is None
    # the edge: 2^22 (14 halvings, T = 0's scale 2^-14 still normal) is taken, 2^23 is not
    assert mg.unsupported(BIG_T.replace(max_T=22), "decode_matmul") is None
    assert "float16 range" in mg.unsupported(BIG_T.replace(max_T=23), "decode_matmul")
    with pytest.raises(ValueError, match="no kernel for .*float16 range"):
        mg.decode_matmul(x, _weights(wide, 64, 256), jnp.float32, **SMALL)


def _register_positions(layout, shape):
    """``{(thread, register index, element): (row, column)}`` of an array of ``shape`` in the
    Mosaic GPU ``layout`` (a TiledLayout), as its ``thread_idxs`` computes them in MLIR."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    contig = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    strides = layout.tiling.tile_strides(tuple(contig))
    tiled = layout.tiled_tiling_shape

    def split(i, dims):  # as TiledLayout._delinearize_index
        sizes = [d.times if isinstance(d, fa.Replicated) else tiled[d] for d in dims]
        full = [0] * len(tiled)
        for d, size, stride in zip(dims, sizes, [int(np.prod(sizes[k + 1:]))
                                                 for k in range(len(sizes))]):
            if not isinstance(d, fa.Replicated):
                full[d] = (i // stride) % size
        return full

    out = {}
    for thread in range(128):
        w, lane = split(thread // 32 % 4, layout.warp_dims), split(thread % 32,
                                                                    layout.lane_dims)
        base = sum((a + b) * s for a, b, s in zip(w, lane, strides[-len(tiled):]))
        for reg in np.ndindex(layout.registers_shape(shape)):
            row, col = np.unravel_index(base + sum(i * s for i, s in zip(reg, strides)), shape)
            for e in range(layout.vector_length):
                out[thread, reg, e] = (int(row), int(col) + e)
    return out


@pytest.mark.parametrize("pairs", [4, 5], ids=["D4", "D4-dither"])
def test_a_operand_registers_hold_the_k_order(pairs):
    """What interpret mode cannot run: the A operand built in registers (pair u of element e
    of an index-word register goes to register ``_a_register(...)``) puts at each of its
    (row, K) what x's planes hold at K (``_k_major``): checked for every thread against the
    positions Mosaic GPU's WGMMA layout gives both arrays."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    rows, words = 64, 16
    layout = fa.WGMMA_LAYOUT
    src = _register_positions(layout, (rows, words))
    dst = _register_positions(layout, (rows, 2 * pairs * words))
    order = mg._k_major(np.arange(2 * pairs * words).reshape(pairs, 2, 1, words))[0]
    seen = set()
    for (thread, reg, e), (row, word) in src.items():
        for u in range(pairs):
            for e2 in range(2):
                at = (thread, mg._a_register(reg, e, u, pairs), e2)
                assert dst[at][0] == row
                assert order[dst[at][1]] == (2 * u + e2) * words + word
                seen.add(at)
    assert seen == set(dst)  # every register of A is built, once


@pytest.mark.parametrize("kernel", ["gemv", "decode_matmul"])
def test_failed_block_corrupt_index_and_leading_axes(kernel):
    """A failed block (T = -1) and an index past q^d (D4 q=3: 81 entries in a byte) give NaN
    rows and leave the others; x's leading axes are kept; the output dtype is the one asked
    for."""
    fn = getattr(mg, kernel)
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
        y = jax.jit(lambda x, c: fn(x, c, jnp.bfloat16, **SMALL))(x, bad)
        assert y.shape == (2, 2, 64) and y.dtype == jnp.bfloat16
        y = np.asarray(y, np.float32)
        assert np.isnan(y[..., nan_rows]).all() and np.isfinite(np.delete(y, nan_rows, -1)).all()


def test_gemv_refusals():
    codes = _weights(D4, 64, 256)
    x = _x(1, 256)
    e8 = hq.HNLQConfig("E8", 4, 2)
    assert "packed codebook" in mg.unsupported(e8)
    # a refusal names its cause: 256 entries hold Z2 q = 16's codebook, whose byte fields
    # carry from M = 2 on (they blamed the entry count)
    assert mg.unsupported(hq.HNLQConfig("Z2", 16, 1)) is None
    assert "would carry: (max r - min r) sum_m q^m = 272 > 255" in mg.unsupported(
        hq.HNLQConfig("Z2", 16, 2))
    assert "q^d = 4096" in mg.unsupported(hq.HNLQConfig("D4", 8, 1))
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


def test_decode_matmul_refusals():
    codes = _weights(D4, 64, 256)
    x = _x(16, 256)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        mg.decode_matmul(x.astype(jnp.float32), codes, jnp.float32)
    with pytest.raises(ValueError, match="at most 64 rows"):
        mg.decode_matmul(_x(65, 256), codes, jnp.float32)
    with pytest.raises(ValueError, match="a_registers must be a bool"):
        mg.decode_matmul(x, codes, jnp.float32, a_registers=1)
    with pytest.raises(ValueError, match="block_w of 16"):
        mg.decode_matmul(x, codes, jnp.float32, block_w=24)
    # the dither's 10 planes x 16 words: K = 160, not whole 128-byte swizzle tiles of 64 rows
    with pytest.raises(ValueError, match=r"10 planes x block_w must be a multiple of x's rows "
                                         r".* \(64\)"):
        mg.decode_matmul(_x(33, 256), _weights(D4_DITHER, 64, 256), jnp.float32,
                         block_w=16, a_registers=True)
    # 64 rows of x: 8 planes x 32 words x 64 rows x 2 bytes = 32 KiB a stage
    with pytest.raises(ValueError, match="shared memory"):
        mg.decode_matmul(_x(64, 256), codes, jnp.float32, block_n=128, block_w=32, stages=5,
                         a_registers=False)
    # the planes through shared memory count: 8 x 128 x 64 x 2 bytes more
    with pytest.raises(ValueError, match="shared memory"):
        mg.decode_matmul(x, codes, jnp.float32, block_n=128, block_w=64, stages=2,
                         a_registers=False)
    with pytest.raises(ValueError, match="no kernel for .*E8"):
        mg.decode_matmul(_x(16, 64), _weights(hq.HNLQConfig("E8", 4, 2), 64, 64), jnp.float32)


def test_launch_params_split_k():
    """splits grow until about ``waves`` programs a multiprocessor (132 without a GPU), never
    past a row's steps; an entry replaces the table's."""
    t = mg.launch_params("gemv", D4, 8192, 2048, 1, entry=dict(block_n=64, block_w=32, waves=4,
                                                        resident=3))
    assert t["splits"] == -(-4 * 132 // 128) and "waves" not in t
    # two programs' shared memory (tables 66 KiB, 4 stages of 11.25 KiB) fit a multiprocessor
    assert t["programs"] == 2 * 132 and "resident" not in t
    t = mg.launch_params("gemv", D4, 8192, 2048, 1, entry=dict(block_w=16, stages=1,
                                                              resident=3))
    assert t["programs"] == 3 * 132
    t = mg.launch_params("gemv", D4, 64, 64, 1, entry=dict(block_w=16))
    assert t["splits"] == 2  # 32 words: two steps of 16
    t = mg.launch_params("decode_matmul", D4, 8192, 2048, 16)
    assert t["a_registers"] is True and t["block_n"] == 64 and t["block_w"] == 32
    assert t["splits"] == -(-1 * 132 // 128)  # the defaults: waves 1
    assert t["stages"] == 2 and t["programs"] == 2 * 132  # two programs of 2 stages each
    # 64 rows of x: one program fits a multiprocessor, and takes the stages of both, as far as
    # its shared memory holds (4 stages of 8 planes x 32 words x 64 rows would pass it)
    t = mg.launch_params("decode_matmul", D4, 8192, 2048, 64)
    assert t["programs"] == 132 and t["stages"] == 3
    assert mg._launch_error("decode_matmul", t, D4, 64) is None
    t = mg.launch_params("decode_matmul", D4, 8192, 2048, 32)
    assert t["programs"] == 132 and t["stages"] == 4
    # stages an entry names are kept (a sweep's candidates stay apart), and the growth stops
    # at the pipeline's steps (128 x 1024: 4 word tiles a row split 4 ways, a step a program)
    t = mg.launch_params("decode_matmul", D4, 8192, 2048, 64, entry=dict(stages=2))
    assert t["programs"] == 132 and t["stages"] == 2
    t = mg.launch_params("decode_matmul", D4, 128, 256, 32)
    assert t["splits"] == 4 and t["programs"] == 132 and t["stages"] == 2
    assert mg.launch_params("gemv", D4, 8192, 2048, 8)["stages"] == 4  # the gemv default's
    # tiles halved until they cover the weight: 48 words a row (384 weights), 192 rows
    t = mg.launch_params("decode_matmul", D4, 192, 96, 16,
                         entry=dict(block_n=128, block_w=32))
    assert (t["block_n"], t["block_w"]) == (64, 16)
    assert mg.supported_shape(D4, 192, 96, t)
    t = mg.launch_params("gemv", D4, 8192, 2048, 1, entry=dict(block_n=128, block_w=64))
    assert (t["block_n"], t["block_w"]) == (128, 64)  # (tiles that fit stay)
    with pytest.raises(ValueError, match="op must be one of"):
        mg.launch_params("matmul", D4, 64, 64, 1)


def test_programs_fit_shared_memory_with_the_callers_tiles():
    """A caller's larger tiles lower the persistent programs to what a multiprocessor's
    shared memory holds (the default's two would need 2 x 156 KiB at 64-word steps), and the
    table's stages to what a program's holds; an explicit ``programs`` or ``stages`` is kept.
    (A one-multiprocessor GPU: programs = resident.)"""
    codes = _weights(D4, 64, 1024)  # 128 words: two 64-word steps, two work items
    calls, real = [], mg._gemv_call
    with pytest.MonkeyPatch.context() as m:
        m.setattr(K.pallas, "gpu_target", lambda: ("sm90", 1))
        m.setattr(mg, "_gemv_call", lambda *a: calls.append(a[8]) or real(*a))
        assert mg.launch_params("gemv", D4, 64, 256, 1)["programs"] == 2  # the default's
        # (splits=2: two work items for two programs)
        y = mg.gemv(_x(1, 1024), codes, jnp.float32, block_w=64, stages=4, splits=2)
        mg.gemv(_x(1, 1024), codes, jnp.float32, block_w=64, stages=4, splits=2, programs=2)
    assert calls == [1, 2]
    # the table's stages drop for the caller's tiles too (64 rows of x, 64-word steps: 4
    # stages of 64 KiB would not fit), an explicit one is kept and refused
    x64 = _x(64, 1024)
    y64 = mg.decode_matmul(x64, codes, jnp.float32, block_w=64, a_registers=False)
    ref64 = _decoded_product(x64, codes)
    np.testing.assert_allclose(np.asarray(y64), ref64, rtol=0,
                               atol=F16_ATOL * np.abs(ref64).max())
    with pytest.raises(ValueError, match="shared memory"):
        mg.decode_matmul(x64, codes, jnp.float32, block_w=64, stages=4, a_registers=False)
    ref = _decoded_product(_x(1, 1024), codes)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


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
def _table_says(op, batch_class, backend, kernel):
    """The tuning table's ``op`` entry for D4 on this GPU generation names ``backend``, and
    the small tiles are ``kernel``'s (this module's) launch parameters."""
    generation, _ = K.pallas.gpu_target()
    tiles = {generation: {op: {"D4": {batch_class: {"backend": backend}}},
                          kernel + "_mosaic": {"D4": {batch_class: dict(SMALL, waves=1)}}}}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gpu_tiles, "TILES", tiles)
        yield


@pytest.mark.parametrize("op,backend,kernel,batch", [
    ("gemv", "mosaic_gpu", "gemv", 2), ("gemv", "mosaic_gpu_mma", "decode_matmul", 8),
    ("decode_matmul", "mosaic_gpu", "decode_matmul", 16)],
    ids=["gemv", "gemv-rows-on-tensor-cores", "decode_matmul"])
def test_matmul_takes_mosaic_where_the_table_says(op, backend, kernel, batch):
    """hq.matmul takes the Mosaic GPU kernel the table's entry names (bfloat16 x), and
    Triton's where the committed table is, or the codes or x do not suit it."""
    codes = _weights(D4, 64, 256)
    x = _x(batch, 256)
    calls, real = [], getattr(mg, kernel)

    def spy(x, *args, **kwargs):
        calls.append(x.shape)
        return real(x, *args, **kwargs)

    # The table is read while tracing: each call traces anew (an eager call's compiled
    # program, cached per shape bucket, keeps the kernel of its first trace)
    fresh = lambda: jax.jit(lambda x, c: hq.matmul(x, c, implementation="pallas"))
    cls = f"batch<={batch}"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mg, kernel, spy)
        fresh()(x, codes)  # the table as committed: Triton
        assert calls == []
        with _table_says(op, cls, backend, kernel):
            assert mg.chosen(codes, batch, x.dtype) == kernel
            assert mg.chosen(_weights(D4, 64, 252), batch, x.dtype) is None  # not tiled exactly
            # the entry is D4's, whatever q and M: three index bytes a block have no word view
            m3 = _weights(hq.HNLQConfig("D4", 4, 3, beta=0.35), 64, 256)
            assert mg.chosen(m3, batch, x.dtype) is None
            y = fresh()(x, codes)
            # float32 x: gemv takes it; the tensor-core kernel's are 16-bit x only
            assert mg.chosen(codes, batch, jnp.float32) == (None if kernel == "decode_matmul"
                                                            else kernel)
            assert mg.chosen(codes, batch, jnp.float16) == kernel
    assert calls == [(batch, 256)]
    ref = _decoded_product(x, codes)
    tol = (F16_ATOL if kernel == "decode_matmul" else 2e-6) * np.abs(ref).max()
    # the output is bfloat16, as x
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2**-8, atol=tol)


@pytest.mark.skipif(NATIVE, reason="natively compiled by the tests above")
@pytest.mark.parametrize("kernel,cfg,batch,extra", [
    ("gemv", D4, 1, {}), ("gemv", D4, 8, {}), ("gemv", WIDE_T, 2, {}),
    ("decode_matmul", D4, 16, {"a_registers": True}),
    ("decode_matmul", D4, 5, {"a_registers": True}),
    ("decode_matmul", D4, 64, {"a_registers": True, "block_w": 64, "stages": 1}),
    ("decode_matmul", D4_DITHER, 64, {"a_registers": False, "block_n": 128}),
    ("decode_matmul", ONE_BLOCK, 16, {"a_registers": True})],
    ids=["gemv-D4-b1", "gemv-D4-b8", "gemv-T8bit-b2", "mma-D4-b16-registers", "mma-D4-b5",
         "mma-D4-b64-registers-64-words", "mma-dither-b64-smem-128",
         "mma-one-block-a-word-dither-registers"])
def test_lowers_for_cuda(kernel, cfg, batch, extra):
    """The kernels lower for CUDA on a CPU machine: Pallas' Mosaic GPU lowering, layout
    inference, the inline shared-memory gathers and the wgmma, its A operand from registers
    too (which interpret mode cannot run; not run: no GPU)."""
    codes = _weights(cfg, 128, 512)
    fn = getattr(mg, kernel)
    f = lambda x, c: fn(x, c, jnp.float32, interpret=False, splits=2, **{**SMALL, **extra})
    text = jax.jit(f).trace(_x(batch, 512), codes).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @mosaic_gpu" in text

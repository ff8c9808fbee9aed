"""Pallas kernels for the hot loops, each beside its pure-JAX reference (the XLA path).

=================  ===========================================  ====================================
kernel             what one program does                        reference (``"xla"``)
=================  ===========================================  ====================================
``encode``         a tile of blocks: overload loop over T,      :func:`hnlq_jax.encode`
                   all M levels in registers
``decode``         a tile of blocks, all levels fused           :func:`hnlq_jax.decode`
``decode_matmul``  ``bn`` output rows: decodes W tile by tile   decode, then ``x @ W_hat^T``
                   next to the ``dot`` (weight-only codes)
``lut_gemv``       ``bn`` output rows of ``W_hat x`` from x's   :func:`hnlq_jax.lut.matmul_one_sided`
                   one-sided tables (gathers)
``modq_sum``       a tile of blocks: label sum mod q, common T  :func:`hnlq_jax.modq.accumulate`
=================  ===========================================  ====================================

The kernels run the library's own lattice code (:func:`~hnlq_jax.codec.encode_at`,
:func:`~hnlq_jax.codec.level_sum`) on per-column loads, so codes are bit-identical to the
reference by construction and the tie rule holds in the kernels exactly as in XLA. That code is
written in the subset that lowers for Triton: floor-based rounding, no value slicing, no captured
array constants, gathers as ``ref[index]``.

``implementation``: ``"pallas"``, ``"xla"``, or ``None``: the kernel on a GPU, XLA elsewhere
(on a CPU a kernel only runs in interpret mode, which is slower than XLA; see
``experiments/bench_kernels.py``). ``interpret=None`` runs the kernel in interpret mode on a CPU;
``False`` forces the real lowering. ``gpu_backend``: ``"triton"`` (default) or
``"mosaic_gpu"`` where the op allows (:data:`MOSAIC_GPU_OPS`); Mosaic GPU has no gathers and
no vector while loops, which encode, decode, the fused matmul and the LUT GEMV need.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from hnlq_jax import codec, lut, modq
from hnlq_jax.codec import Codes, check_codes, check_x, encode_at, level_sum, unpack_digits
from hnlq_jax.config import HNLQConfig, pow2_table
from hnlq_jax.lattices import sumsq

__all__ = [
    "IMPLEMENTATIONS",
    "GPU_BACKENDS",
    "MOSAIC_GPU_OPS",
    "encode",
    "decode",
    "quantize",
    "decode_matmul",
    "lut_gemv",
    "modq_sum",
    "default_implementation",
    "resolve",
]

IMPLEMENTATIONS = ("pallas", "xla")
GPU_BACKENDS = ("triton", "mosaic_gpu")
MOSAIC_GPU_OPS = ("modq_sum",)
_HIGHEST = jax.lax.Precision.HIGHEST


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def unsupported(config: HNLQConfig) -> str | None:
    """Why no kernel applies to ``config`` (``None`` when one does)."""
    d = config.d
    if d & (d - 1):
        return f"d = {d} is not a power of two (Triton blocks must be)"
    return None


def default_implementation(op: str, config: HNLQConfig, batch: int | None = None) -> str:
    """What ``implementation=None`` runs for ``op`` on the default backend.

    On a GPU, the kernel (when it supports ``config``). Elsewhere Pallas only runs in interpret
    mode (the kernel body as XLA ops in a loop over the grid), slower than the XLA path, with
    one measured exception: ``lut_gemv`` of a single vector, where XLA's batched gathers cost
    more than the kernel's (0.5-0.8x the time, ``experiments/bench_kernels.py``).
    """
    if unsupported(config):
        return "xla"
    if jax.default_backend() == "gpu" or (op == "lut_gemv" and batch == 1):
        return "pallas"
    return "xla"


def resolve(implementation, config: HNLQConfig, fn: str, batch: int | None = None) -> str:
    """``"pallas"`` or ``"xla"`` for an ``implementation=`` argument of op ``fn``.

    ``None`` picks :func:`default_implementation`.

    Raises:
      ValueError: an unknown implementation, or ``"pallas"`` for a config no kernel supports.
    """
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{fn}: implementation must be one of {IMPLEMENTATIONS} or None, got "
                         f"{implementation!r}")
    why = unsupported(config)
    if implementation == "pallas" and why:
        raise ValueError(f"{fn}: no Pallas kernel for {config.lattice}: {why}; use "
                         "implementation='xla'")
    if implementation is None:
        return default_implementation(fn.removeprefix("kernels."), config, batch)
    return implementation


def _interpret(interpret) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _compiler_params(gpu_backend: str, fn: str):
    if gpu_backend == "triton":
        return pltriton.CompilerParams(num_warps=4, num_stages=1)
    if gpu_backend == "mosaic_gpu" and fn in MOSAIC_GPU_OPS:
        return plgpu.CompilerParams()
    if gpu_backend == "mosaic_gpu":
        raise ValueError(f"{fn}: no Mosaic GPU kernel (it needs gathers or vector while loops, "
                         f"which Mosaic GPU lacks); Mosaic GPU kernels: {MOSAIC_GPU_OPS}")
    raise ValueError(f"{fn}: gpu_backend must be one of {GPU_BACKENDS}, got {gpu_backend!r}")


def _rows(n: int, block: int) -> int:
    """Rows per program: a power of two, no larger than needed."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    return min(block, max(16, _pow2_at_least(n)))


def _table(values, size: int):
    """A small table padded to a power-of-two length (Triton block shapes must be)."""
    return jnp.pad(values, (0, size - values.shape[0]))


def _scale(b: list, T, pow_ref, beta_ref, config: HNLQConfig, dtype, interpret: bool,
           first: int = 0) -> list:
    """Decoded Cartesian columns ``(beta (x_hat - z)) 2^(alpha T)`` of label columns ``b[m][j]``.

    NaN where T or a label is out of range (as :func:`hnlq_jax.codec.decode_blocks`). The
    products must round in this order. Triton keeps it; XLA, which runs interpret mode, moves
    constants outward (``(c k) beta -> (c beta) k`` for A2's ``k = sqrt(3)/2``), hence the
    barriers there (Triton has no lowering for them and needs none).
    """
    dtype = jnp.dtype(dtype)
    P = level_sum(b, config, first, use_table=False)
    xhat = config.lat.cart_from_P([c.astype(dtype) for c in P])
    fence = jax.lax.optimization_barrier if interpret else (lambda v: v)
    xhat = fence(xhat)
    valid = (T >= 0) & (T <= config.max_T)
    for bm in b:
        for c in bm:
            valid = valid & (c < config.q)
    s = pow_ref[jnp.clip(T, 0, config.max_T)]
    z = config.dither_array
    scaled = fence([beta_ref[0] * (c - dtype.type(zj)) for c, zj in zip(xhat, z)])
    return [jnp.where(valid, c * s, jnp.nan) for c in scaled]


# ----------------------------------------------------------------------------------- encode


def _encode_kernel(x_ref, scale_ref, lab_ref, T_ref, *, config: HNLQConfig, thresholds):
    d, M, max_T = config.d, config.M, config.max_T
    x = [x_ref[:, j] for j in range(d)]
    dtype = x[0].dtype
    finite = jnp.isfinite(x[0])
    for c in x[1:]:
        finite = finite & jnp.isfinite(c)
    norm = jnp.sqrt(sumsq([jnp.where(finite, c, 0) for c in x]))
    # The reference's searchsorted lower bound on T, against constant thresholds.
    t = jnp.zeros(norm.shape, jnp.int32)
    for th in thresholds:
        t = t + (dtype.type(th) < norm).astype(jnp.int32)
    z = [dtype.type(v) for v in config.dither_array]

    def attempt(state):
        t, active, T, digits = state
        s = scale_ref[jnp.minimum(t, max_T)]
        new, over = encode_at([c / s + zj for c, zj in zip(x, z)], config, lookup=False)
        ok = active & ~over
        digits = tuple(jnp.where(ok, a, b) for a, b in zip(new, digits))
        T = jnp.where(ok, t, T)
        t = t + 1
        return t, active & over & (t <= max_T), T, digits

    def any_active(state):
        return jnp.max(state[1].astype(jnp.int32)) > 0

    state = (t, finite & (t <= max_T), jnp.full(t.shape, -1, jnp.int32),
             tuple(jnp.zeros(t.shape, jnp.int32) for _ in range(d)))
    _, _, T, digits = jax.lax.while_loop(any_active, attempt, state)
    for m, bm in enumerate(unpack_digits(list(digits), config)):
        for j, c in enumerate(bm):
            lab_ref[:, m * d + j] = c.astype(jnp.uint8)
    T_ref[...] = T.astype(jnp.int8)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _encode_pallas(x, config, interpret, block, gpu_backend):
    N, d = x.shape
    M = config.M
    with jax.ensure_compile_time_eval():
        scales, thresholds = codec.scale_tables(config, config.beta, x.dtype)
        thresholds = [float(v) for v in np.asarray(thresholds)]
    S = _pow2_at_least(config.max_T + 1)
    bn = _rows(N, block)
    labels, T = pl.pallas_call(
        functools.partial(_encode_kernel, config=config, thresholds=thresholds),
        grid=(pl.cdiv(N, bn),),
        in_specs=[pl.BlockSpec((bn, d), lambda i: (i, 0)), pl.BlockSpec((S,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((bn, M * d), lambda i: (i, 0)), pl.BlockSpec((bn,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((N, M * d), jnp.uint8),
                   jax.ShapeDtypeStruct((N,), jnp.int8)],
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "encode"),
    )(x, _table(scales, S))
    return Codes(labels.reshape(N, M, d), T)


def encode(x, config: HNLQConfig, *, implementation=None, interpret=None, block: int = 256,
           gpu_backend: str = "triton") -> Codes:
    """Algorithm 1 with the overload loop, as one kernel pass over ``x``.

    Args:
      x: ``[..., d]`` floating array (half precision is computed in float32).
      config: the quantizer.
      implementation: ``"pallas"``, ``"xla"`` or ``None`` (see the module docstring).
      interpret: Pallas interpret mode; ``None``: on a CPU.
      block: blocks per program (a power of two >= 16).
      gpu_backend: ``"triton"``.

    Returns:
      ``Codes(labels[..., M, d] uint8, T[...] int8)``, bit-identical to :func:`hnlq_jax.encode`.
    """
    x = check_x(x, config, "kernels.encode")
    if resolve(implementation, config, "kernels.encode") == "xla":
        return codec.encode(x, config)
    flat = x.reshape(-1, config.d)
    if flat.shape[0] == 0:
        return codec.encode(x, config)
    c = _encode_pallas(flat, config, _interpret(interpret), block, gpu_backend)
    return Codes(c.labels.reshape(x.shape[:-1] + (config.M, config.d)), c.T.reshape(x.shape[:-1]))


# ----------------------------------------------------------------------------------- decode


def _decode_kernel(lab_ref, T_ref, pow_ref, beta_ref, o_ref, *, config: HNLQConfig, first: int,
                   interpret: bool):
    d = config.d
    dtype = o_ref.dtype
    b = [[lab_ref[:, m * d + j].astype(jnp.int32) for j in range(d)] for m in range(config.M)]
    cols = _scale(b, T_ref[...].astype(jnp.int32), pow_ref, beta_ref, config, dtype, interpret,
                  first)
    for j, c in enumerate(cols):
        o_ref[:, j] = c


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7))
def _decode_pallas(labels, T, config, levels, dtype, interpret, block, gpu_backend):
    N = T.shape[0]
    M, d = config.M, config.d
    S = _pow2_at_least(config.max_T + 1)
    bn = _rows(N, block)
    return pl.pallas_call(
        functools.partial(_decode_kernel, config=config, first=M - levels, interpret=interpret),
        grid=(pl.cdiv(N, bn),),
        in_specs=[pl.BlockSpec((bn, M * d), lambda i: (i, 0)), pl.BlockSpec((bn,), lambda i: (i,)),
                  pl.BlockSpec((S,), lambda i: (0,)), pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=pl.BlockSpec((bn, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((N, d), dtype),
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "decode"),
    )(labels.reshape(N, M * d).astype(jnp.uint8), T, *_tables(config, dtype))


def _tables(config: HNLQConfig, dtype):
    """The decoder's ``2^(alpha t)`` table (padded to a power of two) and ``[beta]``."""
    pow2 = jnp.asarray(pow2_table(config.alpha, config.max_T), dtype)
    return _table(pow2, _pow2_at_least(config.max_T + 1)), jnp.full((1,), config.beta, dtype)


def decode(codes: Codes, config: HNLQConfig, levels: int | None = None, dtype=None, *,
           implementation=None, interpret=None, block: int = 256, gpu_backend: str = "triton"):
    """Algorithm 2, all levels fused in one kernel pass.

    Args:
      codes: ``Codes(labels[..., M, d], T[...])``.
      config: the quantizer that made them.
      levels: keep only the ``levels`` coarsest levels (default: all).
      dtype: output dtype; default float64 under x64, float32 otherwise.
      implementation, interpret, block, gpu_backend: see :func:`encode`.

    Returns:
      ``[..., d]``, bit-identical to :func:`hnlq_jax.decode`; NaN in blocks with ``T = -1``.
    """
    labels, T = check_codes(codes, config, levels, "kernels.decode")
    if resolve(implementation, config, "kernels.decode") == "xla" or T.size == 0:
        return codec.decode(codes, config, levels, dtype)
    dtype = jnp.dtype(codec.default_float() if dtype is None else dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"kernels.decode: dtype must be floating, got {dtype}")
    compute = jnp.promote_types(dtype, jnp.float32)
    out = _decode_pallas(labels.reshape(-1, config.M, config.d), T.reshape(-1), config,
                         config.M if levels is None else levels, compute, _interpret(interpret),
                         block, gpu_backend)
    return out.reshape(T.shape + (config.d,)).astype(dtype)


# --------------------------------------------------------------------------------- quantize


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _quantize(x, config, implementation, interpret):
    c = encode(x, config, implementation=implementation, interpret=interpret)
    return decode(c, config, dtype=x.dtype, implementation=implementation, interpret=interpret)


def _quantize_fwd(x, config, implementation, interpret):
    return _quantize(x, config, implementation, interpret), None


def _quantize_bwd(config, implementation, interpret, _, g):
    return (g,)


_quantize.defvjp(_quantize_fwd, _quantize_bwd)


def quantize(x, config: HNLQConfig, *, implementation=None, interpret=None):
    """``decode(encode(x))`` through the kernels, with a straight-through gradient.

    Args:
      x: ``[..., d]`` floating array.
      config: the quantizer.
      implementation, interpret: see :func:`encode`.

    Returns:
      ``[..., d]`` in x's dtype; equal to :func:`hnlq_jax.quantize` bit for bit.
    """
    x = check_x(x, config, "kernels.quantize").astype(jnp.asarray(x).dtype)
    return _quantize(x, config, implementation, interpret)


# ---------------------------------------------------------------------------- decode_matmul


def _weight_codes(codes_W, config: HNLQConfig, fn: str):
    labels, T = check_codes(codes_W, config, None, fn)
    if labels.ndim != 4:
        raise ValueError(f"{fn}: W must be coded as n rows of length k: labels [n, nb, M, d], "
                         f"got {labels.shape}")
    return labels, T


def _activations(x, nb: int, config: HNLQConfig, fn: str):
    x = jnp.asarray(x)
    if x.ndim == 0 or -(-x.shape[-1] // config.d) != nb:
        raise ValueError(f"{fn}: x must be [..., k] with ceil(k/d) = {nb} blocks (d={config.d}), "
                         f"got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: x must be floating, got {x.dtype}")
    return x


def _planar(labels, T, bn: int, bk: int):
    """Labels ``[n, nb, M, d]`` as ``[M*d, n, nb]`` and T ``[n, nb]``, padded to tile multiples.

    Each label plane is a 2-D tile in the kernel; padded blocks get T = 0 and label 0 (they
    decode to 0 and meet zero activations).
    """
    n, nb, M, d = labels.shape
    pn, pk = (-n) % bn, (-nb) % bk
    planes = jnp.transpose(labels, (2, 3, 0, 1)).reshape(M * d, n, nb)
    return (jnp.pad(planes, ((0, 0), (0, pn), (0, pk))),
            jnp.pad(T, ((0, pn), (0, pk))))


def _decode_matmul_kernel(x_ref, lab_ref, T_ref, pow_ref, beta_ref, s_ref, o_ref, *,
                          config: HNLQConfig, bk: int, compute, interpret: bool):
    d, M = config.d, config.M
    nk = lab_ref.shape[2] // bk

    def tile(k, acc):
        sl = pl.ds(pl.multiple_of(k * bk, bk), bk)
        b = [[lab_ref[m * d + j, :, sl].astype(jnp.int32) for j in range(d)] for m in range(M)]
        w = _scale(b, T_ref[:, sl].astype(jnp.int32), pow_ref, beta_ref, config, jnp.float32,
                   interpret)
        for j in range(d):
            acc = acc + jax.lax.dot_general(
                x_ref[j, :, sl].astype(compute), w[j].astype(compute), (((1,), (1,)), ((), ())),
                precision=_HIGHEST, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, nk, tile, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = (acc * s_ref[...][None, :]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8))
def _decode_matmul_pallas(x, labels, T, scale, config, interpret, block_n, block_k, gpu_backend):
    n, nb, M, d = labels.shape
    lead, k = x.shape[:-1], x.shape[-1]
    compute = x.dtype if x.dtype == jnp.bfloat16 else jnp.promote_types(x.dtype, jnp.float32)
    out_dtype = jnp.promote_types(x.dtype, jnp.float32) if x.dtype != jnp.bfloat16 else x.dtype
    xf = x.reshape(-1, k)
    B = xf.shape[0]
    bb = max(16, _pow2_at_least(B))  # dot tiles are >= 16 on every side
    bn = _rows(n, block_n)
    bk = _rows(nb, block_k)
    planes, Tp = _planar(labels, T, bn, bk)
    npad, nbp = Tp.shape
    xp = jnp.pad(xf, ((0, bb - B), (0, nbp * d - k))).reshape(bb, nbp, d)
    xp = jnp.transpose(xp, (2, 0, 1))  # [d, bb, nbp]: coordinate planes, as the labels
    s = jnp.pad(jnp.ones((n,), jnp.float32) if scale is None else scale.astype(jnp.float32),
                (0, npad - n))
    S = _pow2_at_least(config.max_T + 1)
    out = pl.pallas_call(
        functools.partial(_decode_matmul_kernel, config=config, bk=bk, compute=compute,
                          interpret=interpret),
        grid=(npad // bn,),
        in_specs=[pl.BlockSpec((d, bb, nbp), lambda i: (0, 0, 0)),
                  pl.BlockSpec((M * d, bn, nbp), lambda i: (0, i, 0)),
                  pl.BlockSpec((bn, nbp), lambda i: (i, 0)),
                  pl.BlockSpec((S,), lambda i: (0,)), pl.BlockSpec((1,), lambda i: (0,)),
                  pl.BlockSpec((bn,), lambda i: (i,))],
        out_specs=pl.BlockSpec((bb, bn), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((bb, npad), out_dtype),
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "decode_matmul"),
    )(xp, planes, Tp, *_tables(config, jnp.float32), s)
    return out[:B, :n].reshape(lead + (n,))


def _decode_matmul_xla(x, labels, T, scale, config):
    """The reference: decode W in float32, then ``x @ W_hat^T`` (accumulated in float32)."""
    n, nb = T.shape
    k = x.shape[-1]
    w = codec.decode_blocks(labels, T, config, None, jnp.float32, config.beta)
    w = w.reshape(n, nb * config.d)[:, :k]
    if scale is not None:
        w = w * scale.astype(jnp.float32)[:, None]
    compute = x.dtype if x.dtype == jnp.bfloat16 else jnp.promote_types(x.dtype, jnp.float32)
    out_dtype = jnp.promote_types(x.dtype, jnp.float32) if x.dtype != jnp.bfloat16 else x.dtype
    y = jnp.einsum("...k,nk->...n", x.astype(compute), w.astype(compute), precision=_HIGHEST,
                   preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _decode_matmul(x, labels, T, scale, config, impl, interpret, block_n, block_k, gpu_backend):
    if impl == "xla":
        return _decode_matmul_xla(x, labels, T, scale, config)
    return _decode_matmul_pallas(x, labels, T, scale, config, interpret, block_n, block_k,
                                 gpu_backend)


def _decode_matmul_fwd(x, labels, T, scale, config, *static):
    return _decode_matmul(x, labels, T, scale, config, *static), (x, labels, T, scale)


def _decode_matmul_bwd(config, impl, interpret, block_n, block_k, gpu_backend, res, g):
    x, labels, T, scale = res
    n, nb = T.shape
    w = codec.decode_blocks(labels, T, config, None, jnp.float32, config.beta)
    w = w.reshape(n, nb * config.d)[:, :x.shape[-1]]  # [n, k], unscaled
    g = g.astype(jnp.float32)
    gs = g if scale is None else g * scale.astype(jnp.float32)
    dx = jnp.einsum("...n,nk->...k", gs, w, precision=_HIGHEST).astype(x.dtype)
    dscale = None
    if scale is not None:
        xw = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w, precision=_HIGHEST)
        dscale = jnp.sum((g * xw).reshape(-1, n), axis=0).astype(scale.dtype)
    return dx, None, None, dscale


_decode_matmul.defvjp(_decode_matmul_fwd, _decode_matmul_bwd)


def decode_matmul(x, codes_W, config: HNLQConfig, *, scale=None, implementation=None,
                  interpret=None, block_n: int = 32, block_k: int = 32,
                  gpu_backend: str = "triton"):
    """``y = (x @ W_hat^T) * scale`` with ``W_hat`` given only by its codes (weight-only).

    The kernel reads the weight as codes (``M log2 q`` bits/dim plus T) and decodes it tile by
    tile next to the matrix-unit ``dot``; the dense weight never exists in memory.

    Args:
      x: ``[..., k]`` activations (float32, bfloat16 or float64). bfloat16 runs a bfloat16
        ``dot`` on the decoded tiles with float32 accumulation.
      codes_W: ``Codes(labels [n, nb, M, d], T [n, nb])``: the n rows of W coded along k,
        ``nb = ceil(k/d)``.
      config: the quantizer that made the codes.
      scale: optional ``[n]`` per-row scale (e.g. per-channel ``c = beta * rms``).
      implementation, interpret, gpu_backend: see :func:`encode`.
      block_n, block_k: output rows and d-blocks per tile (powers of two >= 16).

    Returns:
      ``[..., n]`` in x's dtype (at least float32 unless bfloat16). Differentiable in x and
      scale (the gradient of the decoded product); the codes get none.
    """
    labels, T = _weight_codes(codes_W, config, "kernels.decode_matmul")
    x = _activations(x, T.shape[1], config, "kernels.decode_matmul")
    if scale is not None:
        scale = jnp.asarray(scale)
        if scale.shape != T.shape[:1]:
            raise ValueError(f"kernels.decode_matmul: scale must have shape ({T.shape[0]},), got "
                             f"{scale.shape}")
    impl = resolve(implementation, config, "kernels.decode_matmul")
    return _decode_matmul(x, labels, T, scale, config, impl, _interpret(interpret), block_n,
                          block_k, gpu_backend)


# --------------------------------------------------------------------------------- lut_gemv


def _lut_gemv_kernel(t_ref, e_ref, lab_ref, T_ref, pow_ref, beta_ref, o_ref, *,
                     config: HNLQConfig,
                     bk: int):
    d, M, q = config.d, config.M, config.q
    Q = q**d
    nk = lab_ref.shape[2] // bk
    bn = T_ref.shape[0]

    def tile(k, acc):
        k0 = pl.multiple_of(k * bk, bk)
        sl = pl.ds(k0, bk)
        T = T_ref[:, sl].astype(jnp.int32)
        row = (k0 + jax.lax.broadcasted_iota(jnp.int32, (bn, bk), 1)) * Q
        v = jnp.zeros((bn, bk), jnp.float32)
        valid = (T >= 0) & (T <= config.max_T)
        for m in range(M):
            b = [lab_ref[m * d + j, :, sl].astype(jnp.int32) for j in range(d)]
            for c in b:
                valid = valid & (c < q)
            v = v + float(q**m) * t_ref[row + codec.flat_index(b, q)]
        s = beta_ref[0] * pow_ref[jnp.clip(T, 0, config.max_T)]
        s = jnp.where(valid, s, jnp.nan)
        return acc + jnp.sum(s * (v - e_ref[sl][None, :]), axis=1)

    o_ref[...] = jax.lax.fori_loop(0, nk, tile, jnp.zeros((bn,), jnp.float32))


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _lut_gemv_pallas(labels, T, x, config, interpret, block_n, block_k, gpu_backend):
    n, nb, M, d = labels.shape
    Q = config.q**d
    bn, bk = _rows(n, block_n), _rows(nb, block_k)
    planes, Tp = _planar(labels, T, bn, bk)
    npad, nbp = Tp.shape
    x = x.astype(jnp.float32)
    t = lut.one_sided(x, config)  # [nb, Q]
    t = jnp.pad(t, ((0, nbp - nb), (0, 0))).reshape(-1)
    e = lut.dither_dot(codec.to_blocks(x, d), config)
    e = jnp.pad(jnp.broadcast_to(jnp.asarray(e, jnp.float32), (nb,)), (0, nbp - nb))
    S = _pow2_at_least(config.max_T + 1)
    out = pl.pallas_call(
        functools.partial(_lut_gemv_kernel, config=config, bk=bk),
        grid=(npad // bn,),
        in_specs=[pl.BlockSpec((nbp * Q,), lambda i: (0,)), pl.BlockSpec((nbp,), lambda i: (0,)),
                  pl.BlockSpec((M * d, bn, nbp), lambda i: (0, i, 0)),
                  pl.BlockSpec((bn, nbp), lambda i: (i, 0)), pl.BlockSpec((S,), lambda i: (0,)),
                  pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=pl.BlockSpec((bn,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((npad,), jnp.float32),
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "lut_gemv"),
    )(t, e, planes, Tp, *_tables(config, jnp.float32))
    return out[:n]


def lut_gemv(codes_W, x, config: HNLQConfig, *, implementation=None, interpret=None,
             block_n: int = 32, block_k: int = 32, gpu_backend: str = "triton"):
    """``W_hat x`` through x's one-sided tables: a gather per level and block, no decode.

    Args:
      codes_W: ``Codes(labels [n, nb, M, d], T [n, nb])``.
      x: ``[..., k]`` activations with ``ceil(k/d) = nb``; leading axes are mapped over.
      config: the quantizer (``q^d <= 2^16``, as for :func:`hnlq_jax.lut.one_sided`).
      implementation, interpret, block_n, block_k, gpu_backend: see :func:`decode_matmul`.

    Returns:
      ``[..., n]`` float32, equal to :func:`hnlq_jax.lut.matmul_one_sided` up to summation
      order.
    """
    labels, T = _weight_codes(codes_W, config, "kernels.lut_gemv")
    x = _activations(x, T.shape[1], config, "kernels.lut_gemv")
    lead = x.shape[:-1]
    batch = int(np.prod(lead, dtype=np.int64))
    if resolve(implementation, config, "kernels.lut_gemv", batch) == "xla":
        return lut.matmul_one_sided(codes_W, x, config)
    lut.check_one_sided(config, "kernels.lut_gemv")
    gemv = functools.partial(_lut_gemv_pallas, labels, T, config=config,
                             interpret=_interpret(interpret), block_n=block_n, block_k=block_k,
                             gpu_backend=gpu_backend)
    xf = x.reshape(-1, x.shape[-1])
    out = jax.vmap(lambda v: gemv(v))(xf)
    return out.reshape(lead + (T.shape[0],))


# --------------------------------------------------------------------------------- modq_sum


def _modq_kernel(lab_ref, T_ref, olab_ref, oT_ref, *, config: HNLQConfig):
    K, C, _ = lab_ref.shape
    T0 = T_ref[0, :].astype(jnp.int32)

    def add(k, state):
        sums, same = state
        sums = tuple(s + lab_ref[k, c, :].astype(jnp.int32) for c, s in enumerate(sums))
        return sums, same & (T_ref[k, :].astype(jnp.int32) == T0)

    # The carries start from loaded rows, not zeros: Mosaic GPU gives constants a different
    # register layout and rejects the loop.
    first = tuple(lab_ref[0, c, :].astype(jnp.int32) for c in range(C))
    sums, same = jax.lax.fori_loop(1, K, add, (first, T0 >= 0))
    for c, s in enumerate(sums):
        olab_ref[c, :] = jnp.remainder(s, config.q).astype(jnp.uint8)
    oT_ref[...] = jnp.where(same, T0, -1).astype(jnp.int8)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _modq_pallas(labels, T, config, interpret, block, gpu_backend):
    """Planar layout (labels ``[K, M*d, N]``), which both Triton and Mosaic GPU lower: Mosaic
    GPU copies need 16-byte strides and whole warpgroups of bytes (256 blocks per program)."""
    K, N = T.shape
    C = config.M * config.d
    bn = 256 if gpu_backend == "mosaic_gpu" else _rows(N, block)
    pad = (-N) % bn
    planes = jnp.transpose(labels.reshape(K, N, C).astype(jnp.uint8), (0, 2, 1))
    planes = jnp.pad(planes, ((0, 0), (0, 0), (0, pad)))
    Tp = jnp.pad(T.astype(jnp.int8), ((0, 0), (0, pad)))
    out, T = pl.pallas_call(
        functools.partial(_modq_kernel, config=config),
        grid=((N + pad) // bn,),
        in_specs=[pl.BlockSpec((K, C, bn), lambda i: (0, 0, i)),
                  pl.BlockSpec((K, bn), lambda i: (0, i))],
        out_specs=[pl.BlockSpec((C, bn), lambda i: (0, i)), pl.BlockSpec((bn,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((C, N + pad), jnp.uint8),
                   jax.ShapeDtypeStruct((N + pad,), jnp.int8)],
        interpret=interpret,
        compiler_params=_compiler_params(gpu_backend, "modq_sum"),
    )(planes, Tp)
    return Codes(out[:, :N].T.reshape(N, config.M, config.d), T[:N])


def modq_sum(codes: Codes, config: HNLQConfig, axis: int = 0, *, implementation=None,
             interpret=None, block: int = 256, gpu_backend: str = "triton") -> Codes:
    """Label-wise sum mod q along a leading axis (the compressed-domain sum).

    Args:
      codes: ``Codes(labels[..., M, d], T[...])`` (config without dither).
      config: the quantizer that made them.
      axis: the leading axis summed over.
      implementation, interpret, block: see :func:`encode`.
      gpu_backend: ``"triton"`` or ``"mosaic_gpu"``.

    Returns:
      ``Codes`` with ``axis`` removed, identical to :func:`hnlq_jax.modq.accumulate`: T is the
      common T of the summands, or -1 where they differ or one is -1.
    """
    if resolve(implementation, config, "kernels.modq_sum") == "xla":
        return modq.accumulate(codes, config, axis)
    labels, T = modq.check(codes, config, "kernels.modq_sum")
    axis = modq.leading_axis(axis, T, "kernels.modq_sum")
    labels, T = jnp.moveaxis(labels, axis, 0), jnp.moveaxis(T, axis, 0)
    rest = T.shape[1:]
    if T.size == 0:
        return modq.accumulate(codes, config, axis)
    c = _modq_pallas(labels.reshape((T.shape[0], -1, config.M, config.d)),
                     T.reshape(T.shape[0], -1), config, _interpret(interpret), block, gpu_backend)
    return Codes(c.labels.reshape(rest + (config.M, config.d)), c.T.reshape(rest))

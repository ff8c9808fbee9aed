"""The front doors: ``encode``, ``decode``, ``quantize`` and ``matmul``, one per operation.

Each takes ``implementation=``:

* ``None``: the best measured choice on the default backend (:func:`default_implementation`);
* ``"xla"``: the pure-JAX reference (:mod:`hnlq_jax.codec`);
* ``"pallas"``: the Pallas kernels (:mod:`hnlq_jax.kernels`), interpret mode on a CPU;
* ``"lut"`` (``matmul`` only): the one-sided lookup-table product (:mod:`hnlq_jax.lut`);
* ``"native"`` (``matmul`` and ``decode``): the native CPU kernels
  (:mod:`hnlq_jax.kernels.cpu`), where the package was built with them.

Every implementation gives the same codes and the same decoded values bit for bit (matmul: the
same up to float summation order, except ``"xla"`` and ``"pallas"`` which agree exactly in the
decoded weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import codec, kernels, lut
from hnlq_jax.buckets import run_rows
from hnlq_jax._numerics import saturating_cast, straight_through, wide_dtype
from hnlq_jax.codes import (Codes, check_activations, check_codes, check_weight_codes, is_concrete,
                            pack_t, row_length, unpack_t)
from hnlq_jax.config import HNLQConfig, check_config, is_integer

__all__ = ["IMPLEMENTATIONS", "FAILURES", "encode", "decode", "quantize", "matmul",
           "default_implementation", "resolve", "bucket", "encode_padded"]

IMPLEMENTATIONS = {
    "encode": ("xla", "pallas"),
    "decode": ("xla", "pallas", "native"),
    "quantize": ("xla", "pallas"),
    "matmul": ("xla", "pallas", "lut", "native"),
}
_HIGHEST = jax.lax.Precision.HIGHEST


def default_implementation(op: str, config: HNLQConfig, *arrays) -> str:
    """What ``implementation=None`` runs for ``op`` on the inputs ``arrays``.

    On a GPU, the kernel when one supports ``config``. On a CPU, ``matmul`` and ``decode`` take
    the native kernels where they are built and support ``config``
    (``experiments/bench_cpu_matmul.py``: 5-40x faster than the XLA path; ``decode`` falls back
    to XLA where the kernel does not apply: fewer levels, float64), everything else XLA: Pallas
    only runs in interpret mode there, which is slower (``experiments/bench_kernels.py``).
    Where the inputs live decides (:func:`hnlq_jax.kernels.platform`): a CPU array on a GPU
    machine takes the CPU's path.

    Args:
      op: one of ``IMPLEMENTATIONS``.
      config: the codec's configuration.
      *arrays: the operation's inputs (none: the default device's platform).

    Raises:
      ValueError: an unknown op.
    """
    if op not in IMPLEMENTATIONS:
        raise ValueError(f"default_implementation: op must be one of {tuple(IMPLEMENTATIONS)}, "
                         f"got {op!r}")
    where = kernels.platform(*arrays)
    # (canonical: a NumPy float64 x is computed in float32 with x64 off)
    wide = any(hasattr(a, "dtype") and jax.dtypes.canonicalize_dtype(a.dtype) == jnp.float64
               for a in jax.tree.leaves(arrays))
    if (op in ("matmul", "decode") and where == "cpu" and not wide
            and not kernels.cpu.unsupported(config)):
        return "native"  # float32: float64 activations take XLA
    if kernels.unsupported(config):
        return "xla"
    if where == "gpu":
        return "pallas"
    return "xla"


def resolve(implementation, config: HNLQConfig, op: str, *arrays) -> str:
    """``implementation`` checked for ``op`` (``None``: :func:`default_implementation` for the
    inputs ``arrays``)."""
    allowed = IMPLEMENTATIONS[op]
    if implementation is None:
        return default_implementation(op, config, *arrays)
    if implementation not in allowed:
        raise ValueError(f"{op}: implementation must be one of {allowed} or None, got "
                         f"{implementation!r}")
    why = kernels.unsupported(config)
    if implementation == "pallas" and why:
        raise ValueError(f"{op}: no Pallas kernel for {config.lattice}: {why}; use "
                         "implementation='xla'")
    if implementation == "native":
        why = kernels.cpu.unsupported(config)
        if why:
            raise ValueError(f"{op}: no native kernel for {config.lattice} q={config.q}: {why};"
                             " use implementation='xla'")
        # Under a trace the arrays' device is unknown (XLA then refuses the CPU-only custom
        # call on another platform itself)
        concrete = all(map(is_concrete, jax.tree.leaves(arrays)))
        if concrete and kernels.platform(*arrays) != "cpu":
            raise ValueError(f"{op}: the native kernel runs on the CPU, the inputs live on "
                             f"{kernels.platform(*arrays)}; use implementation='pallas' or 'xla'")
    return implementation


def resolve_interpret(impl: str, interpret, *arrays):
    """``interpret`` for the Pallas kernels (``impl == "pallas"``), resolved from ``arrays``
    before a front door's jit: inside it the kernels see tracers, whose device is unknown,
    and a GPU machine compiled for its GPU what ran on CPU-committed inputs."""
    if impl != "pallas" or interpret is not None:
        return interpret
    return kernels.pallas.interpret_mode(None, *arrays)


FAILURES = ("raise", "mark")


def bucket(n: int) -> int:
    """Padded size of a batch of ``n`` blocks: the next power of two, at least 1024.

    Eager calls pad their flat batch to a bucket so that a stream of batch sizes compiles
    O(log n) programs (the encoder's compile takes seconds) at the price of at most 2x padding.
    """
    return max(1024, 1 << max(0, n - 1).bit_length())


def encode(x, config: HNLQConfig, *, implementation=None, interpret=None,
           failures: str = "raise") -> Codes:
    """Algorithm 1 with overload rescaling, over every leading axis.

    Args:
      x: ``[..., d]`` floating array (half precision is computed in float32).
      config: the quantizer.
      implementation: ``None``, ``"xla"`` or ``"pallas"``.
      interpret: Pallas interpret mode (default: where the inputs live on a CPU).
      failures: what an eager call does with blocks that still overload at ``max_T``:
        ``"raise"`` (default) a ``ValueError``, or ``"mark"`` them ``T = -1`` (they decode to
        NaN). Under ``jit`` they are always marked (the values are not known at trace time).

    Returns:
      Block :class:`Codes` of shape ``x.shape``: ``index [..., M]``, T field, the config.

    Raises:
      ValueError: wrong last-axis size, NaN/Inf in a concrete input, a ``beta`` beyond the
        range of x's dtype, or (``failures="raise"``) values too large for
        ``beta 2^(alpha max_T)``.
      TypeError: non-floating input or a config that is not an ``HNLQConfig``.
    """
    x = codec.check_x(x, config, "encode")
    codec.check_beta_fits(config.beta, x.dtype, "encode")
    if failures not in FAILURES:
        raise ValueError(f"encode: failures must be one of {FAILURES}, got {failures!r}")
    impl = resolve(implementation, config, "encode", x)
    if x.size == 0:
        impl = "xla"
    interpret = resolve_interpret(impl, interpret, x)
    if not is_concrete(x):
        return _encode(x, config, impl, interpret)
    index, T = encode_padded(x, config, impl, interpret)
    codes, T, any_failed = _codes_from_bucket(index, T, x.shape[:-1], config)
    if failures == "raise" and any_failed:
        _raise_on_failures(x, np.asarray(T) < 0, config, "encode")
    return codes


# The eager glue around a bucketed program (padding in, slicing out) is one small jitted
# program per shape each way: as separate jnp operations it compiled one program per
# operation and per new batch size, most of a new size's first call.


@jax.jit
def _to_bucket(x):
    """``x[..., w]`` as a flat ``[bucket(N), w]`` batch, zero-padded."""
    flat = x.reshape(-1, x.shape[-1])
    return jnp.pad(flat, ((0, bucket(flat.shape[0]) - flat.shape[0]), (0, 0)))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _codes_from_bucket(index, T, lead: tuple, config: HNLQConfig):
    """``(Codes, T, any failed)`` of the first ``prod(lead)`` blocks of a bucket's encoding."""
    N = int(np.prod(lead, dtype=np.int64))
    T = T[:N].reshape(lead)
    codes = Codes(index[:N].reshape(lead + (config.M,)), pack_t(T, config), config)
    return codes, T, jnp.any(T < 0)


def _raise_on_failures(x, failed, config: HNLQConfig, fn: str):
    """A clear error for the finite blocks of ``x[..., d]`` the overload loop could not fit
    (``failed[...]`` bool, concrete)."""
    flat = np.asarray(x, np.float64).reshape(-1, config.d)
    top = float(np.max(np.linalg.norm(flat[failed.reshape(-1)], axis=-1)))
    reach = config.beta * 2 ** (config.alpha * config.max_T) * config.overload_radius
    # The overload region is not a ball: blocks well inside the radius can overload too, so
    # the reach is where every block fails, not a bound the failed ones exceed.
    raise ValueError(
        f"{fn}: {int(failed.sum())} block(s) still overload at max_T = {config.max_T} (the "
        f"largest has norm {top:.4g}; every block beyond about {reach:.4g} = beta "
        f"2^(alpha max_T) times the overload radius of {config.lattice} q={config.q} "
        f"M={config.M} does, some nearer ones too). Raise beta (see "
        "calibrate_beta) or max_T (up to 127; T then takes 8 bits), or pass failures='mark' to "
        "mark such blocks T = -1 (they decode to NaN)")


def encode_flat(flat, config: HNLQConfig, impl: str, interpret):
    """``(index [N, M], T [N] int32)`` of blocks ``flat[N, d]``."""
    if impl == "xla":
        return codec.encode_blocks(flat, config, config.beta)
    return kernels.encode(flat, config, interpret=interpret)


_encode_bucket = jax.jit(encode_flat, static_argnums=(1, 2, 3))


def encode_padded(x, config: HNLQConfig, impl: str, interpret=None):
    """The eager encoder: ``(index [B, M], T [B] int32)`` of the blocks of a concrete
    ``x[..., d]`` flattened and zero-padded to ``B = bucket(N)`` blocks (the first ``N`` rows
    are ``x``'s), with no input checks. One compiled encoder per bucket: a new shape compiles
    only the small padding program.
    """
    return _encode_bucket(_to_bucket(x), config, impl, interpret)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _encode(x, config: HNLQConfig, impl: str, interpret) -> Codes:
    lead = x.shape[:-1]
    index, T = encode_flat(x.reshape(-1, config.d), config, impl, interpret)
    return Codes(index.reshape(lead + (config.M,)), pack_t(T.reshape(lead), config), config)


def _out_dtype(dtype, fn: str):
    # canonical: float64 is float32 with x64 off, as every JAX array of it
    dtype = jax.dtypes.canonicalize_dtype(codec.default_float() if dtype is None else dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{fn}: dtype must be floating, got {dtype}")
    return dtype


def decode(codes: Codes, *, levels: int | None = None, dtype=None, implementation=None,
           interpret=None):
    """Algorithm 2: the values the codes stand for. The config travels with the codes.

    Args:
      codes: :class:`Codes` (block or row codes).
      levels: keep only the ``levels`` coarsest levels (successive refinement): the result is
        the input quantized on ``q^(M - levels) L``. Default: all.
      dtype: output dtype; default float64 under x64, float32 otherwise (half precision is
        computed in float32 and rounded, saturating at the dtype's largest value).
      implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"native"`` (the native CPU
        kernel: all levels, float32 or half precision).
      interpret: Pallas interpret mode (default: where the inputs live on a CPU).

    Returns:
      ``codes.shape``: ``[..., d]`` for block codes, ``[..., n]`` (times the row scale) for row
      codes; NaN in blocks with ``T = -1``.

    Raises:
      TypeError: not ``Codes`` or a non-floating dtype.
      ValueError: corrupted codes (index or T out of range, checked when concrete; under jit
        such blocks give NaN), ``levels`` outside ``1..M``, or a ``beta`` beyond the range of
        the dtype decoded in.
    """
    check_codes(codes, "decode")
    config = codes.config
    if levels is not None and not (is_integer(levels) and 1 <= levels <= config.M):
        raise ValueError(f"decode: levels must be an int in 1..M={config.M}, got {levels!r}")
    dtype = _out_dtype(dtype, "decode")
    compute = jnp.promote_types(dtype, jnp.float32)  # half precision: float32, then round
    codec.check_beta_fits(config.beta, compute, "decode")
    impl = resolve(implementation, config, "decode", codes)
    if impl == "native" and (levels is not None or compute != jnp.float32):
        if implementation == "native":
            raise ValueError("decode: the native kernel decodes all levels in float32 (or half "
                             "precision); use implementation='xla' for levels= or float64")
        impl = "xla"
    N = int(np.prod(codes.blocks_shape, dtype=np.int64))
    if N == 0 or not codes.blocks_shape:
        impl = "xla"
    interpret = resolve_interpret(impl, interpret, codes)
    if not is_concrete(codes.index):
        return saturating_cast(_decode(codes, levels, compute, impl, interpret), dtype)
    # Eager: one flat, bucket-padded batch, so a new batch size reuses the compiled decoder.
    out = _decode(_codes_to_bucket(codes), levels, compute, impl, interpret)
    return _decoded_from_bucket(out, codes, compute, dtype)


@jax.jit
def _codes_to_bucket(codes: Codes) -> Codes:
    """Block codes as a flat batch of ``bucket(N)`` blocks (padding: index 0, T = 0)."""
    config = codes.config
    lead = codes.blocks_shape
    T = unpack_t(codes.tfield, config, lead[-1] if lead else None).reshape(-1) - 1
    pad = bucket(T.shape[0]) - T.shape[0]
    index = jnp.pad(codes.index.reshape(-1, config.M), ((0, pad), (0, 0)))
    return Codes(index, pack_t(jnp.pad(T, (0, pad)), config), config)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _decoded_from_bucket(out, codes: Codes, compute, dtype):
    """The first blocks of a bucket's decoded values, in the shape and dtype of ``codes``."""
    lead = codes.blocks_shape
    out = out[:int(np.prod(lead, dtype=np.int64))].reshape(lead + (codes.config.d,))
    return saturating_cast(_finish_rows(out, codes, compute), dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _decode(codes: Codes, levels, compute, impl: str, interpret):
    blocks = Codes(codes.index, codes.tfield, codes.config)
    if impl == "xla":
        out = codec.decode_xla(blocks, levels, compute)
    elif impl == "native":
        out = _decode_native(blocks)
    else:
        out = kernels.decode(blocks, levels, compute, interpret=interpret)
    return _finish_rows(out, codes, compute)


def _decode_native(blocks: Codes):
    """Block values ``[..., nb, d]`` float32 of block codes, by the native kernel: the codes
    as rows of blocks (a flat eager bucket as rows of 64, so that its threads share them)."""
    config, lead = blocks.config, blocks.blocks_shape
    flat = len(lead) == 1 and lead[0] % 64 == 0
    rows = (lead[0] // 64, 64) if flat else (int(np.prod(lead[:-1], dtype=np.int64)), lead[-1])
    rowed = Codes(blocks.index.reshape(rows + (config.M,)), blocks.tfield.reshape(rows[0], -1),
                  config)
    return kernels.cpu.decode(rowed).reshape(lead + (config.d,))


def _finish_rows(blocks, codes: Codes, compute):
    """Block values ``[..., nb, d]`` as the logical array of row codes (else unchanged)."""
    if codes.n is None:
        return blocks
    out = codec.from_blocks(blocks, codes.n)
    if codes.scale is not None:
        out = out * codes.scale.astype(compute)[..., None]
    return out


def _quantize(x, config, impl, interpret):
    """``decode(encode(x))`` with the shared straight-through gradient (none through the codes)."""
    xs = jax.lax.stop_gradient(x)
    index, T = encode_flat(xs.reshape(-1, config.d), config, impl, interpret)
    c = Codes(index, pack_t(T, config), config)
    if impl == "xla":
        out = codec.decode_xla(c, None, x.dtype)
    else:
        out = kernels.decode(c, None, x.dtype, interpret=interpret)
    return straight_through(x, out.reshape(x.shape), None)


def quantize(x, config: HNLQConfig, *, implementation=None, interpret=None,
             failures: str = "raise"):
    """``decode(encode(x))`` with a straight-through (identity) gradient.

    Args:
      x: ``[..., d]`` floating array.
      config: the quantizer.
      implementation: ``None``, ``"xla"`` or ``"pallas"``.
      interpret: Pallas interpret mode (default: where the inputs live on a CPU).
      failures: as :func:`encode`: an eager call raises on blocks beyond ``max_T``
        (``"raise"``) or returns NaN there (``"mark"``); under ``jit`` they are NaN.

    Returns:
      ``[..., d]`` in ``x``'s dtype (half precision is computed in float32 and rounded back,
      saturating at the dtype's largest value: a block near it can decode just beyond).

    Raises:
      ValueError, TypeError: as :func:`encode`.
    """
    check_config(config, "quantize")  # before x: swapped arguments get this error
    dtype = jnp.asarray(x).dtype
    x = codec.check_x(x, config, "quantize")
    codec.check_beta_fits(config.beta, x.dtype, "quantize")
    if failures not in FAILURES:
        raise ValueError(f"quantize: failures must be one of {FAILURES}, got {failures!r}")
    impl = resolve(implementation, config, "quantize", x)
    if x.size == 0:
        return x.astype(dtype)
    interpret = resolve_interpret(impl, interpret, x)
    if not is_concrete(x):
        return saturating_cast(_quantize_jit(x, config, impl, interpret), dtype)
    # Eager: a bucket-padded flat batch (see bucket).
    out = _quantize_jit(_to_bucket(x), config, impl, interpret)
    out, failed, any_failed = _values_from_bucket(out, x.shape, dtype)
    if failures == "raise" and any_failed:
        _raise_on_failures(x, np.asarray(failed), config, "quantize")
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _values_from_bucket(out, shape: tuple, dtype):
    """``(values, failed blocks, any failed)`` of the first blocks of a bucket's ``quantize``;
    the input is finite (checked), so a NaN marks a block that could not be encoded."""
    out = out[:int(np.prod(shape[:-1], dtype=np.int64))].reshape(shape)
    failed = jnp.any(jnp.isnan(out), axis=-1)
    return saturating_cast(out, dtype), failed, jnp.any(failed)


_quantize_jit = jax.jit(_quantize, static_argnums=(1, 2, 3))


# ------------------------------------------------------------------------------------ matmul


def _dense_weight(codes: Codes, dtype):
    """``[n, k]`` decoded weight in ``dtype`` without the row scale (the XLA reference)."""
    config = codes.config
    n, nb = codes.blocks_shape
    u = unpack_t(codes.tfield, config, nb)
    w = codec.decode_blocks(codes.index, u, config, None, dtype, config.beta)
    return w.reshape(n, nb * config.d)[:, :row_length(codes)]


def _matmul_xla(x, codes: Codes):
    wide = wide_dtype(x.dtype)
    w = _dense_weight(codes, wide)
    if codes.scale is not None:
        w = w * codes.scale.astype(wide)[:, None]
    compute, out_dtype = _compute_dtypes(x.dtype)
    y = jnp.einsum("...k,nk->...n", x.astype(compute), w.astype(compute), precision=_HIGHEST,
                   preferred_element_type=wide)
    return y.astype(out_dtype)


def _compute_dtypes(dtype):
    """``(compute, output)`` dtypes: bfloat16 runs a bfloat16 product with float32
    accumulation; float16 (too narrow a range for the product) a float32 one rounded back to
    float16, as a half-precision layer's output; others at least float32."""
    if dtype == jnp.bfloat16:
        return dtype, dtype
    wide = wide_dtype(dtype)
    return wide, (dtype if dtype == jnp.float16 else wide)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x, codes, impl, interpret):
    if impl == "xla":
        return _matmul_xla(x, codes)
    if impl == "lut":
        return lut.matmul_one_sided(codes, x).astype(_compute_dtypes(x.dtype)[1])
    compute, out_dtype = _compute_dtypes(x.dtype)
    if impl == "native":  # float32 sums of the reference's (bfloat16-rounded) weights
        flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        bf16 = compute == jnp.bfloat16
        if flat.shape[0] >= kernels.cpu.GEMM_ROWS:  # decoded once, then a float GEMM
            y = jnp.dot(flat, kernels.cpu.decode(codes, bf16).T, precision=_HIGHEST)
        else:
            y = kernels.cpu.decode_matmul(flat, codes, bf16_weights=bf16)
        return y.reshape(x.shape[:-1] + (y.shape[-1],)).astype(out_dtype)
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    narrow = wide_dtype(x.dtype) == jnp.float32  # float64 x takes Triton's decode_matmul
    mosaic = narrow and kernels.mosaic_gpu.chosen(codes, rows, x.dtype)  # the table's fastest
    if mosaic:
        kernel = getattr(kernels.mosaic_gpu, mosaic)
        return kernel(x, codes, out_dtype, interpret=interpret)
    if (rows <= kernels.GEMV_ROWS and narrow
            and not kernels.pallas.few_rows_on_tensor_cores(codes, rows, x.dtype)):
        return kernels.gemv(x, codes, out_dtype, interpret=interpret)
    return kernels.decode_matmul(x, codes, compute, out_dtype, interpret=interpret)


def _matmul_fwd(x, codes, impl, interpret):
    return _matmul(x, codes, impl, interpret), (x, codes)


def _matmul_bwd(impl, interpret, res, g):
    x, codes = res
    wide = wide_dtype(x.dtype)
    w = _dense_weight(codes, wide)  # [n, k], unscaled
    g = g.astype(wide)
    gs = g if codes.scale is None else g * codes.scale.astype(wide)
    dx = jnp.einsum("...n,nk->...k", gs, w, precision=_HIGHEST).astype(x.dtype)
    dscale = None
    if codes.scale is not None:
        xw = jnp.einsum("...k,nk->...n", x.astype(wide), w, precision=_HIGHEST)
        dscale = jnp.sum((g * xw).reshape(-1, w.shape[0]), axis=0).astype(codes.scale.dtype)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0),
                         (codes.index, codes.tfield))
    return dx, Codes(zeros[0], zeros[1], codes.config, scale=dscale, n=codes.n)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x, codes: Codes, *, implementation=None, interpret=None):
    """``y = x @ W_hat^T`` with the weight given only by its codes (weight-only quantization).

    Args:
      x: ``[..., k]`` real activations (float32, bfloat16, float16 or float64; bfloat16 runs
        a bfloat16 product with float32 accumulation, float16 a float32 product).
      codes: the weight ``W[n, k]`` as codes with blocks ``[n, nb]`` (row codes from
        :func:`hnlq_jax.encode_rows`, whose row scales are applied, or block codes with
        ``k = nb d``).
      implementation: ``None``, ``"xla"`` (decode, then ``dot``), ``"pallas"`` (fused
        kernels, the dense weight never in memory: ``kernels.gemv`` for up to
        ``kernels.GEMV_ROWS`` rows of x, float32 products of the unrounded decoded weights
        whatever x's dtype; ``kernels.decode_matmul`` beyond, and for those rows of bfloat16
        x where the GPU's tuning table found the tensor cores faster), ``"lut"`` (x's
        one-sided tables gathered by the codes' indices) or ``"native"`` (the native CPU
        kernel: decodes weight tiles in cache next to the product, or from
        ``kernels.cpu.GEMM_ROWS`` rows of x the whole weight once before a float GEMM; float32
        activations and sums, bfloat16 and float16 ones as ``"xla"`` rounds them).
      interpret: Pallas interpret mode (default: where the inputs live on a CPU).

    Returns:
      ``[..., n]`` in x's dtype. Differentiable in x and in
      the row scale; the integer code arrays get no gradient.

    Outside ``jit`` the call runs one cached compiled program per row bucket of x
    (:func:`hnlq_jax.buckets.row_bucket`: rows are zero-padded, so a new batch size in a bucket compiles
    nothing new) and the codes' ranges are checked once per codes object, not on every call.
    """
    codes = check_weight_codes(codes, "matmul")
    x = check_activations(x, codes, "matmul")
    codec.check_beta_fits(codes.config.beta, wide_dtype(x.dtype), "matmul")
    impl = resolve(implementation, codes.config, "matmul", x, codes)
    if impl == "native" and jax.dtypes.canonicalize_dtype(x.dtype) == jnp.float64:
        raise ValueError("matmul: the native kernel computes in float32; use "
                         "implementation='xla' for float64 activations")
    if impl == "lut":
        lut.check_one_sided(codes.config, "matmul")
    if x.size == 0 or codes.blocks_shape[0] == 0:
        return jnp.zeros(x.shape[:-1] + (codes.blocks_shape[0],), _compute_dtypes(x.dtype)[1])
    interpret = resolve_interpret(impl, interpret, x, codes)
    if not (is_concrete(x) and all(map(is_concrete, jax.tree.leaves(codes)))):
        return _matmul(x, codes, impl, interpret)
    return run_rows(_matmul_jit, x, codes, impl, interpret)


_matmul_jit = jax.jit(_matmul, static_argnums=(2, 3))


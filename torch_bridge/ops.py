"""The HNLQ operations as ``torch.library`` custom ops: ``torch.ops.hnlq.*``.

``torch.compile`` cannot trace into JAX. Registered as custom ops, with fake implementations
(output shapes and dtypes from ``jax.eval_shape`` of the same JAX call, so a compiled graph sees
the same shape and dtype checks) and autograd formulas, the JAX code runs at run time inside a
compiled graph without a graph break (``fullgraph=True`` works). Codes cross as their two
integer arrays, ``index`` and ``tfield`` (plus ``scale`` and ``n`` for row codes, see
:class:`torch_bridge.Codes`); the config as the primitives of :func:`config_args`.

==================  ========================================================================
op                  JAX function (same result bit for bit; ``matmul`` on CPU tensors: row
                    buckets below :data:`GEMM_ROWS`, up to 32 rows; from there in torch's
                    GEMM's sum order)
==================  ========================================================================
``encode``          :func:`hnlq_jax.encode` -> ``(index, tfield)``
``decode``          :func:`hnlq_jax.decode`
``quantize``        :func:`hnlq_jax.quantize`; autograd: straight-through (identity)
``matmul``          :func:`hnlq_jax.matmul`; autograd: ``matmul_backward`` (x and scale)
``matmul_backward`` the ``jax.vjp`` of :func:`hnlq_jax.matmul` -> ``(dx, dscale)``
``rotate``          :meth:`hnlq_jax.incoherence.Rotation.apply` / ``inverse``; autograd: the
                    other one
==================  ========================================================================

On CPU tensors, where the native kernels are built, ``matmul`` calls them on the tensors' memory
(:func:`hnlq_jax.kernels.cpu.decode_matmul_host`; no JAX dispatch per call): the same sums as
the jitted :func:`hnlq_jax.matmul` while the row bucket is below :data:`GEMM_ROWS` (up to 32
rows), torch's GEMM of the decoded weight from there; ``rotate`` likewise calls the rotation kernel
(:func:`hnlq_jax.kernels.cpu.rotate_host`) where ``Rotation.apply`` takes it.

Float64 inputs (or a float64 ``dtype``) run under JAX's x64 mode
(:func:`torch_bridge.interop.x64_for`). The wrappers in :mod:`torch_bridge.codec` are the
intended entry points; these ops are what they call.
"""

# No ``from __future__ import annotations``: the op schemas are inferred from the annotations.
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.autograd.forward_ad as _forward_ad

import hnlq_jax as hq
from hnlq_jax import HNLQConfig
from hnlq_jax.buckets import row_bucket
from hnlq_jax.codes import check_weight_codes, row_length
from torch_bridge.interop import (TensorCache, cached_jax, is_wide, tensor_state, to_jax,
                                  to_torch, x64_context, x64_for)

__all__ = ["config_args", "config_of", "direct", "matmul_direct", "refuse_forward_ad",
           "rotate_direct"]

ConfigArgs = tuple[str, int, int, float, float, int, Optional[list[float]]]
# A tensor inside torch.func's vmap / grad / jvp (its type is a plain torch.Tensor); torch's own
# check, private, so looked up where it exists
_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None),
                             "is_functorch_wrapped_tensor", lambda t: False)


def config_args(config: HNLQConfig) -> ConfigArgs:
    """``config`` as the op arguments ``(lattice, q, M, beta, alpha, max_T, dither)``."""
    if not isinstance(config, HNLQConfig):
        raise TypeError(f"torch_bridge: config must be an hnlq_jax.HNLQConfig, got "
                        f"{type(config).__name__}")
    dither = None if config.dither is None else list(config.dither)
    return (config.lattice, config.q, config.M, config.beta, config.alpha, config.max_T, dither)


@functools.lru_cache(maxsize=256)
def _config_of(lattice, q, M, beta, alpha, max_T, dither) -> HNLQConfig:
    return HNLQConfig(lattice, q, M, beta, alpha, max_T, dither)


def config_of(lattice, q, M, beta, alpha, max_T, dither) -> HNLQConfig:
    """The :class:`~hnlq_jax.HNLQConfig` of :func:`config_args` (inverse)."""
    return _config_of(lattice, q, M, beta, alpha, max_T, None if dither is None else tuple(dither))


def jax_dtype(dtype: torch.dtype):
    return jnp.dtype(str(dtype).removeprefix("torch."))


def torch_dtype(dtype) -> torch.dtype:
    return getattr(torch, jnp.dtype(dtype).name)


def _spec(t):
    if t is None:
        return None
    # int() specializes a symbolic size of a dynamic-shape graph: JAX needs concrete shapes.
    return jax.ShapeDtypeStruct(tuple(int(s) for s in t.shape), jax_dtype(t.dtype))


def _fake(fn, device, *tensors, wide=()):
    """Empty tensors shaped and typed like ``fn``'s outputs (``fn`` traced by ``eval_shape``)."""
    with x64_for(*tensors, *wide):
        out = jax.eval_shape(fn, *(_spec(t) for t in tensors))
    return tuple(torch.empty(o.shape, dtype=torch_dtype(o.dtype), device=device)
                 for o in jax.tree.leaves(out))


def _own(out: torch.Tensor, *inputs) -> torch.Tensor:
    """``out``, copied if it views an input's memory (a JAX no-op returns its argument, and a
    custom op's outputs must not alias its inputs)."""
    ptrs = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    return out.clone() if out.untyped_storage().data_ptr() in ptrs and out.numel() else out


@functools.lru_cache(maxsize=None)
def _matmul_jit(implementation, interpret):
    """hq.matmul compiled whole, its argument checks at trace time: a layer's codes are checked
    once (check_weight_codes remembers them), so a call costs one compiled dispatch. One jitted
    function per choice: jit's fast path then has no keyword or static arguments to handle."""
    return jax.jit(functools.partial(hq.matmul, implementation=implementation,
                                     interpret=interpret))


def _host_or_jax(t: torch.Tensor):
    """A CPU tensor of a NumPy dtype as a NumPy view (which a compiled JAX call takes in a few
    microseconds; a DLPack import costs 35-150 us), anything else through :func:`to_jax`."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float16, torch.float64):
        return t.detach().contiguous().numpy()
    return to_jax(t)


def _bucket_rows(x: torch.Tensor):
    """``(rows, pad)``: ``x``'s rows ``[R, k]`` zero-padded in torch to their row bucket
    (:func:`hnlq_jax.buckets.row_bucket`), as :func:`_host_or_jax` gives them. Padded here, so
    a new batch size compiles nothing in JAX, not even the padding."""
    rows = x.reshape(-1, x.shape[-1])
    pad = row_bucket(rows.shape[0]) - rows.shape[0]
    if pad:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
    return _host_or_jax(rows), pad


def _rows_back(y, x: torch.Tensor, pad: int) -> torch.Tensor:
    """The op's output from a bucket's rows ``y[R + pad, n]``: ``[*x.shape[:-1], n]``."""
    # On the CPU a copy through NumPy (the output is small beside a weight) costs a few us
    # where a DLPack export of a fresh array costs ~75
    host = x.device.type == "cpu" and y.dtype in (jnp.float32, jnp.float16, jnp.float64)
    y = torch.from_numpy(np.array(y)) if host else to_torch(y)
    return _own(y[:y.shape[0] - pad].reshape(x.shape[:-1] + y.shape[-1:]), x)


def _codes(index, tfield, scale, n, config) -> hq.Codes:
    """:class:`hnlq_jax.Codes` of the op arguments (JAX arrays or shape specs)."""
    return hq.Codes(index, tfield, config, scale=scale, n=n)


# ------------------------------------------------------------------------------------ encode


@torch.library.custom_op("hnlq::encode", mutates_args=())
def encode(x: torch.Tensor, implementation: Optional[str], failures: str, lattice: str, q: int,
           M: int, beta: float, alpha: float, max_T: int,
           dither: Optional[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)
    with x64_for(x):
        c = hq.encode(to_jax(x), config, implementation=implementation, failures=failures)
        return _own(to_torch(c.index), x), _own(to_torch(c.tfield), x)


@encode.register_fake
def _(x, implementation, failures, lattice, q, M, beta, alpha, max_T, dither):
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)

    def fn(a):
        c = hq.encode(a, config, implementation=implementation)
        return c.index, c.tfield

    return _fake(fn, x.device, x)


# ------------------------------------------------------------------------------------ decode


@torch.library.custom_op("hnlq::decode", mutates_args=())
def decode(index: torch.Tensor, tfield: torch.Tensor, scale: Optional[torch.Tensor],
           n: Optional[int], levels: Optional[int], dtype: torch.dtype,
           implementation: Optional[str], lattice: str, q: int, M: int, beta: float,
           alpha: float, max_T: int, dither: Optional[list[float]]) -> torch.Tensor:
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)
    with x64_for(index, tfield, scale, dtype):
        codes = _codes(to_jax(index), to_jax(tfield), None if scale is None else to_jax(scale),
                       n, config)
        out = hq.decode(codes, levels=levels, dtype=jax_dtype(dtype),
                        implementation=implementation)
        return _own(to_torch(out), scale)


@decode.register_fake
def _(index, tfield, scale, n, levels, dtype, implementation, lattice, q, M, beta, alpha, max_T,
      dither):
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)

    def fn(i, t, s):
        return hq.decode(_codes(i, t, s, n, config), levels=levels, dtype=jax_dtype(dtype),
                         implementation=implementation)

    return _fake(fn, index.device, index, tfield, scale, wide=(dtype,))[0]


# ---------------------------------------------------------------------------------- quantize


@torch.library.custom_op("hnlq::quantize", mutates_args=())
def quantize(x: torch.Tensor, implementation: Optional[str], lattice: str, q: int, M: int,
             beta: float, alpha: float, max_T: int,
             dither: Optional[list[float]]) -> torch.Tensor:
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)
    with x64_for(x):
        return _own(to_torch(hq.quantize(to_jax(x), config, implementation=implementation)), x)


@quantize.register_fake
def _(x, implementation, lattice, q, M, beta, alpha, max_T, dither):
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)
    return _fake(lambda a: hq.quantize(a, config, implementation=implementation), x.device, x)[0]


def _quantize_backward(ctx, g):
    return (g,) + (None,) * 8  # straight-through: the identity for x, nothing for the rest


quantize.register_autograd(_quantize_backward)


# ------------------------------------------------------------------------------------ matmul


_MATMULS = TensorCache()


def _prepared_matmul(x, index, tfield, scale, n, implementation, config):
    """``(codes, compiled function, x64, host)`` of one layer's product for x's dtype and
    device, built once per state of the code tensors: their JAX views, the checks of the codes
    (a full scan), the implementation chosen where the arrays are concrete (inside the compiled
    call they are tracers, and the default backend would decide instead of where the tensors
    live), and where that is the native kernel on CPU tensors, their addresses for a direct
    call (``host``, else ``None``)."""
    def build():
        wide = is_wide(x, index, tfield, scale)
        with x64_context(wide):
            codes = _codes(cached_jax(index), cached_jax(tfield),
                           None if scale is None else cached_jax(scale), n, config)
            check_weight_codes(codes, "hnlq::matmul")
            rows = np.zeros((1, x.shape[-1]), jax_dtype(x.dtype))  # x's dtype: a stand-in
            impl = hq.ops.resolve(implementation, config, "matmul", rows, codes)
            fn = _matmul_jit(impl, hq.kernels.platform(codes) == "cpu" or None)
        codes_tensors = [t for t in (index, tfield, scale) if t is not None]
        host = None
        if (impl == "native" and x.dtype in _HOST_DTYPES and x.device.type == "cpu"
                and all(t.device.type == "cpu" and t.is_contiguous() for t in codes_tensors)
                and (scale is None or scale.dtype == torch.float32)):
            host = hq.kernels.cpu.HostCodes(config, codes.blocks_shape[0], row_length(codes),
                                            index.data_ptr(), tfield.data_ptr(),
                                            0 if scale is None else scale.data_ptr())
        return (codes, fn, wide, host), True

    extra = (tensor_state(tfield), tensor_state(scale), n, implementation, config, x.dtype,
             x.device)
    return _MATMULS.get(index, extra, build)


# Activations the native kernel takes on the host path: float32 sums, bfloat16 with the
# reference's bfloat16-rounded weights, float16 rounded back (as hq.matmul's native path).
_HOST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The direct calls' work below which they run on the calling thread: in a model they follow
# torch's operations, whose OpenMP workers still spin on the other cores, and a thread of ours
# competing with them costs more than it brings (experiments/host_threads.py; the work is
# weights x activation rows for the fused product, values for a rotation).
MATMUL_ONE_THREAD = 1 << 24
ROTATE_ONE_THREAD = 1 << 22
# Activation rows (of the row bucket) from which the layer decodes the weight and leaves the
# sums to torch's GEMM. Lower than hnlq_jax.kernels.cpu.GEMM_ROWS (XLA's crossover, the product
# called alone): after torch's operations the fused kernel loses from 32-48 rows at every
# weight shape measured (experiments/host_threads.py), while torch's GEMM runs unhindered.
GEMM_ROWS = 40


def _threads(work: int, one_thread: int) -> int:
    """Threads for a direct call of ``work``: 1 below ``one_thread``, else torch's."""
    return 1 if work < one_thread else torch.get_num_threads()


# Decoded weights held at a time by a large batch's product (16 MiB of float32): a weight of
# 4096 x 11008 would take 180 MB whole.
_SLAB_WEIGHTS = 1 << 22


def _matmul_host(x: torch.Tensor, host, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The native kernels called directly on the tensors' memory (no JAX dispatch). Below
    :data:`GEMM_ROWS` rows (of the row bucket) the fused product, the sums of the jitted
    ``hq.matmul`` bit for bit (on the calling thread below :data:`MATMUL_ONE_THREAD` weights x
    rows); from there the decoded weight, a slab of rows at a time, and torch's GEMM (sums in
    torch's order; ``hq.matmul`` itself switches to XLA's GEMM from
    ``hq.kernels.cpu.GEMM_ROWS``). ``bias`` (``[n]``), where given, is added as ``y + bias`` in
    x's dtype would be, into the fresh output in place: the op's ``y + bias`` bit for bit (an
    ``addmm``, as ``F.linear`` adds it, rounds otherwise from 33 rows on)."""
    cpu = hq.kernels.cpu
    if x.ndim == 0 or x.shape[-1] != host.k:  # as hq.matmul's check_activations
        raise ValueError(f"hnlq::matmul: x must be [..., k] with k = {host.k} (the codes' row "
                         f"length), got shape {tuple(x.shape)}")
    # (conversions only where they convert: each no-op call costs about a microsecond, a
    # small layer's whole product a few)
    rows = x if x.ndim == 2 else x.reshape(math.prod(x.shape[:-1]), host.k)  # (k may be 0)
    if rows.dtype != torch.float32:
        rows = rows.to(torch.float32)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    bf16 = x.dtype == torch.bfloat16
    if rows.numel() == 0 or host.n == 0:  # as hq.matmul: zeros (the kernels need a weight)
        y = torch.zeros(rows.shape[0], host.n)
    elif row_bucket(rows.shape[0]) >= GEMM_ROWS:  # a slab of weight rows at a time
        slab = max(1, _SLAB_WEIGHTS // host.k)
        w = torch.empty(min(slab, host.n), host.k)
        parts = []
        for r0 in range(0, host.n, slab):
            part = host.rows(r0, min(host.n, r0 + slab))
            # On the calling thread: just after torch's GEMMs its OpenMP workers still spin on
            # the other cores, and decoding threads of ours competing with them took 2-4x the
            # time of one (a 1536 x 384 weight, 2 cores: 0.19-0.33 ms against 0.73-0.81 ms).
            cpu.decode_host(w.data_ptr(), part, bf16, 1)
            wt = w[:part.n].T
            parts.append(rows @ wt)
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    else:
        y = torch.empty(rows.shape[0], host.n)
        cpu.decode_matmul_host(y.data_ptr(), rows.data_ptr(), rows.shape[0], host, bf16,
                               _threads(rows.shape[0] * host.n * host.k, MATMUL_ONE_THREAD))
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if bias is not None:
        y.add_(bias if bias.dtype == y.dtype else bias.to(y.dtype))
    return y if x.ndim == 2 else y.reshape(x.shape[:-1] + (host.n,))


@torch.library.custom_op("hnlq::matmul", mutates_args=())
def matmul(x: torch.Tensor, index: torch.Tensor, tfield: torch.Tensor,
           scale: Optional[torch.Tensor], n: Optional[int], implementation: Optional[str],
           lattice: str, q: int, M: int, beta: float, alpha: float, max_T: int,
           dither: Optional[list[float]]) -> torch.Tensor:
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)
    prepared = _prepared_matmul(x, index, tfield, scale, n, implementation, config)
    return _matmul_prepared(x, prepared)


def _matmul_prepared(x: torch.Tensor, prepared) -> torch.Tensor:
    """The op's product from :func:`_prepared_matmul`'s ``(codes, fn, wide, host)``: the
    native kernels on the tensors' memory where ``host``, else the compiled JAX function."""
    codes, fn, wide, host = prepared
    if host is not None:
        return _matmul_host(x, host)
    with x64_context(wide):
        rows, pad = _bucket_rows(x)
        return _rows_back(fn(rows, codes), x, pad)


@matmul.register_fake
def _(x, index, tfield, scale, n, implementation, lattice, q, M, beta, alpha, max_T, dither):
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)

    def fn(a, i, t, s):
        return hq.matmul(a, _codes(i, t, s, n, config), implementation=implementation)

    return _fake(fn, x.device, x, index, tfield, scale)[0]


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _matmul_vjp(g, x, index, tfield, scale, n, implementation, config):
    """``(dx, dscale)`` of :func:`hnlq_jax.matmul` (``dscale`` None without a scale)."""
    def f(x, scale):
        return hq.matmul(x, _codes(index, tfield, scale, n, config), implementation=implementation)

    return jax.vjp(f, x, scale)[1](g)


@torch.library.custom_op("hnlq::matmul_backward", mutates_args=())
def matmul_backward(g: torch.Tensor, x: torch.Tensor, index: torch.Tensor, tfield: torch.Tensor,
                    scale: Optional[torch.Tensor], n: Optional[int],
                    implementation: Optional[str], lattice: str, q: int, M: int, beta: float,
                    alpha: float, max_T: int,
                    dither: Optional[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dscale)``; ``dscale`` is an empty tensor when there is no scale."""
    config = config_of(lattice, q, M, beta, alpha, max_T, dither)
    with x64_for(g, x, index, tfield, scale):
        dx, ds = _matmul_vjp(to_jax(g.contiguous()), to_jax(x), to_jax(index), to_jax(tfield),
                             None if scale is None else to_jax(scale), n, implementation, config)
        dx = _own(to_torch(dx), g, x)
        ds = x.new_empty(0) if ds is None else _own(to_torch(ds), scale)
    return dx, ds


@matmul_backward.register_fake
def _(g, x, index, tfield, scale, n, implementation, lattice, q, M, beta, alpha, max_T, dither):
    return torch.empty_like(x), (x.new_empty(0) if scale is None else torch.empty_like(scale))


def _matmul_setup(ctx, inputs, output):
    x, index, tfield, scale, n, implementation, *config = inputs
    ctx.save_for_backward(x, index, tfield, scale)
    ctx.args = (n, implementation, *config)


def _matmul_backward(ctx, g):
    x, index, tfield, scale = ctx.saved_tensors
    dx, ds = torch.ops.hnlq.matmul_backward(g, x, index, tfield, scale, *ctx.args)
    dx = dx if ctx.needs_input_grad[0] else None
    ds = ds if scale is not None and ctx.needs_input_grad[3] else None
    return (dx, None, None, ds) + (None,) * 9


matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup)


# ------------------------------------------------------------------------------------ rotate


@torch.library.custom_op("hnlq::rotate", mutates_args=())
def rotate(x: torch.Tensor, n: int, seed: int, inverse: bool) -> torch.Tensor:
    """``x @ R`` (``inverse``: ``x @ R^T``) of :class:`hnlq_jax.incoherence.Rotation(n, seed)`
    over the last axis, bit for bit its ``apply`` / ``inverse`` (where these take the native
    kernel on a CPU, it is called on the tensor's memory: no JAX dispatch)."""
    rotation = hq.incoherence.Rotation(n, seed)  # checks n and seed
    if _rotates_on_host(x, n):
        return _rotate_host(x, n, seed, inverse)
    with x64_for(x):
        rows, pad = _bucket_rows(x)
        return _rows_back(rotation.inverse(rows) if inverse else rotation.apply(rows), x, pad)


def _rotates_on_host(x: torch.Tensor, n: int) -> bool:
    """Whether ``Rotation(n).apply`` of ``x`` takes the native kernel (so the op calls it on
    the tensor's memory)."""
    return (x.device.type == "cpu" and x.dtype in _HOST_DTYPES and x.ndim > 0
            and x.shape[-1] == n
            and hq.incoherence.default_implementation(n, jax_dtype(x.dtype), "cpu") == "native")


def _rotate_host(x: torch.Tensor, n: int, seed: int, inverse: bool) -> torch.Tensor:
    """The native kernel of ``Rotation(n, seed)`` on the memory of a CPU tensor (no JAX
    dispatch). Below :data:`ROTATE_ONE_THREAD` values on the calling thread: in a model it
    runs right after torch's GEMMs, whose OpenMP workers still spin on the other cores (as
    :func:`_matmul_host`'s decode; a rotated MiniLM, ~300,000 values a call, encoded in 1.67x
    the float model's time with one thread, 2.03x with two); larger calls on torch's threads."""
    rows = x.to(torch.float32).contiguous()
    y = torch.empty_like(rows)
    k, _, _ = hq.incoherence.split_size(n)
    signs, mixer = hq.incoherence.tables(n, seed, np.dtype(np.float32))
    hq.kernels.cpu.rotate_host(y.data_ptr(), rows.data_ptr(), rows.numel() // n, signs, mixer, k,
                               inverse,
                               _threads(rows.numel(), ROTATE_ONE_THREAD))
    return y.to(x.dtype)


@rotate.register_fake
def _(x, n, seed, inverse):
    return torch.empty_like(x)


def _rotate_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _rotate_backward(ctx, g):
    n, seed, inverse = ctx.args  # R is orthogonal: the gradient of x @ R is g @ R^T
    return torch.ops.hnlq.rotate(g.contiguous(), n, seed, not inverse), None, None, None


rotate.register_autograd(_rotate_backward, setup_context=_rotate_setup)


# ------------------------------------------------------------------- direct calls (no dispatch)


def direct(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call on ``tensors`` may skip a custom op's dispatch (about 60-90 us of torch's
    Python layers per call) and run the host kernels itself: outside ``torch.compile``,
    ``torch.export`` and ``torch.jit.trace`` tracing (a tracer would not see the kernel write
    its output) and forward-mode AD, with no autograd graph to record (gradients disabled, or
    nothing requires them), on plain tensors (no subclass, no ``torch.func`` wrapper: fake,
    batched and functorch tensors take the op)."""
    if (torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None
            or _forward_ad._current_level >= 0):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # a loop: every call of a layer asks (generators cost microseconds)
        if t is not None and (type(t) is not torch.Tensor or grad and t.requires_grad
                              or _functorch_wrapped(t)):
            return False
    return True


def refuse_forward_ad(x: torch.Tensor, where: str) -> None:
    """Raises where ``x`` carries a forward-mode tangent: the ops have no forward-mode rule,
    and torch would return their results without one, silently."""
    if _forward_ad._current_level >= 0 and _forward_ad.unpack_dual(x).tangent is not None:
        raise NotImplementedError(f"{where}: forward-mode AD (torch.autograd.forward_ad) is not "
                                  "supported; use reverse mode (backward, torch.func.vjp)")


def matmul_direct(x: torch.Tensor, index: torch.Tensor, tfield: torch.Tensor,
                  scale: Optional[torch.Tensor], n: Optional[int],
                  implementation: Optional[str], config: ConfigArgs,
                  bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``torch.ops.hnlq.matmul(x, index, tfield, scale, n, implementation, *config)`` (plus
    ``bias``, where given: one with no gradient to record) computed without the op's dispatch
    where :func:`direct` allows it: the op's own body (the same product bit for bit; on the
    host path the bias as :func:`_matmul_host` adds it, elsewhere ``y + bias``); ``None``
    where the op must run (the caller then calls it)."""
    if not direct(x, index, tfield, scale):
        return None
    prepared = _prepared_matmul(x, index, tfield, scale, n, implementation, config_of(*config))
    if prepared[3] is not None:
        return _matmul_host(x, prepared[3], bias)
    y = _matmul_prepared(x, prepared)
    return y if bias is None else y + bias.to(y.dtype)


def rotate_direct(x: torch.Tensor, n: int, seed: int, inverse: bool) -> Optional[torch.Tensor]:
    """``torch.ops.hnlq.rotate(x, n, seed, inverse)`` without the op's dispatch where it runs
    the native kernel and :func:`direct` allows it (bit for bit); else ``None``."""
    if not direct(x) or not _rotates_on_host(x, n):
        return None
    return _rotate_host(x, n, seed, inverse)

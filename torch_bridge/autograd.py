"""JAX functions as ``torch.autograd.Function``s: jitted JAX forward, jitted ``jax.vjp`` backward."""

from __future__ import annotations

import functools

import jax
import torch
from torch.autograd.function import once_differentiable

from torch_bridge.interop import to_jax, to_torch, x64_for

__all__ = ["jax_function"]


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd, bwd, *tensors):
        ctx.bwd = bwd
        ctx.save_for_backward(*tensors)  # torch's version counters guard the inputs
        with x64_for(*tensors):
            return to_torch(fwd(*(to_jax(t) for t in tensors)))

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        tensors = ctx.saved_tensors
        with x64_for(*tensors, g):
            grads = ctx.bwd(tuple(to_jax(t) for t in tensors), to_jax(g.contiguous()))
            out = [to_torch(gi) if t.requires_grad and t.is_floating_point() else None
                   for gi, t in zip(grads, tensors)]
        return (None, None, *out)


def jax_function(fn):
    """Wraps a JAX function of arrays into a differentiable function of torch tensors.

    The forward pass is ``jax.jit(fn)``; the backward pass is the jitted ``jax.vjp`` of
    ``fn``, so every floating input gets its gradient (custom_vjp rules included, e.g. the
    straight-through gradient of :func:`hnlq_jax.quantize`). Tensors cross through DLPack
    without copies. ``fn`` must return one array; integer inputs get no gradient. With a
    float64 or int64 input it runs under JAX's x64 mode (:func:`torch_bridge.x64_for`).

    Args:
      fn: ``fn(*arrays) -> array``; close over non-array arguments (configs).

    Returns:
      ``f(*tensors) -> tensor``.
    """
    fwd = jax.jit(fn)

    @jax.jit
    def bwd(args, g):
        return jax.vjp(fn, *args)[1](g)

    @functools.wraps(fn)
    def apply(*tensors):
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{getattr(fn, '__name__', 'jax_function')}: expected torch "
                                f"tensors, got {type(t).__name__}")
        return _Apply.apply(fwd, bwd, *tensors)

    return apply

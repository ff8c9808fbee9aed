"""Lookup-table inner products and matmuls on torch tensors: :mod:`hnlq_jax.lut` through DLPack.

Codes are :class:`torch_bridge.Codes` (from :func:`torch_bridge.encode` or
:func:`torch_bridge.encode_rows`). The results equal :mod:`hnlq_jax.lut` called directly, bit
for bit. The one-sided products are differentiable in their real argument (the exact gradient
of a product linear in it); codes get no gradient.
"""

from __future__ import annotations

import functools

import torch

import hnlq_jax as hq
from hnlq_jax import HNLQConfig, lut
from torch_bridge.autograd import jax_function
from torch_bridge.codec import Codes, check_codes_arg
from torch_bridge.interop import to_torch, x64_for

__all__ = ["dot", "dot_one_sided", "matmul", "matmul_one_sided"]


def _two_sided(name: str, a: Codes, b: Codes, **options) -> torch.Tensor:
    fn = f"torch_bridge.lut.{name}"
    a, b = check_codes_arg(a, fn), check_codes_arg(b, fn)
    with x64_for(*a.op_args(), *b.op_args()):
        return to_torch(getattr(lut, name)(a.to_jax(), b.to_jax(), **options))


def _check_implementation(implementation, name: str):
    if implementation not in (None,) + lut.IMPLEMENTATIONS:
        raise ValueError(f"torch_bridge.lut.{name}: implementation must be one of "
                         f"{lut.IMPLEMENTATIONS} or None, got {implementation!r}")


def dot(codes_x: Codes, codes_y: Codes) -> torch.Tensor:
    """``<x_hat, y_hat>`` of two coded vectors (:func:`hnlq_jax.lut.dot`); ``[...]``."""
    return _two_sided("dot", codes_x, codes_y)


def matmul(codes_A: Codes, codes_B: Codes, *, implementation: str | None = None) -> torch.Tensor:
    """``A_hat @ B_hat`` of coded rows of A and columns of B (:func:`hnlq_jax.lut.matmul`,
    ``implementation`` as there)."""
    _check_implementation(implementation, "matmul")
    return _two_sided("matmul", codes_A, codes_B, implementation=implementation)


@functools.lru_cache(maxsize=None)
def _one_sided(name: str, config: HNLQConfig, n: int | None, scaled: bool, options: tuple):
    f = functools.partial(getattr(lut, name), **dict(options))
    if scaled:
        return jax_function(lambda i, t, s, y: f(hq.Codes(i, t, config, scale=s, n=n), y))
    return jax_function(lambda i, t, y: f(hq.Codes(i, t, config, n=n), y))


def _apply_one_sided(name: str, codes, y, **options):
    fn = f"torch_bridge.lut.{name}"
    codes = check_codes_arg(codes, fn)
    with x64_for(*codes.op_args()):
        codes.to_jax()  # validates the codes now (the jitted product cannot)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{fn}: expected a real tensor, got {type(y).__name__}")
    if y.is_floating_point() and not torch.isfinite(y).all():  # under jit JAX cannot check
        raise ValueError(f"{fn}: the real argument has NaN or Inf entries; expected finite values")
    scaled = codes.scale is not None
    arrays = (codes.index, codes.tfield) + ((codes.scale,) if scaled else ()) + (y,)
    return _one_sided(name, codes.config, codes.n, scaled, tuple(options.items()))(*arrays)


def dot_one_sided(codes_x: Codes, y: torch.Tensor) -> torch.Tensor:
    """``<x_hat, y>`` of coded vectors and real ``y [..., n]`` (:func:`hnlq_jax.lut.dot_one_sided`).

    Differentiable in ``y``.
    """
    return _apply_one_sided("dot_one_sided", codes_x, y)


def matmul_one_sided(codes_W: Codes, x: torch.Tensor, *,
                     implementation: str | None = None) -> torch.Tensor:
    """``x @ W_hat^T``: real ``x [..., k]``, codes of W's n rows
    (:func:`hnlq_jax.lut.matmul_one_sided`; ``implementation``, the sums over x's tables, as
    there: ``"native"``, ``"xla"`` or ``None``). The codes come first, as in every
    :mod:`hnlq_jax.lut` product.

    Returns ``[..., n]``; differentiable in ``x``. (:func:`torch_bridge.matmul` with
    ``implementation="lut"`` is the same product as a custom op.)
    """
    _check_implementation(implementation, "matmul_one_sided")  # before it keys a cache
    return _apply_one_sided("matmul_one_sided", codes_W, x, implementation=implementation)

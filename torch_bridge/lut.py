"""Lookup-table inner products and matmuls on torch tensors: :mod:`hnlq_jax.lut` through DLPack.

Codes are ``(labels, T)`` pairs of tensors as :func:`torch_bridge.encode` returns them. The
results equal :mod:`hnlq_jax.lut` called directly, bit for bit. The one-sided products are
differentiable in their real argument (the exact gradient of a product linear in it); codes get
no gradient.
"""

from __future__ import annotations

import functools

import torch

import hnlq_jax as hq
from hnlq_jax import HNLQConfig, lut
from torch_bridge.autograd import jax_function
from torch_bridge.codec import as_codes
from torch_bridge.interop import to_jax, to_torch

__all__ = ["dot", "dot_one_sided", "matmul", "matmul_one_sided"]


def dot(codes_x, codes_y, config: HNLQConfig) -> torch.Tensor:
    """``<x_hat, y_hat>`` of two coded vectors (:func:`hnlq_jax.lut.dot`); ``[...]``."""
    fn = "torch_bridge.dot"
    return to_torch(lut.dot(as_codes(codes_x, config, fn), as_codes(codes_y, config, fn), config))


def matmul(codes_A, codes_B, config: HNLQConfig) -> torch.Tensor:
    """``A_hat @ B_hat`` of coded rows of A and columns of B (:func:`hnlq_jax.lut.matmul`)."""
    fn = "torch_bridge.matmul"
    return to_torch(lut.matmul(as_codes(codes_A, config, fn), as_codes(codes_B, config, fn),
                               config))


@functools.lru_cache(maxsize=None)
def _one_sided(name: str, config: HNLQConfig):
    f = getattr(lut, name)
    return jax_function(lambda labels, T, y: f(hq.Codes(labels, T), y, config))


def _apply_one_sided(name: str, codes, y, config):
    fn = f"torch_bridge.{name}"
    codes = as_codes(codes, config, fn)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{fn}: expected a real tensor, got {type(y).__name__}")
    if y.is_floating_point() and not torch.isfinite(y).all():  # under jit JAX cannot check
        raise ValueError(f"{fn}: the real argument has NaN or Inf entries; expected finite values")
    return _one_sided(name, config)(to_torch(codes.labels), to_torch(codes.T), y)


def dot_one_sided(codes_x, y: torch.Tensor, config: HNLQConfig) -> torch.Tensor:
    """``<x_hat, y>`` of coded vectors and real ``y [..., n]`` (:func:`hnlq_jax.lut.dot_one_sided`).

    Differentiable in ``y``.
    """
    return _apply_one_sided("dot_one_sided", codes_x, y, config)


def matmul_one_sided(codes_W, x: torch.Tensor, config: HNLQConfig) -> torch.Tensor:
    """``x @ W_hat^T``: real ``x [..., k]``, codes of W's n rows (:func:`hnlq_jax.lut.matmul_one_sided`).

    Returns ``[..., n]``; differentiable in ``x``.
    """
    return _apply_one_sided("matmul_one_sided", codes_W, x, config)

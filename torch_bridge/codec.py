"""The HNLQ codec on torch tensors: the same codes as :mod:`hnlq_jax`, bit for bit."""

from __future__ import annotations

import functools

import torch

import hnlq_jax as hq
from hnlq_jax import HNLQConfig
from hnlq_jax.codec import check_codes, check_x
from torch_bridge.autograd import jax_function
from torch_bridge.interop import to_jax, to_torch

__all__ = ["encode", "decode", "quantize"]


def _check_config(config, fn):
    if not isinstance(config, HNLQConfig):
        raise TypeError(f"{fn}: config must be an hnlq_jax.HNLQConfig, got "
                        f"{type(config).__name__}")


def encode(t: torch.Tensor, config: HNLQConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 on a tensor ``[..., d]``: ``(labels[..., M, d] uint8, T[...] int8)``.

    Runs :func:`hnlq_jax.encode` (same checks and errors: wrong last axis, non-floating dtype,
    NaN/Inf). Gradient-requiring and non-contiguous tensors are accepted.
    """
    _check_config(config, "torch_bridge.encode")
    codes = hq.encode(to_jax(t), config)
    return to_torch(codes.labels), to_torch(codes.T)


def as_codes(codes, config: HNLQConfig, fn: str) -> hq.Codes:
    """A ``(labels, T)`` pair of tensors as :class:`hnlq_jax.Codes`, checked (shapes, range)."""
    _check_config(config, fn)
    if not (isinstance(codes, (tuple, list)) and len(codes) == 2
            and all(isinstance(c, torch.Tensor) for c in codes)):
        raise TypeError(f"{fn}: codes must be a (labels, T) pair of tensors")
    return hq.Codes(*check_codes((to_jax(codes[0]), to_jax(codes[1])), config, None, fn))


def decode(codes, config: HNLQConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Algorithm 2: ``(labels, T)`` tensors to ``x_hat[..., d]`` (float32 by default)."""
    codes = as_codes(codes, config, "torch_bridge.decode")
    jdtype = to_jax(torch.zeros((), dtype=dtype)).dtype
    return to_torch(hq.decode(codes, config, dtype=jdtype))


@functools.lru_cache(maxsize=None)
def _quantizer(config: HNLQConfig):
    return jax_function(lambda x: hq.quantize(x, config))


def quantize(t: torch.Tensor, config: HNLQConfig) -> torch.Tensor:
    """``decode(encode(t))`` with a straight-through gradient (a ``torch.autograd.Function``).

    Args:
      t: ``[..., d]`` floating tensor.
      config: the quantizer.

    Returns:
      The quantized tensor, same shape and dtype; gradients pass through unchanged.
    """
    _check_config(config, "torch_bridge.quantize")
    check_x(to_jax(t), config, "torch_bridge.quantize")  # shape, dtype, NaN/Inf: as hq.quantize
    return _quantizer(config)(t)

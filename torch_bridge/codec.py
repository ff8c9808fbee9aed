"""The HNLQ codec on torch tensors: the same codes as :mod:`hnlq_jax`, bit for bit.

Each function calls its ``torch.ops.hnlq`` custom op (:mod:`torch_bridge.ops`), so the same
calls work inside ``torch.compile``.
"""

from __future__ import annotations

import torch

import hnlq_jax as hq
from hnlq_jax import HNLQConfig
from hnlq_jax.codec import check_codes
from torch_bridge import ops
from torch_bridge.interop import to_jax

__all__ = ["encode", "decode", "quantize"]


def encode(t: torch.Tensor, config: HNLQConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 on a tensor ``[..., d]``: ``(labels[..., M, d] uint8, T[...] int8)``.

    Runs :func:`hnlq_jax.encode` (same checks and errors: wrong last axis, non-floating dtype,
    NaN/Inf). Gradient-requiring and non-contiguous tensors are accepted.
    """
    return torch.ops.hnlq.encode(t, *ops.config_args(config))


def as_codes(codes, config: HNLQConfig, fn: str) -> hq.Codes:
    """A ``(labels, T)`` pair of tensors as :class:`hnlq_jax.Codes`, checked (shapes, range)."""
    ops.config_args(config)
    if not (isinstance(codes, (tuple, list)) and len(codes) == 2
            and all(isinstance(c, torch.Tensor) for c in codes)):
        raise TypeError(f"{fn}: codes must be a (labels, T) pair of tensors")
    return hq.Codes(*check_codes((to_jax(codes[0]), to_jax(codes[1])), config, None, fn))


def decode(codes, config: HNLQConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Algorithm 2: ``(labels, T)`` tensors to ``x_hat[..., d]`` (float32 by default)."""
    args = ops.config_args(config)
    if not (isinstance(codes, (tuple, list)) and len(codes) == 2):
        raise TypeError("torch_bridge.decode: codes must be a (labels, T) pair of tensors")
    return torch.ops.hnlq.decode(codes[0], codes[1], dtype, *args)


def quantize(t: torch.Tensor, config: HNLQConfig) -> torch.Tensor:
    """``decode(encode(t))`` with a straight-through gradient (a custom op with autograd).

    Args:
      t: ``[..., d]`` floating tensor.
      config: the quantizer.

    Returns:
      The quantized tensor, same shape and dtype; gradients pass through unchanged.
    """
    return torch.ops.hnlq.quantize(t, *ops.config_args(config))

"""The codec as ``torch.library`` custom ops: ``torch.ops.hnlq.encode / decode / quantize``.

``torch.compile`` cannot trace into JAX. Registered as custom ops, with fake implementations
(output shapes and dtypes from ``jax.eval_shape`` of the JAX function, so a compiled graph
sees the same shape and dtype checks) and the straight-through autograd formula for
``quantize``, the JAX code runs at run time inside a compiled graph without a graph break.
:func:`torch_bridge.encode`, :func:`~torch_bridge.decode` and :func:`~torch_bridge.quantize`
call these ops; a config is passed as the primitives of :func:`config_args`.
"""

# No ``from __future__ import annotations``: the op schemas are inferred from the annotations.
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import torch

import hnlq_jax as hq
from hnlq_jax import HNLQConfig
from torch_bridge.interop import to_jax, to_torch

__all__ = ["config_args"]

ConfigArgs = tuple[str, int, int, float, float, int, Optional[list[float]]]


def config_args(config: HNLQConfig) -> ConfigArgs:
    """``config`` as the op arguments ``(lattice, q, M, beta, alpha, max_T, dither)``."""
    if not isinstance(config, HNLQConfig):
        raise TypeError(f"torch_bridge: config must be an hnlq_jax.HNLQConfig, got "
                        f"{type(config).__name__}")
    dither = None if config.dither is None else list(config.dither)
    return (config.lattice, config.q, config.M, config.beta, config.alpha, config.max_T, dither)


@functools.lru_cache(maxsize=64)
def _config_of(lattice, q, M, beta, alpha, max_T, dither) -> HNLQConfig:
    return HNLQConfig(lattice, q, M, beta, alpha, max_T, dither)


def _config(lattice, q, M, beta, alpha, max_T, dither) -> HNLQConfig:
    return _config_of(lattice, q, M, beta, alpha, max_T, None if dither is None else tuple(dither))


def jax_dtype(dtype: torch.dtype):
    return jnp.dtype(str(dtype).removeprefix("torch."))


def torch_dtype(dtype) -> torch.dtype:
    return getattr(torch, jnp.dtype(dtype).name)


def _fake(fn, *tensors):
    """Empty tensors shaped and typed like ``fn``'s outputs (``fn`` traced by ``eval_shape``)."""
    specs = [jax.ShapeDtypeStruct(tuple(t.shape), jax_dtype(t.dtype)) for t in tensors]
    out = jax.eval_shape(fn, *specs)
    return tuple(torch.empty(o.shape, dtype=torch_dtype(o.dtype), device=tensors[0].device)
                 for o in jax.tree.leaves(out))


@torch.library.custom_op("hnlq::encode", mutates_args=())
def encode(x: torch.Tensor, lattice: str, q: int, M: int, beta: float, alpha: float, max_T: int,
           dither: Optional[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    codes = hq.encode(to_jax(x), _config(lattice, q, M, beta, alpha, max_T, dither))
    return to_torch(codes.labels), to_torch(codes.T)


@encode.register_fake
def _(x, lattice, q, M, beta, alpha, max_T, dither):
    config = _config(lattice, q, M, beta, alpha, max_T, dither)
    return _fake(lambda a: tuple(hq.encode(a, config)), x)


@torch.library.custom_op("hnlq::decode", mutates_args=())
def decode(labels: torch.Tensor, T: torch.Tensor, dtype: torch.dtype, lattice: str, q: int, M: int,
           beta: float, alpha: float, max_T: int, dither: Optional[list[float]]) -> torch.Tensor:
    config = _config(lattice, q, M, beta, alpha, max_T, dither)
    return to_torch(hq.decode(hq.Codes(to_jax(labels), to_jax(T)), config,
                              dtype=jax_dtype(dtype)))


@decode.register_fake
def _(labels, T, dtype, lattice, q, M, beta, alpha, max_T, dither):
    config = _config(lattice, q, M, beta, alpha, max_T, dither)
    return _fake(lambda a, b: hq.decode(hq.Codes(a, b), config, dtype=jax_dtype(dtype)),
                 labels, T)[0]


@torch.library.custom_op("hnlq::quantize", mutates_args=())
def quantize(x: torch.Tensor, lattice: str, q: int, M: int, beta: float, alpha: float,
             max_T: int, dither: Optional[list[float]]) -> torch.Tensor:
    return to_torch(hq.quantize(to_jax(x), _config(lattice, q, M, beta, alpha, max_T, dither)))


@quantize.register_fake
def _(x, lattice, q, M, beta, alpha, max_T, dither):
    config = _config(lattice, q, M, beta, alpha, max_T, dither)
    return _fake(lambda a: hq.quantize(a, config), x)[0]


def _quantize_backward(ctx, g):
    return (g,) + (None,) * 7  # straight-through: the identity for x, nothing for the config


quantize.register_autograd(_quantize_backward)

"""torch_bridge: HNLQ for PyTorch users, running the JAX code through zero-copy DLPack.

* :func:`to_jax`, :func:`to_torch`: DLPack exchange (aliasing rules in :mod:`torch_bridge.interop`)
* :func:`encode`, :func:`decode`, :func:`quantize`: the codec on tensors, same codes as
  :mod:`hnlq_jax` bit for bit; ``quantize`` is differentiable (straight-through); all three
  are ``torch.ops.hnlq`` custom ops (:mod:`torch_bridge.ops`), usable under ``torch.compile``
* :func:`dot`, :func:`dot_one_sided`, :func:`matmul`, :func:`matmul_one_sided`: lookup-table
  products of codes (:mod:`hnlq_jax.lut`)
* :func:`jax_function`: any JAX function as a differentiable torch function (its ``jax.vjp``)
* :class:`QLinear`, :func:`quantize_model`: quantized ``nn.Linear`` layers (QAT and PTQ)
* :func:`hnlq_hook`, :class:`HNLQHookState`: a DDP communication hook sending HNLQ codes
"""

from torch_bridge.autograd import jax_function
from torch_bridge.codec import decode, encode, quantize
from torch_bridge.ddp import HNLQHookState, hnlq_hook
from torch_bridge.interop import to_jax, to_torch
from torch_bridge.lut import dot, dot_one_sided, matmul, matmul_one_sided
from torch_bridge.qlinear import QLinear, quantize_model

__all__ = ["HNLQHookState", "QLinear", "decode", "dot", "dot_one_sided", "encode", "hnlq_hook",
           "jax_function", "matmul", "matmul_one_sided", "quantize", "quantize_model", "to_jax",
           "to_torch"]

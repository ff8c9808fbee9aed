"""torch_bridge: HNLQ for PyTorch users, running the JAX code through zero-copy DLPack.

* :func:`to_jax`, :func:`to_torch`, :func:`x64_for`: DLPack exchange (aliasing and 64-bit rules
  in :mod:`torch_bridge.interop`)
* :class:`Codes`: compact codes as tensors (``index``, ``tfield``, ``scale``), the torch
  counterpart of :class:`hnlq_jax.Codes` (``Codes.from_jax`` / ``codes.to_jax()``)
* :func:`encode`, :func:`decode`, :func:`quantize`, :func:`matmul` (weight-only, on codes):
  the front doors on tensors, bit for bit with :mod:`hnlq_jax`; ``torch.ops.hnlq`` custom ops
  (:mod:`torch_bridge.ops`), usable under ``torch.compile(fullgraph=True)``;
  :func:`encode_rows` makes weight codes
* :mod:`torch_bridge.lut`: lookup-table products of codes (:mod:`hnlq_jax.lut`)
* :func:`jax_function`: any JAX function as a differentiable torch function (its ``jax.vjp``)
* :class:`QLinear`: quantization-aware training (float master weight, cached codes)
* :func:`quantize_model`, :class:`QuantizedLinear`: post-training quantization to layers that
  hold only codes, scales and bias (the report: :class:`hnlq_jax.sizes.QuantizeReport`);
  :func:`load_quantized` restores such a model from its state dict without encoding, and
  :func:`model_sizes` reports its sizes; :class:`SplitMultiheadAttention` is the
  ``nn.MultiheadAttention`` whose projections it converts
* :func:`hnlq_hook`, :class:`HNLQHookState`: a DDP communication hook sending HNLQ codes
"""

from torch_bridge import lut
from torch_bridge.autograd import jax_function
from torch_bridge.codec import Codes, decode, encode, encode_rows, matmul, quantize
from torch_bridge.ddp import HNLQHookState, hnlq_hook
from torch_bridge.interop import to_jax, to_torch, x64_for
from torch_bridge.attention import SplitMultiheadAttention
from torch_bridge.qlinear import QLinear
from torch_bridge.quantized import (QuantizedLinear, QuantizeReport, load_quantized, model_sizes,
                                    quantize_model)

__all__ = ["Codes", "HNLQHookState", "QLinear", "QuantizeReport", "QuantizedLinear",
           "SplitMultiheadAttention", "decode", "encode", "encode_rows", "hnlq_hook",
           "jax_function", "load_quantized", "lut", "matmul", "model_sizes", "quantize",
           "quantize_model", "to_jax", "to_torch", "x64_for"]

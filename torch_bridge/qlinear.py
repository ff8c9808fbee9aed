"""``QLinear``: a drop-in ``torch.nn.Linear`` with HNLQ-quantized weights (and activations).

The weight format is :mod:`hnlq_jax.rows`, the same as the Flax ``QDense``: row j of
``weight[out, in]`` is divided by ``c_j = beta * rms(weight_j)`` and coded in d-blocks along
``in``, so the codes of a ``QLinear`` and a ``QDense`` with the same weights are identical.
"""

from __future__ import annotations

import numpy as np
import torch

import hnlq_jax as hq
from hnlq_jax import HNLQConfig
from hnlq_jax.codec import Codes, to_blocks
from hnlq_jax.rows import row_rms, rows_codes, rows_decode
from torch_bridge.interop import to_jax, to_torch

__all__ = ["QLinear", "quantize_model"]

STE_MODES = ("identity", "clipped")
CALIBRATION_BLOCKS = 4096


class _StraightThrough(torch.autograd.Function):
    """Forward ``w_hat`` exactly; the gradient goes to ``w`` (times ``mask`` unless None)."""

    @staticmethod
    def forward(ctx, w, w_hat, mask):
        ctx.save_for_backward(mask)
        return w_hat.clone()

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return (g if mask.numel() == 0 else g * mask), None, None


def _calibrated_beta(weight: torch.Tensor, config: HNLQConfig) -> float:
    """The paper's beta grid search on (up to 4096 sampled) row-normalized blocks."""
    w = to_jax(weight.detach().float())
    blocks = np.asarray(to_blocks(w / row_rms(w)[:, None], config.d)).reshape(-1, config.d)
    if len(blocks) > CALIBRATION_BLOCKS:
        pick = np.random.default_rng(0).choice(len(blocks), CALIBRATION_BLOCKS, replace=False)
        blocks = blocks[np.sort(pick)]
    return hq.calibrate_beta(blocks, config)[0]


class QLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward pass uses HNLQ-quantized weights (straight-through backward).

    Same parameters (``weight [out, in]``, ``bias [out]``) and initialization as ``nn.Linear``,
    so state dicts move between the two. Buffers: the cached codes ``labels [out, nb, M, d]``
    (uint8), ``T [out, nb]`` (int8), ``scale [out]`` and the decoded ``w_hat`` (not saved).

    Args:
      in_features, out_features, bias, device, dtype: as ``nn.Linear``.
      config: the quantizer (lattice, q, M, alpha, max_T; beta see ``calibrate``).
      quantize_weights: quantize the weight (default).
      quantize_activations: also quantize the input per token (row), beta from
        :func:`hnlq_jax.gaussian_beta`.
      ste: ``"identity"`` or ``"clipped"`` (no gradient in blocks that overloaded, T > 0).
      quantize_every: in training, re-quantize the weight every N forward calls (the codes are
        cached in between); ``0``: only :meth:`refresh_codes` does. Eval mode always uses the
        cached codes.
      calibrate: choose beta by the paper's grid search on this layer's row-normalized weight
        (at construction and in :meth:`from_linear`); ``False`` uses ``config.beta``.
    """

    def __init__(self, in_features: int, out_features: int, config: HNLQConfig, bias: bool = True,
                 *, quantize_weights: bool = True, quantize_activations: bool = False,
                 ste: str = "identity", quantize_every: int = 1, calibrate: bool = True,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if not isinstance(config, HNLQConfig):
            raise TypeError(f"QLinear: config must be an hnlq_jax.HNLQConfig, got "
                            f"{type(config).__name__}")
        if ste not in STE_MODES:
            raise ValueError(f"QLinear: ste must be one of {STE_MODES}, got {ste!r}")
        if isinstance(quantize_every, bool) or not isinstance(quantize_every, int) or \
                quantize_every < 0:
            raise ValueError(f"QLinear: quantize_every must be an int >= 0, got {quantize_every!r}")
        self.config, self.ste = config, ste
        self.quantize_weights, self.quantize_activations = quantize_weights, quantize_activations
        self.quantize_every, self.calibrate = quantize_every, calibrate
        self.beta = _calibrated_beta(self.weight, config) if calibrate else config.beta
        nb = -(-in_features // config.d)
        self.register_buffer("labels", torch.zeros(out_features, nb, config.M, config.d,
                                                   dtype=torch.uint8, device=device))
        self.register_buffer("T", torch.zeros(out_features, nb, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, device=device))
        self.register_buffer("w_hat", torch.zeros_like(self.weight), persistent=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        if quantize_weights:
            self.refresh_codes()

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: HNLQConfig, **kwargs) -> QLinear:
        """A ``QLinear`` with ``linear``'s weights (post-training quantization when used in eval).

        Beta is calibrated on these weights unless ``calibrate=False``.
        """
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"QLinear.from_linear: expected an nn.Linear, got "
                            f"{type(linear).__name__}")
        q = cls(linear.in_features, linear.out_features, config, linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype,
                **{**kwargs, "calibrate": False, "quantize_weights": False})
        with torch.no_grad():
            q.weight.copy_(linear.weight)
            if linear.bias is not None:
                q.bias.copy_(linear.bias)
        q.calibrate = kwargs.get("calibrate", True)
        q.quantize_weights = kwargs.get("quantize_weights", True)
        q.beta = _calibrated_beta(q.weight, config) if q.calibrate else config.beta
        if q.quantize_weights:
            q.refresh_codes()
        q.train(linear.training)
        return q

    @torch.no_grad()
    def refresh_codes(self):
        """Re-quantizes the weight now (codes, scales and ``w_hat``)."""
        w = to_jax(self.weight.detach().float())
        codes, c = rows_codes(w, self.config, self.beta)
        self.labels = to_torch(codes.labels, copy=True)
        self.T = to_torch(codes.T, copy=True)
        self.scale = to_torch(c, copy=True)
        self.w_hat = to_torch(rows_decode(codes, c, self.config, self.in_features,
                                          w.dtype), copy=True).to(self.weight.dtype)

    def codes(self) -> Codes:
        """The cached codes as :class:`hnlq_jax.Codes` (JAX arrays)."""
        return Codes(to_jax(self.labels), to_jax(self.T))

    def _mask(self):
        if self.ste == "identity":
            return torch.empty(0)
        keep = (self.T == 0).to(self.weight.dtype).repeat_interleave(self.config.d, dim=1)
        return keep[:, : self.in_features]

    def _quantize_rows(self, x):
        flat = x.reshape(-1, x.shape[-1])
        codes, c = rows_codes(to_jax(flat.detach().float()), self.config,
                              hq.gaussian_beta(self.config))
        x_hat = to_torch(rows_decode(codes, c, self.config, x.shape[-1], np.float32), copy=True)
        return _StraightThrough.apply(flat, x_hat.to(x.dtype), torch.empty(0)).reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QLinear: expected input [..., {self.in_features}], got "
                             f"{tuple(x.shape)}")
        w = self.weight
        if self.quantize_weights:
            if self.training:
                if self.quantize_every and int(self.step) % self.quantize_every == 0:
                    self.refresh_codes()
                self.step += 1
            w = _StraightThrough.apply(self.weight, self.w_hat, self._mask())
        if self.quantize_activations:
            x = self._quantize_rows(x)
        return torch.nn.functional.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        c = self.config
        return (f"{super().extra_repr()}, lattice={c.lattice}, q={c.q}, M={c.M}, "
                f"beta={self.beta:.4g}, weights={self.quantize_weights}, "
                f"activations={self.quantize_activations}, ste={self.ste}")


def quantize_model(model: torch.nn.Module, config: HNLQConfig, filter_fn=None,
                   **kwargs) -> torch.nn.Module:
    """Replaces the ``nn.Linear`` layers of ``model`` in place by :meth:`QLinear.from_linear`.

    Args:
      model: any module.
      config: the quantizer.
      filter_fn: ``filter_fn(name, linear) -> bool``; only layers where it is true are
        replaced (default: all). ``name`` is the qualified name, as in ``named_modules``.
      **kwargs: ``QLinear`` options (``quantize_activations``, ``ste``, ...).

    Returns:
      ``model`` (modified in place).
    """
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is torch.nn.Linear and (filter_fn is None or filter_fn(name, m))]
    for name, lin in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QLinear.from_linear(lin, config, **kwargs))
    return model

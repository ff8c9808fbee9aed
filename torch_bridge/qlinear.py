"""``QLinear``: a drop-in ``torch.nn.Linear`` for quantization-aware training with HNLQ.

It keeps the float master weight (trained as usual) and caches the compact row codes of it
(the format of :mod:`torch_bridge.quantized` and the Flax ``QDense``, so both give the same codes
and the same beta for the same weights). The forward value is ``torch.ops.hnlq.matmul`` on the
codes (:func:`hnlq_jax.matmul`, bit for bit; on CPU tensors from ``torch_bridge.ops.GEMM_ROWS``
rows in torch's GEMM's sum order), in training and in eval mode alike; the backward
pass is straight-through:

* ``dL/dx``: the exact gradient of the product with the decoded weight (``matmul``'s);
* ``dL/dW = dL/dW_hat`` (``ste="identity"``), or zero in blocks that overloaded, ``T != 0``
  (``ste="clipped"``).

The state dict holds ``weight`` and ``bias`` (as ``nn.Linear``), the calibrated ``beta``, the
codes (``index``, ``tfield``, ``scale``), the training ``step`` and, in the extra state, the
config and :data:`hnlq_jax.FORMAT_VERSION`: a reloaded layer computes exactly as the saved one,
and a state dict of another config or version is refused. A plain ``nn.Linear`` state dict
loads with ``strict=False``: the codes are then made from the loaded weight.
"""

from __future__ import annotations

import torch

from hnlq_jax.config import HNLQConfig, check_beta
from hnlq_jax.rows import bucket_rows
from hnlq_jax.stats import gaussian_beta
from torch_bridge.codec import decode, encode_rows
from torch_bridge.quantized import CodesLayer, calibrated_beta, check_weight, has_codes

__all__ = ["QLinear"]

STE_MODES = ("identity", "clipped")


class _Through(torch.autograd.Function):
    """Forward ``value``; backward: the incoming gradient to ``value`` and to ``proxy`` alike.

    The straight-through estimator: ``proxy`` is a differentiable stand-in (same shape) whose
    gradient is the one wanted for the quantized value.
    """

    @staticmethod
    def forward(ctx, value, proxy):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, g):
        return g, g


def _keep(codes_T: torch.Tensor, d: int, n: int, dtype) -> torch.Tensor:
    """``[rows, n]`` mask of the clipped STE: 1 where the block did not overload (``T == 0``)."""
    return (codes_T == 0).to(dtype).repeat_interleave(d, dim=-1)[..., :n]


class QLinear(CodesLayer, torch.nn.Linear):
    """``nn.Linear`` with HNLQ quantization-aware training (see the module docstring).

    Args:
      in_features, out_features, bias, device, dtype: as ``nn.Linear`` (same parameters and
        initialization).
      config: the quantizer (lattice, q, M, alpha, max_T; beta see ``calibrate``).
      quantize_weights: quantize the weight (default); ``False``: a plain linear layer.
      quantize_activations: also quantize the input per token (row).
      ste: ``"identity"`` or ``"clipped"``.
      quantize_every: in training, re-quantize the weight every N forward calls; ``0``: only
        :meth:`refresh_codes` does. With N != 1 the layer also keeps the quantization error of
        the last refresh (buffer ``error = W_hat - W``, ``[out, in]``) and training calls between
        refreshes compute with ``W + error``, so the layer follows the optimizer instead of
        standing still at its cached codes (as the Flax ``QDense``). Eval mode always uses the
        cached codes.
      calibrate: the weight's beta from :func:`hnlq_jax.rows.calibrate_rows` (at construction,
        in :meth:`from_linear` and by :meth:`calibrate_beta`; stored in the ``beta`` buffer), the
        activations' from :func:`hnlq_jax.gaussian_beta`; ``False`` uses ``config.beta``.
      implementation: the :func:`hnlq_jax.matmul` implementation (``None``: the default).
    """

    def __init__(self, in_features: int, out_features: int, config: HNLQConfig, bias: bool = True,
                 *, quantize_weights: bool = True, quantize_activations: bool = False,
                 ste: str = "identity", quantize_every: int = 1, calibrate: bool = True,
                 implementation=None, device=None, dtype=None):
        if in_features < 1 or out_features < 1:  # nothing to code or calibrate on
            raise ValueError(f"QLinear: in_features and out_features must be >= 1, got "
                             f"{in_features} and {out_features}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if not isinstance(config, HNLQConfig):
            raise TypeError(f"QLinear: config must be an hnlq_jax.HNLQConfig, got "
                            f"{type(config).__name__}")
        if ste not in STE_MODES:
            raise ValueError(f"QLinear: ste must be one of {STE_MODES}, got {ste!r}")
        self.config, self.ste, self.implementation = config, ste, implementation
        self.quantize_weights, self.quantize_activations = quantize_weights, quantize_activations
        self.calibrate = calibrate
        self.quantize_every = quantize_every
        self._register_codes(config, device, torch.promote_types(self.weight.dtype,
                                                                 torch.float32))
        self.register_buffer("beta", torch.tensor(config.beta, dtype=torch.float32,
                                                  device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        # (a layer on the meta device has no values to code: its codes stay unset until a
        # state dict loads, as into an nn.Linear there)
        if quantize_weights and self.weight.device.type != "meta":
            self.calibrate_beta()
            self.refresh_codes()

    @property
    def quantize_weights(self) -> bool:
        """Whether the weight is quantized (see the constructor); turned on, the layer codes
        its current weight (at a beta calibrated on it where the layer never had codes)."""
        return self._quantize_weights

    @quantize_weights.setter
    def quantize_weights(self, on: bool):
        turned_on = on and getattr(self, "_quantize_weights", None) is False
        # (not while the constructor runs; on the meta device there is nothing to code)
        if turned_on and "tfield" in self._buffers and self.weight.device.type != "meta":
            beta = self.beta.clone()
            try:  # coded first: a weight that cannot be coded leaves the layer as it was
                if not has_codes(self.tfield):
                    self.calibrate_beta()
                self.refresh_codes()
            except Exception:
                with torch.no_grad():
                    self.beta.copy_(beta)
                raise
        self._quantize_weights = bool(on)

    def __setstate__(self, state):
        # a layer pickled when quantize_weights was a plain attribute
        if "quantize_weights" in state:
            state["_quantize_weights"] = state.pop("quantize_weights")
        super().__setstate__(state)

    @property
    def quantize_every(self) -> int:
        """The refresh interval in training (see the constructor); may be changed at any time."""
        return self._quantize_every

    @quantize_every.setter
    def quantize_every(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"QLinear: quantize_every must be an int >= 0, got {n!r}")
        self._quantize_every = n
        if n == 1:  # refreshing every call needs no copy of the error
            self._buffers.pop("error", None)
        elif "error" not in self._buffers:
            self.register_buffer("error", torch.zeros_like(self.weight, requires_grad=False))
            if self.quantize_weights and "tfield" in self._buffers:  # codes made: their error
                self._error_from_codes()

    def _error_from_codes(self):
        """Sets the cached ``error`` to the current codes' quantization error."""
        with torch.no_grad():
            self.error.copy_(decode(self.codes(), dtype=self.weight.dtype) - self.weight)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: HNLQConfig, **kwargs) -> QLinear:
        """A ``QLinear`` with ``linear``'s weights, beta calibrated on them (unless
        ``calibrate=False``) and codes made from them; ``kwargs`` as the constructor."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"QLinear.from_linear: expected an nn.Linear, got "
                            f"{type(linear).__name__}")
        if kwargs.get("quantize_weights", True):
            check_weight(linear.weight, "QLinear.from_linear")
        q = cls(linear.in_features, linear.out_features, config, linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype,
                **{**kwargs, "quantize_weights": False})
        with torch.no_grad():
            q.weight.copy_(linear.weight)
            if linear.bias is not None:
                q.bias.copy_(linear.bias)
        q.quantize_weights = kwargs.get("quantize_weights", True)  # calibrates and codes
        return q.train(linear.training)

    @torch.no_grad()
    def calibrate_beta(self):
        """Sets ``beta`` from the current weight (``config.beta`` when ``calibrate=False``)."""
        self.beta.fill_(float(calibrated_beta(self.weight, self.config, self.calibrate)))

    # The JAX encoder is not traceable by torch.compile: a compiled training step breaks its
    # graph here (and in _quantize_rows) and runs the refresh eagerly.
    @torch.compiler.disable
    @torch.no_grad()
    def refresh_codes(self):
        """Re-quantizes the weight now at the stored ``beta`` (codes, scales and, with
        ``quantize_every != 1``, the quantization error).

        Raises:
          ValueError: a weight entry has grown too far above its row's RMS for the stored
            beta (call :meth:`calibrate_beta` first, or raise ``max_T``).
        """
        args = (self.weight.detach(), self.config)
        kwargs = dict(beta=self.beta, implementation=self.implementation)
        try:  # (the common case checks the codes with one compiled reduction)
            codes = encode_rows(*args, **kwargs)
        except ValueError as error:
            try:
                failed = encode_rows(*args, **kwargs, failures="mark").T < 0
            except ValueError:
                failed = None
            if failed is None or not bool(failed.any()):  # another error (a NaN weight)
                raise error from None
            first = [int(i) for i in torch.nonzero(failed)[0]]
            # the layer's remedies: its beta is the stored one, not config.beta
            raise ValueError(
                f"QLinear.refresh_codes: {int(failed.sum())} block(s) still overload at max_T = "
                f"{self.config.max_T} (the first at block {first}): an entry of the weight has "
                f"grown far above its row's RMS for the stored beta = {float(self.beta):.4g}; "
                "call layer.calibrate_beta() (a beta for the weight as it is now), raise "
                "config.max_T, or clip the weight's outliers") from None
        self.set_codes(codes)
        if self.quantize_every != 1:
            self.error.copy_(decode(self.codes(), dtype=self.weight.dtype) - self.weight)

    def _weight_proxy(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ (W * mask)^T`` with x detached: its gradient in W is the straight-through one."""
        w = self.weight
        if self.ste == "clipped":
            w = w * _keep(self.codes().T, self.config.d, self.in_features, w.dtype)
        return torch.nn.functional.linear(x.detach().to(w.dtype), w)

    @torch.compiler.disable
    def _quantize_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Straight-through per-row quantization of the activations ``x[..., k]``."""
        k = x.shape[-1]
        flat = x.reshape(-1, k)
        rows = flat.shape[0]
        # Rows padded to a bucket: a stream of batch sizes compiles the encoder O(log n) times.
        padded = torch.nn.functional.pad(flat.detach(),
                                         (0, 0, 0, bucket_rows(rows, k, self.config) - rows))
        beta = gaussian_beta(self.config) if self.calibrate else self.config.beta
        # Marked, as under jit in Flax: an activation row too heavy-tailed for beta decodes to
        # NaN in this forward instead of stopping it.
        codes = encode_rows(padded, self.config, beta=beta, failures="mark")
        x_hat = decode(codes, dtype=x.dtype)[:rows]
        proxy = flat
        if self.ste == "clipped":
            proxy = flat * _keep(codes.T[:rows], self.config.d, k, x.dtype)
        return _Through.apply(x_hat, proxy).reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QLinear: expected input [..., {self.in_features}], got "
                             f"{tuple(x.shape)}")
        if self.quantize_activations:
            x = self._quantize_rows(x)
        if not self.quantize_weights:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        cached = self.training and self.quantize_every != 1
        if self.training:
            if self.quantize_every and int(self.step) % self.quantize_every == 0:
                self.refresh_codes()
                cached = False  # exactly the fresh codes' weights
            self.step += 1
        if cached:
            y = torch.nn.functional.linear(x, (self.weight + self.error).detach().to(x.dtype))
        else:
            y = self.codes_matmul(x)
        if torch.is_grad_enabled() and self.weight.requires_grad:
            y = _Through.apply(y, self._weight_proxy(x).to(y.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _apply(self, fn, recurse=True):
        # beta stays float32 (as the layer keeps it in any dtype, and QDense): .half() or
        # .bfloat16() would round it, and every later refresh would code with another beta.
        # The row scales likewise stay at least float32, as a layer built in half keeps them.
        beta, scale = self.beta, self.scale
        super()._apply(fn, recurse)
        if self.beta.dtype != torch.float32:
            self.beta = beta.to(self.beta.device)
        if self.scale.dtype.itemsize < 4:
            self.scale = scale.to(self.scale.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "beta"
        if key in state_dict:  # checked before loading: a corrupted beta codes garbage
            try:
                check_beta(torch.as_tensor(state_dict[key]).detach().to("cpu", torch.float64),
                           f"QLinear (loading {key})",
                           what="a positive finite scalar (a corrupted checkpoint?)")
            except ValueError as e:
                error_msgs.append(str(e))
                return
        error = state_dict.get(prefix + "error")
        if isinstance(error, torch.Tensor) and not bool(torch.isfinite(error.detach()).all()):
            # The training forward adds it to the weight: NaN outputs, without a word.
            error_msgs.append(f"QLinear (loading {prefix}error): the cached quantization error "
                              "holds NaN or Inf (a corrupted checkpoint?)")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if (self.quantize_weights and prefix + "weight" in state_dict
                and (prefix + "index" not in state_dict or not has_codes(self.tfield))):
            # a float checkpoint (strict=False), or a QLinear's that never coded its weight
            self.calibrate_beta()
            self.refresh_codes()
        # `error` is a training cache that quantize_every = 1 keeps none of: a state saved with
        # another interval loads all the same (ignored, or computed from the loaded codes).
        key = prefix + "error"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key in missing_keys:
            missing_keys.remove(key)
            if self.quantize_weights and prefix + "index" in state_dict:
                self._error_from_codes()

    def extra_repr(self) -> str:
        c = self.config
        return (f"{super().extra_repr()}, lattice={c.lattice}, q={c.q}, M={c.M}, "
                f"beta={float(self.beta):.4g}, weights={self.quantize_weights}, "
                f"activations={self.quantize_activations}, ste={self.ste}")

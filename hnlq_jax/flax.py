"""Quantization-aware training and quantized inference in Flax: :class:`QDense`,
:class:`QuantDotGeneral` and the inference form (:func:`export_params`), which post-training
quantization of a float model's Dense, DenseGeneral and Einsum layers also produces
(:func:`quantize_params`); the float model itself computes from it inside :func:`use_codes`.

**Weight format.** A kernel ``W[in, out]`` is held as the row :class:`~hnlq_jax.Codes` of
``W^T`` (:func:`hnlq_jax.rows.rows_codes`): output unit ``j`` is divided by
``c_j = beta * rms(W[:, j])`` and coded in d-blocks along the input features at unit beta, so
``codes.config == unit(config)`` and ``codes.scale == c``. For D4 q=4 M=2 that is 4 bits of
codebook index and 1 bit of T field per weight, plus one float32 scale per output unit.

**Beta.** The same rule in :class:`QDense` and :class:`QuantDotGeneral` (and PyTorch's
``QLinear``): with ``calibrate=True`` the weights' beta is
:func:`hnlq_jax.rows.calibrate_rows` of the kernel (the paper's grid search on a fixed sample of
its row-normalized blocks), so the same kernel gets the same beta and the same codes everywhere;
QDense runs it once, at initialization, and stores it; the stateless hook runs it per call.
Activations, normalized per token to unit RMS, use :func:`~hnlq_jax.gaussian_beta`. With
``calibrate=False`` both use ``config.beta``.

**Forward and backward.** The forward pass is :func:`hnlq_jax.matmul` on the codes
(``compute="decode"``: its default implementation, the native kernel on a CPU where it is
built (else XLA decode-then-dot), the fused Pallas kernels on a GPU; ``"kernel"``: the Pallas kernel everywhere; ``"lut"``: x's
one-sided lookup tables gathered by the codes). The backward pass is straight-through
(:func:`hnlq_jax._numerics.straight_through`), as for ``x @ W_hat``:

* ``ste="identity"``: ``dL/dW = dL/dW_hat``, ``dL/dx = dL/dy W_hat^T``;
* ``ste="clipped"``: the same, but ``dL/dW`` is zero in blocks that overloaded (``T != 0``).

**Variables.** Training form (``QDense.init``): ``params`` holds ``kernel [in, out]`` and
``bias [out]`` exactly as ``nn.Dense`` (a checkpoint moves between the two); the ``hnlq``
collection holds ``beta`` (float32), ``codes`` (the kernel's row codes), the training
``step`` and, with ``quantize_every != 1``, ``error`` (``W_hat - kernel^T`` at the last refresh:
between refreshes training computes with ``kernel^T + error``). Inference form (:func:`export_params`): ``params`` without the quantized kernels and
``hnlq`` with only ``codes``; the same model applies it through :func:`hnlq_jax.matmul`.

**Saving.** ``Codes`` are registered with :mod:`flax.serialization`: their state dict records
:data:`hnlq_jax.FORMAT_VERSION` and the config next to the arrays, so
``flax.serialization.to_bytes`` / ``from_bytes`` and orbax ``PyTreeCheckpointer`` checkpoints
of ``to_state_dict`` round-trip bit for bit, and restoring codes of another config or format
version raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.core
import flax.linen as nn
from flax import serialization, traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import ops, ptq
from hnlq_jax._numerics import straight_through
from hnlq_jax.codes import (Codes, check_checksum, check_codes, check_header_checksum,
                            check_saved_header, checksum, header_checksum, is_concrete,
                            read_saved_header, saved_header)
from hnlq_jax.config import HNLQConfig, check_beta, check_config, saved_int
from hnlq_jax.incoherence import Rotation
from hnlq_jax.layouts import KernelLayout, LayerCall, dense_call, layer_call
from hnlq_jax.sizes import QuantizeReport, Sizes, measure
from hnlq_jax.rows import (bucket_rows, calibrate_rows, check_finite_weight, check_row_failures,
                           rows_codes, unit)
from hnlq_jax.stats import gaussian_beta

__all__ = [
    "QDense",
    "QUANTIZE_EVERY",
    "QuantDotGeneral",
    "export_params",
    "gaussian_beta",
    "import_params",
    "model_sizes",
    "quantize_params",
    "refresh_codes",
    "use_codes",
]

STE_MODES = ("identity", "clipped")
# compute mode -> hnlq_jax.matmul implementation (None: the backend's default).
COMPUTE_MODES = {"decode": None, "kernel": "pallas", "lut": "lut"}
COLLECTION = "hnlq"
# A rotated layer's codes (of W R, applied to x R) sit under their own key, beside its
# "rotation": restoring a rotated export into a target without rotations (or the reverse) then
# fails on the missing key, where a shared "codes" key would restore and compute garbage.
CODES_KEYS = {False: "codes", True: "rotated_codes"}
# A layer's kernel layout (hnlq_jax.layouts.KernelLayout) sits beside its codes unless the
# kernel is the nn.Dense [in, out] (the only layout of earlier saves, and of QDense).
LAYOUT_KEY = "layout"
# QDense's default refresh interval: a training step then costs <= 2x a float step on the
# digits MLP at the accuracy of refreshing every step (experiments/qat_digits.py, 3 seeds;
# docs/flax.md, "Refresh schedule"). Encoding the kernel every step costs 6-7x on CPU there.
QUANTIZE_EVERY = 16


def _check_knobs(config, ste, compute, quantize_every, where: str):
    check_config(config, where)
    if ste not in STE_MODES:
        raise ValueError(f"{where}: ste must be one of {STE_MODES}, got {ste!r}")
    if compute not in COMPUTE_MODES:
        raise ValueError(f"{where}: compute must be one of {tuple(COMPUTE_MODES)}, got "
                         f"{compute!r}")
    if (isinstance(quantize_every, bool) or not isinstance(quantize_every, int)
            or quantize_every < 0):
        raise ValueError(f"{where}: quantize_every must be an int >= 0, got {quantize_every!r}")


def _weight_beta(kernel, config: HNLQConfig, calibrate: bool):
    """``[]`` float32 beta of a kernel ``[in, out]``: :func:`calibrate_rows` of its rows
    (output units) when ``calibrate``, else ``config.beta``."""
    if calibrate:
        return calibrate_rows(jax.lax.stop_gradient(kernel).T, config)
    return jnp.asarray(config.beta, jnp.float32)


def _act_beta(config: HNLQConfig, calibrate: bool, quantize_activations: bool):
    """Beta of the per-token activations (None: not quantized)."""
    if not quantize_activations:
        return None
    return gaussian_beta(config) if calibrate else config.beta


def _kernel_codes(kernel, config: HNLQConfig, beta) -> Codes:
    """Row codes of a kernel ``[in, out]``: blocks ``[out, ceil(in/d)]``, scales ``[out]``."""
    return rows_codes(jax.lax.stop_gradient(kernel).T, config, beta)


def _decoded(codes: Codes, kernel_t):
    """``(W_hat, W_hat - kernel^T)``, both ``[out, in]`` in the kernel's dtype: the codes'
    weight and their quantization error."""
    w_hat = ops.decode(codes, dtype=kernel_t.dtype)
    return w_hat, w_hat - kernel_t


def _ste_mask(codes: Codes, ste: str, dtype):
    """Straight-through mask ``[rows, n]`` of row codes (None: let every gradient through)."""
    if ste == "identity":
        return None
    keep = jnp.repeat((codes.T == 0).astype(dtype), codes.config.d, axis=-1)  # [rows, nb * d]
    return keep[:, :codes.n]


def _quantize_rows(x, config: HNLQConfig, beta, ste: str):
    """Straight-through quantization of the rows of ``x[..., k]`` with per-row scales."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if is_concrete(flat):
        # Eager calls pad the rows to the blocks of an ops.bucket, so a stream of batch sizes
        # compiles the encoder O(log n) times. Under a transformation the caller's program owns
        # the shapes.
        flat = jnp.pad(flat, ((0, bucket_rows(rows, k, config) - rows), (0, 0)))
    codes = rows_codes(jax.lax.stop_gradient(flat), config, beta)
    x_hat = ops.decode(codes, dtype=x.dtype)[:rows]
    mask = _ste_mask(codes, ste, x.dtype)
    mask = None if mask is None else mask[:rows]
    return straight_through(flat[:rows], x_hat, mask).reshape(x.shape)


def _forward(x, kernel, codes: Codes, ste: str, compute: str, act_beta, precision,
             weight=None):
    """``x[..., in] @ W_hat[in, out]`` from the codes, with straight-through gradients.

    The value is :func:`hnlq_jax.matmul`'s. The gradients are those of ``x @ W_ste`` where
    ``W_ste`` is ``W_hat`` forward and passes its gradient straight through to ``kernel``;
    under ``jit`` that product is dead code when nothing differentiates it, and eager calls on
    concrete arrays (which nothing can differentiate) skip it. ``kernel=None``: the inference
    form, which has no kernel to train.

    ``weight`` (``[out, in]``, training with cached codes): the forward weight to use instead
    of the codes' ``W_hat``, computed as that one product; the gradients are unchanged.
    """
    if act_beta is not None:
        x = _quantize_rows(x, codes.config, act_beta, ste)
    if weight is None:
        y = ops.matmul(x, codes, implementation=COMPUTE_MODES[compute]).astype(x.dtype)
        if kernel is None or (is_concrete(x) and is_concrete(kernel)):
            return y
    w_hat = ops.decode(codes, dtype=kernel.dtype) if weight is None else weight  # [out, in]
    w_ste = straight_through(kernel.T, w_hat, _ste_mask(codes, ste, kernel.dtype))
    # In the compute dtype, as nn.Dense casts its kernel.
    y_ste = jax.lax.dot_general(x, w_ste.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                                precision=precision)
    return y_ste if weight is not None else straight_through(y_ste, jax.lax.stop_gradient(y),
                                                             None)


def _check_layer_codes(codes, config: HNLQConfig, k: int, features: int, where: str):
    """The cached codes must be this layer's: its config and a kernel^T ``[features, k]``."""
    if not isinstance(codes, Codes):
        raise TypeError(f"{where}: the {COLLECTION!r} collection must hold hnlq_jax.Codes under "
                        f"'codes', got {type(codes).__name__}; see hnlq_jax.flax.import_params")
    if codes.config != unit(config):
        raise ValueError(f"{where}: the layer's codes were made with {codes.config}, but the "
                         f"layer is configured with {unit(config)} (beta lives in the scales); "
                         "re-export the model with this config or build the layer with theirs")
    if codes.n != k or len(codes.blocks_shape) != 2 or codes.blocks_shape[0] != features:
        raise ValueError(f"{where}: expected row codes of a kernel^T [{features}, {k}], got "
                         f"codes of shape {list(codes.shape)} (blocks {list(codes.blocks_shape)})")
    if codes.scale is None:  # unit-beta codes without their row scales decode to W / c
        raise ValueError(f"{where}: the layer's codes have no row scales (a layer's codes are "
                         "hnlq_jax.rows codes with scale [features]); export the model again")


@dataclasses.dataclass(frozen=True)
class QuantDotGeneral:
    """A ``dot_general`` that quantizes its right operand (the kernel) with HNLQ on every call.

    For ``nn.Dense(dot_general_cls=functools.partial(QuantDotGeneral, config=cfg))`` (linen) and
    ``nnx.Linear(dot_general=QuantDotGeneral(cfg))`` (nnx). Stateless: the kernel's beta and
    codes are made per call by the rule of the module docstring, so its outputs and gradients
    are those of a :class:`QDense` initialized on the same kernel (``quantize_every=1``, the
    same ``calibrate``). The beta search costs about 15 ms per call and layer on a 2-core CPU
    whatever the layer's size: for speed, search once
    (``calibrate_rows(kernel.T, config)``) and pass ``calibrate=False`` with that ``config.beta``.

    Attributes:
      config: lattice, q, M, alpha, max_T (and beta, see ``calibrate``).
      quantize_activations: also quantize the left operand per token.
      ste: ``"identity"`` or ``"clipped"``.
      compute: ``"decode"``, ``"kernel"`` or ``"lut"`` (see :class:`QDense`).
      calibrate: calibrate beta (default) instead of using ``config.beta``.
    """

    config: HNLQConfig = HNLQConfig()
    quantize_activations: bool = False
    ste: str = "identity"
    compute: str = "decode"
    calibrate: bool = True

    def __post_init__(self):
        _check_knobs(self.config, self.ste, self.compute, 1, "QuantDotGeneral")

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 **_):
        (lc, rc), (lb, rb) = dimension_numbers
        if (tuple(lb) or tuple(rb) or tuple(lc) != (lhs.ndim - 1,) or tuple(rc) != (0,)
                or rhs.ndim != 2):
            raise ValueError(
                "QuantDotGeneral: supports the Dense contraction lhs[..., k] x rhs[k, n] "
                f"(dimension_numbers (((lhs.ndim-1,), (0,)), ((), ()))), got {dimension_numbers} "
                f"for shapes {lhs.shape}, {rhs.shape}"
            )
        codes = _kernel_codes(rhs, self.config, _weight_beta(rhs, self.config, self.calibrate))
        y = _forward(lhs, rhs, codes, self.ste, self.compute,
                     _act_beta(self.config, self.calibrate, self.quantize_activations), precision)
        return y if preferred_element_type is None else y.astype(preferred_element_type)


class QDense(nn.Module):
    """A drop-in for ``flax.linen.Dense`` with HNLQ quantization-aware training.

    Applied to training variables (``params/kernel`` present) it trains; applied to the
    inference form of :func:`export_params` (codes, scales and bias only) it computes
    ``matmul(x, codes) + bias``.

    Attributes:
      features: output size.
      config: lattice, q, M, alpha, max_T of the quantizer (its ``beta`` is used only with
        ``calibrate=False``).
      use_bias: as ``nn.Dense``.
      quantize_weights: quantize the kernel (``False``: a plain Dense, e.g. for ablations).
      quantize_activations: also quantize the input per token (row).
      ste: straight-through variant, ``"identity"`` or ``"clipped"`` (zero gradient in blocks
        that overloaded).
      quantize_every: re-quantize the kernel every N training calls (default
        :data:`QUANTIZE_EVERY`); the codes are cached in the ``hnlq`` collection between
        refreshes, so apply with ``mutable=["hnlq"]`` (without it there is no cache to keep
        and every training call re-quantizes). Between refreshes the forward pass uses the
        current kernel plus the quantization error of the last refresh (exactly the codes' weights
        at a refresh), and the gradient reaches the kernel. ``0``: training calls use the
        cache too, and the loop refreshes it with :func:`refresh_codes`. Calls with
        ``deterministic=True`` quantize the kernel as it is (the cache, refreshed before the
        optimizer's last update, may be steps old) and leave the cache alone.
      compute: how :func:`hnlq_jax.matmul` runs: ``"decode"`` (its default implementation for
        the backend), ``"kernel"`` (the fused Pallas decode-matmul, which reads only the codes;
        interpret mode on a CPU, so slow there) or ``"lut"`` (one-sided lookup tables). The
        outputs agree to float rounding and the gradients are the same.
      calibrate: the weights' beta from :func:`~hnlq_jax.rows.calibrate_rows` of the kernel at
        initialization (stored as ``hnlq/beta``), the activations' from :func:`gaussian_beta`;
        ``False`` uses ``config.beta`` for both.
      deterministic: default for the call argument of the same name.
      dtype, param_dtype, precision, kernel_init, bias_init: as ``nn.Dense`` (``precision``
        applies to the product that carries the gradients).
    """

    features: int
    config: HNLQConfig = HNLQConfig()
    use_bias: bool = True
    quantize_weights: bool = True
    quantize_activations: bool = False
    ste: str = "identity"
    quantize_every: int = QUANTIZE_EVERY
    compute: str = "decode"
    calibrate: bool = True
    deterministic: bool | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, inputs, deterministic: bool | None = None):
        """Applies the layer.

        Args:
          inputs: ``[..., in]``.
          deterministic: evaluation: the codes of the current kernel, no training state
            changed (default: the attribute, else ``False``). The inference form is always
            deterministic.

        Returns:
          ``[..., features]``.

        Raises:
          ValueError: codes of another config or shape in the ``hnlq`` collection.
        """
        _check_knobs(self.config, self.ste, self.compute, self.quantize_every, "QDense")
        if deterministic is None:
            deterministic = bool(self.deterministic)
        x = jnp.asarray(inputs)
        if self.features < 1 or x.ndim == 0 or x.shape[-1] < 1:
            raise ValueError(f"{self._where()}: expected features >= 1 and inputs [..., in >= 1], "
                             f"got features={self.features} and inputs of shape {x.shape}")
        if (self.quantize_weights and not self.is_initializing()
                and not self.has_variable("params", "kernel")):
            return self._inference(x)
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        x, cast_kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        if not self.quantize_weights:
            y = jax.lax.dot_general(x, cast_kernel, (((x.ndim - 1,), (0,)), ((), ())),
                                    precision=self.precision)
        else:  # the codes are made from the parameter itself (param_dtype), not a cast of it
            y = self._quantized(x, kernel, deterministic)
        return y if bias is None else y + bias

    def _inference(self, x):
        """The inference form: ``matmul(x, codes) + bias`` (no kernel exists), or
        ``matmul(rotation.apply(x), codes) + bias`` when it holds a rotation
        (:func:`quantize_params` with ``rotate=True``)."""
        if not any(self.has_variable(COLLECTION, k) for k in CODES_KEYS.values()):
            raise ValueError(f"{self._where()}: neither params/kernel nor {COLLECTION}/codes "
                             "found; apply the variables of QDense.init or export_params")
        codes, rotation = _inference_codes(self, self._where())
        if isinstance(codes, Codes) and codes.n is not None and (x.ndim == 0
                                                                 or x.shape[-1] != codes.n):
            raise ValueError(f"{self._where()}: expected inputs [..., {codes.n}] "
                             f"(the layer's codes hold a [{self.features}, {codes.n}] kernel^T), "
                             f"got shape {tuple(x.shape)}")
        _check_layer_codes(codes, self.config, x.shape[-1], self.features, self._where())
        if rotation is not None:  # codes of W R: compute with x R
            x = _rotated(x, rotation, self._where())
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        x, bias = nn.dtypes.promote_dtype(x, bias, dtype=self.dtype)
        act_beta = _act_beta(self.config, self.calibrate, self.quantize_activations)
        y = _forward(x, None, codes, self.ste, self.compute, act_beta, self.precision)
        return y if bias is None else y + bias

    def _where(self) -> str:
        return f"QDense {self.name or '(root)'}"

    def _quantized(self, x, kernel, deterministic: bool):
        cfg = self.config
        if not (self.is_initializing() or self.is_mutable_collection(COLLECTION)
                or self.has_variable(COLLECTION, "beta")):
            raise ValueError(
                f"{self._where()}: params/kernel but no {COLLECTION}/beta and codes (a float "
                f"Dense checkpoint?): quantize it with one training call, "
                f"model.apply(variables, x, mutable=[{COLLECTION!r}]), and merge the returned "
                f"{COLLECTION!r} collection into the variables")
        beta = self.variable(COLLECTION, "beta", _weight_beta, kernel, cfg, self.calibrate)
        if is_concrete(beta.value):  # under jit a bad beta marks every block (NaN outputs)
            check_beta(beta.value, f"{self._where()}: {COLLECTION}/beta",
                       what="a positive finite scalar (a corrupted checkpoint?)")
        cache = self.variable(COLLECTION, "codes", _kernel_codes, kernel, cfg, beta.value)
        # With cached codes the forward weight is kernel^T plus the quantization error of the
        # last refresh, W_hat - kernel^T then ([out, in]): the weight follows the optimizer
        # between refreshes (a layer standing still for N steps made Adam overshoot), needs no
        # decode, and is exactly W_hat at a refresh. Refreshing every call needs no copy of it.
        now = jax.lax.stop_gradient(kernel).T
        mutable = self.is_mutable_collection(COLLECTION)
        # Variables made with quantize_every=1 hold no error: a mutable apply adds it, an
        # immutable one computes what it needs without it.
        error = (self.variable(COLLECTION, "error", lambda: _decoded(cache.value, now)[1])
                 if self.quantize_every != 1 and (self.is_initializing() or not deterministic)
                 and (mutable or self.has_variable(COLLECTION, "error")) else None)
        step = self.variable(COLLECTION, "step", jnp.zeros, (), jnp.int32)
        _check_layer_codes(cache.value, cfg, kernel.shape[0], self.features,
                           self._where())
        if error is not None:  # a restored training cache: the forward weight adds it
            if jnp.shape(error.value) != now.shape:
                raise ValueError(f"{self._where()}: {COLLECTION}/error must be [{self.features}, "
                                 f"{kernel.shape[0]}] (W_hat - kernel^T), got shape "
                                 f"{jnp.shape(error.value)}; restore the layer's own checkpoint")
            check_finite_weight(error.value, f"{self._where()}: {COLLECTION}/error",
                                "the cached quantization error (a corrupted checkpoint?)")

        def fresh():  # (codes, their error, the forward weight: exactly W_hat)
            codes = _kernel_codes(kernel, cfg, beta.value)
            w_hat, err = _decoded(codes, now)
            return codes, err, w_hat

        def cached():
            if error is None:
                w_hat, err = _decoded(cache.value, now)
                return cache.value, err, w_hat
            return cache.value, error.value, now + error.value

        weight = None
        if self.is_initializing():
            codes = cache.value
        elif deterministic:  # the codes of the kernel as it is now: a cache may be steps old
            codes = _kernel_codes(kernel, cfg, beta.value)
        elif self.quantize_every == 0:
            codes, _, weight = cached()
        elif mutable and self.quantize_every > 1:
            refresh = step.value % self.quantize_every == 0
            codes, err, weight = jax.lax.cond(refresh, fresh, cached)
            step.value = step.value + 1
            cache.value, error.value = codes, err
        else:  # every call (no cache to keep without a mutable collection)
            if mutable and error is not None:
                codes, error.value, _ = fresh()
            else:
                codes = _kernel_codes(kernel, cfg, beta.value)
            if mutable:
                step.value = step.value + 1
                cache.value = codes
        return _forward(x, kernel, codes, self.ste, self.compute,
                        _act_beta(cfg, self.calibrate, self.quantize_activations), self.precision,
                        weight)


def _inference_codes(module: nn.Module, where: str):
    """``(codes, rotation or None)`` of a layer's inference form (no kernel): the codes
    (``rotated_codes`` with their rotation, else ``codes``), refusing a training cache."""
    rotated = module.has_variable(COLLECTION, CODES_KEYS[True])
    if rotated != module.has_variable(COLLECTION, "rotation"):
        raise ValueError(
            f"{where}: {COLLECTION}/rotated_codes (codes of W R) and {COLLECTION}/rotation come "
            "together, got only one; restore rotated exports with hnlq_jax.flax.import_params")
    stale = [k for k in ("step", "error") if module.has_variable(COLLECTION, k)]
    if stale:  # codes without their kernel, cached by training: up to N - 1 steps old
        raise ValueError(
            f"{where}: {COLLECTION}/codes come with {COLLECTION}/{stale[0]}, a training cache "
            "(its codes may be quantize_every - 1 steps older than the kernel), but no "
            "params/kernel; restore the training variables and apply "
            "hnlq_jax.flax.export_params for the inference form")
    codes = module.get_variable(COLLECTION, CODES_KEYS[rotated])
    return codes, module.get_variable(COLLECTION, "rotation") if rotated else None


def _rotated(x, rotation, where: str):
    """``x R``: the input of a layer whose codes hold ``W R``."""
    if not isinstance(rotation, Rotation) or rotation.n != x.shape[-1]:
        raise ValueError(f"{where}: {COLLECTION}/rotation must be an incoherence.Rotation of "
                         f"size {x.shape[-1]}, got {rotation!r}")
    return rotation.apply(x)


def _from_codes(next_fun, args, kwargs, context):
    """:func:`use_codes`' interceptor: an ``nn.Dense`` / ``DenseGeneral`` / ``Einsum`` call
    without a kernel but with codes is computed from the codes."""
    module = context.module
    if (context.method_name != "__call__" or module.has_variable("params", "kernel")
            or not any(module.has_variable(COLLECTION, k) for k in CODES_KEYS.values())):
        return next_fun(*args, **kwargs)
    call = layer_call(module, args, kwargs)
    if call is None:  # QDense and other modules compute their codes themselves
        return next_fun(*args, **kwargs)
    where = f"use_codes: layer {_layer_name(tuple(module.path))}"
    if not isinstance(call, LayerCall):
        raise ValueError(f"{where} holds codes, but this call is not a product with its kernel: "
                         f"{call}")
    codes, rotation = _inference_codes(module, where)
    layout = (module.get_variable(COLLECTION, LAYOUT_KEY)
              if module.has_variable(COLLECTION, LAYOUT_KEY) else None)
    if layout is None and isinstance(codes, Codes) and len(codes.blocks_shape) == 2:
        layout = KernelLayout.dense(codes.n, codes.blocks_shape[0])
    if layout != call.layout:
        raise ValueError(
            f"{where}: its codes hold a kernel of {layout}, but this call uses its kernel as "
            f"{call.layout} (roles: i contracted with the input, o output); quantize the model "
            "with calibration= (which records each kernel's layout from its calls)")
    _check_layer_codes(codes, codes.config, layout.k, layout.n, where)
    x = jnp.asarray(args[0] if args else kwargs["inputs"])
    # The float layer computes in its dtype, else in the promotion of input and parameters.
    dtype = module.dtype if module.dtype is not None else jnp.result_type(x, module.param_dtype)
    x2 = call.inputs(x).astype(dtype)
    if rotation is not None:
        x2 = _rotated(x2, rotation, where)
    y = call.outputs(ops.matmul(x2, codes).astype(dtype))
    if module.use_bias:
        y = y + jnp.reshape(module.get_variable("params", "bias"), call.bias_shape()).astype(dtype)
    return y


@contextlib.contextmanager
def use_codes():
    """Applies plain Flax layers from their codes: inside it, ``model.apply(inference, x)`` of
    the float architecture computes every ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Einsum``
    whose kernel an inference form replaced by codes (:func:`quantize_params`,
    :func:`import_params`) as ``hnlq_jax.matmul`` of its codes, with the layer's bias and
    dtype; other layers, and layers that still have a kernel, run as they are.

    The layers are intercepted (``flax.linen.intercept_methods``) while the model is traced:
    enter it inside a jitted function, not around the call of one traced before.

    Example::

        inference, report = quantize_params(variables, config, calibration=run)
        with use_codes():
            y = model.apply(inference, x)

    Raises (at the call of a layer):
      ValueError: codes whose kernel layout is not the call's (a kernel quantized without
        calibration as ``[in, out]``, used transposed by an einsum), codes of another shape,
        or a call that is not a product with the kernel (e.g. ``batch_dims``).
    """
    with nn.intercept_methods(_from_codes):
        yield


# ------------------------------------------------------------------ variables and artifacts


def _codes_in(collection) -> dict:
    """``{layer path: codes}`` of a ``hnlq`` collection (Codes, or their saved state dicts)."""
    flat = traverse_util.flatten_dict(
        collection, is_leaf=lambda _, v: isinstance(v, dict) and "format_version" in v)
    return {path[:-1]: v for path, v in flat.items() if path[-1] in CODES_KEYS.values()}


def _layers(variables, fn: str) -> dict:
    if not (isinstance(variables, Mapping) and isinstance(variables.get(COLLECTION), Mapping)):
        raise ValueError(f"{fn}: expected variables with a {COLLECTION!r} collection (from "
                         "QDense.init or export_params)")
    layers = _codes_in(variables[COLLECTION])
    if not layers:
        raise ValueError(f"{fn}: the {COLLECTION!r} collection holds no QDense codes")
    return layers


def refresh_codes(variables, config: HNLQConfig):
    """Re-quantizes every QDense kernel now (``quantize_every=0`` training, or after training).

    Args:
      variables: training variables ``{"params": ..., "hnlq": ...}`` of a model whose QDense
        layers share ``config``.
      config: their quantizer.

    Returns:
      The variables with fresh ``hnlq/.../codes`` (``params`` unchanged).

    Raises:
      ValueError: no QDense layers, a layer without a kernel (the inference form), or codes of
        another config.
    """
    return _refresh(variables, config, "refresh_codes")


def _layer_name(path: tuple) -> str:
    """A layer's name in messages (:func:`hnlq_jax.ptq.layer_name` of its path)."""
    return ptq.layer_name("/".join(path))


def _refresh(variables, config: HNLQConfig, fn: str):
    """:func:`refresh_codes`, its errors under the name of ``fn`` (the public caller)."""
    check_config(config, fn)
    flat = traverse_util.flatten_dict(variables[COLLECTION]) if COLLECTION in variables else {}
    params = traverse_util.flatten_dict(variables.get("params", {}))
    for path, codes in _layers(variables, fn).items():
        where = f"{fn}: layer {_layer_name(path)}"
        if path + ("kernel",) not in params:
            raise ValueError(f"{where} has no kernel (the inference form): nothing to refresh")
        kernel = params[path + ("kernel",)]
        _check_layer_codes(codes, config, kernel.shape[0], kernel.shape[1], where)
        # Codes of a NaN kernel would decode to NaN outputs (a diverged run, exported).
        check_finite_weight(kernel, where, "the kernel [in, out]")
        flat[path + ("codes",)] = _kernel_codes(kernel, config, flat[path + ("beta",)])
        # Eagerly, as encode_rows: a kernel entry beyond beta's reach raises (jit marks it).
        check_row_failures(flat[path + ("codes",)], "raise", where)
        if path + ("error",) in flat:
            flat[path + ("error",)] = _decoded(flat[path + ("codes",)], kernel.T)[1]
    return {**variables, COLLECTION: traverse_util.unflatten_dict(flat)}


def export_params(variables, config: HNLQConfig):
    """The inference form: codes, scales and every other parameter, no quantized kernel.

    The kernels are quantized afresh (:func:`refresh_codes`), so the export matches the final
    weights even when training used ``quantize_every > 1``. The same model applies the result
    (``model.apply(inference, x)``), computing every QDense with :func:`hnlq_jax.matmul`.

    Args:
      variables: training variables ``{"params": ..., "hnlq": ...}`` (QDense layers sharing
        ``config``).
      config: their quantizer.

    Returns:
      ``(inference, report)``: ``inference = {"params": params without the quantized kernels,
      "hnlq": {layer path: {"codes": Codes}}}`` (and the other collections, e.g.
      ``batch_stats``, as they were), and a :class:`hnlq_jax.sizes.QuantizeReport`
      (``converted``: the layers; ``sizes``: :func:`model_sizes` of ``inference``).
    """
    variables = _refresh(variables, config, "export_params")
    params = traverse_util.flatten_dict(variables["params"])
    layers = _layers(variables, "export_params")
    for path in layers:
        del params[path + ("kernel",)]
    inference = {**_other_collections(variables), "params": traverse_util.unflatten_dict(params),
                 COLLECTION: traverse_util.unflatten_dict(
                     {path + ("codes",): codes for path, codes in layers.items()})}
    return inference, _report(inference, [(p, "QDense") for p in sorted(layers)])


def _other_collections(variables) -> dict:
    """The collections besides params and hnlq (batch statistics, ...), which the inference
    form keeps as they are."""
    return {k: v for k, v in variables.items() if k not in ("params", COLLECTION)}


def model_sizes(inference) -> Sizes:
    """The :class:`hnlq_jax.sizes.Sizes` of an inference form's quantized layers (their codes
    and biases), e.g. after :func:`import_params`; what :func:`export_params` and
    :func:`quantize_params` report as ``report.sizes``.

    Raises:
      ValueError: not an inference form with QDense codes.
    """
    layers = _layers(inference, "model_sizes")
    params = traverse_util.flatten_dict(inference.get("params", {}))
    return measure(layers.values(), [np.asarray(params[path + ("bias",)]) for path in layers
                                     if path + ("bias",) in params])


def _report(inference, layers, **fields) -> QuantizeReport:
    """The report of an inference form whose ``layers`` (``(path, type name)``) were
    quantized."""
    codes = _codes_in(inference[COLLECTION])
    return QuantizeReport(converted=[("/".join(p), kind, tuple(codes[p].shape))
                                     for p, kind in layers], sizes=model_sizes(inference),
                          **fields)


def import_params(saved, config: HNLQConfig | None = None):
    """The inference form from a saved state dict (no encoding: a reload restores the codes).

    Args:
      saved: ``flax.serialization.to_state_dict(inference)`` of an :func:`export_params`
        result after a round trip (``msgpack_restore``, an orbax restore), or the inference
        form itself.
      config: the quantizer the model is built with, checked against every layer's saved
        config (``beta`` may differ: it lives in the scales); ``None`` takes each layer's
        saved config.

    Returns:
      ``{"params": ..., "hnlq": {layer path: {"codes": Codes}}}`` for ``model.apply``, and
      the saved collections besides them as they were (``batch_stats``, ...);
      a rotated layer (:func:`quantize_params` with ``rotate=True``) holds
      ``{"rotated_codes": Codes, "rotation": Rotation}``; a kernel that is not ``[in, out]``
      (``DenseGeneral``, ``Einsum``) also its ``"layout"`` (a
      :class:`~hnlq_jax.layouts.KernelLayout`). Rotated layers saved before they had their
      own key (``"codes"`` beside ``"rotation"``) are read as rotated.

    Raises:
      ValueError: no codes, codes saved in another format version or with another config
        (the message names both), corrupted codes, a layer with both kinds of codes or
        rotated codes without their rotation, or the training form.
    """
    if config is not None:
        check_config(config, "import_params")
    if isinstance(saved, Mapping):  # a FrozenDict (or one inside) reads as plain dicts
        saved = flax.core.unfreeze(saved)
    layers = _layers(saved, "import_params")
    params = saved.get("params", {})
    hnlq = {}
    for path, record in layers.items():
        where = f"import_params: layer {_layer_name(path)}"
        node = _layer_record(saved[COLLECTION], path)
        if "beta" in node:  # the training form would come out half converted
            raise ValueError(f"{where} holds training state (beta, step): the training form; "
                             "restore it into QDense.init variables, or make the inference "
                             "form with export_params(variables, config)")
        if set(CODES_KEYS.values()) <= set(node):
            raise ValueError(f"{where} holds both 'codes' and 'rotated_codes'; export it again")
        rotation = node.get("rotation")
        if CODES_KEYS[True] in node and rotation is None:
            raise ValueError(f"{where}: rotated codes (of W R) without their 'rotation'; the "
                             "layer cannot be applied without it: export it again")
        if isinstance(record, Codes):
            record = _codes_state(record)
        hnlq[path + (CODES_KEYS[rotation is not None],)] = _codes_from_state(
            record, None if config is None else unit(config), where)
        if rotation is not None:
            hnlq[path + ("rotation",)] = (rotation if isinstance(rotation, Rotation)
                                          else Rotation.from_dict(rotation))
        layout = node.get(LAYOUT_KEY)
        if layout is not None:
            layout = (layout if isinstance(layout, KernelLayout)
                      else KernelLayout.from_dict(layout))
            codes = hnlq[path + (CODES_KEYS[rotation is not None],)]
            if (codes.n, codes.blocks_shape[:1]) != (layout.k, (layout.n,)):
                raise ValueError(f"{where}: codes of shape {list(codes.shape)} do not hold a "
                                 f"kernel of {layout}; export it again")
            hnlq[path + (LAYOUT_KEY,)] = layout
    return {**jax.tree.map(jnp.asarray, _other_collections(saved)),
            "params": jax.tree.map(jnp.asarray, params),
            COLLECTION: traverse_util.unflatten_dict(hnlq)}


def _layer_record(collection, path: tuple) -> Mapping:
    """A layer's entries in a ``hnlq`` collection: its codes and, when rotated, rotation."""
    node = collection
    for key in path:
        node = node[key]
    return node


# ------------------------------------------------------------- post-training quantization


def _kernels(params) -> dict:
    """``{path: kernel}`` of every params subtree with a ``kernel`` of rank >= 2."""
    flat = traverse_util.flatten_dict(params)
    return {path[:-1]: v for path, v in flat.items()
            if path[-1] == "kernel" and np.ndim(v) >= 2}


def _module_call(module, args, kwargs):
    """:func:`hnlq_jax.layouts.layer_call`, with QDense's kernel ``[in, out]`` too."""
    if isinstance(module, QDense):
        shape = jnp.shape(args[0] if args else kwargs["inputs"])
        # a scalar input: QDense's own call raises the clear error
        return dense_call(len(shape), shape[-1], module.features) if shape else "a scalar input"
    return layer_call(module, args, kwargs)


def _collect_hessians(run, variables, targets, seen: dict | None = None) -> dict:
    """``{path: (H, rows)}`` of the inputs (arranged ``[..., K]`` by the call's layout) of the
    layers at ``targets`` over one eager call ``run(variables)``; records each dense-like layer
    reached in ``seen`` (call order) as ``{path: (type name, LayerCall or why not one)}``."""
    acc = {}

    def interceptor(next_fun, args, kwargs, context):
        call = (_module_call(context.module, args, kwargs)
                if context.method_name == "__call__" else None)
        if call is not None:
            path = tuple(context.module.path)
            if seen is not None:
                first = seen.setdefault(path, (type(context.module).__name__, call))[1]
                if isinstance(first, LayerCall) and (not isinstance(call, LayerCall)
                                                     or call.layout != first.layout):
                    other = call.layout.roles if isinstance(call, LayerCall) else call
                    seen[path] = (seen[path][0], "called with two kernel layouts "
                                  f"({first.layout.roles}, then {other})")
            if path in targets and isinstance(call, LayerCall):
                H, rows = acc.get(path, (None, 0))
                H, rows = ptq.hessian_update(H, call.inputs(args[0] if args
                                                            else kwargs["inputs"]), rows)
                # A traced input, or a constant one whose statistics a trace still captures.
                if isinstance(H, jax.core.Tracer):
                    raise ValueError("quantize_params: calibration ran the model under a jax "
                                     "transformation (jit, vmap, ...); run(variables) must "
                                     "apply it eagerly so the inputs can be accumulated")
                acc[path] = H, rows
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        run(variables)
    return acc


def _select(kernels: dict, seen: dict | None, filter_fn, fn: str):
    """``(layouts, kinds, skipped)`` of the kernels to quantize: ``{path: KernelLayout}`` in
    sorted path order, ``{path: type name}`` and the report's ``(name, type, reason)`` of the
    kernels kept in float. Without calibration (``seen is None``) a 2-D kernel is ``[in, out]``
    and the axes of a larger one are unknown."""
    layouts, kinds, skipped, missing = {}, {}, [], []
    for path, kernel in sorted(kernels.items()):
        kind, call = (seen or {}).get(path, ("Dense" if kernel.ndim == 2 else
                                             f"{kernel.ndim}-D kernel", None))
        name = "/".join(path)
        if filter_fn is not None and not filter_fn(path, kernel):
            skipped.append((name, kind, "filter_fn"))
        elif seen is None and kernel.ndim == 2:
            layouts[path], kinds[path] = KernelLayout.dense(*kernel.shape), kind
        elif seen is None:
            skipped.append((name, kind, "which of its axes are inputs is known only from a "
                            "call: quantize with calibration= to convert DenseGeneral and "
                            "Einsum kernels"))
        elif call is None and kernel.ndim == 2:
            missing.append(_layer_name(path))
        elif call is None:
            skipped.append((name, kind, "no nn.Dense, DenseGeneral or Einsum used it during "
                            "calibration"))
        elif not isinstance(call, LayerCall):
            skipped.append((name, kind, call))
        elif call.layout.shape != tuple(kernel.shape):
            raise ValueError(f"{fn}: layer {_layer_name(path)} was called with a kernel of shape "
                             f"{list(call.layout.shape)}, its params hold {list(kernel.shape)}")
        else:
            layouts[path], kinds[path] = call.layout, kind
    if missing:
        raise ValueError(f"{fn}: calibration never ran {len(missing)} of the layers to quantize: "
                         f"{', '.join(missing)}; run the model on inputs that reach them, or "
                         "leave them out with filter_fn")
    return layouts, kinds, skipped


def quantize_params(variables, config: HNLQConfig, calibration=None, *, filter_fn=None,
                    calibrate: bool = True, rotate: bool | None = None,
                    act_order: bool | None = None, damp: float | None = None,
                    criterion: str | None = None, grid=ptq.DEFAULT_GRID,
                    t_budget=None, sequential: bool = False, seed: int = 0,
                    progress: bool = False):
    """Post-training quantization of a Flax model's dense-like layers into the inference form.

    Every params subtree with a ``kernel`` that an ``nn.Dense``, ``QDense``, ``nn.DenseGeneral``
    or ``nn.Einsum`` call uses as a product (selected by ``filter_fn``; without
    ``calibration`` only 2-D kernels, taken as ``[in, out]``, since only a call tells which
    axes of a larger kernel are inputs) is coded as the row codes of its ``[out, in]`` matrix
    (:class:`hnlq_jax.layouts.KernelLayout`; ``kernel^T`` for a Dense): by round-to-nearest
    (:func:`hnlq_jax.rows.rows_codes` at the calibrated beta) without ``calibration``, or by
    compensated rounding (:func:`hnlq_jax.ptq.gptq_rows`) against the Hessian of its inputs
    with it, by default in the recommended setting (rotated, activation order,
    ``criterion="f"``, ``damp=0.01``: :data:`hnlq_jax.ptq.RECOMMENDED`; any option given
    overrides it). The result is what :func:`export_params` returns, so the same architecture built
    with :class:`QDense` layers applies it (``model.apply(inference, x)``; Dense layers only),
    as does the float model inside :func:`use_codes` (every kind above), and it saves and loads
    the same way (:func:`import_params`).

    **Calibration** (``calibration=run``): ``run(variables)`` applies the float model to
    calibration data, eagerly (not under ``jit``), e.g. ``lambda v: [model.apply(v, x) for x in
    batches]``. Method interception (``flax.linen.intercept_methods``) records each layer's
    kernel layout and collects ``H = sum x^T x`` of its inputs (arranged ``[..., in]`` by the
    layout) in one call; with ``sequential=True`` one layer at a time in the order the forward
    pass reaches them, each from a model whose earlier layers compute with their quantized
    weights (decoded into the float model's params), so only one H is held, for one call per
    layer.

    Args:
      variables: the float model's variables ``{"params": ...}``.
      config: the quantizer.
      calibration: ``None`` (round-to-nearest) or ``run(variables)`` (above).
      filter_fn: ``filter_fn(path, kernel) -> bool`` (``path`` a tuple of names); only layers
        where it is true are quantized (default: all).
      calibrate: beta from :func:`hnlq_jax.rows.calibrate_rows` (with ``calibration``, the
        search of :func:`~hnlq_jax.ptq.gptq_rows` around it); ``False``: ``config.beta``.
      rotate: incoherence processing: layer ``k`` (in sorted path order) gets
        ``Rotation(in, seed + k)`` (``in``: the matrix's columns), stored as
        ``hnlq/<path>/rotation`` beside the codes of ``W R`` (``hnlq/<path>/rotated_codes``)
        and applied to the layer's input.
        ``None`` (default): with ``calibration`` the recommended ``True``, else ``False``.
      act_order, damp, criterion, grid, t_budget: as :func:`~hnlq_jax.ptq.gptq_rows` (with
        ``calibration``); ``None`` (default) for ``act_order``, ``damp`` and ``criterion`` is
        the recommended setting, :data:`hnlq_jax.ptq.RECOMMENDED`.
      sequential: collect one layer's H at a time (above).
      seed: base seed of the rotations.
      progress: a tqdm progress bar over the layers (needs ``tqdm``).

    Returns:
      ``(inference, report)``: ``inference = {"params": params without the quantized kernels,
      "hnlq": {path: {"codes": Codes}}}`` (rotated: ``{"rotated_codes": Codes, "rotation":
      Rotation}``; a kernel not ``[in, out]`` also ``"layout"``; the other collections, e.g.
      ``batch_stats``, as they were) and a
      :class:`hnlq_jax.sizes.QuantizeReport`: ``converted`` (the layers, named by their
      ``/``-joined paths, with their module type, in the order quantized), ``skipped`` (the
      kernels kept in float, with the reason), ``sizes`` and, with
      ``calibration``, ``proxy_loss``, ``clipped`` and ``t_bits`` (the entropy of T per
      weight) per layer.

    Raises:
      ValueError: nothing to convert (the message lists each kernel and why it stayed float);
        ``calibration`` not callable, run under ``jit``, or never reaching a selected 2-D
        kernel (the message names them); the errors of
        :func:`~hnlq_jax.ptq.gptq_rows`.
    """
    fn = "quantize_params"
    check_config(config, fn)
    if isinstance(variables, flax.core.FrozenDict):  # as import_params takes them
        variables = flax.core.unfreeze(variables)
    if not isinstance(variables, dict) or "params" not in variables:
        got = (f"a dict without 'params' (keys {sorted(variables)[:4]}; pass the whole "
               "variables of model.init, not variables['params'])"
               if isinstance(variables, dict) else type(variables).__name__)
        raise ValueError(f"{fn}: expected the float model's variables {{'params': ...}}, got "
                         f"{got}")
    if calibration is not None and not callable(calibration):
        raise TypeError(f"{fn}: calibration must be None or a callable run(variables), got "
                        f"{type(calibration).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{fn}: seed must be a non-negative int, got {seed!r}")
    ptq.check_calibration_options(fn, calibration, act_order=act_order, damp=damp,
                                  criterion=criterion, grid=grid, t_budget=t_budget,
                                  sequential=sequential)
    rotate, act_order, damp, criterion = ptq.recommended(fn, calibration, rotate, act_order,
                                                        damp, criterion)
    params = traverse_util.flatten_dict(variables["params"])
    kernels = _kernels(variables["params"])
    seen, hessians = None, {}
    if calibration is not None and kernels:
        seen = {}
        hessians = _collect_hessians(calibration, variables,
                                     set() if sequential else set(kernels), seen)
    layouts, kinds, skipped = _select(kernels, seen, filter_fn, fn)
    if not layouts:
        why = "; ".join(f"{n} ({k}): {r}" for n, k, r in skipped) or "the params hold no kernel"
        raise ValueError(f"{fn}: converted nothing (no Dense, DenseGeneral or Einsum kernel "
                         f"selected): {why}")
    rotations = {path: Rotation(lay.k, seed + i) if rotate else None
                 for i, (path, lay) in enumerate(layouts.items())}
    order = list(layouts) if seen is None else [p for p in seen if p in layouts]
    hnlq, report = {}, {"proxy_loss": {}, "clipped": {}, "t_bits": {}}
    for path in _progress(order, progress):
        layout, rotation = layouts[path], rotations[path]
        kernel = params[path + ("kernel",)]
        if sequential and calibration is not None:
            hessians = _collect_hessians(calibration, {**variables, "params": (
                traverse_util.unflatten_dict(params))}, {path})
        H = hessians.pop(path, (None, 0))[0]
        name = "/".join(path)
        check_finite_weight(kernel, f"{fn}: layer {_layer_name(path)}", "the kernel")
        w = layout.matrix(kernel)  # [out, in]
        with ptq.layer_context(fn, name):
            if H is None:
                w = w if rotation is None else rotation.rotate_weight(w)
                codes = _kernel_codes(w.T, config, _weight_beta(w.T, config, calibrate))
                # as export_params: a block beyond reach would decode to NaN (GPTQ clips it)
                check_row_failures(codes, "raise", fn)
            else:
                result = ptq.gptq_rows(w, H, config, damp=damp, act_order=act_order,
                                       beta=None if calibrate else config.beta, grid=grid,
                                       criterion=criterion, t_budget=t_budget,
                                       rotation=rotation)
                codes = result.codes
                report["proxy_loss"][name] = result.loss
                report["clipped"][name], report["t_bits"][name] = result.clipped, result.t_bits
        hnlq[path + (CODES_KEYS[rotation is not None],)] = codes
        if rotation is not None:
            hnlq[path + ("rotation",)] = rotation
        if layout.roles != "io":
            hnlq[path + (LAYOUT_KEY,)] = layout
        if sequential:  # later layers calibrate through this one's quantized weight
            w_hat = ops.decode(codes, dtype=kernel.dtype)
            params[path + ("kernel",)] = layout.kernel(w_hat if rotation is None
                                                       else rotation.inverse(w_hat))
    kept = {k: v for k, v in traverse_util.flatten_dict(variables["params"]).items()
            if k[:-1] not in layouts or k[-1] != "kernel"}
    inference = {**_other_collections(variables), "params": traverse_util.unflatten_dict(kept),
                 COLLECTION: traverse_util.unflatten_dict(hnlq)}
    return inference, _report(inference, [(p, kinds[p]) for p in order], skipped=skipped,
                              **report)


def _progress(items, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError as e:
        raise ImportError("quantize_params(progress=True) needs tqdm (pip install tqdm)") from e
    return tqdm(items, desc="quantize_params", unit="layer")


# ------------------------------------------------------------- Codes in flax.serialization


def _codes_header(config: HNLQConfig, n) -> dict:
    """What describes saved codes' arrays: format version, config and row length."""
    return {**saved_header(config), "n": n}


def _codes_state(codes: Codes) -> dict:
    """The saved form of codes: their arrays, format version, config and row length, the
    arrays' CRC-32 and the header's."""
    header = _codes_header(codes.config, codes.n)
    return {**header, "index": codes.index, "tfield": codes.tfield, "scale": codes.scale,
            "crc32": checksum(codes.index, codes.tfield, codes.scale),
            "header_crc32": header_checksum(header)}


def _codes_from_state(state, config: HNLQConfig | None, where: str) -> Codes:
    """Codes from their saved form; they must be of this format version and of ``config``
    (``None``: any)."""
    keys = {"n", "index", "tfield", "scale"}
    saved = (read_saved_header(state, where) if config is None else
             check_saved_header(state, config, where, "load them into a model of their config"))
    if not keys <= set(state):
        raise ValueError(f"{where}: expected saved hnlq_jax.Codes with keys {sorted(keys)}, "
                         f"got {sorted(state)}")
    scale = None if state["scale"] is None else jnp.asarray(state["scale"])
    n = None if state["n"] is None else saved_int(state["n"])
    if state["n"] is not None and (n is None or n < 0):
        raise ValueError(f"{where}: the saved row length n must be an int >= 0 or None, got "
                         f"{state['n']!r}; save the codes again")
    codes = check_codes(Codes(jnp.asarray(state["index"]), jnp.asarray(state["tfield"]), saved,
                              scale=scale, n=n), where)
    check_checksum(state, (state["index"], state["tfield"], state["scale"]), where)
    check_header_checksum(state, _codes_header(saved, n), where)
    return codes


def _restore_codes(target: Codes, state) -> Codes:
    where = f"restoring {serialization.current_path()}"
    codes = _codes_from_state(state, target.config, where)
    if (codes.shape, codes.blocks_shape) != (target.shape, target.blocks_shape):
        raise ValueError(f"{where}: saved codes of shape {list(codes.shape)} (blocks "
                         f"{list(codes.blocks_shape)}), the target has {list(target.shape)} "
                         f"(blocks {list(target.blocks_shape)})")
    return codes


serialization.register_serialization_state(Codes, _codes_state, _restore_codes, override=True)


def _restorer(cls):
    """The restore function of a saved :class:`Rotation` or :class:`KernelLayout`: it must be
    the target's (a model is built with its layers' rotations and layouts)."""
    def restore(target, state):
        saved = cls.from_dict(state)
        if saved != target:
            raise ValueError(f"restoring {serialization.current_path()}: saved {saved!r}, the "
                             f"target has {target!r}")
        return saved
    return restore


for _cls in (Rotation, KernelLayout):
    serialization.register_serialization_state(_cls, _cls.to_dict, _restorer(_cls),
                                               override=True)

"""Quantization-aware training in Flax: :class:`QDense` and the :class:`QuantDotGeneral` hook.

A kernel ``W[in, out]`` is quantized in d-blocks along its input (contraction) axis with a
per-output-channel scale: column j is divided by ``c_j = beta * rms(W[:, j])`` and encoded with
the codec at unit beta, so ``W_hat[:, j] = c_j * decode(codes_j)``. Activations, when quantized,
get the same treatment per token (row of ``x``). The forward pass uses ``W_hat``; the backward
pass is straight-through:

* ``ste="identity"``: ``dL/dW = dL/dW_hat``;
* ``ste="clipped"``: the same, but zero in blocks that overloaded (``T > 0``), whose values the
  quantizer had to rescale.

Variables of :class:`QDense` (linen): ``params`` holds ``kernel [in, out]`` and ``bias [out]``
exactly as ``nn.Dense`` (a checkpoint moves between the two); the ``hnlq`` collection holds the
per-layer ``beta``, the cached codes (``labels [out, nb, M, d]`` uint8, ``T [out, nb]`` int8), the
channel scales ``scale [out]``, their decoded kernel ``w_hat [in, out]`` (so that steps between
refreshes and inference do not decode again) and the training ``step``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import kernels, lut
from hnlq_jax.codec import Codes, to_blocks
from hnlq_jax.config import HNLQConfig
from hnlq_jax.packing import Packed, pack, unpack
from hnlq_jax.rows import row_rms, rows_codes, rows_decode, unit
from hnlq_jax.stats import gaussian_beta, search_beta

__all__ = [
    "QDense",
    "QuantDotGeneral",
    "export_params",
    "gaussian_beta",
    "import_params",
    "refresh_codes",
]

STE_MODES = ("identity", "clipped")
COMPUTE_MODES = ("decode", "lut", "kernel")
COLLECTION = "hnlq"
CALIBRATION_BLOCKS = 4096  # blocks of a layer's kernel that its beta is calibrated on


def _check_knobs(config, ste, compute, quantize_every, where: str):
    if not isinstance(config, HNLQConfig):
        raise TypeError(f"{where}: config must be an HNLQConfig, got {type(config).__name__}")
    if ste not in STE_MODES:
        raise ValueError(f"{where}: ste must be one of {STE_MODES}, got {ste!r}")
    if compute not in COMPUTE_MODES:
        raise ValueError(f"{where}: compute must be one of {COMPUTE_MODES}, got {compute!r}")
    if isinstance(quantize_every, bool) or not isinstance(quantize_every, int) or quantize_every < 0:
        raise ValueError(f"{where}: quantize_every must be an int >= 0, got {quantize_every!r}")


@jax.custom_vjp
def _straight_through(w, w_hat, mask):
    """``w_hat`` forward (exactly); the gradient goes to ``w``, times ``mask`` unless None."""
    return w_hat


def _st_fwd(w, w_hat, mask):
    return w_hat, mask


def _st_bwd(mask, g):
    if mask is None:
        return g, None, None
    return g * mask, None, None


_straight_through.defvjp(_st_fwd, _st_bwd)


def _ste_mask(T, k: int, ste: str, dtype):
    """Straight-through mask ``[r, k]`` for codes with ``T[r, nb]`` (None: pass everything)."""
    if ste == "identity":
        return None
    d = -(-k // T.shape[-1]) if T.shape[-1] else 1
    keep = jnp.repeat((T == 0).astype(dtype), d, axis=-1)  # [r, nb * d]
    return keep[:, :k]


def _quantize_rows(x, config, beta, ste):
    """Straight-through quantization of the rows of ``x[..., k]`` (per-row scales)."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    codes, c = rows_codes(jax.lax.stop_gradient(flat), config, beta)
    x_hat = rows_decode(codes, c, config, k, x.dtype)
    return _straight_through(flat, x_hat, _ste_mask(codes.T, k, ste, x.dtype)).reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _coded_product(config, compute, x, w_ste, labels, T, c):
    """``x @ W_hat`` from the codes (``"lut"``: one-sided tables; ``"kernel"``: the fused
    Pallas decode-matmul); gradients as for ``x @ w_ste``."""
    codes = Codes(labels, T)
    if compute == "lut":
        y = lut.matmul_one_sided(codes, x, unit(config))
        return y * c.astype(y.dtype)
    return kernels.decode_matmul(x, codes, unit(config), scale=c, implementation="pallas")


def _coded_fwd(config, compute, x, w_ste, labels, T, c):
    return _coded_product(config, compute, x, w_ste, labels, T, c), (x, w_ste)


def _coded_bwd(config, compute, res, g):
    x, w_ste = res
    dx = jnp.einsum("...o,io->...i", g, w_ste)
    dw = jnp.einsum("...i,...o->io", x, g)
    return dx, dw, None, None, None


_coded_product.defvjp(_coded_fwd, _coded_bwd)


def _product(x, w_ste, codes, c, config, compute, precision):
    """``x[..., in] @ W_hat[in, out]`` by the chosen path (same gradients)."""
    if compute != "decode":
        return _coded_product(config, compute, x, w_ste, codes.labels, codes.T, c)
    return jax.lax.dot_general(x, w_ste, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _kernel_codes(kernel, config, beta):
    """Codes of a kernel ``[in, out]`` (rows = output channels) and its channel scales."""
    return rows_codes(jax.lax.stop_gradient(kernel).T, config, beta)


def _fresh(kernel, config, beta):
    """``(codes, c, w_hat[in, out])`` of a kernel, quantized now."""
    codes, c = _kernel_codes(kernel, config, beta)
    return codes, c, rows_decode(codes, c, config, kernel.shape[0], kernel.dtype).T


_fresh_jit = jax.jit(_fresh, static_argnums=1)


def _forward(x, kernel, w_hat, codes, c, config, ste, compute, act_beta, quantize_activations,
             precision):
    k = kernel.shape[0]
    mask = _ste_mask(codes.T, k, ste, kernel.dtype)
    # Straight-through in the kernel's dtype, then the compute dtype (as Dense casts its kernel).
    w_ste = _straight_through(kernel, w_hat, None if mask is None else mask.T).astype(x.dtype)
    if quantize_activations:
        x = _quantize_rows(x, config, act_beta, ste)
    return _product(x, w_ste, codes, c, config, compute, precision).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class QuantDotGeneral:
    """A ``dot_general`` that quantizes its right operand (the kernel) with HNLQ on every call.

    For ``nn.Dense(dot_general_cls=functools.partial(QuantDotGeneral, config=cfg))`` (linen) and
    ``nnx.Linear(dot_general=QuantDotGeneral(cfg))`` (nnx). Stateless: the kernel's codes are
    recomputed per call (``QDense`` with ``quantize_every=1``), with ``beta`` from
    :func:`gaussian_beta` (the kernel's channels are normalized to unit RMS), or
    ``config.beta`` when ``calibrate=False``.

    Attributes:
      config: lattice, q, M, alpha, max_T (and beta, see ``calibrate``).
      quantize_activations: also quantize the left operand per token.
      ste: ``"identity"`` or ``"clipped"``.
      compute: ``"decode"``, ``"lut"`` or ``"kernel"`` (see :class:`QDense`).
      calibrate: use :func:`gaussian_beta` (default) instead of ``config.beta``.
    """

    config: HNLQConfig = HNLQConfig()
    quantize_activations: bool = False
    ste: str = "identity"
    compute: str = "decode"
    calibrate: bool = True

    def __post_init__(self):
        _check_knobs(self.config, self.ste, self.compute, 1, "QuantDotGeneral")

    @property
    def beta(self) -> float:
        """The beta in use (weights and activations)."""
        return gaussian_beta(self.config) if self.calibrate else self.config.beta

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 **_):
        (lc, rc), (lb, rb) = dimension_numbers
        if tuple(lb) or tuple(rb) or tuple(lc) != (lhs.ndim - 1,) or tuple(rc) != (0,) or rhs.ndim != 2:
            raise ValueError(
                "QuantDotGeneral: supports the Dense contraction lhs[..., k] x rhs[k, n] "
                f"(dimension_numbers (((lhs.ndim-1,), (0,)), ((), ()))), got {dimension_numbers} "
                f"for shapes {lhs.shape}, {rhs.shape}"
            )
        codes, c, w_hat = _fresh(rhs, self.config, self.beta)
        y = _forward(lhs, rhs, w_hat, codes, c, self.config, self.ste, self.compute, self.beta,
                     self.quantize_activations, precision)
        return y if preferred_element_type is None else y.astype(preferred_element_type)


class QDense(nn.Module):
    """A drop-in for ``flax.linen.Dense`` with HNLQ quantization-aware training.

    Attributes:
      features: output size.
      config: lattice, q, M, alpha, max_T of the quantizer (its ``beta`` is used only with
        ``calibrate=False``).
      use_bias: as ``nn.Dense``.
      quantize_weights: quantize the kernel (``False``: a plain Dense, e.g. for ablations).
      quantize_activations: also quantize the input per token (beta from :func:`gaussian_beta`).
      ste: straight-through variant, ``"identity"`` or ``"clipped"`` (zero gradient in blocks
        that overloaded).
      quantize_every: re-quantize the kernel every N training calls; the codes are cached in
        the ``hnlq`` collection between refreshes (apply with ``mutable=["hnlq"]``). ``0``:
        training calls use the cache too, and the loop refreshes it with :func:`refresh_codes`
        (a separate program; in-step refreshes cost a conditional that slows every step on
        XLA:CPU). Calls with ``deterministic=True`` always use the cached codes and never
        re-quantize.
      compute: ``"decode"`` (decode then matmul), ``"lut"`` (one-sided lookup tables) or
        ``"kernel"`` (the fused Pallas decode-matmul :func:`hnlq_jax.kernels.decode_matmul`,
        which reads only the codes; interpret mode on a CPU, so slow there); the outputs
        agree to float rounding and the gradients are the same.
      calibrate: at initialization, choose beta by the paper's grid search on this layer's
        normalized kernel (stored as ``hnlq/beta``); ``False`` uses ``config.beta``.
      deterministic: default for the call argument of the same name.
      dtype, param_dtype, precision, kernel_init, bias_init: as ``nn.Dense``.
    """

    features: int
    config: HNLQConfig = HNLQConfig()
    use_bias: bool = True
    quantize_weights: bool = True
    quantize_activations: bool = False
    ste: str = "identity"
    quantize_every: int = 1
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
          deterministic: inference mode: use the cached codes (default: the attribute, else
            ``False``).

        Returns:
          ``[..., features]``.
        """
        _check_knobs(self.config, self.ste, self.compute, self.quantize_every, "QDense")
        if deterministic is None:
            deterministic = bool(self.deterministic)
        x = jnp.asarray(inputs)
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

    def _quantized(self, x, kernel, deterministic: bool):
        cfg = self.config
        k, n = kernel.shape
        nb = -(-k // cfg.d)
        beta = self.variable(COLLECTION, "beta", self._init_beta, kernel)
        shapes = {"labels": ((n, nb, cfg.M, cfg.d), jnp.uint8), "T": ((n, nb), jnp.int8),
                  "scale": ((n,), jnp.float32), "w_hat": ((k, n), kernel.dtype)}
        cache = {name: self.variable(COLLECTION, name, jnp.zeros, *shape)
                 for name, shape in shapes.items()}
        step = self.variable(COLLECTION, "step", jnp.zeros, (), jnp.int32)

        def cached():
            v = {name: var.value for name, var in cache.items()}
            return Codes(v["labels"], v["T"]), v["scale"], v["w_hat"]

        def fresh():
            codes, c, w_hat = _fresh(kernel, cfg, beta.value)
            return codes, c.astype(jnp.float32), w_hat

        if self.is_initializing():
            codes, c, w_hat = fresh()
        elif deterministic or self.quantize_every == 0:
            codes, c, w_hat = cached()
        elif self.is_mutable_collection(COLLECTION):
            refresh = step.value % self.quantize_every == 0
            codes, c, w_hat = jax.lax.cond(refresh, fresh, cached)
            step.value = step.value + 1
        elif self.quantize_every == 1:
            codes, c, w_hat = fresh()
        else:
            raise ValueError(
                f"QDense: quantize_every={self.quantize_every} caches codes between training "
                "calls: apply with mutable=['hnlq'] (or deterministic=True to use the cache)"
            )
        training = self.is_mutable_collection(COLLECTION) and not deterministic
        if self.is_initializing() or (training and self.quantize_every):
            for name, value in zip(("labels", "T", "scale", "w_hat"), (*codes, c, w_hat)):
                cache[name].value = value
        act_beta = None
        if self.quantize_activations:
            act_beta = gaussian_beta(cfg) if self.calibrate else cfg.beta
        return _forward(x, kernel, w_hat, codes, c, cfg, self.ste, self.compute, act_beta,
                        self.quantize_activations, self.precision)

    def _init_beta(self, kernel):
        if not self.calibrate:
            return jnp.asarray(self.config.beta, jnp.float32)
        w = jax.lax.stop_gradient(kernel).T
        blocks = to_blocks(w / row_rms(w)[:, None], self.config.d).reshape(-1, self.config.d)
        # A fixed-size sample (strided, or tiled when smaller): one compile for every layer.
        idx = (jnp.arange(CALIBRATION_BLOCKS) * blocks.shape[0]) // CALIBRATION_BLOCKS
        return search_beta(blocks[idx], self.config).astype(jnp.float32)


def _layer_paths(variables) -> list:
    """Paths (tuples) of the quantized layers: where the ``hnlq`` collection holds codes."""
    if COLLECTION not in variables:
        raise ValueError(f"expected variables with a {COLLECTION!r} collection (from QDense.init)")
    flat = traverse_util.flatten_dict(variables[COLLECTION])
    return sorted(path[:-1] for path in flat if path[-1] == "labels")


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _check_config(config):
    if not isinstance(config, HNLQConfig):
        raise TypeError(f"config must be an HNLQConfig, got {type(config).__name__}")


def refresh_codes(variables, config: HNLQConfig):
    """Re-quantizes every QDense kernel now (``quantize_every=0`` training, or after training).

    Args:
      variables: ``{"params": ..., "hnlq": ...}`` of a model with QDense layers that share
        ``config``.
      config: their quantizer.

    Returns:
      The variables with fresh ``labels``, ``T`` and ``scale`` (``params`` unchanged).
    """
    _check_config(config)
    flat = traverse_util.flatten_dict(variables[COLLECTION]) if COLLECTION in variables else {}
    for path in _layer_paths(variables):
        kernel = _get(variables["params"], path)["kernel"]
        codes, c, w_hat = _fresh_jit(kernel, config, flat[path + ("beta",)])
        flat[path + ("labels",)], flat[path + ("T",)] = codes.labels, codes.T
        flat[path + ("scale",)], flat[path + ("w_hat",)] = c.astype(jnp.float32), w_hat
    return {**variables, COLLECTION: traverse_util.unflatten_dict(flat)}


def export_params(variables, config: HNLQConfig):
    """The deployable model: packed codes and scales for every QDense kernel, the rest as is.

    The kernels are quantized afresh (:func:`refresh_codes`), so the export matches the final
    weights even when training used ``quantize_every > 1``.

    Args:
      variables: ``{"params": ..., "hnlq": ...}`` (QDense layers sharing ``config``).
      config: their quantizer.

    Returns:
      ``(deployable, report)``: ``deployable = {"params": params without the quantized kernels,
      "codes": {layer path: {"data", "T", "scale", "beta", "shape"}}}`` (numpy arrays), and
      ``report = {"float32_bytes", "deployed_bytes", "ratio"}``: the model's size stored as
      float32 against the deployable one.
    """
    variables = refresh_codes(variables, config)
    params = traverse_util.flatten_dict(jax.device_get(variables["params"]))
    codes_out = {}
    for path in _layer_paths(variables):
        layer = _get(variables[COLLECTION], path)
        packed = pack(Codes(layer["labels"], layer["T"]), unit(config))
        kernel = params.pop(path + ("kernel",))
        codes_out["/".join(path)] = {
            "data": np.asarray(packed.data), "T": np.asarray(packed.T),
            "scale": np.asarray(layer["scale"]), "beta": np.asarray(layer["beta"]),
            "shape": np.asarray(kernel.shape),
        }
    rest = traverse_util.unflatten_dict(params)
    float_bytes = sum(4 * int(np.size(v)) for v in traverse_util.flatten_dict(
        jax.device_get(variables["params"])).values())
    deployed = sum(np.asarray(v).nbytes for v in traverse_util.flatten_dict(rest).values())
    deployed += sum(a.nbytes for layer in codes_out.values() for k, a in layer.items()
                    if k != "shape")
    report = {"float32_bytes": float_bytes, "deployed_bytes": int(deployed),
              "ratio": float_bytes / max(int(deployed), 1)}
    return {"params": rest, "codes": codes_out}, report


def import_params(deployable, config: HNLQConfig):
    """Inverse of :func:`export_params`: variables for QDense models (kernels decoded).

    Args:
      deployable: the first result of :func:`export_params`.
      config: the quantizer it was exported with.

    Returns:
      ``{"params": ..., "hnlq": ...}``: each kernel is the decoded ``W_hat`` and the cached
      codes are the exported ones, so inference (``deterministic=True``) reproduces the exported
      model exactly.
    """
    _check_config(config)
    params = traverse_util.flatten_dict(deployable["params"])
    hnlq = {}
    for name, layer in deployable["codes"].items():
        path = tuple(name.split("/")) if name else ()
        k, n = (int(v) for v in layer["shape"])
        nb = -(-k // config.d)
        codes = unpack(Packed(layer["data"], layer["T"]), unit(config))
        if codes.labels.shape != (n, nb, config.M, config.d):
            raise ValueError(f"import_params: layer {name} does not match config {config}")
        scale = jnp.asarray(layer["scale"])
        w_hat = rows_decode(codes, scale, config, k, jnp.float32).T
        params[path + ("kernel",)] = w_hat
        for key, v in (("labels", codes.labels), ("T", codes.T), ("scale", scale), ("w_hat", w_hat),
                       ("beta", jnp.asarray(layer["beta"])), ("step", jnp.zeros((), jnp.int32))):
            hnlq[path + (key,)] = v
    return {"params": traverse_util.unflatten_dict(params),
            COLLECTION: traverse_util.unflatten_dict(hnlq)}

"""Post-training quantization: :class:`QuantizedLinear` layers that hold only codes, scales and
bias, and :func:`quantize_model`, which puts them in place of a model's ``nn.Linear`` layers.

**Weight format** (:mod:`hnlq_jax.rows`, the same as :class:`~torch_bridge.QLinear` and the
Flax ``QDense``): row j of ``weight[out, in]`` is divided by ``c_j = beta * rms(row_j)`` and
coded in d-blocks along ``in`` at unit beta, ``beta`` from
:func:`hnlq_jax.rows.calibrate_rows` of the layer's weight. For D4 q=4 M=2 that is one uint8
codebook index per level and block and a 4-bit T field per block: 5 bits per weight, plus a
float32 scale and bias per output.

**State dict** (:class:`CodesLayer`): buffers ``index [out, nb, M]``, ``tfield`` (uint8) and
``scale [out]``, the ``bias`` parameter, and an ``_extra_state`` recording
:data:`hnlq_jax.FORMAT_VERSION`, the codes' config and ``in_features``. No float weight is
stored. Loading a state dict written in another format version, with another config (beta
aside: it lives in the scales) or another ``in_features``, or codes without their
``_extra_state`` (also under ``strict=False``) raises ``ValueError`` naming both, before any
buffer is written; corrupted codes (an index ``>= q^d``, a T field above ``max_T + 1``) raise
too.

**Forward**: ``torch.ops.hnlq.matmul`` (:func:`hnlq_jax.matmul`, bit for bit; on CPU tensors
below ``torch_bridge.ops.GEMM_ROWS`` rows, from there torch's GEMM) plus the bias,
also under ``torch.compile(fullgraph=True)``.

**Calibration and rotation** (:func:`quantize_model` ``calibration=run``, ``rotate=True``): the
codes come from :func:`hnlq_jax.ptq.gptq_rows` on each layer's input Hessian, collected by
forward pre-hooks during ``run(model)``; a rotated layer holds the codes of ``W R`` and applies
``R`` (:class:`hnlq_jax.incoherence.Rotation`, ``torch.ops.hnlq.rotate``) to its inputs; its
extra state also records ``rotation`` (``Rotation.to_dict()``), checked on loading like the
config.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from hnlq_jax import FORMAT_VERSION, HNLQConfig
from hnlq_jax import ptq as hptq
from hnlq_jax.codes import (check_checksum, check_header_checksum, check_saved_header,
                            checksum, header_checksum, index_dtype, read_saved_header,
                            saved_header, tfield_shape)
from hnlq_jax.incoherence import Rotation
from hnlq_jax.ops import IMPLEMENTATIONS
from hnlq_jax.rows import calibrate_rows, check_finite_weight, unit
from hnlq_jax.sizes import QuantizeReport, Sizes, measure
from torch_bridge import ops
from torch_bridge.attention import SplitMultiheadAttention, why_not_split
from torch_bridge.codec import Codes, decode, encode_rows
from torch_bridge.interop import to_jax, to_torch, x64_for

__all__ = ["CodesLayer", "QuantizeReport", "QuantizedLinear", "load_quantized", "model_sizes",
           "quantize_model"]

_CODES = ("index", "tfield", "scale")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def calibrated_beta(weight: torch.Tensor, config: HNLQConfig, calibrate: bool):
    """The weight's beta: :func:`~hnlq_jax.rows.calibrate_rows` (a ``[]`` float32 JAX array)
    when ``calibrate``, else ``config.beta``."""
    if not calibrate:
        return config.beta
    with x64_for(weight):
        return calibrate_rows(to_jax(weight.detach()), config)


def check_weight(weight: torch.Tensor, fn: str):
    """:func:`hnlq_jax.rows.check_finite_weight` of a torch weight (before calibration, which
    would report normalized blocks instead of weights)."""
    with x64_for(weight):
        check_finite_weight(to_jax(weight.detach()), fn)


def _raw(t: torch.Tensor):
    """The bytes of a tensor as a NumPy uint8 array (on the host; any dtype, bfloat16 too)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


def check_layer_implementation(implementation, fn: str):
    """Refuses an ``implementation`` the layers cannot take: they encode and decode with it
    too, so ``"lut"`` (a product only) would fail later.

    Raises:
      ValueError: not ``None`` nor one of the encoder's implementations.
    """
    allowed = IMPLEMENTATIONS["encode"]
    if implementation is not None and implementation not in allowed:
        raise ValueError(f"{fn}: implementation must be None or one of {allowed} (the layer "
                         f"encodes, decodes and multiplies with it), got {implementation!r}")


def has_codes(tfield: torch.Tensor) -> bool:
    """Whether a layer's T field holds codes that were set: a layer registers it as zeros
    (every block failed, decoding to NaN), which no encoding of a weight gives (encoding
    refuses such blocks). On the meta device, which holds no values (nothing to code
    there), ``True``."""
    return tfield.device.type == "meta" or bool(tfield.any())


class CodesLayer:
    """Mixin of the layers that hold the row codes of a weight ``[out, in]`` as buffers.

    Buffers ``index``, ``tfield``, ``scale``; the config (``codes_config``, unit beta) and
    :data:`hnlq_jax.FORMAT_VERSION` travel in the extra state and are checked on loading.
    Subclasses call :meth:`_register_codes` in ``__init__`` and set ``in_features``,
    ``out_features`` and ``implementation``.
    """

    def _register_codes(self, config: HNLQConfig, device, scale_dtype):
        if not isinstance(config, HNLQConfig):
            raise TypeError(f"{type(self).__name__}: config must be an hnlq_jax.HNLQConfig, got "
                            f"{type(config).__name__}")
        check_layer_implementation(self.implementation, type(self).__name__)
        self.codes_config = unit(config)
        self._op_config = ops.config_args(self.codes_config)
        lead = (self.out_features, -(-self.in_features // config.d))
        self.register_buffer("index", torch.zeros(
            lead + (config.M,), dtype=ops.torch_dtype(index_dtype(config)), device=device))
        # T field 0 = failed blocks: a layer whose codes were never set decodes to NaN.
        self.register_buffer("tfield", torch.zeros(tfield_shape(lead, config), dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("scale", torch.ones(self.out_features, dtype=scale_dtype,
                                                 device=device))

    def codes(self) -> Codes:
        """The layer's weight codes (:class:`torch_bridge.Codes` viewing the buffers)."""
        return Codes(self.index, self.tfield, self.codes_config, self.scale, self.in_features)

    def set_codes(self, codes: Codes):
        """Replaces the cached codes (e.g. from :func:`torch_bridge.encode_rows`).

        Raises:
          ValueError: codes of another config or shape than this layer's.
        """
        where = f"{type(self).__name__}.set_codes"
        if not isinstance(codes, Codes):
            raise TypeError(f"{where}: expected torch_bridge.Codes, got {type(codes).__name__}")
        if codes.config != self.codes_config:
            raise ValueError(f"{where}: the codes were made with {codes.config}, the layer holds "
                             f"codes of {self.codes_config}")
        if codes.shape != (self.out_features, self.in_features) or codes.scale is None:
            raise ValueError(f"{where}: expected scaled row codes of a weight "
                             f"[{self.out_features}, {self.in_features}], got {codes}")
        # Copied: the layer writes its buffers in place (load_state_dict), and codes from
        # Codes.from_jax view JAX arrays, which must not change.
        device = self.index.device
        self.index = codes.index.to(device, copy=True)
        self.tfield = codes.tfield.to(device, copy=True)
        self.scale = codes.scale.to(device, copy=True)

    def codes_matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
        """``x @ W_hat^T (+ bias)`` from the cached codes: ``torch.ops.hnlq.matmul``, whose
        body an inference call runs without the op's dispatch (:func:`torch_bridge.ops.
        matmul_direct`: the same product bit for bit, the bias added as ``y + bias``; on CPU
        tensors the native kernels); else ``y + bias``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: expected input [..., {self.in_features}], "
                             f"got {tuple(x.shape)}")
        ops.refuse_forward_ad(x, type(self).__name__)
        args = (x, self.index, self.tfield, self.scale, self.in_features, self.implementation)
        # A bias whose gradient autograd records is added outside the product.
        fold = bias is not None and not (torch.is_grad_enabled() and bias.requires_grad)
        y = ops.matmul_direct(*args, self._op_config, bias if fold else None)
        if y is None:
            y = torch.ops.hnlq.matmul(*args, *self._op_config)
        elif fold:
            return y
        return y if bias is None else y + bias.to(y.dtype)

    # -- state dict: format version, config and row length travel with the codes
    def _header(self) -> dict:
        """What describes the codes in the extra state (and its ``header_crc32`` covers): format
        version, config, in_features (the codes' shape holds it only rounded up to whole
        d-blocks)."""
        return {**saved_header(self.codes_config), "in_features": self.in_features}

    def get_extra_state(self) -> dict:
        header = self._header()
        return {**header, "crc32": checksum(*map(_raw, (self.index, self.tfield, self.scale))),
                "header_crc32": header_checksum(header)}

    def set_extra_state(self, state):
        self._check_saved(state, type(self).__name__)

    def _check_saved(self, state, where: str):
        check_saved_header(state, self.codes_config, where,
                           "build the layer with the saved config")
        # Absent from state dicts written before it was recorded: nothing to check there.
        if "in_features" in state and state["in_features"] != self.in_features:
            raise ValueError(f"{where}: the codes were saved from a weight with in_features = "
                             f"{state['in_features']!r}, the layer has in_features = "
                             f"{self.in_features}; build the layer with the saved shape")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        where = f"{type(self).__name__} {prefix.rstrip('.') or '(root)'}"
        if prefix + "labels" in state_dict:
            raise ValueError(f"{where}: the state dict holds codes in the earlier unversioned "
                             "format (labels, T); this torch_bridge reads format version "
                             f"{FORMAT_VERSION}: quantize the float model again")
        extra = prefix + "_extra_state"
        if extra in state_dict:  # checked before any buffer is overwritten
            self._check_saved(state_dict[extra], where)
            # the saved header equals this layer's (checked): its CRC then covers both
            check_header_checksum(state_dict[extra], self._header(), where)
        elif any(prefix + name in state_dict for name in _CODES):
            # Without the header nothing says which config or format the codes are in.
            raise ValueError(f"{where}: the state dict holds codes but no {extra!r} (their "
                             "format version and config); load a complete state dict as "
                             "saved by state_dict()")
        for name in ("index", "tfield"):
            t = state_dict.get(prefix + name)
            if t is not None and t.dtype != getattr(self, name).dtype:
                raise ValueError(f"{where}: saved {name} is {t.dtype}, expected "
                                 f"{getattr(self, name).dtype} for {self.codes_config}")
        saved = [state_dict.get(prefix + name) for name in _CODES]
        if all(isinstance(t, torch.Tensor) and t.shape == getattr(self, name).shape
               for t, name in zip(saved, _CODES)):
            # Checked before the buffers are overwritten: a refused state dict leaves the layer
            # as it was. (Other shapes are reported by torch's own size check.)
            codes = Codes(*saved[:2], self.codes_config, saved[2], self.in_features)
            try:
                _jax_codes(codes)  # raises on corrupted codes (index, T or scale out of range)
            except ValueError as e:  # named by the layer, as the other loading errors
                raise ValueError(f"{where}: {e}") from None
            if extra in state_dict:  # in range, yet maybe not what was saved
                check_checksum(state_dict[extra], map(_raw, saved), where)
            if saved[2].dtype != self.scale.dtype:
                # The scales load in their saved dtype (a refresh makes them at least float32):
                # copied into this layer's, they would round, and the layer compute otherwise.
                self.scale = self.scale.to(saved[2].dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class QuantizedLinear(CodesLayer, torch.nn.Module):
    """An inference ``nn.Linear`` whose weight exists only as HNLQ codes.

    ``y = matmul(x, codes) + bias`` through ``torch.ops.hnlq.matmul``. Build one with
    :meth:`from_linear` or :func:`quantize_model`; the constructor makes an empty layer (codes
    marked failed, so it outputs NaN) to load a state dict into.

    Args:
      in_features, out_features, bias, device: as ``nn.Linear``.
      config: the quantizer (its beta is unused: each layer's beta is in its scales).
      implementation: the implementation of the layer's :func:`hnlq_jax.matmul`, encode and
        decode (``None``: the backend's default; ``"xla"``, ``"pallas"``).
      dtype: dtype of the bias and scales (default float32).
      rotation: an :class:`hnlq_jax.incoherence.Rotation` of size ``in_features``: the codes
        are of the rotated weight ``W R`` and the layer computes ``matmul(x R, codes)``
        (``torch.ops.hnlq.rotate``, bit for bit ``Rotation.apply``). It is saved in the extra
        state (``Rotation.to_dict()``); loading a state dict with another rotation (or none,
        into a rotated layer, or the reverse) raises ``ValueError``.
    """

    def __init__(self, in_features: int, out_features: int, config: HNLQConfig,
                 bias: bool = True, *, implementation=None, device=None, dtype=None,
                 rotation: Rotation | None = None):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:  # nothing to code
                raise ValueError(f"QuantizedLinear: {name} must be an int >= 1, got {v!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"QuantizedLinear: bias must be a bool, got {bias!r}")
        if rotation is not None and (not isinstance(rotation, Rotation)
                                     or rotation.n != in_features):
            raise ValueError(f"QuantizedLinear: rotation must be None or an "
                             f"hnlq_jax.incoherence.Rotation of size in_features = "
                             f"{in_features}, got {rotation!r}")
        self.in_features, self.out_features = in_features, out_features
        self.implementation = implementation
        self.rotation = rotation
        dtype = torch.float32 if dtype is None else dtype
        self._register_codes(config, device, dtype)
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: HNLQConfig, *, calibrate: bool = True,
                    implementation=None, hessian=None, rotation: Rotation | None = None,
                    damp: float = hptq.DAMP, act_order: bool = False,
                    criterion: str = "loss", grid=hptq.DEFAULT_GRID,
                    t_budget=None) -> QuantizedLinear:
        """The quantized form of ``linear``.

        A plain ``nn.Linear`` (or a subclass) is coded by :func:`torch_bridge.encode_rows` with
        its calibrated beta (``calibrate=False``: ``config.beta``), or, given the ``hessian``
        of its inputs, by :func:`hnlq_jax.ptq.gptq_rows` (compensated rounding; ``damp``,
        ``act_order``, ``criterion``, ``grid``, ``t_budget`` as there; its beta search when
        ``calibrate``, else ``config.beta``). With a ``rotation`` the rotated weight is coded
        (see the class). A layer that already holds codes (a :class:`~torch_bridge.QLinear`)
        keeps them, so the result computes exactly as that layer in eval mode.

        Raises:
          TypeError: not an ``nn.Linear``.
          ValueError: a ``QLinear`` with another config or that quantizes its activations
            (which ``QuantizedLinear`` does not), or given a ``hessian`` or ``rotation``; the
            errors of :func:`~hnlq_jax.ptq.gptq_rows` for a bad ``hessian``.
        """
        return cls._from_linear(linear, config, calibrate=calibrate,
                                implementation=implementation, hessian=hessian,
                                rotation=rotation, damp=damp, act_order=act_order,
                                criterion=criterion, grid=grid, t_budget=t_budget)[0]

    @classmethod
    def _from_linear(cls, linear, config, *, calibrate, implementation, hessian=None,
                     rotation=None, damp=hptq.DAMP, act_order=False, criterion="loss",
                     grid=hptq.DEFAULT_GRID, t_budget=None):
        """``(layer, PTQResult or None)``: :meth:`from_linear` and the compensation's result."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"QuantizedLinear.from_linear: expected an nn.Linear, got "
                            f"{type(linear).__name__}")
        w = linear.weight
        dtype = torch.promote_types(w.dtype, torch.float32)
        layer = cls(linear.in_features, linear.out_features, config, linear.bias is not None,
                    implementation=implementation, device=w.device, dtype=dtype,
                    rotation=rotation)
        result = None
        if _holds_codes(linear):
            if getattr(linear, "quantize_activations", False):
                raise ValueError("QuantizedLinear.from_linear: the layer quantizes its "
                                 "activations, which QuantizedLinear does not")
            if hessian is not None or rotation is not None:
                raise ValueError("QuantizedLinear.from_linear: the layer already holds codes "
                                 "(it keeps them): no hessian or rotation applies")
            codes = linear.codes()
        elif check_weight(w, "QuantizedLinear.from_linear") or hessian is not None:
            wd = w.detach().to(dtype)
            with x64_for(wd, hessian):  # (a float64 tensor converts only with x64 on)
                H = hessian if not isinstance(hessian, torch.Tensor) else to_jax(hessian.detach())
                result = hptq.gptq_rows(to_jax(wd), H, config, damp=damp, act_order=act_order,
                                        criterion=criterion, grid=grid, t_budget=t_budget,
                                        beta=None if calibrate else config.beta,
                                        rotation=rotation, implementation=implementation)
                codes = Codes.from_jax(result.codes, copy=True)
        else:
            wd = w.detach()
            if rotation is not None:
                with x64_for(wd):
                    wd = to_torch(rotation.rotate_weight(to_jax(wd)), copy=True)
            codes = encode_rows(wd, config, beta=calibrated_beta(wd, config, calibrate),
                                implementation=implementation)
        layer.set_codes(codes)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        return layer.train(linear.training), result

    @property
    def weight(self) -> torch.Tensor:
        """The decoded weight ``[out, in]``, computed on each access and never stored (for code
        that reads ``.weight`` directly)."""
        w = decode(self.codes(), dtype=self.scale.dtype, implementation=self.implementation)
        if self.rotation is not None:  # W = W' R^T
            w = torch.ops.hnlq.rotate(w, self.rotation.n, self.rotation.seed, True)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is not None:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"{type(self).__name__}: expected input [..., "
                                 f"{self.in_features}], got {tuple(x.shape)}")
            ops.refuse_forward_ad(x, type(self).__name__)  # before the rotation drops it
            args = (x, self.rotation.n, self.rotation.seed, False)
            rotated = ops.rotate_direct(*args)
            x = torch.ops.hnlq.rotate(*args) if rotated is None else rotated
        return self.codes_matmul(x, self.bias)

    # -- the rotation travels in the extra state too
    def _header(self) -> dict:
        header = super()._header()
        if self.rotation is not None:
            header["rotation"] = self.rotation.to_dict()
        return header

    def _check_saved(self, state, where: str):
        super()._check_saved(state, where)
        saved = state.get("rotation")
        saved = None if saved is None else Rotation.from_dict(saved)
        if saved != self.rotation:
            def say(r):
                return "no rotation" if r is None else f"Rotation(n={r.n}, seed={r.seed})"
            raise ValueError(f"{where}: the codes were saved with {say(saved)}, but the layer "
                             f"has {say(self.rotation)}; build the layer with the saved rotation "
                             "(QuantizedLinear(..., rotation=Rotation.from_dict(...))), or a "
                             "model with quantize_model(..., rotate=True, seed=...) given the "
                             "seed it was saved with (layer k's rotation has seed + k)")

    def extra_repr(self) -> str:
        c = self.codes_config
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, lattice={c.lattice}, q={c.q}, M={c.M}"
                + ("" if self.rotation is None else f", rotation_seed={self.rotation.seed}"))


def model_sizes(model: torch.nn.Module) -> Sizes:
    """The :class:`hnlq_jax.sizes.Sizes` of a model's :class:`QuantizedLinear` layers (a shared
    layer counted once), e.g. after :func:`load_quantized`; what :func:`quantize_model`
    reports as ``report.sizes``."""
    return _sizes({id(m): m for m in model.modules() if isinstance(m, QuantizedLinear)}.values())


def _sizes(layers) -> Sizes:
    layers = list(layers)
    return measure([_jax_codes(q.codes()) for q in layers],
                   [q.bias.detach() for q in layers if q.bias is not None])


def _jax_codes(codes: Codes):
    """``codes`` as JAX codes (float64 scales with x64 on for the conversion)."""
    with x64_for(*codes.op_args()):
        return codes.to_jax()


def _holds_codes(module) -> bool:
    """Whether ``module`` computes with codes of its weight (a ``QLinear`` with
    ``quantize_weights=False`` is a float layer), which :func:`quantize_model` keeps."""
    return isinstance(module, CodesLayer) and getattr(module, "quantize_weights", True)


def _why_not(module: torch.nn.Linear) -> str | None:
    """Why ``module`` is kept in float (None: convert it)."""
    if isinstance(module, CodesLayer):
        if getattr(module, "quantize_activations", False):
            return "it quantizes its activations, which QuantizedLinear does not"
        return None
    if type(module).forward is not torch.nn.Linear.forward:
        return (f"{type(module).__name__} overrides nn.Linear.forward: converting it would drop "
                "its behaviour; convert it by hand (QuantizedLinear.from_linear) if that is "
                "intended")
    return None


def _children(model: torch.nn.Module, kind):
    """``(name, parent, child name, child)`` of every module of type ``kind`` inside ``model``,
    in ``named_modules`` order (a module before the modules inside it), once per place it sits
    in: a module shared by several parents, or held by one under several names, is listed
    under each (``named_children`` would list it once a parent)."""
    def walk(prefix, parent, path):
        for child_name, child in parent._modules.items():
            if child is None:
                continue
            name = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, kind):
                yield name, parent, child_name, child
            if id(child) not in path:  # a module inside itself: once
                yield from walk(name, child, path | {id(child)})
    yield from walk("", model, frozenset({id(model)}))


def _split_attentions(model: torch.nn.Module, decide) -> None:
    """Puts a :class:`SplitMultiheadAttention` (float copies of the projections) in place of
    each ``nn.MultiheadAttention`` of ``model`` for which ``decide(name, attention, split)``
    is true (a shared one is split once), so that its projections are linear modules."""
    splits = {}
    for name, parent, child_name, child in list(_children(model, torch.nn.MultiheadAttention)):
        if id(child) not in splits:
            split = (SplitMultiheadAttention.from_attention(child)
                     if why_not_split(child) is None else None)
            splits[id(child)] = split if decide(name, child, split) else None
        if splits[id(child)] is not None:
            setattr(parent, child_name, splits[id(child)])
    for encoder in model.modules():
        if isinstance(encoder, torch.nn.TransformerEncoder) and any(
                isinstance(layer.self_attn, SplitMultiheadAttention) for layer in encoder.layers):
            # What the encoder's constructor decides for attention with separate projections:
            # its nested-tensor path would hand the layers nested tensors.
            encoder.use_nested_tensor = False


def _collect_hessians(model, targets: dict, run) -> dict:
    """``{id(layer): (H, rows)}``: ``H = sum x^T x`` of each target layer's inputs over one call
    ``run(model)`` (forward pre-hooks, :func:`hnlq_jax.ptq.hessian_update`)."""
    acc: dict = {}

    def hook(module, args):
        x = args[0]
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"quantize_model: calibration fed {targets[id(module)]} a "
                            f"{type(x).__name__} input; expected a floating tensor")
        x = x.detach()
        H, rows = acc.get(id(module), (None, 0))
        with x64_for(x):
            acc[id(module)] = hptq.hessian_update(H, to_jax(x), rows)

    handles = [m.register_forward_pre_hook(hook) for m in
               {id(m): m for m in model.modules()}.values() if id(m) in targets]
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    missing = [hptq.layer_name(name) for key, name in targets.items()
               if acc.get(key, (None, 0))[1] == 0]
    if missing:
        raise ValueError(f"quantize_model: calibration never ran {len(missing)} of the layers "
                         f"to convert, so they have no Hessian: {', '.join(missing)}; run the "
                         "model on inputs that reach them, or leave them out with filter_fn")
    return acc


def _progress(items, enabled: bool, total: int):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError as e:
        raise ImportError("quantize_model(progress=True) needs tqdm (pip install tqdm)") from e
    return tqdm(items, total=total, desc="quantize_model", unit="layer")


def quantize_model(model: torch.nn.Module, config: HNLQConfig, filter_fn=None, *,
                   calibrate: bool = True, implementation=None, calibration=None,
                   rotate: bool | None = None, act_order: bool | None = None,
                   damp: float | None = None, criterion: str | None = None,
                   grid=hptq.DEFAULT_GRID, t_budget=None,
                   sequential: bool = False, seed: int = 0,
                   progress: bool = False) -> QuantizeReport:
    """Replaces the ``nn.Linear`` layers of ``model``, in place, by :class:`QuantizedLinear`.

    Converted: every ``nn.Linear`` and every subclass that does not override ``forward``,
    :class:`~torch_bridge.QLinear` layers (from their cached codes), and the four projections
    of every ``nn.MultiheadAttention`` (also inside ``nn.TransformerEncoderLayer`` and
    friends): each is first replaced by a :class:`~torch_bridge.SplitMultiheadAttention`, the
    same attention with ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` as linear layers
    (named so in the report and ``filter_fn``), whose linears are then converted like any
    other. Kept in float, with a warning and an entry in the report: subclasses with their own
    ``forward``, ``QLinear`` layers that quantize activations, and attentions with
    ``add_bias_kv`` or ``add_zero_attn``. A layer shared by several parents (or held by one
    under several names) is converted once and replaced everywhere. Layers are coded in
    ``named_modules`` order.

    **Calibration** (``calibration=run``): forward pre-hooks on the layers to convert collect
    ``H = sum x^T x`` of each one's inputs (:func:`hnlq_jax.ptq.hessian_update`, float32, or
    float64 for float64 inputs) during one call ``run(model)`` of the still-float model
    (under ``torch.no_grad()``); each layer is then coded by
    :func:`hnlq_jax.ptq.gptq_rows` (compensated rounding) instead of round-to-nearest, by
    default in the recommended setting (rotated, activation order, ``criterion="f"``,
    ``damp=0.01``: :data:`hnlq_jax.ptq.RECOMMENDED`; any option given overrides it). All
    layers' Hessians are held at once: ``4 * in^2`` bytes per layer. With ``sequential=True``
    the layers are taken one at a time in ``named_modules`` order (which should be the order
    the forward pass reaches them): ``run(model)`` is called once per layer, with only that
    layer hooked and every earlier one already replaced, so each layer's H is that of the
    inputs it will see in the quantized model and only one H is held; it costs one calibration
    pass per layer (and an error part way leaves the layers coded so far replaced).
    ``QLinear`` layers keep their codes and are not hooked (one with
    ``quantize_weights=False`` is converted as an ``nn.Linear`` is).

    Args:
      model: any module (not itself an ``nn.Linear``).
      config: the quantizer.
      filter_fn: ``filter_fn(name, linear) -> bool``; only layers where it is true are
        converted (default: all). ``name`` is the qualified name, as in ``named_modules``.
      calibrate: each layer's beta from :func:`hnlq_jax.rows.calibrate_rows` of its weight
        (default; with ``calibration``, :func:`~hnlq_jax.ptq.gptq_rows`' beta search around
        it); ``False`` uses ``config.beta``.
      implementation: the layers' :func:`hnlq_jax.matmul` implementation.
      calibration: ``None`` (round-to-nearest), or a callable ``run(model)`` that runs the
        model on calibration data (any input types; its return value is ignored).
      rotate: incoherence processing: converted layer ``k`` (0, 1, ... in ``named_modules``
        order, counting each shared layer once) gets
        ``Rotation(in_features, seed + k)`` (:mod:`hnlq_jax.incoherence`), codes of the
        rotated weight and applies the rotation to its inputs; with or without calibration.
        ``None`` (default): with ``calibration`` the recommended ``True``, else ``False``.
      act_order, damp, criterion, grid, t_budget: as :func:`hnlq_jax.ptq.gptq_rows` (with
        ``calibration`` only). ``criterion="f"`` trades the proxy loss against the entropy of
        T (fewer overloads, fewer packed bits) with one beta per layer; ``t_budget`` caps that
        entropy (bits per weight) in every layer; a ``grid`` reaching above 1 lets either
        choose larger betas. ``None`` (default) for ``act_order``, ``damp`` and ``criterion``
        is the recommended setting, :data:`hnlq_jax.ptq.RECOMMENDED`.
      sequential: collect one layer's H at a time from the partly quantized model (above).
      seed: the base seed of the rotations.
      progress: a tqdm progress bar over the layers being coded (needs ``tqdm``).

    Returns:
      A :class:`QuantizeReport` (print it for a summary); with ``calibration`` it holds each
      layer's proxy loss.

    Raises:
      TypeError: ``model`` is not a module, ``config`` not an ``HNLQConfig``, ``calibration``
        neither ``None`` nor callable.
      ValueError: ``model`` is itself an ``nn.Linear`` (use ``QuantizedLinear.from_linear``);
        nothing would be converted (no weight layer, every one filtered out, kept or already
        quantized: the message lists each with its reason, as ``quantize_params`` does);
        ``calibration`` never ran a layer to convert (the message names them); the errors of
        :func:`~hnlq_jax.ptq.gptq_rows` (e.g. a bad ``damp``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantize_model: expected a torch.nn.Module, got {type(model).__name__}")
    ops.config_args(config)  # a clear TypeError for a config that is not an HNLQConfig
    if isinstance(model, torch.nn.Linear):
        raise ValueError("quantize_model: replaces layers inside a model, and the model is "
                         "itself an nn.Linear: use QuantizedLinear.from_linear(model, config)")
    check_layer_implementation(implementation, "quantize_model")  # before any work
    if calibration is not None and not callable(calibration):
        raise TypeError(f"quantize_model: calibration must be None or a callable run(model) "
                        f"that runs the model on calibration data, got "
                        f"{type(calibration).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"quantize_model: seed must be a non-negative int, got {seed!r}")
    if criterion not in (None, "loss", "f"):
        raise ValueError(f"quantize_model: criterion must be 'loss' or 'f', got {criterion!r}")
    for name, flag in (("sequential", sequential), ("calibrate", calibrate),
                       ("progress", progress)):
        if not isinstance(flag, bool):
            raise TypeError(f"quantize_model: {name} must be a bool, got {flag!r}")
    hptq.check_calibration_options("quantize_model", calibration, act_order=act_order,
                                   damp=damp, criterion=criterion, grid=grid,
                                   t_budget=t_budget, sequential=sequential)
    rotate, act_order, damp, criterion = hptq.recommended("quantize_model", calibration,
                                                         rotate, act_order, damp, criterion)
    report = QuantizeReport()

    def split(name, attention, split):
        why = why_not_split(attention)
        if why is not None:
            report.skipped.append((name, type(attention).__name__, why))
            return False
        return filter_fn is None or any(filter_fn(f"{name}.{p}", getattr(split, p))
                                        for p in _PROJECTIONS)

    _split_attentions(model, split)
    chosen = []
    # QuantizedLinear too (not an nn.Linear), to report that it is already quantized
    for name, parent, child_name, child in _children(model, (torch.nn.Linear, QuantizedLinear)):
        why = ("already quantized" if isinstance(child, QuantizedLinear)
               else "filter_fn" if filter_fn is not None and not filter_fn(name, child)
               else "a projection of an nn.MultiheadAttention kept in float (above)"
               if isinstance(parent, torch.nn.MultiheadAttention) else _why_not(child))
        if why is not None:
            report.skipped.append((name, type(child).__name__, why))
        else:
            chosen.append((name, parent, child_name, child))
    if not chosen:  # before any work: a silent no-op would leave the model in float
        raise ValueError(f"quantize_model: {report}")
    firsts = {}  # id(layer) -> (first name, layer), in order
    for name, _, _, child in chosen:
        firsts.setdefault(id(child), (name, child))
    # layers to code from their float weight (a QLinear that never coded its own too)
    fresh = {k: v for k, v in firsts.items() if not _holds_codes(v[1])}
    hessians = {}
    if calibration is not None and fresh and not sequential:
        hessians = _collect_hessians(model, {k: n for k, (n, _) in fresh.items()},
                                     calibration)
    done: dict[int, QuantizedLinear] = {}

    def install(key):
        for _, parent, child_name, child in chosen:
            if id(child) == key:
                setattr(parent, child_name, done[key])

    for k, (key, (name, child)) in enumerate(_progress(firsts.items(), progress, len(firsts))):
        plain = key in fresh
        if sequential and calibration is not None and plain:
            hessians = _collect_hessians(model, {key: name}, calibration)
        H, rows = hessians.pop(key, (None, 0))  # pop: free it once coded
        rotation = Rotation(child.in_features, seed + k) if rotate and plain else None
        with hptq.layer_context("quantize_model", name):
            q, result = QuantizedLinear._from_linear(
                child, config, calibrate=calibrate, implementation=implementation, hessian=H,
                rotation=rotation, damp=damp, act_order=act_order, criterion=criterion,
                grid=grid, t_budget=t_budget)
        done[key] = q
        if sequential:  # later layers' calibration runs through this one's codes
            install(key)
        if result is not None:
            report.proxy_loss[name], report.clipped[name] = result.loss, result.clipped
            report.tokens[name], report.t_bits[name] = rows, result.t_bits
    for key in done:
        install(key)
    for name, parent, child_name, child in chosen:
        report.converted.append((name, type(child).__name__,
                                 (child.out_features, child.in_features)))
    report.sizes = _sizes(done.values())
    unexpected = [s for s in report.skipped if s[2] not in ("filter_fn", "already quantized")]
    if unexpected:
        warnings.warn(f"quantize_model: kept {len(unexpected)} weight layer(s) in float: "
                      + "; ".join(f"{n} ({k}): {r}" for n, k, r in unexpected), stacklevel=2)
    return report


def load_quantized(model: torch.nn.Module, state_dict: dict, *, implementation=None,
                   strict: bool = True, assign: bool = False) -> torch.nn.Module:
    """Restores a quantized model from its state dict into the float architecture, encoding
    nothing.

    Each ``nn.Linear`` of ``model`` (a :class:`~torch_bridge.QLinear` too: the QAT model that
    :func:`quantize_model` converted) whose entry in ``state_dict`` holds the codes of a
    ``QuantizedLinear`` (the ``_extra_state`` it saves: format version, config, in_features,
    rotation; and no float weight) is replaced, in place, by an empty ``QuantizedLinear`` built
    from that extra state
    (on the linear's device; scales and bias in the saved scales' dtype), after each
    ``nn.MultiheadAttention`` whose projections were saved as ``q_proj`` / ``k_proj`` /
    ``v_proj`` is split as :func:`quantize_model` splits it; then the whole state dict loads,
    its codes checked as every load checks them. The result computes bit for bit as the model
    that was saved.

    Args:
      model: the float model (e.g. freshly built from its config: its float weights are
        dropped where codes replace them, so they need not be initialized meaningfully).
      state_dict: the quantized model's ``state_dict()`` (``torch.load`` with the default
        ``weights_only=True`` reads it: the extra state is plain data).
      implementation: the layers' :func:`hnlq_jax.matmul` implementation (``None``: default).
      strict: as ``nn.Module.load_state_dict``.
      assign: as ``nn.Module.load_state_dict``: the state dict's tensors become the model's
        (a model built on the ``meta`` device, whose tensors cannot be copied into, takes
        ``assign=True``).

    Returns:
      ``model``, with the quantized layers in place (a layer shared by several parents, or
      held under several names, stays one layer).

    Raises:
      ValueError: codes saved for a module that is missing or not an ``nn.Linear`` of the
        saved shape, a corrupted or foreign header, or codes out of range (naming the layer);
        torch's errors for missing or unexpected keys when ``strict``.
    """
    check_layer_implementation(implementation, "load_quantized")
    built = {}  # id(float layer) -> its QuantizedLinear
    _split_attentions(model, lambda name, attention, split: any(
        key.startswith(f"{name}.{p}.") for key in state_dict for p in _PROJECTIONS[:3]))
    for key, state in state_dict.items():
        if not key.endswith("_extra_state") or not (isinstance(state, dict)
                                                    and "format_version" in state):
            continue  # another module's extra state
        name = key[:-len("_extra_state")].rstrip(".")
        where = f"load_quantized: layer {name or '(root)'}"
        if not name:
            raise ValueError(f"{where}: the state dict is one layer's; load it into a "
                             "QuantizedLinear built with its shape, config and rotation")
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{where}: the state dict holds codes for it, but the model has "
                             "no such module; build the model the state dict was saved "
                             "from") from None
        if isinstance(module, QuantizedLinear) or f"{name}.weight" in state_dict:
            # a layer of the saved kind (a QLinear saved as one) loads itself; a float weight
            # is a QLinear's (maybe one that never coded it): not a QuantizedLinear's
            continue
        config = read_saved_header(state, where)
        index, scale = state_dict.get(name + ".index"), state_dict.get(name + ".scale")
        if not isinstance(index, torch.Tensor) or not isinstance(scale, torch.Tensor):
            raise ValueError(f"{where}: the state dict lacks its index or scale")
        saved = (index.shape[0], state.get("in_features", getattr(module, "in_features", None)))
        if not isinstance(module, torch.nn.Linear) or saved != (module.out_features,
                                                                module.in_features):
            raise ValueError(f"{where}: codes of a weight [{saved[0]}, {saved[1]}] do not fit "
                             f"the model's {type(module).__name__}"
                             + (f" [{module.out_features}, {module.in_features}]"
                                if isinstance(module, torch.nn.Linear) else "")
                             + "; build the model the state dict was saved from")
        if id(module) in built:  # the same layer under another name
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, built[id(module)])
            continue
        rotation = state.get("rotation")
        layer = QuantizedLinear(
            module.in_features, module.out_features, config, module.bias is not None,
            implementation=implementation, device=module.weight.device, dtype=scale.dtype,
            rotation=None if rotation is None else Rotation.from_dict(rotation))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.train(module.training))
        built[id(module)] = layer
    model.load_state_dict(state_dict, strict=strict, assign=assign)
    return model


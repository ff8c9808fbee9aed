"""HNLQ codes and the front doors on torch tensors: the same codes and values as
:mod:`hnlq_jax`, bit for bit.

:class:`Codes` is the torch counterpart of :class:`hnlq_jax.Codes`: the compact integer arrays
``index`` and ``tfield`` (and ``scale`` of row codes) as tensors, with the config and row length
carried in Python (``docs/format.md`` describes the fields). :func:`encode`, :func:`decode`,
:func:`quantize` and :func:`matmul` call their ``torch.ops.hnlq`` custom ops
(:mod:`torch_bridge.ops`), so the same calls work inside ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import dataclasses

import torch

import hnlq_jax as hq
from hnlq_jax import HNLQConfig
from hnlq_jax.codec import check_beta_fits, check_x, to_blocks
from hnlq_jax.codes import check_codes, logical_shape
from hnlq_jax.config import check_beta
from hnlq_jax.ops import resolve
from hnlq_jax.rows import check_row_failures, rows_codes
from torch_bridge import ops
from torch_bridge.interop import to_jax, to_torch, x64_for

__all__ = ["Codes", "decode", "encode", "encode_rows", "matmul", "quantize"]


@dataclasses.dataclass(frozen=True, eq=False)
class Codes:
    """HNLQ codes as torch tensors (the fields of :class:`hnlq_jax.Codes`).

    Attributes:
      index: ``[..., M]`` codebook indices (``torch.uint8`` / ``uint16`` / ``uint32``).
      tfield: the uint8 T field (``T + 1``, two blocks per byte when ``max_T <= 14``).
      config: the quantizer that made the codes.
      scale: ``None``, or the per-row scales ``[...rows]`` of row codes.
      n: the row length of row codes, ``None`` for block codes.
    """

    index: torch.Tensor
    tfield: torch.Tensor
    config: HNLQConfig
    scale: torch.Tensor | None = None
    n: int | None = None

    @classmethod
    def from_jax(cls, codes: hq.Codes, copy: bool = False) -> Codes:
        """The tensors of :class:`hnlq_jax.Codes` (DLPack views, or copies with ``copy=True``).

        Raises:
          TypeError, ValueError: not valid ``hnlq_jax.Codes`` (see ``check_codes``).
        """
        check_codes(codes, "Codes.from_jax")
        scale = None if codes.scale is None else to_torch(codes.scale, copy)
        return cls(to_torch(codes.index, copy), to_torch(codes.tfield, copy), codes.config,
                   scale, codes.n)

    def to_jax(self) -> hq.Codes:
        """:class:`hnlq_jax.Codes` viewing these tensors (DLPack, no copy), validated.

        64-bit tensors need JAX's x64 mode: call it under
        ``torch_bridge.x64_for(*codes.op_args())``.

        Raises:
          TypeError, ValueError: wrong dtypes or shapes, an index ``>= q^d`` or a T field above
            ``max_T + 1``, row length or scale that do not fit the blocks.
        """
        for name in ("index", "tfield", "scale"):
            v = getattr(self, name)
            if not (isinstance(v, torch.Tensor) or (name == "scale" and v is None)):
                raise TypeError(f"torch_bridge.Codes: {name} must be a tensor, got "
                                f"{type(v).__name__}")
        scale = None if self.scale is None else to_jax(self.scale)
        return check_codes(hq.Codes(to_jax(self.index), to_jax(self.tfield), self.config,
                                    scale=scale, n=self.n), "torch_bridge.Codes")

    @property
    def blocks_shape(self) -> tuple:
        """Leading shape of the blocks: ``index.shape[:-1]``."""
        return tuple(self.index.shape[:-1])

    @property
    def shape(self) -> tuple:
        """Shape of the decoded tensor (``[..., d]`` block codes, ``[..., n]`` row codes)."""
        return logical_shape(self.blocks_shape, self.config, self.n)

    @property
    def T(self) -> torch.Tensor:
        """``[...]`` int8 overload steps, ``-1`` for a failed block (unpacked on demand)."""
        with x64_for(*self.op_args()):
            return to_torch(self.to_jax().T, copy=True)

    @property
    def labels(self) -> torch.Tensor:
        """``[..., M, d]`` uint8 digit view (derived on demand)."""
        with x64_for(*self.op_args()):
            return to_torch(self.to_jax().labels, copy=True)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors held: index, T field and scale."""
        return sum(t.nbytes for t in (self.index, self.tfield, self.scale) if t is not None)

    def op_args(self) -> tuple:
        """``(index, tfield, scale, n)``: the codes' arguments of the ``torch.ops.hnlq`` ops."""
        return self.index, self.tfield, self.scale, self.n

    def __repr__(self) -> str:
        c = self.config
        kind = "blocks" if self.n is None else f"rows n={self.n}"
        scale = "" if self.scale is None else f", scale {self.scale.dtype}{list(self.scale.shape)}"
        return (f"torch_bridge.Codes({c.lattice} q={c.q} M={c.M}, {kind}, shape "
                f"{list(self.shape)}: index {self.index.dtype}{list(self.index.shape)}, T field "
                f"{list(self.tfield.shape)}{scale})")


def check_codes_arg(codes, fn: str) -> Codes:
    """``codes`` if it is a :class:`Codes`, else a ``TypeError`` for ``fn`` (the value checks
    run where the codes reach JAX)."""
    if not isinstance(codes, Codes):
        hint = (" (convert with torch_bridge.Codes.from_jax)" if isinstance(codes, hq.Codes)
                else "")
        raise TypeError(f"{fn}: expected torch_bridge.Codes, got {type(codes).__name__}{hint}")
    return codes


def _check_tensor(t, fn: str):
    """A clear error for a non-tensor input (the custom ops would raise a schema error)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(t).__name__} (for NumPy or "
                        "JAX arrays use the hnlq_jax function of the same name)")


def encode(t: torch.Tensor, config: HNLQConfig, *, implementation=None,
           failures: str = "raise") -> Codes:
    """Algorithm 1 on a tensor ``[..., d]``: block :class:`Codes` (:func:`hnlq_jax.encode`).

    Same checks and errors as :func:`hnlq_jax.encode` (wrong last axis, non-floating dtype,
    NaN/Inf, blocks beyond ``max_T`` unless ``failures="mark"``). Gradient-requiring and
    non-contiguous tensors are accepted; float64 is encoded in float64.
    """
    _check_tensor(t, "torch_bridge.encode")
    index, tfield = torch.ops.hnlq.encode(t, implementation, failures, *ops.config_args(config))
    return Codes(index, tfield, config)


def decode(codes: Codes, *, levels: int | None = None, dtype: torch.dtype = torch.float32,
           implementation=None) -> torch.Tensor:
    """Algorithm 2 (:func:`hnlq_jax.decode`): ``[..., d]`` (block codes) or ``[..., n]`` times
    the row scale (row codes), in ``dtype`` (float32 by default; float64 is computed in
    float64); ``levels`` keeps the coarsest levels only."""
    codes = check_codes_arg(codes, "torch_bridge.decode")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"torch_bridge.decode: dtype must be a torch.dtype, got {dtype!r}")
    return torch.ops.hnlq.decode(*codes.op_args(), levels, dtype, implementation,
                                 *ops.config_args(codes.config))


def quantize(t: torch.Tensor, config: HNLQConfig, *, implementation=None) -> torch.Tensor:
    """``decode(encode(t))`` with a straight-through gradient (:func:`hnlq_jax.quantize`).

    Args:
      t: ``[..., d]`` floating tensor.
      config: the quantizer.
      implementation: ``None``, ``"xla"`` or ``"pallas"``.

    Returns:
      The quantized tensor, same shape and dtype; gradients pass through unchanged.
    """
    _check_tensor(t, "torch_bridge.quantize")
    return torch.ops.hnlq.quantize(t, implementation, *ops.config_args(config))


def matmul(x: torch.Tensor, codes: Codes, *, implementation=None) -> torch.Tensor:
    """``x @ W_hat^T`` with the weight given only by its codes (:func:`hnlq_jax.matmul`).

    Args:
      x: ``[..., k]`` real activations.
      codes: the weight ``W[n, k]``: :class:`Codes` with blocks ``[n, nb]`` (row codes from
        :func:`encode_rows`, whose scales are applied).
      implementation: ``None``, ``"xla"``, ``"pallas"`` or ``"lut"``.

    Returns:
      ``[..., n]`` in x's dtype (float32, float64, bfloat16 or float16),
      differentiable in ``x`` and in the row scale, equal to :func:`hnlq_jax.matmul` bit for
      bit (on CPU tensors whose row bucket is below ``torch_bridge.ops.GEMM_ROWS``: up to 32
      rows; from there in torch's GEMM's sum order).
    """
    codes = check_codes_arg(codes, "torch_bridge.matmul")
    _check_tensor(x, "torch_bridge.matmul")
    ops.refuse_forward_ad(x, "torch_bridge.matmul")
    return torch.ops.hnlq.matmul(x, *codes.op_args(), implementation,
                                 *ops.config_args(codes.config))


# Not traceable by torch.compile (DLPack hand-over to JAX): a compiled caller (a QLinear
# training step) breaks its graph here and runs it eagerly.
@torch.compiler.disable
def encode_rows(w: torch.Tensor, config: HNLQConfig, *, beta=None, implementation=None,
                failures: str = "raise") -> Codes:
    """Row codes of ``w[..., k]`` with per-row scales ``beta * rms(row)`` (the layers' format).

    :func:`hnlq_jax.rows.rows_codes` at ``beta``: with ``beta=None`` (``config.beta``) the codes
    of :func:`hnlq_jax.encode_rows`. Runs eagerly (not a custom op): it converts weights,
    outside compiled graphs.

    Args:
      w: ``[..., k]`` floating tensor (a weight ``[out, in]``).
      config: the quantizer.
      beta: ``None``, a float or a scalar tensor, relative to each row's RMS (e.g.
        :func:`hnlq_jax.rows.calibrate_rows`).
      implementation: ``None``, ``"xla"`` or ``"pallas"`` (the encoder).
      failures: ``"raise"`` (default) a ``ValueError`` for blocks that still overload at
        ``max_T`` (an entry far above its row's RMS for ``beta``), or ``"mark"`` them
        ``T = -1`` (they decode to NaN), as :func:`hnlq_jax.encode_rows`.

    Returns:
      Row :class:`Codes` (config ``config.replace(beta=1.0)``, ``scale`` in w's dtype, at least
      float32), owning their memory.
    """
    fn = "torch_bridge.encode_rows"
    _check_tensor(w, fn)
    if w.ndim == 0:
        raise ValueError(f"{fn}: expected a tensor with a row axis [..., k]")
    ops.config_args(config)  # a clear TypeError for a config that is not an HNLQConfig
    if beta is not None:
        # float64 on the host: NumPy reads no bfloat16 tensor.
        check_beta(beta.detach().to("cpu", torch.float64) if isinstance(beta, torch.Tensor)
                   else beta, fn, what="None, a positive number or a positive scalar tensor")
    with x64_for(w, beta):
        wj = to_jax(w)
        blocks = check_x(to_blocks(wj, config.d), config, fn)  # config, dtype, NaN/Inf
        beta = config.beta if beta is None else to_jax(beta) if isinstance(beta, torch.Tensor) \
            else beta
        check_beta_fits(beta, blocks.dtype, fn)  # (a tensor's beta: in its dtype already)
        codes = rows_codes(wj, config, beta, resolve(implementation, config, "encode", wj))
        check_row_failures(codes, failures, fn)
        return Codes.from_jax(codes, copy=True)

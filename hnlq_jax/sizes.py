"""What a quantized model weighs, in one vocabulary for the torch and Flax paths.

:class:`Sizes` counts a model's quantized layers: their weights, what they took as float32,
what they hold now (codes, row scales, biases), and the codes alone in memory and packed
(:func:`hnlq_jax.pack`, the T field entropy coded). Every ratio is named for its direction:
``ratio_to_float32`` is a size over the float32 size (0.16 means 6.25x smaller).
:class:`QuantizeReport` is what ``torch_bridge.quantize_model`` and
``hnlq_jax.flax.quantize_params`` / ``export_params`` return; ``torch_bridge.model_sizes`` and
``hnlq_jax.flax.model_sizes`` give the :class:`Sizes` of a model already quantized (after a
reload).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from hnlq_jax.codes import Codes
from hnlq_jax.packing import pack

__all__ = ["QuantizeReport", "Sizes", "measure"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of a model's quantized layers.

    Attributes:
      layers: the quantized layers.
      weights: their weights (``out * in`` summed).
      float32_bytes: their weights and biases as float32.
      quantized_bytes: what they hold now: codes, row scales and biases.
      code_bytes: the codes in memory (index, T field, row scales).
      packed_code_bytes: the codes packed for storage (:func:`hnlq_jax.pack`).
    """

    layers: int = 0
    weights: int = 0
    float32_bytes: int = 0
    quantized_bytes: int = 0
    code_bytes: int = 0
    packed_code_bytes: int = 0

    @property
    def bits_per_weight(self) -> float:
        """Bits a weight takes in memory, ``8 code_bytes / weights`` (32 for float32, 16 for
        bfloat16, 8 for int8, 4 for int4 without scales)."""
        return 8 * self.code_bytes / self.weights if self.weights else math.nan

    @property
    def packed_bits_per_weight(self) -> float:
        """Bits a weight takes packed, ``8 packed_code_bytes / weights``."""
        return 8 * self.packed_code_bytes / self.weights if self.weights else math.nan

    @property
    def ratio_to_float32(self) -> float:
        """``quantized_bytes / float32_bytes``: the quantized layers' size over their float32
        size."""
        return self.quantized_bytes / self.float32_bytes if self.float32_bytes else math.nan

    def __str__(self) -> str:
        if not self.layers:
            return "no quantized layers"
        return (f"{self.layers} quantized layer(s), {self.weights:,} weights: "
                f"{self.bits_per_weight:.3f} bits/weight in memory, "
                f"{self.packed_bits_per_weight:.3f} packed; {self.float32_bytes:,} bytes as "
                f"float32 -> {self.quantized_bytes:,} bytes ({self.ratio_to_float32:.3f}x)")


def measure(codes: Iterable[Codes], biases: Iterable) -> Sizes:
    """The :class:`Sizes` of layers given their weights' codes and their biases.

    Args:
      codes: each quantized layer's weight codes (row codes ``[out, in]``).
      biases: the biases those layers hold (NumPy or JAX arrays, torch tensors: anything
        with ``shape`` and ``nbytes``).
    """
    codes, biases = list(codes), list(biases)
    weights = sum(math.prod(c.shape) for c in codes)
    code_bytes = sum(c.nbytes for c in codes)
    return Sizes(layers=len(codes), weights=weights,
                 float32_bytes=4 * (weights + sum(math.prod(b.shape) for b in biases)),
                 quantized_bytes=int(code_bytes + sum(b.nbytes for b in biases)),
                 code_bytes=int(code_bytes),
                 packed_code_bytes=sum(pack(c).nbytes for c in codes))


@dataclasses.dataclass
class QuantizeReport:
    """What a model's quantization converted, what it kept, and the sizes.

    Attributes:
      converted: ``(name, type name, (out, in))`` of each quantized layer.
      skipped: ``(name, type name, reason)`` of each weight layer left as it was (in float,
        or quantized already).
      sizes: the :class:`Sizes` of the quantized layers.
      proxy_loss: with calibration, ``{name: tr(dW H dW^T)}`` of each layer coded by
        compensated rounding (:attr:`hnlq_jax.ptq.PTQResult.loss`); empty otherwise.
      clipped: with calibration, ``{name: blocks shrunk to encode}`` (normally 0).
      tokens: with calibration, ``{name: input rows seen}`` where the caller counts them.
      t_bits: with calibration, ``{name: entropy of T per weight}`` (what ``t_budget``
        bounds).
    """

    converted: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    sizes: Sizes = dataclasses.field(default_factory=Sizes)
    proxy_loss: dict = dataclasses.field(default_factory=dict)
    clipped: dict = dataclasses.field(default_factory=dict)
    tokens: dict = dataclasses.field(default_factory=dict)
    t_bits: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [str(self.sizes) if self.converted else
                 f"converted nothing: {self._why_nothing()}"]
        lines += [f"  {name}: proxy loss {loss:.6g}"
                  + (f" over {self.tokens[name]:,} input rows" if name in self.tokens else "")
                  + f", {self.clipped.get(name, 0)} clipped block(s), T "
                  f"{self.t_bits.get(name, 0.0):.3f} bits/weight"
                  for name, loss in self.proxy_loss.items()]
        lines += [f"  kept {name} ({kind}): {reason}" for name, kind, reason in self.skipped]
        return "\n".join(lines)

    def _why_nothing(self) -> str:
        if not self.skipped:
            return "the model has no weight layer this converts"
        return f"all {len(self.skipped)} weight layer(s) were kept (below)"

"""hnlq_jax: hierarchical nested-lattice quantization (Kaplan & Ordentlich 2025) in JAX.

The public API, re-exported here:

* lattices: :func:`lattice`, :class:`Lattice`, :func:`closest_point`
* the quantizer: :class:`HNLQConfig`, :func:`encode`, :func:`decode`, :func:`quantize`,
  :func:`matmul`, :func:`encode_rows`, :class:`Codes` (compact, self-describing),
  :data:`FORMAT_VERSION`, :func:`codebook`
* blocks: :func:`to_blocks`, :func:`from_blocks`
* packing: :func:`pack`, :func:`unpack`, :class:`Packed`, :func:`bits_per_block`
* statistics: :func:`rate_stats`, :class:`RateStats`, :func:`calibrate_beta`,
  :func:`gaussian_beta`,
  :class:`BetaSearch`

The front doors (``encode``, ``decode``, ``quantize``, ``matmul``) live in :mod:`hnlq_jax.ops`
and take ``implementation=None | "xla" | "pallas"`` (``"lut"`` for matmul). Submodules:
:mod:`hnlq_jax.codes` (the code format), :mod:`hnlq_jax.lut` (lookup-table inner products and
matrix products), :mod:`hnlq_jax.modq` (mod-q sums of codes), :mod:`hnlq_jax.kernels` (the Pallas
kernels), :mod:`hnlq_jax.rows` (the per-row weight format), :mod:`hnlq_jax.rd` (the paper's
rate-distortion experiment), :mod:`hnlq_jax.ptq` (post-training quantization: Hessian-aware
compensated rounding), :mod:`hnlq_jax.incoherence` (the randomized Hadamard rotation of a layer's
input side), :mod:`hnlq_jax.sizes` (what a quantized model weighs: the reports of
``quantize_model`` / ``quantize_params``); imported explicitly: :mod:`hnlq_jax.wire` (the wire
format of compressed collectives), :mod:`hnlq_jax.dist` (compressed means over devices and the optax
gradient compressor) and, with the ``flax`` extra, :mod:`hnlq_jax.flax` (``QDense``,
``QuantDotGeneral``). The formats and the math are in ``docs/``.
"""

from hnlq_jax import buckets, incoherence, kernels, lut, modq, ptq, rd, sizes
from hnlq_jax.codec import codebook, from_blocks, to_blocks
from hnlq_jax.codes import FORMAT_VERSION, Codes
from hnlq_jax.config import HNLQConfig
from hnlq_jax.lattices import Lattice, closest_point, lattice
from hnlq_jax.ops import decode, encode, matmul, quantize
from hnlq_jax.packing import Packed, bits_per_block, pack, unpack
from hnlq_jax.rows import encode_rows
from hnlq_jax.stats import BetaSearch, RateStats, calibrate_beta, gaussian_beta, rate_stats

__version__ = "0.1.0"

__all__ = [
    "BetaSearch",
    "Codes",
    "FORMAT_VERSION",
    "HNLQConfig",
    "Lattice",
    "Packed",
    "RateStats",
    "bits_per_block",
    "calibrate_beta",
    "closest_point",
    "codebook",
    "decode",
    "encode",
    "encode_rows",
    "from_blocks",
    "gaussian_beta",
    "incoherence",
    "kernels",
    "lattice",
    "lut",
    "matmul",
    "modq",
    "ptq",
    "rd",
    "sizes",
    "pack",
    "quantize",
    "rate_stats",
    "to_blocks",
    "unpack",
]

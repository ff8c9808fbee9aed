"""Kernels, kept apart from dispatch (the front doors in :mod:`hnlq_jax.ops` choose them).

* :mod:`hnlq_jax.kernels.pallas`: the Pallas kernels (GPU; interpret mode on a CPU), whose
  names are re-exported here (``kernels.encode``, ``kernels.decode_matmul``, ...);
* :mod:`hnlq_jax.kernels.mosaic_gpu`: Mosaic GPU kernels (``plgpu.kernel``, jax >= 0.11;
  GPU interpret mode on a CPU): ``mosaic_gpu.gemv`` and ``mosaic_gpu.decode_matmul`` (tensor
  cores), taken where the tuning table says so;
* :mod:`hnlq_jax.kernels.cpu`: native CPU kernels (C++ through ``jax.ffi``), built with the
  package where a C++ compiler is found (``kernels.cpu.available()``).
"""

from hnlq_jax.kernels import cpu, mosaic_gpu, pallas
from hnlq_jax.kernels.pallas import (GEMV_ROWS, GPU_BACKENDS, MOSAIC_GPU_OPS, decode,
                                     decode_matmul, encode, gemv, modq_sum, platform,
                                     unsupported)

__all__ = ["GEMV_ROWS", "GPU_BACKENDS", "MOSAIC_GPU_OPS", "cpu", "decode", "decode_matmul",
           "encode", "gemv", "modq_sum", "mosaic_gpu", "pallas", "platform", "unsupported"]

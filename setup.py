"""Builds the native CPU kernels (hnlq_jax/kernels/csrc) with the machine's C++ compiler.

Everything else is in pyproject.toml. The extension is optional: where it cannot be built,
the package installs without it and runs the pure-JAX paths (``python -m hnlq_jax info`` says
which paths are available). The XLA FFI headers come from jaxlib, a build requirement.
"""

import jax
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "hnlq_jax.kernels._cpu",
    sources=["hnlq_jax/kernels/csrc/module.cc", "hnlq_jax/kernels/csrc/decode.cc",
             "hnlq_jax/kernels/csrc/decode_matmul.cc", "hnlq_jax/kernels/csrc/lut_matmul.cc",
             "hnlq_jax/kernels/csrc/rotate.cc"],
    depends=["hnlq_jax/kernels/csrc/common.h", "hnlq_jax/kernels/csrc/decode_rows.h"],
    include_dirs=[jax.ffi.include_dir()],
    language="c++",
    # No -march=native: the AVX2 paths are chosen at run time, so the build runs anywhere.
    # -ffp-contract=off: no product and add fused where the source has two operations (an
    # AVX-512 clone may use FMA, a default one cannot: the same bits on every CPU). The one
    # exception is rotate.cc's mix_signs, whose products are exact (times +-1), marked there.
    extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-pthread",
                        "-ffp-contract=off"],
    extra_link_args=["-pthread"],
    optional=True,
)])

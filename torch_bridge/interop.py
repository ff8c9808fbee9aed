"""Zero-copy exchange of tensors between PyTorch and JAX through DLPack.

Aliasing rules (both directions share memory, on CPU and on CUDA):

* ``to_jax(t)`` returns a JAX array that *views* ``t``'s memory: a later in-place write to ``t``
  shows up in the JAX array. Clone the tensor first (``t.clone()``) when it will be written.
* ``to_torch(a)`` returns a tensor viewing the JAX array: an in-place op on it mutates the JAX
  array, which JAX assumes immutable. Pass ``copy=True`` when the tensor will be written.
* Tensors that require grad are detached (the JAX array carries no torch graph; use the
  :mod:`torch_bridge.autograd` wrappers for gradients). Non-contiguous tensors (slices with
  steps, ``expand``) are made contiguous first, which copies: DLPack in JAX takes compact
  strides only. ``from_dlpack(..., copy=True)`` does not copy on CPU, so neither is relied on.

**64-bit tensors.** JAX computes in 32 bits unless its x64 mode is on, and outside it would
silently turn a float64 array into float32. The rule of this package: every ``torch_bridge``
operation (the codec, ``matmul``, the LUT products, :func:`~torch_bridge.jax_function`, the
layers) given a float64 or int64 tensor, or asked for a float64 result, runs its JAX code
inside ``jax.enable_x64(True)`` (:func:`x64_for`), so float64 inputs are computed in float64,
exactly as :mod:`hnlq_jax` computes them under x64. Only the raw :func:`to_jax` leaves the mode
to the caller.
"""

from __future__ import annotations

import contextlib
import weakref

import jax
import jax.numpy as jnp
import torch

__all__ = ["to_jax", "to_torch", "x64_for"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint32, torch.uint16, torch.uint8, torch.bool)
_WIDE = (torch.float64, torch.int64)


def x64_for(*values) -> contextlib.AbstractContextManager:
    """``jax.enable_x64(True)`` when any of ``values`` is a 64-bit tensor or dtype, else a no-op.

    Args:
      *values: tensors, ``torch.dtype`` s or anything else (ignored, e.g. ``None``).

    Returns:
      A context manager for the JAX call that consumes (or produces) them.
    """
    return x64_context(is_wide(*values))


def is_wide(*values) -> bool:
    """Whether any of ``values`` (tensors, ``torch.dtype`` s, anything else: ignored) is 64-bit."""
    return any((v.dtype if isinstance(v, torch.Tensor) else v) in _WIDE
               for v in values if isinstance(v, (torch.Tensor, torch.dtype)))


def x64_context(wide: bool) -> contextlib.AbstractContextManager:
    """``jax.enable_x64(True)`` where ``wide`` and x64 is off, else a no-op."""
    if wide and not jax.config.jax_enable_x64:
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def to_jax(t: torch.Tensor) -> jax.Array:
    """A JAX array sharing ``t``'s memory (see the module docstring for the aliasing rules).

    Args:
      t: a CPU or CUDA tensor of a float, integer or bool dtype.

    Returns:
      ``jax.Array`` of the same shape and dtype, on the matching JAX device.

    Raises:
      TypeError: not a tensor, an unsupported dtype (complex, float8, ...), or a 64-bit dtype
        while JAX's x64 mode is off (the ``torch_bridge`` operations switch it on themselves;
        see the module docstring).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_jax: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"to_jax: unsupported dtype {t.dtype}; supported: "
                        f"{', '.join(str(d) for d in _DTYPES)}")
    if t.dtype in _WIDE and not jax.config.jax_enable_x64:
        raise TypeError(f"to_jax: a {t.dtype} tensor becomes a 64-bit JAX array only in JAX's "
                        "x64 mode (outside it JAX would silently compute in 32 bits): call "
                        "to_jax inside `with torch_bridge.x64_for(t):` (or jax.enable_x64(True)),"
                        " or convert first (t.float() / t.int()). The torch_bridge operations "
                        "do this themselves")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.device.type == "cuda" and jax.default_backend() != "gpu":
        raise ValueError("to_jax: a CUDA tensor needs JAX with a GPU backend "
                         f"(JAX has {jax.default_backend()!r}); move the tensor with .cpu()")
    return jnp.from_dlpack(t)


def tensor_state(t: torch.Tensor | None) -> tuple | None:
    """What identifies a tensor's contents between calls without reading them: its memory,
    torch's version counter (bumped by every in-place write), shape, dtype and device. An
    inference tensor (made under ``torch.inference_mode``) has no version counter: its state
    is the rest, so an in-place write into it (possible only under inference mode) is not
    seen. What the callers derive is then still right (JAX views of the same memory, shapes,
    addresses) except the codes' check, not repeated (an invalid code reads NaN, as under
    ``jit``); rebuilding each call instead cost a layer 30x its time."""
    if t is None:
        return None
    version = None if t.is_inference() else t._version
    return (t.data_ptr(), version, t.shape, t.dtype, t.device)


class TensorCache:
    """Values derived from tensors that stay put between calls (a layer's codes), by identity:
    reused while the tensor is the same, with the same :func:`tensor_state` and the same
    ``extra`` key; dropped with the tensor."""

    def __init__(self):
        self._entries: dict = {}

    def get(self, t: torch.Tensor, extra, build):
        """The value cached for ``t`` and ``extra``, else ``build()`` -> ``(value, keep)``,
        cached where ``keep``."""
        state = (tensor_state(t), extra)
        entry = self._entries.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == state:
            return entry[2]
        value, keep = build()
        if keep:
            key, entries = id(t), self._entries
            entries[key] = (weakref.ref(t, lambda _: entries.pop(key, None)), state, value)
        return value


# A new JAX view per call would cost a DLPack import each and defeat the check-once cache of
# hnlq_jax.Codes.
_VIEWS = TensorCache()


def cached_jax(t: torch.Tensor) -> jax.Array:
    """:func:`to_jax` of ``t``, the same JAX array again while ``t`` is the same tensor with the
    same memory and no in-place write since (torch's version counter)."""
    return _VIEWS.get(t, None, lambda: (to_jax(t), t.is_contiguous()))  # else a copy's view


def to_torch(a, copy: bool = False) -> torch.Tensor:
    """A tensor sharing the JAX array's memory, or owning a copy with ``copy=True``.

    Args:
      a: a JAX array.
      copy: return a tensor with its own memory (safe to write in place).

    Returns:
      ``torch.Tensor`` of the same shape and dtype on the matching device.
    """
    if not isinstance(a, jax.Array):
        raise TypeError(f"to_torch: expected a jax.Array, got {type(a).__name__}")
    t = torch.from_dlpack(a)
    return t.clone() if copy else t

"""Kernels of any rank as the ``[out, in]`` matrices that row codes hold, and the calls of
Flax's dense-like layers (``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``) as products with
them.

A kernel's axes are either contracted with the input (role ``"i"``) or indexed by the output
(role ``"o"``). :class:`KernelLayout` records the roles, so the kernel is the matrix
``W[N, K]`` whose rows are its output units in the order of its ``o`` axes and whose columns
are its input features in the order of its ``i`` axes (an ``nn.Dense`` kernel ``[in, out]``
is ``"io"`` and ``W = kernel^T``). :class:`LayerCall` is one call of a layer written as that
product: the input arranged to ``[..., K]``, ``y2 = x2 @ W^T``, the output arranged back.
Which axes play which role is known only from a call (``DenseGeneral``'s ``axis``, an
einsum's equation): a ``[3, 4, 5]`` kernel is ``"ioo"`` in a query projection and ``"iio"`` in
an output projection. Needs the ``flax`` extra (used by :mod:`hnlq_jax.flax`).
"""

from __future__ import annotations

import dataclasses
import math
import string

import flax.linen as nn
import jax
import jax.numpy as jnp

from hnlq_jax.config import check_saved_kind, saved_int

__all__ = ["KernelLayout", "LayerCall", "dense_call", "layer_call"]

KIND = "hnlq_jax.KernelLayout"
LAYOUT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """The roles of a kernel's axes (module docstring).

    Frozen and hashable, and a pytree without leaves (it lives in a variables tree beside a
    layer's codes and passes through ``jit`` as structure).

    Attributes:
      shape: the kernel's shape, positive ints.
      roles: one character per axis: ``"i"`` (contracted with the input) or ``"o"`` (an
        output axis); at least one of each.
    """

    shape: tuple
    roles: str

    def __post_init__(self):
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list)) else None
        if shape is None or any(isinstance(s, bool) or saved_int(s) is None or saved_int(s) < 1
                                for s in shape):
            raise ValueError(f"KernelLayout.shape must be a tuple of ints >= 1, got "
                             f"{self.shape!r}")
        object.__setattr__(self, "shape", tuple(saved_int(s) for s in shape))
        if (not isinstance(self.roles, str) or len(self.roles) != len(self.shape)
                or set(self.roles) != {"i", "o"}):
            raise ValueError(f"KernelLayout.roles must give each of the {len(self.shape)} "
                             "kernel axes a role 'i' (input) or 'o' (output), with at least one "
                             f"of each, got {self.roles!r}")

    @classmethod
    def dense(cls, k: int, n: int) -> KernelLayout:
        """The ``nn.Dense`` kernel ``[k, n]``."""
        return cls((k, n), "io")

    @property
    def in_axes(self) -> tuple:
        return tuple(a for a, r in enumerate(self.roles) if r == "i")

    @property
    def out_axes(self) -> tuple:
        return tuple(a for a, r in enumerate(self.roles) if r == "o")

    @property
    def k(self) -> int:
        """Input features: the matrix's columns."""
        return math.prod(self.shape[a] for a in self.in_axes)

    @property
    def n(self) -> int:
        """Output units: the matrix's rows."""
        return math.prod(self.shape[a] for a in self.out_axes)

    def matrix(self, kernel):
        """``W[N, K]`` of a kernel of this layout (a NumPy or JAX array, kept as it is)."""
        if tuple(kernel.shape) != self.shape:
            raise ValueError(f"KernelLayout.matrix: expected a kernel of shape "
                             f"{list(self.shape)}, got {list(kernel.shape)}")
        return kernel.transpose(self.out_axes + self.in_axes).reshape(self.n, self.k)

    def kernel(self, matrix):
        """The kernel of a matrix ``W[N, K]`` (inverse of :meth:`matrix`)."""
        order = self.out_axes + self.in_axes
        w = matrix.reshape(tuple(self.shape[a] for a in order))
        return w.transpose(tuple(sorted(range(len(order)), key=order.__getitem__)))

    # -- saving
    def to_dict(self) -> dict:
        """What a saved layer stores: ``{"kind", "version", "shape", "roles"}`` (the shape as
        ``"3x4x5"``, so every serializer keeps it as it is)."""
        return {"kind": KIND, "version": LAYOUT_VERSION,
                "shape": "x".join(map(str, self.shape)), "roles": self.roles}

    @classmethod
    def from_dict(cls, state) -> KernelLayout:
        """Inverse of :meth:`to_dict`.

        Raises:
          ValueError: not a dict of this kind and version, or invalid fields.
        """
        check_saved_kind(state, "KernelLayout.from_dict", KIND, LAYOUT_VERSION,
                         ("shape", "roles"))
        try:
            shape = tuple(int(s) for s in str(state["shape"]).split("x"))
            return cls(shape, state["roles"])
        except ValueError as e:
            raise ValueError(f"KernelLayout.from_dict: invalid fields: {e}") from None


jax.tree_util.register_pytree_node(
    KernelLayout, lambda lay: ((), (lay.shape, lay.roles)), lambda aux, _: KernelLayout(*aux))


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One call of a dense-like layer as ``x2[..., K] @ W[N, K]^T`` (module docstring), in
    einsum letters: the input ``lhs``, the kernel ``rhs``, the output ``out``.

    Attributes:
      layout: the kernel's layout in this call.
      lhs, rhs, out: the call's einsum equation ``lhs,rhs->out``, ellipses spelled out.
    """

    layout: KernelLayout
    lhs: str
    rhs: str
    out: str

    @property
    def _kept(self) -> str:
        """The input's letters that the output keeps (in the input's order)."""
        return "".join(c for c in self.lhs if c not in self.rhs)

    def inputs(self, x):
        """``x2[..., K]``: the input's kept axes, then its contracted ones in kernel order."""
        order = self._kept + "".join(self.rhs[a] for a in self.layout.in_axes)
        # A Dense call's order is the input's own: no transpose op on the serving path.
        x2 = x if order == self.lhs else jnp.einsum(f"{self.lhs}->{order}", x)
        return x2.reshape(*x2.shape[:len(self._kept)], self.layout.k)

    def outputs(self, y2):
        """The layer's output from ``y2[..., N]`` (without bias)."""
        outs = "".join(self.rhs[a] for a in self.layout.out_axes)
        sizes = tuple(self.layout.shape[a] for a in self.layout.out_axes)
        y = y2.reshape(*y2.shape[:-1], *sizes)
        order = self._kept + outs
        return y if order == self.out else jnp.einsum(f"{order}->{self.out}", y)

    def bias_shape(self) -> tuple:
        """The shape a bias of the kernel's output axes broadcasts to (as the layers add it)."""
        sizes = dict(zip(self.rhs, self.layout.shape))
        return tuple(sizes.get(c, 1) for c in self.out)


def _tuple(v) -> tuple:
    """A layer attribute given as an int or a sequence of ints, as a tuple."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _letters(n: int, used: str) -> str:
    return "".join(c for c in string.ascii_letters if c not in used)[:n]


def _einsum_call(equation: str, x_ndim: int, shape: tuple):
    """:class:`LayerCall` of ``einsum(equation, x, kernel[shape])``, or why it is not one."""
    eq = equation.replace(" ", "")
    if "->" not in eq or eq.count(",") != 1:
        return f"einsum {equation!r} is not of the form 'lhs,rhs->out'"
    operands, out = eq.split("->")
    lhs, rhs = operands.split(",")
    if "." in rhs:
        return f"einsum {equation!r}: an ellipsis in the kernel's operand"
    if "..." in lhs:
        fill = _letters(x_ndim - len(lhs.replace("...", "")), eq)
        lhs, out = lhs.replace("...", fill), out.replace("...", fill)
    if "." in lhs + out or len(lhs) != x_ndim or len(rhs) != len(shape):
        return f"einsum {equation!r} does not match an input of rank {x_ndim} and a kernel {shape}"
    if any(len(set(s)) != len(s) for s in (lhs, rhs, out)):
        return f"einsum {equation!r} repeats an index within an operand (a diagonal)"
    both = [c for c in rhs if c in lhs and c in out]
    if both:
        return (f"einsum {equation!r}: kernel index {both[0]!r} also indexes the input and the "
                "output (a batched product: one matrix per entry)")
    alone = [c for c in lhs + rhs if c not in out and (c in lhs) != (c in rhs)]
    if alone:
        return f"einsum {equation!r} sums index {alone[0]!r} of one operand alone"
    if any(c not in lhs + rhs for c in out):
        return f"einsum {equation!r}: an output index names neither operand"
    roles = "".join("i" if c in lhs else "o" for c in rhs)
    if set(roles) != {"i", "o"}:
        return (f"einsum {equation!r}: the kernel has no "
                f"{'output' if 'o' not in roles else 'contracted'} axis")
    return LayerCall(KernelLayout(shape, roles), lhs, rhs, out)


def dense_call(x_ndim: int, k: int, n: int):
    """:class:`LayerCall` of ``x[..., k] @ kernel[k, n]`` (``nn.Dense``), or why not."""
    lhs = _letters(x_ndim + 1, "")
    lhs, o = lhs[:-1], lhs[-1]
    return _einsum_call(f"{lhs},{lhs[-1:]}{o}->{lhs[:-1]}{o}", x_ndim, (k, n))


def layer_call(module, args, kwargs):
    """How a call of a Flax layer maps to a product with its kernel's matrix.

    Args:
      module: the called module (bound).
      args, kwargs: the call's arguments.

    Returns:
      A :class:`LayerCall`; a string saying why this call is not such a product (e.g. a
      ``DenseGeneral`` with ``batch_dims``, a batched einsum, a subclass with its own
      ``__call__``); or ``None`` when the module is not an ``nn.Dense``, ``nn.DenseGeneral`` or
      ``nn.Einsum``.
    """
    kind = type(module)
    if kind.__call__ not in (nn.Dense.__call__, nn.DenseGeneral.__call__, nn.Einsum.__call__):
        if isinstance(module, (nn.Dense, nn.DenseGeneral, nn.Einsum)):
            return (f"a subclass of a Flax dense layer with its own __call__ ({kind.__name__}: "
                    "what it computes with the kernel is not known)")
        return None
    x_shape = jnp.shape(args[0] if args else kwargs["inputs"])
    x_ndim = len(x_shape)
    if x_ndim == 0:
        return "a scalar input"
    if kind.__call__ is nn.Dense.__call__:
        return dense_call(x_ndim, x_shape[-1], module.features)
    lhs = _letters(x_ndim, "")
    if kind.__call__ is nn.DenseGeneral.__call__:
        if _tuple(module.batch_dims):
            return "DenseGeneral with batch_dims (a batched product: one matrix per entry)"
        features = _tuple(module.features)
        axis = tuple(sorted(a % x_ndim for a in _tuple(module.axis)))  # as the layer sorts
        outs = _letters(x_ndim + len(features), "")[x_ndim:]
        rhs = "".join(lhs[a] for a in axis) + outs
        kept = "".join(c for i, c in enumerate(lhs) if i not in axis)
        return _einsum_call(f"{lhs},{rhs}->{kept}{outs}", x_ndim,
                            tuple(x_shape[a] for a in axis) + tuple(features))
    equation = kwargs.get("einsum_str", args[1] if len(args) > 1 else None) or module.einsum_str
    if not isinstance(equation, str):
        return f"einsum_str {equation!r} is not a string"
    return _einsum_call(equation, x_ndim, tuple(module.shape))

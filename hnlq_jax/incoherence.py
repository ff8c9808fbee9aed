"""Incoherence processing: a seeded random orthogonal transform of a layer's input side.

``R = diag(s) K``: random signs ``s`` followed by a fast Hadamard-type transform ``K``, applied
to row vectors as ``x -> x R`` (the last axis). For ``n = 2^k m`` (``docs/ptq.md``):

    K = H_{2^k} / 2^(k/2)  (Kronecker)  B_m,

with ``H_{2^k}`` the Walsh-Hadamard matrix (a butterfly, ``n k`` additions) and ``B_m`` an
``m x m`` orthogonal matrix: a normalized Paley Hadamard matrix when one of order ``m`` exists
(``m = 12 = 11 + 1``, ``20``, ...), otherwise a seeded random orthogonal matrix. ``m`` is the odd
part of ``n``, doubled while that gives a Paley order (at most :data:`MAX_MIXER`), so
``384 = 32 * 12`` and ``1536 = 128 * 12``. Applying it costs ``n (k + m)`` operations per vector.

Both sides of a linear layer use the same :meth:`Rotation.apply`: ``x' = x R`` and ``W' = W R``
(each weight row rotated), so ``x' W'^T = x R R^T W^T = x W^T``; the Hessian of the rotated inputs
is ``R^T H R`` (:meth:`Rotation.rotate_hessian`).

Everything random comes from the seed through NumPy's PCG64 on the host (the signs from raw
PCG64 words, the mixer from a float64 Gaussian), so JAX, PyTorch and NumPy callers build the
same transform, and :meth:`Rotation.to_dict` (kind, version, n, seed) is all a saved layer needs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import kernels
from hnlq_jax.buckets import run_rows
from hnlq_jax.codes import as_array
from hnlq_jax.config import check_saved_kind, saved_int

__all__ = ["IMPLEMENTATIONS", "KIND", "MAX_MIXER", "ROTATION_VERSION", "Rotation",
           "default_implementation", "mixer", "paley_hadamard", "signs", "split_size", "tables"]

KIND = "randomized_hadamard"
# "native": the CPU kernel (hnlq_jax.kernels.cpu.rotate), float32, the default where it is
# built; "xla": jnp operations (any platform and dtype).
IMPLEMENTATIONS = ("xla", "native")
ROTATION_VERSION = 1
# Largest Paley order used for the mixer (it costs m multiply-adds per value).
MAX_MIXER = 64
_MAX_SEED = 2**63


def _read_only_cache(maxsize):
    """``functools.lru_cache`` for functions returning a NumPy array, returned read-only: every
    caller shares the cached array, so one caller's edit would change every later rotation."""
    def wrap(f):
        @functools.lru_cache(maxsize=maxsize)
        @functools.wraps(f)
        def cached(*args):
            out = f(*args)
            out.flags.writeable = False
            return out
        return cached
    return wrap


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % f for f in range(2, math.isqrt(p) + 1))


def _paley_order(p: int) -> bool:
    """A Paley (type I) Hadamard matrix of order p exists: p - 1 a prime = 3 mod 4."""
    return _is_prime(p - 1) and (p - 1) % 4 == 3


@functools.lru_cache(maxsize=None)
def split_size(n: int) -> tuple[int, int, bool]:
    """``(k, m, paley)`` with ``n = 2^k m``: the Walsh-Hadamard size ``2^k`` and the mixer size.

    ``m`` starts as the odd part of ``n`` and is doubled (taking factors from ``2^k``) to the
    smallest Paley order ``<= MAX_MIXER``; when there is none, ``m`` stays odd and the mixer is a
    random orthogonal matrix (``paley`` False; ``m = 1`` needs no mixer).
    """
    k = (n & -n).bit_length() - 1
    m = n >> k
    if m == 1:
        return k, 1, True
    for j in range(k + 1):
        p = m << j
        if p > MAX_MIXER:
            break
        if _paley_order(p):
            return k - j, p, True
    return k, m, False


@_read_only_cache(maxsize=None)
def paley_hadamard(p: int) -> np.ndarray:
    """The ``p x p`` Paley type I Hadamard matrix (entries +-1, ``H H^T = p I``), int8.

    With ``g = p - 1`` a prime = 3 mod 4 and ``chi`` the quadratic character mod ``g``:
    ``H = I + [[0, 1^T], [-1, Q]]``, ``Q[i, j] = chi(j - i)``.
    """
    g = p - 1
    if not _paley_order(p):
        raise ValueError(f"paley_hadamard: p - 1 = {g} is not a prime = 3 mod 4")
    squares = np.zeros(g, bool)
    squares[(np.arange(1, g) ** 2) % g] = True
    chi = np.where(squares, 1, -1)
    chi[0] = 0
    i = np.arange(g)
    Q = chi[(i[None, :] - i[:, None]) % g]
    S = np.zeros((p, p), np.int64)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = Q
    return (np.eye(p, dtype=np.int64) + S).astype(np.int8)


@_read_only_cache(maxsize=64)
def signs(n: int, seed: int) -> np.ndarray:
    """``[n]`` float64 random signs: bit ``i`` of the raw PCG64(seed) words (least significant
    first), ``s_i = 1 - 2 bit``."""
    words = np.random.PCG64(seed).random_raw(-(-n // 64)).astype(np.uint64)
    bits = (words[:, None] >> np.arange(64, dtype=np.uint64)[None, :]) & np.uint64(1)
    return 1.0 - 2.0 * bits.reshape(-1)[:n].astype(np.float64)


@_read_only_cache(maxsize=64)
def mixer(n: int, seed: int) -> np.ndarray:
    """``[m, m]`` float64 orthogonal mixer of ``n`` (``m`` from :func:`split_size`).

    A Paley Hadamard matrix over ``sqrt(m)`` when one exists; otherwise the Q factor of the QR
    decomposition of a ``default_rng([seed, 1])`` Gaussian, its columns' signs fixed so that R
    has a positive diagonal (a unique, Haar-distributed matrix).
    """
    _, m, paley = split_size(n)
    if paley:
        return paley_hadamard(m).astype(np.float64) / math.sqrt(m) if m > 1 else np.ones((1, 1))
    g = np.random.default_rng([seed, 1]).standard_normal((m, m))
    q, r = np.linalg.qr(g)
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)[None, :]


@functools.lru_cache(maxsize=None)  # the torch op asks on every call
def default_implementation(n: int, dtype, platform: str) -> str:
    """What ``implementation=None`` runs for a rotation of size ``n`` of ``dtype`` arrays on
    ``platform``: the native CPU kernel where it is built, for float32 and half precision, when
    the mixer has at most ``MAX_MIXER`` rows (a Paley matrix or a small random one); otherwise
    XLA (float64; GPUs; a larger random mixer, whose product XLA's GEMM computes faster than
    the kernel's loop)."""
    ct = jnp.promote_types(jax.dtypes.canonicalize_dtype(dtype), jnp.float32)
    fits = split_size(n)[1] <= MAX_MIXER
    return ("native" if kernels.cpu.available() and ct == jnp.float32 and fits
            and platform == "cpu" else "xla")


def _wht(x, k: int, m: int):
    """Normalized Walsh-Hadamard transform over the ``2^k`` axis of ``x[..., 2^k, m]``."""
    lead = x.shape[:-2]
    for j in range(k):
        h = 1 << j
        y = x.reshape(lead + ((1 << k) // (2 * h), 2, h, m))
        a, b = y[..., 0, :, :], y[..., 1, :, :]
        x = jnp.stack([a + b, a - b], axis=-3).reshape(lead + (1 << k, m))
    return x * jnp.asarray(2.0 ** (-k / 2), x.dtype) if k else x


@functools.lru_cache(maxsize=256)
def tables(n: int, seed: int, ct) -> tuple[np.ndarray, np.ndarray]:
    """The signs ``[n]`` and mixer ``[m, m]`` of ``Rotation(n, seed)`` in the dtype ``ct``
    (read-only; the kernels' operands)."""
    out = signs(n, seed).astype(ct), mixer(n, seed).astype(ct)
    for a in out:  # (astype copies)
        a.flags.writeable = False
    return out


@functools.partial(jax.jit, static_argnums=3)
def _transform(x, s, B, inverse: bool):
    """``x @ R`` (or ``x @ R^T``) in the dtype of the tables ``s``, ``B``, returned in
    ``x.dtype``. The tables are arguments, not constants: every rotation of a size shares one
    compiled program per input shape."""
    k, m, _ = split_size(x.shape[-1])
    y = x.astype(s.dtype)
    if not inverse:
        y = y * s
    y = y.reshape(x.shape[:-1] + (1 << k, m))
    if inverse and m > 1:
        y = jnp.matmul(y, B.T, precision=jax.lax.Precision.HIGHEST)
    y = _wht(y, k, m)
    if not inverse and m > 1:
        y = jnp.matmul(y, B, precision=jax.lax.Precision.HIGHEST)
    y = y.reshape(x.shape)
    if inverse:
        y = y * s
    return y.astype(x.dtype)


@functools.partial(jax.jit, static_argnums=3)
def _transform_native(x, s, B, inverse: bool):
    """:func:`_transform` by the native CPU kernel (float32 tables; ``x`` computed in
    float32)."""
    k, m, _ = split_size(x.shape[-1])
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return kernels.cpu.rotate(rows, s, B, k, m, inverse).reshape(x.shape).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Rotation:
    """The randomized orthogonal transform ``R = diag(s) K`` of size ``n`` (module docstring).

    Frozen and hashable (a static argument of ``jax.jit``), and a pytree without leaves (it
    passes through ``jit`` inside a variables tree); the arrays it needs are derived from
    ``(n, seed)`` on the host and cached.

    Attributes:
      n: the transformed axis' length (a layer's in-features), >= 1.
      seed: an int in ``0 .. 2^63 - 1``.
    """

    n: int
    seed: int = 0

    def __post_init__(self):
        for name in ("n", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"Rotation.{name} must be an int, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.n < 1:
            raise ValueError(f"Rotation.n must be >= 1, got {self.n}")
        if not 0 <= self.seed < _MAX_SEED:
            raise ValueError(f"Rotation.seed must be in 0..2^63-1, got {self.seed}")

    # -- saving
    def to_dict(self) -> dict:
        """What a saved layer stores: ``{"kind", "version", "n", "seed"}`` (JSON-ready)."""
        return {"kind": KIND, "version": ROTATION_VERSION, "n": self.n, "seed": self.seed}

    @classmethod
    def from_dict(cls, state) -> Rotation:
        """Inverse of :meth:`to_dict`.

        Raises:
          ValueError: not a dict of this kind and version, or invalid fields.
        """
        check_saved_kind(state, "Rotation.from_dict", KIND, ROTATION_VERSION, ("n", "seed"))
        n, seed = saved_int(state["n"]), saved_int(state["seed"])
        if n is None or seed is None:  # a float or string is refused, never truncated
            raise ValueError(f"Rotation.from_dict: invalid fields: expected integers n and "
                             f"seed, got {state['n']!r}, {state['seed']!r}")
        try:
            return cls(n, seed)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Rotation.from_dict: invalid fields: {e}") from None

    # -- the transform
    @property
    def signs(self) -> np.ndarray:
        """``[n]`` float64 signs ``s``."""
        return signs(self.n, self.seed)

    def matrix(self) -> np.ndarray:
        """The dense ``[n, n]`` float64 ``R`` with ``apply(x) = x @ R`` (for tests and tools)."""
        k, _, _ = split_size(self.n)
        h = np.ones((1, 1))
        for _ in range(k):
            h = np.block([[h, h], [h, -h]])
        K = np.kron(h / math.sqrt(2**k), mixer(self.n, self.seed))
        return self.signs[:, None] * K

    def _rotate(self, x, inverse: bool, fn: str, implementation):
        x = x if isinstance(x, np.ndarray) else as_array(x)  # NumPy stays on the host
        if x.ndim == 0 or x.shape[-1] != self.n:
            raise ValueError(f"Rotation.{fn}: expected an array [..., n={self.n}] (the rotated "
                             f"axis last), got shape {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"Rotation.{fn}: expected a floating-point array, got {x.dtype}")
        ct = jnp.promote_types(jax.dtypes.canonicalize_dtype(x.dtype), jnp.float32)
        if implementation is None:
            implementation = default_implementation(self.n, x.dtype, kernels.platform(x))
        elif implementation not in IMPLEMENTATIONS:
            raise ValueError(f"Rotation.{fn}: implementation must be one of {IMPLEMENTATIONS} "
                             f"or None, got {implementation!r}")
        elif implementation == "native" and (not kernels.cpu.available() or ct != jnp.float32):
            why = kernels.cpu.why_unavailable() or "it computes in float32, x is float64"
            raise ValueError(f"Rotation.{fn}: no native kernel: {why}; use "
                             "implementation='xla'")
        transform = _transform_native if implementation == "native" else _transform
        s, B = tables(self.n, self.seed, ct)
        if isinstance(x, jax.core.Tracer) or x.size == 0:
            return transform(x, s, B, inverse)
        return run_rows(transform, x, s, B, inverse)

    def apply(self, x, implementation: str | None = None):
        """``x @ R`` over the last axis (``[..., n]``, traceable); same dtype as ``x``
        (half precision is computed in float32).

        Outside ``jit`` the rows run in one compiled program per row bucket
        (:func:`hnlq_jax.buckets.run_rows`), shared by every rotation of size ``n``.

        Args:
          x: ``[..., n]`` floating point.
          implementation: ``None`` (:func:`default_implementation`: the native CPU kernel for
            float32/half arrays on a CPU where it is built), ``"xla"`` or ``"native"``
            (:data:`IMPLEMENTATIONS`; the two agree within float32 rounding, bit for bit when
            ``n`` is a power of two).

        Raises:
          ValueError: ``x`` is not ``[..., n]``, an unknown implementation, or ``"native"``
            where the kernel is not built or ``x`` is float64.
          TypeError: ``x`` is not floating point.
        """
        return self._rotate(x, False, "apply", implementation)

    def inverse(self, x, implementation: str | None = None):
        """``x @ R^T``: undoes :meth:`apply` (``R`` is orthogonal); arguments as
        :meth:`apply`'s."""
        return self._rotate(x, True, "inverse", implementation)

    # -- a layer's two sides
    def rotate_weight(self, w, implementation: str | None = None):
        """``W' = W R`` for a weight ``w[out, n]`` (rows along the input side)."""
        return self.apply(w, implementation)

    def rotate_hessian(self, H):
        """``H' = R^T H R``: the Hessian ``X'^T X'`` of the rotated inputs ``X' = X R``."""
        H = jnp.asarray(H)
        if H.ndim != 2 or H.shape != (self.n, self.n):
            raise ValueError(f"Rotation.rotate_hessian: expected H [{self.n}, {self.n}], got "
                             f"shape {tuple(H.shape)}")
        Hr = self.apply(jnp.swapaxes(self.apply(H), 0, 1))  # (H R)^T R = R^T H R, H symmetric
        return (Hr + Hr.T) / 2


# A Rotation is a pytree with no leaves (n and seed are static), so it can live in a variables
# tree (e.g. a QDense layer's inference form) and pass through jit as part of its structure.
jax.tree_util.register_pytree_node(
    Rotation, lambda r: ((), (r.n, r.seed)), lambda aux, _: Rotation(*aux))

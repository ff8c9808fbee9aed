"""``HNLQConfig``: the frozen, validated, hashable description of one HNLQ quantizer."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax.lattices import Lattice, closest_point, lattice

__all__ = ["HNLQConfig", "check_config", "saved_int"]

MAX_Q_POW_M = 2**20  # keeps every integer of the encoder and decoder inside int32 (docs/math.md)
MAX_T_CAP = 127  # T + 1 is stored in at most 8 bits
MAX_CODEBOOK_SIZE = 2**32  # one codebook index per level fits uint32
# Relative slack on norm bounds: float rounding of a norm is far below it, so "norm > bound *
# (1 + slack)" proves overload, and skipping such t's never changes T.
NORM_SLACK = 1e-3


@dataclasses.dataclass(frozen=True)
class HNLQConfig:
    """Hierarchical nested-lattice quantizer (``docs/math.md``).

    Frozen and hashable, so it can be a static argument of ``jax.jit``. Validated at
    construction.

    Attributes:
      lattice: lattice name: ``"Z2"``, ``"A2"``, ``"D4"``, ``"E8"``, ``"Z{n}"`` or ``"D{n}"``.
      q: nesting ratio, an integer >= 2 (labels are in ``0..q-1``; at most 256 for uint8).
      M: number of levels, >= 1; rate ``M log2 q`` bits/dim (plus ``H(T)/d``).
      beta: scale; the encoder quantizes ``x / beta`` (see :func:`hnlq_jax.calibrate_beta`).
      alpha: overload step: block ``k`` is encoded at ``beta * 2**(alpha * T_k)``
        (``alpha * max_T`` below 1024).
      max_T: largest rescaling step tried (inclusive). ``0`` turns the overload loop off: an
        overloaded block is then marked ``T = -1`` rather than rescaled. Up to 14 a block's T
        takes 4 bits in :class:`~hnlq_jax.Codes`; above, 8 bits (``docs/format.md``).
      dither: optional fixed subtractive dither ``z`` (length ``d``, inside the Voronoi cell).
    """

    lattice: str = "D4"
    q: int = 4
    M: int = 2
    beta: float = 1.0
    alpha: float = 1 / 3
    max_T: int = 14
    dither: tuple[float, ...] | None = None

    def __post_init__(self):
        lat = lattice(self.lattice)  # raises on unknown names
        for name in ("q", "M", "max_T"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"HNLQConfig.{name} must be an int, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.q < 2 or self.q > 256:
            raise ValueError(f"HNLQConfig.q must be in 2..256 (uint8 labels), got {self.q}")
        if self.M < 1:
            raise ValueError(f"HNLQConfig.M must be >= 1, got {self.M}")
        if self.q**lat.d > MAX_CODEBOOK_SIZE:
            raise ValueError(
                f"HNLQConfig: q**d = {self.q}**{lat.d} codebook entries exceed 2**32, the largest "
                "codebook index a Codes array holds (uint32); use a smaller q"
            )
        if self.q**self.M > MAX_Q_POW_M:
            raise ValueError(
                f"HNLQConfig: q**M = {self.q}**{self.M} exceeds 2**20, the limit that keeps "
                "the exact integer arithmetic inside int32"
            )
        # Integer P coordinates up to ~2 * clamp radius (E8 doubles) times the label map must
        # stay inside int32.
        growth = 2 * np.abs(lat.basis_from_P).sum(axis=1).max() * (2 if lat.kind == "E8" else 1)
        if self.clamp_radius * growth > 2**30:
            raise ValueError(
                f"HNLQConfig: q**M = {self.q**self.M} is too large for {lat.name}: the integer "
                "arithmetic would leave int32"
            )
        if not 0 <= self.max_T <= MAX_T_CAP:
            raise ValueError(f"HNLQConfig.max_T must be in 0..{MAX_T_CAP}, got {self.max_T}")
        for name in ("beta", "alpha"):
            v = getattr(self, name)
            if isinstance(v, jax.core.Tracer):
                raise TypeError(f"HNLQConfig.{name} must be a concrete number, got a traced "
                                "value: a config is a static (hashable) argument under jit")
            if (isinstance(v, (np.ndarray, jax.Array)) and v.shape == ()
                    and jnp.issubdtype(v.dtype, jnp.floating)):
                v = float(v)  # a 0-d NumPy or JAX array, e.g. hnlq_jax.rows.calibrate_rows
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise TypeError(f"HNLQConfig.{name} must be a real number, got {v!r}")
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"HNLQConfig.{name} must be finite and > 0, got {v}")
            object.__setattr__(self, name, float(v))
        if self.alpha * self.max_T >= 1024:  # the largest step's 2^(alpha T) leaves float64
            raise ValueError(f"HNLQConfig: alpha * max_T = {self.alpha * self.max_T:g} must be "
                             "below 1024 (the overload scale 2^(alpha T) is computed in "
                             "float64); lower alpha or max_T")
        if self.dither is not None:
            z = np.asarray(self.dither, dtype=np.float64)
            if z.shape != (lat.d,):
                raise ValueError(
                    f"HNLQConfig.dither must have length d={lat.d} for {lat.name}, got shape "
                    f"{z.shape}"
                )
            if not np.all(np.isfinite(z)):
                raise ValueError("HNLQConfig.dither must be finite")
            with jax.ensure_compile_time_eval():  # configs are also made while tracing
                inside = not np.any(np.asarray(closest_point(z, lat)) != 0)
            if not inside:
                raise ValueError(
                    f"HNLQConfig.dither {z.tolist()} is outside the Voronoi cell of 0 of "
                    f"{lat.name} (its nearest lattice point is not 0)"
                )
            object.__setattr__(self, "dither", tuple(float(v) for v in z))

    @property
    def lat(self) -> Lattice:
        """The :class:`~hnlq_jax.lattices.Lattice` object."""
        return lattice(self.lattice)

    @property
    def d(self) -> int:
        """Lattice dimension (block length)."""
        return self.lat.d

    @property
    def rate(self) -> float:
        """Nominal rate ``M log2 q`` in bits per dimension (without ``H(T)/d``)."""
        return self.M * math.log2(self.q)

    @property
    def overload_radius(self) -> float:
        """``(q^M (1 + r_{q,M}) + 1) r_cov``: a scaled input farther from 0 surely overloads."""
        r = (1 - self.q ** (1 - self.M)) / (self.q - 1)
        return (self.q**self.M * (1 + r) + 1) * self.lat.covering_radius

    @property
    def clamp_radius(self) -> float:
        """Scaled inputs beyond this norm are marked overloaded without integer arithmetic."""
        return max(self.overload_radius * (1 + NORM_SLACK), 2.0**20)

    @property
    def dither_array(self) -> np.ndarray:
        """The dither as float64 ``[d]`` (zeros when there is none)."""
        return np.zeros(self.d) if self.dither is None else np.asarray(self.dither)

    def beta_min(self) -> float:
        """Start of the paper's beta grid: ``q^-M sqrt(d/(d+2)) / sqrt(sigma_L^2)``
        (``docs/math.md``, "Choosing beta")."""
        return beta_min(self.lattice, self.q, self.M)

    def replace(self, **changes) -> HNLQConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def check_config(config, fn: str, name: str = "config") -> HNLQConfig:
    """Returns ``config`` if it is an :class:`HNLQConfig`.

    Args:
      config: the value to check.
      fn: the public function checking it, named first in the message.
      name: what ``config`` is called there (e.g. ``"Packed.config"``).

    Raises:
      TypeError: ``config`` is not an ``HNLQConfig`` (e.g. a lattice name or a dict):
        ``"{fn}: {name} must be an HNLQConfig, got {type}"``.
    """
    if not isinstance(config, HNLQConfig):
        raise TypeError(f"{fn}: {name} must be an HNLQConfig, got {type(config).__name__}")
    return config


def check_beta(beta, fn: str, shapes: tuple = ((),), what: str = "a positive number"
               ) -> np.ndarray:
    """A concrete beta argument (a number, array or CPU tensor) as float64, checked.

    Raises:
      ValueError: ``beta`` is not of one of ``shapes``, or not finite and > 0 everywhere
        (NaN, 0, negative or Inf would code every block as failed, or at a flipped scale):
        ``"{fn}: beta must be {what}, got ..."``.
    """
    b = np.asarray(beta, dtype=np.float64)
    if b.shape not in shapes or not np.all(np.isfinite(b) & (b > 0)):
        raise ValueError(f"{fn}: beta must be {what}, got {beta!r}")
    return b


@functools.lru_cache(maxsize=None)
def beta_min(name: str, q: int, M: int) -> float:
    lat = lattice(name)
    return q**-M * math.sqrt(lat.d / (lat.d + 2)) / math.sqrt(lat.second_moment)


@functools.lru_cache(maxsize=None)
def pow2_table(alpha: float, max_T: int) -> np.ndarray:
    """``2**(alpha*t)`` for t = 0..max_T, in float64 with Python's pow (as the reference)."""
    return np.array([2.0 ** (alpha * t) for t in range(max_T + 1)], dtype=np.float64)


def check_saved_kind(state, fn: str, kind: str, version: int, fields: tuple) -> None:
    """A saved record (a rotation, a kernel layout) must be a dict of ``kind`` at ``version``
    with ``fields`` besides; ``fn`` names the reader in the ``ValueError``."""
    keys = ("kind", "version") + fields
    if not isinstance(state, dict) or not set(keys) <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{fn}: expected a dict with {', '.join(keys[:-1])} and {keys[-1]}, "
                         f"got {got}")
    if state["kind"] != kind or saved_int(state["version"]) != version:
        raise ValueError(f"{fn}: saved kind {state['kind']!r} version {state['version']!r}; "
                         f"this version reads {kind!r} version {version}")


def is_integer(value) -> bool:
    """A Python or NumPy integer, not a bool (which Python counts as one): what an argument
    that counts or indexes (levels, an axis, a number of steps) must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def saved_int(value) -> int | None:
    """An integer field of a saved artifact (format version, sizes, seeds) as an ``int``: a
    Python int, NumPy integer or 0-d integer array (as a checkpoint may restore it); ``None``
    for anything else (a float, bool or string is refused by the caller, never truncated)."""
    if isinstance(value, (str, bytes)):
        return None
    a = np.asarray(value)
    return int(a) if a.ndim == 0 and a.dtype.kind in "iu" else None

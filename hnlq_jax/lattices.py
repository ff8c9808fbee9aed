"""Lattices and their nearest-point routines (Conway & Sloane 1982) with the HNLQ tie rule.

Every lattice has an *integer coordinate system* ("P coordinates") in which its points are
integer vectors, so that inner levels of the encoder and the whole decoder run in exact
integer arithmetic (SPEC §3):

* ``Z{n}`` and ``D{n}``: Cartesian coordinates.
* ``E8``: doubled Cartesian coordinates (E8 contains half-integer points).
* ``A2``: coordinates in the basis ``G``.

Two nearest-point entry points share the same case analysis:

* :func:`nearest_float` for real input (level 0): ``Q_L(y + eps)`` in the input's dtype, exact
  ties that survive resolved by the rule.
* :func:`nearest_int` for ``Q_L(N / D)`` with an integer numerator ``N`` (P coordinates) and an
  integer denominator ``D``: every comparison is made on integers, so no rounding decides a tie.

The tie rule: among equally near points take the one with the largest ``<u, lambda>``, ``u`` the
unit vector built from the fractional parts of the square roots of the first ``d`` primes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax.numpy as jnp
import numpy as np

__all__ = ["Lattice", "lattice", "closest_point", "LATTICE_NAMES"]

LATTICE_NAMES = ("Z2", "A2", "D4", "E8")

_E8_G = np.array(
    [
        [2, -1, 0, 0, 0, 0, 0, 0.5],
        [0, 1, -1, 0, 0, 0, 0, 0.5],
        [0, 0, 1, -1, 0, 0, 0, 0.5],
        [0, 0, 0, 1, -1, 0, 0, 0.5],
        [0, 0, 0, 0, 1, -1, 0, 0.5],
        [0, 0, 0, 0, 0, 1, -1, 0.5],
        [0, 0, 0, 0, 0, 0, 1, 0.5],
        [0, 0, 0, 0, 0, 0, 0, 0.5],
    ]
)
_A2_G = np.array([[1.0, 0.5], [0.0, math.sqrt(3.0) / 2.0]])


def _primes(n: int) -> list[int]:
    out, k = [], 2
    while len(out) < n:
        if all(k % p for p in out):
            out.append(k)
        k += 1
    return out


def tie_vector(d: int) -> np.ndarray:
    """The unit vector ``u`` of the tie rule (SPEC §3), float64 of shape ``[d]``."""
    n = np.array([math.sqrt(p) % 1.0 - 0.5 for p in _primes(d)])
    return n / np.linalg.norm(n)


def _dn_generator(n: int) -> np.ndarray:
    """Columns (-1,-1,0,..), (1,-1,0,..), e_{j-1} - e_j: the SPEC's D4 basis for every n."""
    G = np.zeros((n, n))
    G[0, 0], G[1, 0], G[0, 1], G[1, 1] = -1, -1, 1, -1
    for j in range(2, n):
        G[j - 1, j], G[j, j] = 1, -1
    return G


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Lattice:
    """A lattice ``L = G Z^d`` with the data its nearest-point routines need.

    Attributes:
      name: ``"Z2"``, ``"A2"``, ``"D4"``, ``"E8"``, ``"Z{n}"`` or ``"D{n}"``.
      d: dimension.
      G: ``[d, d]`` float64 generator; its columns are the basis.
      kind: ``"Z"``, ``"D"``, ``"E8"`` or ``"A2"`` (which routine applies).
      u: ``[d]`` float64 tie vector.
      covering_radius: radius of the smallest ball around 0 containing the Voronoi cell.
      second_moment: ``sigma_L^2`` per dimension used for the beta grid (SPEC §7).
      P_from_basis: ``[d, d]`` int64, P coordinates of ``G b`` for integer ``b``.
      basis_from_P: ``[d, d]`` int64 numerator of the map back to basis coordinates.
      basis_den: its common denominator (exact division for lattice points).
    """

    name: str
    d: int
    G: np.ndarray
    kind: str
    u: np.ndarray
    covering_radius: float
    second_moment: float
    P_from_basis: np.ndarray
    basis_from_P: np.ndarray
    basis_den: int

    def __repr__(self) -> str:
        return f"Lattice({self.name!r}, d={self.d})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Lattice) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def cart_from_P(self, P):
        """Cartesian coordinates ``[..., d]`` of points given in P coordinates."""
        if self.kind == "E8":
            return P * 0.5
        if self.kind == "A2":
            return matvec(self.G, P)
        return P


@functools.lru_cache(maxsize=None)
def lattice(name: str) -> Lattice:
    """Returns the lattice called ``name``.

    Args:
      name: ``"Z2"``, ``"A2"``, ``"D4"``, ``"E8"``, or ``"Z{n}"`` / ``"D{n}"`` for any n >= 2.

    Raises:
      ValueError: for any other name.
    """
    if not isinstance(name, str):
        raise TypeError(f"lattice name must be a str, got {type(name).__name__}")
    m = re.fullmatch(r"([ZD])(\d+)", name)
    if name == "E8":
        G, kind, rcov, s2 = _E8_G, "E8", 1.0, 929 / 12960
        P_from_basis = np.rint(2 * G)
    elif name == "A2":
        G, kind, rcov, s2 = _A2_G, "A2", 1 / math.sqrt(3), 5 / 72
        P_from_basis = np.eye(2)
    elif m and int(m.group(2)) >= 2:
        n = int(m.group(2))
        if m.group(1) == "Z":
            G, kind, rcov, s2 = np.eye(n), "Z", math.sqrt(n) / 2, 1 / 12
        else:
            # sigma^2(D_n) = 1/12 + 1/(2n(n+1)); the paper's scripts use sqrt(2)*0.076602
            # for D4 (13/120 rounded), kept so that beta grids match the reference.
            s2 = math.sqrt(2) * 0.076602 if n == 4 else 1 / 12 + 1 / (2 * n * (n + 1))
            G, kind, rcov = _dn_generator(n), "D", max(1.0, math.sqrt(n) / 2)
        P_from_basis = G.copy()
    else:
        raise ValueError(
            f"unknown lattice {name!r}: expected 'Z2', 'A2', 'D4', 'E8', 'Z{{n}}' or 'D{{n}}' "
            "with n >= 2"
        )
    d = G.shape[0]
    # basis = adj(P_from_basis) @ P / det: integer numerator and denominator.
    det = int(round(np.linalg.det(P_from_basis)))
    adj = np.rint(np.linalg.inv(P_from_basis) * det).astype(np.int64)
    g = math.gcd(abs(det), *(abs(int(v)) for v in adj.ravel()))
    sign = -1 if det < 0 else 1
    return Lattice(
        name=name,
        d=d,
        G=np.array(G, dtype=np.float64),
        kind=kind,
        u=tie_vector(d),
        covering_radius=float(rcov),
        second_moment=float(s2),
        P_from_basis=P_from_basis.astype(np.int64),
        basis_from_P=sign * adj // g,
        basis_den=abs(det) // g,
    )


def matvec(A: np.ndarray, v):
    """``A @ v`` over the last axis for a small constant numpy matrix ``A``.

    Unrolled, summed in a fixed order (XLA does not reassociate it), with the entries as Python
    scalars so that ``v``'s dtype is kept: integer arrays stay exact integer arithmetic.
    """
    cast = int if jnp.issubdtype(v.dtype, jnp.integer) else float
    cols = [v[..., j] for j in range(v.shape[-1])]
    rows = []
    for i in range(A.shape[0]):
        acc = None
        for j, c in enumerate(cols):
            if A[i, j] != 0:
                term = c * cast(A[i, j])
                acc = term if acc is None else acc + term
        rows.append(jnp.zeros_like(cols[0]) if acc is None else acc)
    return jnp.stack(rows, axis=-1)


def _sumsq(v):
    """Squared norm over the last axis, summed in coordinate order."""
    acc = v[..., 0] * v[..., 0]
    for j in range(1, v.shape[-1]):
        acc = acc + v[..., j] * v[..., j]
    return acc


def _round_ties(N, D, u):
    """Nearest integer to ``N / D`` per coordinate; exact halves go toward ``sign(u_i)``.

    Works on integers (``D`` a positive int) and on floats (``D == 1``), exactly in both.

    Returns:
      ``(f, rho)``: the rounded value and the residual numerator ``N - D f``.
    """
    up = jnp.asarray(u > 0)
    if jnp.issubdtype(N.dtype, jnp.integer):
        t = 2 * N + D
        f = jnp.floor_divide(t, 2 * D)
        tie = jnp.remainder(t, 2 * D) == 0  # N/D = f - 1/2: floor took the upper neighbour
        f = f - (tie & ~up).astype(N.dtype)
        return f, N - D * f
    r = jnp.round(N)  # half to even; y - round(y) is exact in floating point
    rho = N - r
    r = r + ((rho == 0.5) & up).astype(N.dtype) - ((rho == -0.5) & ~up).astype(N.dtype)
    return r, N - r


def _nearest_dn(N, D, u):
    """``Q_{D_n}(N / D)`` (Conway & Sloane), with the tie rule. Returns ``(f, rho)``."""
    f, rho = _round_ties(N, D, u)
    odd = jnp.remainder(jnp.sum(f, axis=-1, keepdims=True), 2) != 0
    uu = jnp.asarray(u, dtype=jnp.float32)
    s = jnp.where(rho > 0, 1, jnp.where(rho < 0, -1, jnp.where(uu > 0, 1, -1)))
    mag = jnp.abs(rho)
    best = mag == jnp.max(mag, axis=-1, keepdims=True)
    # Among the largest |rho_i| take the largest s*u_i: the |u_i| are distinct, so no tie is left.
    score = jnp.where(best, s * uu, -2.0)
    pick = jnp.argmax(score, axis=-1)[..., None] == jnp.arange(N.shape[-1])
    step = jnp.where(odd & pick, s, 0).astype(f.dtype)
    f = f + step
    return f, rho - D * step


def _prefer(d_a, d_b, tie_b):
    """True where candidate b wins: strictly nearer, or equally near and preferred by the rule."""
    return (d_b < d_a) | ((d_b == d_a) & tie_b)


def _ufloat(v, u):
    """``<u, v>`` for a small integer or float vector ``v`` (only its sign is used)."""
    return matvec(np.asarray(u)[None, :], v.astype(jnp.float32))[..., 0]


def nearest_int(N, D: int, lat: Lattice):
    """``Q_L(N / D)`` for integer P coordinates ``N [..., d]``; returns int P coordinates.

    All comparisons are on integers, so ties are decided by the rule and never by rounding.
    Magnitudes: callers keep ``|N| <= 2^23`` and ``D <= 2^12``, which fits int32.
    """
    u = lat.u
    if lat.kind == "Z":
        return _round_ties(N, D, u)[0]
    if lat.kind == "D":
        return _nearest_dn(N, D, u)[0]
    if lat.kind == "E8":
        # Cartesian y = N / (2D). Candidates: Q_D8(y) and Q_D8(y - 1/2) + 1/2.
        fa, ra = _nearest_dn(N, 2 * D, u)
        fb, rb = _nearest_dn(N - D, 2 * D, u)
        Pa, Pb = 2 * fa, 2 * fb + 1
        take_b = _prefer(_sumsq(ra), _sumsq(rb), _ufloat(Pb - Pa, u) > 0)
        return jnp.where(take_b[..., None], Pb, Pa)
    # A2 in basis coordinates: the nearest point is a corner of the cell floor(N/D) + {0,1}^2.
    base = jnp.floor_divide(N, D)
    v = N - D * base
    return base + _a2_pick(
        [(v0 * v0 + v0 * v1 + v1 * v1) for v0, v1 in _a2_offsets_residual(v, D)], lat
    )


_A2_OFFSETS = ((0, 0), (1, 0), (0, 1), (1, 1))


def _a2_offsets_residual(v, D):
    for o0, o1 in _A2_OFFSETS:
        yield v[..., 0] - D * o0, v[..., 1] - D * o1


def _a2_pick(dists, lat: Lattice):
    """Offsets ``[..., 2]`` of the nearest of the four A2 corner candidates.

    Candidates are visited from the most to the least preferred by the tie rule (largest
    ``<u, G c>`` first), and a later one replaces the current one only when strictly nearer.
    """
    uG = lat.G.T @ lat.u
    order = sorted(range(4), key=lambda k: -float(uG @ np.array(_A2_OFFSETS[k])))
    best_d = dists[order[0]]
    best_o = jnp.broadcast_to(jnp.array(_A2_OFFSETS[order[0]], jnp.int32), best_d.shape + (2,))
    for k in order[1:]:
        better = dists[k] < best_d
        best_d = jnp.where(better, dists[k], best_d)
        best_o = jnp.where(better[..., None], jnp.array(_A2_OFFSETS[k], jnp.int32), best_o)
    return best_o


def nearest_float(y, lat: Lattice):
    """Level-0 nearest point ``Q_L(y + eps)`` in ``y``'s floating dtype.

    Args:
      y: ``[..., d]`` floating array.
      lat: the lattice.

    Returns:
      ``[..., d]`` P coordinates of the nearest point, as integer-valued floats of ``y.dtype``.
    """
    eps = jnp.asarray(lat.u * 2.0**-41, dtype=y.dtype)
    y = y + eps
    u = lat.u
    if lat.kind == "Z":
        return _round_ties(y, 1, u)[0]
    if lat.kind == "D":
        return _nearest_dn(y, 1, u)[0]
    if lat.kind == "E8":
        fa, ra = _nearest_dn(y, 1, u)
        fb, _ = _nearest_dn(y - 0.5, 1, u)
        Pa, Pb = 2 * fa, 2 * fb + 1
        take_b = _prefer(_sumsq(ra), _sumsq(y - (fb + 0.5)), _ufloat(Pb - Pa, u) > 0)
        return jnp.where(take_b[..., None], Pb, Pa)
    base = jnp.floor(matvec(np.linalg.inv(lat.G), y))
    dists = [_sumsq(y - matvec(lat.G, base + jnp.asarray(o, y.dtype))) for o in _A2_OFFSETS]
    return base + _a2_pick(dists, lat).astype(y.dtype)


def closest_point(y, lat: Lattice | str):
    """Nearest lattice point ``Q_L(y)`` over the last axis, with the tie rule of SPEC §3.

    Args:
      y: ``[..., d]`` floating array (half precision is computed in float32).
      lat: a :class:`Lattice` or its name.

    Returns:
      ``[..., d]`` Cartesian coordinates of the nearest lattice points, in ``y``'s dtype
      (float32 for half-precision input).
    """
    lat = lattice(lat) if isinstance(lat, str) else lat
    y = jnp.asarray(y)
    if y.ndim == 0 or y.shape[-1] != lat.d:
        raise ValueError(f"closest_point: last axis must have size d={lat.d} for {lat.name}, "
                         f"got shape {y.shape}")
    if not jnp.issubdtype(y.dtype, jnp.floating):
        raise TypeError(f"closest_point: expected a floating array, got {y.dtype}")
    if jnp.finfo(y.dtype).bits < 32:
        y = y.astype(jnp.float32)
    return lat.cart_from_P(nearest_float(y, lat))

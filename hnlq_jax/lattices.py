"""Lattices and their nearest-point routines (Conway & Sloane 1982) with the HNLQ tie rule.

Every lattice has an *integer coordinate system* ("P coordinates") in which its points are
integer vectors, so that inner levels of the encoder and the whole decoder run in exact
integer arithmetic (docs/math.md, "Tie rule"):

* ``Z{n}`` and ``D{n}``: Cartesian coordinates.
* ``E8``: doubled Cartesian coordinates (E8 contains half-integer points).
* ``A2``: coordinates in the basis ``G``.

Points are passed as *columns*: a list of ``d`` arrays of one common shape, coordinate ``i`` in
``cols[i]``. All work is elementwise on those arrays, so XLA fuses a whole nearest-point search
into one loop and a Pallas kernel can run the same code on per-column loads.

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

import jax
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
    """The unit vector ``u`` of the tie rule (docs/math.md, "Tie rule"), float64 of shape ``[d]``."""
    n = np.array([math.sqrt(p) % 1.0 - 0.5 for p in _primes(d)])
    return n / np.linalg.norm(n)


def _dn_generator(n: int) -> np.ndarray:
    """Columns (-1,-1,0,..), (1,-1,0,..), e_{j-1} - e_j: the D4 basis of docs/math.md for every n."""
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
      second_moment: ``sigma_L^2`` per dimension used for the beta grid (docs/math.md, "Choosing beta").
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

    def cart_from_P(self, P: list) -> list:
        """Cartesian coordinates of points given in P coordinates (columns)."""
        if self.kind == "E8":
            return [c * 0.5 for c in P]
        if self.kind == "A2":
            return matvec(self.G, P)
        return list(P)


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
    m = re.fullmatch(r"([ZD])([1-9]\d*)", name)  # ("Z02" is no second name of Z2)
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
        # Names are exact; a name in another case or with spaces gets the one it resembles.
        upper = name.strip().upper()
        n = re.fullmatch(r"[ZD](\d+)", upper)
        known = upper in ("E8", "A2") or (n is not None and int(n.group(1)) >= 2)
        hint = f" (did you mean {upper!r}?)" if known and upper != name else ""
        raise ValueError(
            f"unknown lattice {name!r}{hint}: expected 'Z2', 'A2', 'D4', 'E8', 'Z{{n}}' or "
            f"'D{{n}}' with n >= 2"
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


def columns(x) -> list:
    """Splits ``x[..., d]`` into its ``d`` columns."""
    return [x[..., j] for j in range(x.shape[-1])]


def matvec(A: np.ndarray, cols: list) -> list:
    """``A @ v`` for a small constant numpy matrix ``A`` and ``v`` given as columns.

    The sums are unrolled in a fixed order and the entries enter as Python scalars, so the
    columns' dtype is kept: integer columns stay exact integer arithmetic.
    """
    cast = int if jnp.issubdtype(cols[0].dtype, jnp.integer) else float
    out = []
    for i in range(A.shape[0]):
        acc = None
        for j, c in enumerate(cols):
            if A[i, j] != 0:
                term = c if A[i, j] == 1 else c * cast(A[i, j])
                acc = term if acc is None else acc + term
        out.append(jnp.zeros_like(cols[0]) if acc is None else acc)
    return out


def sumsq(cols: list):
    """Squared norm of column vectors, summed in coordinate order."""
    acc = cols[0] * cols[0]
    for c in cols[1:]:
        acc = acc + c * c
    return acc


def floor_div(N, D: int):
    """``floor(N / D)`` for an integer array ``N`` and a positive Python int ``D``.

    A power of two is an arithmetic shift (exact for negative ``N`` too): XLA lowers a signed
    floor division by a constant to a division plus sign fix-ups, several times the work on
    the encoder's inner levels.
    """
    if D & (D - 1) == 0:
        return N >> (D.bit_length() - 1)
    return jnp.floor_divide(N, D)


def mod(N, D: int):
    """``N mod D`` in ``[0, D)`` for an integer array ``N`` and a positive Python int ``D``
    (a mask for a power of two: two's complement makes it the non-negative remainder)."""
    if D & (D - 1) == 0:
        return N & (D - 1)
    return jnp.remainder(N, D)


def _round_ties(N, D, u_i: float):
    """Nearest integer to ``N / D``; an exact half goes toward ``sign(u_i)``.

    Exact on integers (``D`` a positive int) and on floats (``D == 1``).

    Returns:
      ``(f, rho)``: the rounded value and the residual numerator ``N - D f``.
    """
    if jnp.issubdtype(N.dtype, jnp.integer):
        t = 2 * N + D
        f = floor_div(t, 2 * D)
        if u_i < 0:  # N/D = f - 1/2 exactly: floor took the upper neighbour
            f = f - (mod(t, 2 * D) == 0).astype(N.dtype)
        return f, N - D * f
    # On |N|, not N: a - floor(a) is exact for a >= 0 (for negative N, N - floor(N) can round
    # onto 0.5). floor/abs/where only, so the same code lowers for Triton (no round there).
    a = jnp.abs(N)
    m = jnp.floor(a)
    f = a - m
    tie_up = (N >= 0) if u_i > 0 else (N < 0)  # an exact half goes toward sign(u_i)
    m = jnp.where((f > 0.5) | ((f == 0.5) & tie_up), m + 1, m)
    r = jnp.where(N < 0, -m, m)
    return r, N - r


def _nearest_dn(cols: list, D, u: np.ndarray):
    """``Q_{D_n}(N / D)`` (Conway & Sloane) with the tie rule. Returns ``(f, rho)`` columns."""
    fr = [_round_ties(c, D, float(ui)) for c, ui in zip(cols, u)]
    f, rho = [a for a, _ in fr], [b for _, b in fr]
    step = _parity_steps(f, [jnp.abs(r) for r in rho], _residual_signs(rho, u), u)
    return [fi + s for fi, s in zip(f, step)], [ri - D * s for ri, s in zip(rho, step)]


def _residual_signs(rho: list, u: np.ndarray) -> list:
    """Where each residual counts as positive for the parity fix: ``rho_i > 0``, or
    ``rho_i = 0`` and ``u_i > 0``."""
    return [(r > 0) | ((r == 0) & (ui > 0)) for r, ui in zip(rho, u)]


def _parity_steps(f: list, mag: list, pos: list, u: np.ndarray) -> list:
    """The D_n parity fix of the rounded point ``f``: the steps to add to it.

    Where ``sum(f)`` is odd, the coordinate maximizing ``(mag_i, s_i u_i)`` moves one step
    toward ``s_i`` (+1 where ``pos_i``, else -1): ``mag_i`` orders the coordinates like
    ``|rho_i|``, the residual's magnitude, and ``s_i`` is the residual's sign, or ``sign(u_i)``
    where it is 0. The ``|u_i|`` are distinct, so the pick is unique.
    """
    total = f[0]
    for c in f[1:]:
        total = total + c
    odd = (mod(total, 2) if jnp.issubdtype(total.dtype, jnp.integer)
           else jnp.remainder(total, 2)) != 0
    best_mag = best_score = best_i = None
    for i, (m, p, ui) in enumerate(zip(mag, pos, u)):
        score = jnp.where(p, float(ui), -float(ui))
        if best_mag is None:
            best_mag, best_score, best_i = m, score, jnp.zeros(m.shape, jnp.int32)
            continue
        better = (m > best_mag) | ((m == best_mag) & (score > best_score))
        best_mag = jnp.where(better, m, best_mag)
        best_score = jnp.where(better, score, best_score)
        best_i = jnp.where(better, i, best_i)
    return [jnp.where(odd & (best_i == i), jnp.where(p, 1, -1), 0).astype(fi.dtype)
            for i, (fi, p) in enumerate(zip(f, pos))]


def _u_dot(u: np.ndarray, cols: list):
    """``<u, v>`` in float32 for small integer-valued columns (only its sign is used).

    Safe in float32: for the offsets E8 compares (odd entries up to 5 in magnitude) the
    smallest ``|<u, v>|`` is 7.6e-6, and the float32 sign agrees with float64's for all 6^8.
    """
    acc = None
    for ui, c in zip(u, cols):
        term = c.astype(jnp.float32) * float(ui)
        acc = term if acc is None else acc + term
    return acc


def _nearest_e8(a: list, b: list, D, u: np.ndarray) -> list:
    """E8 = D8 u (D8 + 1/2): the nearer of Q_D8(a/D) and Q_D8(b/D) + 1/2, in P coordinates.

    For integer numerators: ``a`` and ``b`` are those of y and y - 1/2 over ``D``. Both cosets
    go through one D8 search on columns stacked along a new last axis of size 2 (half the
    code to compile; the one stacking Triton lowers), and the squared distances are integers.
    """
    axis = a[0].ndim
    f, rho = _nearest_dn([jax.lax.stack([ca, cb], axis) for ca, cb in zip(a, b)], D, u)
    f = [jax.lax.unstack(c, axis) for c in f]
    rho = [jax.lax.unstack(c, axis) for c in rho]
    Pa, Pb = [2 * c[0] for c in f], [2 * c[1] + 1 for c in f]
    da, db = sumsq([r[0] for r in rho]), sumsq([r[1] for r in rho])
    tie_b = _u_dot(u, [cb - ca for ca, cb in zip(Pa, Pb)]) > 0
    take_b = (db < da) | ((db == da) & tie_b)
    return [jnp.where(take_b, cb, ca) for ca, cb in zip(Pa, Pb)]


def _nearest_e8_float(y: list, u: np.ndarray) -> list:
    """``Q_E8(y)`` for real columns ``y``, exactly: the nearer of the two coset candidates is
    decided by the sign of their squared-distance difference, computed without rounding.

    Float arithmetic cannot do what the integer path does: ``y - 1/2`` rounds for small ``|y|``,
    and sums of squared residuals round differently depending on whether the compiler fuses
    them into FMAs (XLA:CPU does; other backends may not), so near-equal distances would be
    decided by rounding and could differ between backends. Here everything derives from the
    exact residuals ``rho = y - round(y)`` (docs/math.md, "Tie rule"):

    * coset D8 + 1/2: ``y - 1/2`` rounds to ``round(y)`` where ``rho > 0`` (or ``rho = 0`` and
      the rule says up), else one below; its residual is ``rho -+ 1/2``, of magnitude
      ``1/2 - |rho|``, so the parity fix orders coordinates by ``-|rho|``.
    * With ``Pa``, ``Pb`` the two candidates in doubled coordinates and ``k = 2 round(y)``,
      ``4 (|y - a|^2 - |y - b|^2) = 4 sum_i v_i rho_i + K``, ``v = Pb - Pa`` and
      ``K = sum_i (Pa_i - k_i)^2 - (Pb_i - k_i)^2`` small integers: the squares of ``rho``
      cancel, and :func:`_exact_sign` gives the sign of what remains.

    Returns:
      P-coordinate (doubled Cartesian) columns as integer-valued floats of ``y``'s dtype.
    """
    fr = [_round_ties(c, 1, float(ui)) for c, ui in zip(y, u)]
    fa, rho = [a for a, _ in fr], [b for _, b in fr]
    mag = [jnp.abs(r) for r in rho]
    # Coset b, in terms of rho: rounding y - 1/2 goes down one where rho < 0 (or rho = 0 and
    # the rule takes the lower of the two); its residual is positive where -1/2 < rho < 0,
    # zero (sign from u_i) where |rho| = 1/2, and +1/2 where rho = 0 and it went down, and its
    # magnitude is 1/2 - |rho|: the parity fix orders coordinates by -|rho|.
    down = (rho_i < 0 if ui > 0 else rho_i <= 0 for rho_i, ui in zip(rho, u))
    fb = [jnp.where(dn, fi - 1, fi) for dn, fi in zip(down, fa)]
    pos_b = [((r < 0) & (m < 0.5)) | (((m == 0.5) if ui > 0 else (r == 0)))
             for r, m, ui in zip(rho, mag, u)]
    # Both cosets' parity fixes in one pass on columns stacked along a new last axis.
    axis = y[0].ndim
    pair = lambda a, b: [jax.lax.stack([ca, cb], axis) for ca, cb in zip(a, b)]  # noqa: E731
    pos_a = _residual_signs(rho, u)
    steps = _parity_steps(pair(fa, fb), pair(mag, [-m for m in mag]), pair(pos_a, pos_b), u)
    step_a, step_b = zip(*(jax.lax.unstack(c, axis) for c in steps))
    # Offsets from k = 2 fa in doubled coordinates: Pa - k in {0, +-2}, Pb - k in {+-1, +-3}.
    da = [2 * s.astype(jnp.int32) for s in step_a]
    db = [2 * (b - a + s).astype(jnp.int32) + 1 for a, b, s in zip(fa, fb, step_b)]
    v = [q - p for p, q in zip(da, db)]
    tie = jnp.where(_u_dot(u, v) > 0, 1, -1)
    take_b = _exact_sign(rho, [4 * c for c in v], sumsq(da) - sumsq(db), tie, 4 * 5 * len(y)) > 0
    return [jnp.where(take_b, 2 * (b + s) + 1, 2 * (a + s0))
            for a, b, s0, s in zip(fa, fb, step_a, step_b)]


def _exact_sign(x: list, w: list, K, tie, bound: int):
    """``sign(sum_i w_i x_i + K)`` exactly, and ``tie`` where that sum is 0.

    The x are read ``G`` bits at a time as fixed-point digits (``h = trunc(x 2^G)``, ``x <-
    x 2^G - h``, both exact) into an integer ``R <- R 2^G + sum_i w_i h_i``. What is still
    unread is below ``bound`` in magnitude (in units of the last digit), so the sign is settled
    once ``|R| >= bound`` (R then stays as it is), or after the last digit of the smallest
    float, where R is the exact sum. One digit settles all but about ``bound 2^-G`` of random
    inputs, and the loop stops when every entry is settled.

    XLA:CPU fuses elementwise producers into every consumer: the loop (rather than unrolled
    digits) and the tie applied inside it keep the whole computation behind the result from
    being recomputed by each of its consumers (unrolled, or with the tie applied after the
    loop, E8's level 0 was 5-40x slower).

    Args:
      x: float columns with ``|x_i| <= 1/2``.
      w: int32 columns (small integer weights) with ``sum_i |w_i| <= bound``.
      K: int32 column.
      tie: int32 column of +-1.
      bound: a static bound on ``sum_i |w_i|`` (below 2^8).

    Returns:
      A nonzero integer column (int32 or int64) with the sign of the sum, or ``tie``'s.
    """
    dtype = x[0].dtype
    fi = jnp.finfo(dtype)
    itype = jnp.int32 if fi.bits == 32 else jnp.int64
    G = jnp.iinfo(itype).bits - 2 - bound.bit_length()  # |R 2^G + sum w h| < 2 bound 2^G
    levels = -(-(fi.nmant - fi.minexp) // G)  # digits down to the least subnormal bit
    w = [c.astype(itype) for c in w]
    scale = dtype.type(2.0**G)

    def digit(carry):
        n, xs, R = carry
        xs = [c * scale for c in xs]
        h = [jnp.where(c < 0, -jnp.floor(-c), jnp.floor(c)) for c in xs]
        acc = R * (1 << G)
        for wi, hi in zip(w, h):
            acc = acc + wi * hi.astype(itype)
        R = jnp.where(jnp.abs(R) < bound, acc, R)
        # After the last digit R is exact: 0 only for an exact tie.
        R = jnp.where((n + 1 == levels) & (R == 0), tie.astype(itype), R)
        return n + 1, [c - hc for c, hc in zip(xs, h)], R

    def unsettled(carry):
        # max, not any: Triton lowers no reduce_or.
        return (carry[0] < levels) & (jnp.max((jnp.abs(carry[2]) < bound).astype(jnp.int32)) > 0)

    return jax.lax.while_loop(unsettled, digit, (0, list(x), K.astype(itype)))[2]


def nearest_int(cols: list, D: int, lat: Lattice) -> list:
    """``Q_L(N / D)`` for integer P-coordinate columns ``N``; returns integer P columns.

    All comparisons are on integers, so ties are decided by the rule and never by rounding.
    Callers keep ``|N| <= 2^23`` and ``D <= 256``, which fits int32.
    """
    u = lat.u
    if lat.kind == "Z":
        return [_round_ties(c, D, float(ui))[0] for c, ui in zip(cols, u)]
    if lat.kind == "D":
        return _nearest_dn(cols, D, u)[0]
    if lat.kind == "E8":
        # Cartesian y = N / (2D); y - 1/2 = (N - D) / (2D).
        return _nearest_e8(cols, [c - D for c in cols], 2 * D, u)
    # A2 in basis coordinates: the nearest point is a corner of the cell floor(N/D) + {0,1}^2.
    base = [floor_div(c, D) for c in cols]
    v0, v1 = (c - D * b for c, b in zip(cols, base))
    dists = [
        (v0 - D * o0) * (v0 - D * o0) + (v0 - D * o0) * (v1 - D * o1) + (v1 - D * o1) ** 2
        for o0, o1 in _A2_OFFSETS
    ]
    o = _a2_pick(dists, lat)
    return [base[0] + o[0], base[1] + o[1]]


_A2_OFFSETS = ((0, 0), (1, 0), (0, 1), (1, 1))


def _a2_pick(dists: list, lat: Lattice) -> list:
    """Offset columns of the nearest of the four A2 corner candidates.

    Candidates are visited from the most to the least preferred by the tie rule (largest
    ``<u, G c>`` first); a later one replaces the current one only when strictly nearer.
    """
    uG = lat.G.T @ lat.u
    order = sorted(range(4), key=lambda k: -float(uG @ np.array(_A2_OFFSETS[k])))
    best_d = dists[order[0]]
    o0 = jnp.full(best_d.shape, _A2_OFFSETS[order[0]][0], jnp.int32)
    o1 = jnp.full(best_d.shape, _A2_OFFSETS[order[0]][1], jnp.int32)
    for k in order[1:]:
        better = dists[k] < best_d
        best_d = jnp.where(better, dists[k], best_d)
        o0 = jnp.where(better, _A2_OFFSETS[k][0], o0)
        o1 = jnp.where(better, _A2_OFFSETS[k][1], o1)
    return [o0, o1]


def nearest_float(cols: list, lat: Lattice) -> list:
    """Level-0 nearest point in the columns' floating dtype, exactly.

    float64: ``Q_L(y + eps)``, bit for bit the reference; exact ties that survive the addition
    are resolved by the rule. float32: ``Q_L(y)`` with the rule applied to exact ties.

    Args:
      cols: ``d`` floating columns of ``y``.
      lat: the lattice.

    Returns:
      P-coordinate columns of the nearest point, as integer-valued floats.
    """
    if cols[0].dtype == jnp.float64:
        y = [c + np.float64(e) for c, e in zip(cols, lat.u * 2.0**-41)]
    else:
        # eps is below float32 resolution except on coordinates near 0, where adding it would
        # mix eps with the exact rule on the others: apply the exact rule alone.
        y = list(cols)
    u = lat.u
    if lat.kind == "Z":
        return [_round_ties(c, 1, float(ui))[0] for c, ui in zip(y, u)]
    if lat.kind == "D":
        return _nearest_dn(y, 1, u)[0]
    if lat.kind == "E8":
        return _nearest_e8_float(y, u)
    base = [jnp.floor(c) for c in matvec(np.linalg.inv(lat.G), y)]
    dists = []
    for o0, o1 in _A2_OFFSETS:
        cart = matvec(lat.G, [base[0] + o0, base[1] + o1])
        dists.append(sumsq([a - b for a, b in zip(y, cart)]))
    o = _a2_pick(dists, lat)
    return [base[0] + o[0].astype(y[0].dtype), base[1] + o[1].astype(y[0].dtype)]


def closest_point(y, lat: Lattice | str):
    """Nearest lattice point ``Q_L(y)`` over the last axis, with the tie rule (docs/math.md).

    Args:
      y: ``[..., d]`` floating array (half precision is computed in float32).
      lat: a :class:`Lattice` or its name.

    Returns:
      ``[..., d]`` Cartesian coordinates of the nearest lattice points, in ``y``'s dtype
      (float32 for half-precision input).

    Exact for coordinates below about 2^24 / d in magnitude in float32 (2^53 / d in float64;
    E8: 2^21): beyond, D_n's parity sum and E8's half-integer coset round (the encoder's
    clamp keeps its level-0 inputs far below). Subnormal coordinates count as zero on
    XLA:CPU, which flushes them; the encoder flushes them itself, on every backend.
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
    return _closest_jit(y, lat)


@functools.partial(jax.jit, static_argnums=1)
def _closest_jit(y, lat):
    return jnp.stack(lat.cart_from_P(nearest_float(columns(y), lat)), axis=-1)

"""The paper's rate-distortion experiment: how far HNLQ sits above the Gaussian bound.

(``docs/math.md``, "Reference numbers".)

For each lattice, q and M: beta by the paper's grid search on iid N(0,1) data, then MSE per
dimension, ``H(T)``, the effective rate ``R = M log2 q + H(T)/d`` and the figure of merit
``f = MSE 2^(2R)`` in dB (the distance above ``D(R) = 2^(-2R)``). The single-level Voronoi code
with nesting ratio ``q^2`` (``M = 1``, the same nominal rate as ``M = 2``) is the comparison.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np

from hnlq_jax.config import MAX_CODEBOOK_SIZE, HNLQConfig
from hnlq_jax.lattices import lattice
from hnlq_jax.stats import calibrate_beta

__all__ = ["RDPoint", "rate_distortion", "format_table", "plot"]


class RDPoint(NamedTuple):
    """One operating point of :func:`rate_distortion`.

    Attributes:
      lattice, q, M: the configuration.
      code: ``"hnlq"``, or ``"voronoi"`` for the single-level code (``M = 1``) at ``q``.
      beta: the grid-search beta.
      mse: mean squared error per dimension.
      entropy_T: ``H(T)`` in bits per block.
      rate: ``M log2 q + H(T)/d`` bits per dimension.
      f_dB: ``10 log10(mse 2^(2 rate))``, dB above the Gaussian bound.
      overload_rate: fraction of blocks with ``T > 0``.
    """

    lattice: str
    q: int
    M: int
    code: str
    beta: float
    mse: float
    entropy_T: float
    rate: float
    f_dB: float
    overload_rate: float


def _point(name: str, q: int, M: int, code: str, n: int, seed: int) -> RDPoint:
    cfg = HNLQConfig(name, q, M)
    x = np.random.default_rng(seed).standard_normal((n, cfg.d))
    beta, t = calibrate_beta(x, cfg, scale=1.0)  # the paper's grid
    i = t.best
    return RDPoint(name, q, M, code, beta, float(t.mse[i]), float(t.entropy_T[i]),
                   float(t.rate[i]), 10 * math.log10(t.f[i]), float(t.overload_rate[i]))


def rate_distortion(lattices=("Z2", "A2", "D4", "E8"), qs=(3, 4, 8), Ms=(1, 2, 3), n: int = 4000,
                    seed: int = 0, voronoi: bool = True, callback=None) -> list[RDPoint]:
    """Runs the grid search for every configuration, in float64 (as the reference).

    Args:
      lattices: lattice names.
      qs: nesting ratios.
      Ms: numbers of levels.
      n: sample size (the paper: 4000 d-vectors from ``numpy.random.default_rng(0)``).
      seed: the sample's seed.
      voronoi: also run the Voronoi code at ``q^2`` (``M = 1``) for each lattice and q, where
        its codebook fits Codes (``q^2 <= 256`` and ``q^(2d) <= 2^32``: not E8 at q = 8).
      callback: called with each :class:`RDPoint` as it is done (progress).

    Returns:
      The points, in the order lattice, q, then M (Voronoi after the M's of its q).
    """
    jobs = []
    for name in lattices:
        for q in qs:
            jobs += [(name, q, M, "hnlq") for M in Ms]
            if voronoi and q * q <= 256 and (q * q) ** lattice(name).d <= MAX_CODEBOOK_SIZE:
                jobs.append((name, q * q, 1, "voronoi"))
    for job in jobs:  # fail fast on an invalid configuration, before any long run
        HNLQConfig(*job[:3])
    out = []
    with jax.enable_x64(True):
        for job in jobs:
            out.append(_point(*job, n=n, seed=seed))
            if callback is not None:
                callback(out[-1])
    return out


def format_table(points) -> str:
    """The points as an aligned text table."""
    head = (f"{'lattice':7s} {'code':8s} {'q':>3s} {'M':>2s} {'beta':>8s} {'MSE/dim':>10s} "
            f"{'H(T)':>6s} {'R':>6s} {'f (dB)':>7s} {'P(T>0)':>7s}")
    rows = [head]
    for p in points:
        rows.append(f"{p.lattice:7s} {p.code:8s} {p.q:3d} {p.M:2d} {p.beta:8.4f} {p.mse:10.3e} "
                    f"{p.entropy_T:6.3f} {p.rate:6.3f} {p.f_dB:7.3f} {p.overload_rate:7.3f}")
    return "\n".join(rows)


def plot(points, path) -> None:
    """Saves ``f`` (dB) versus R, one panel per lattice (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(p.lattice for p in points))
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False,
                             sharey=True)
    for ax, name in zip(axes[0], names):
        pts = [p for p in points if p.lattice == name]
        for q in sorted({p.q for p in pts if p.code == "hnlq"}):
            line = sorted((p for p in pts if p.code == "hnlq" and p.q == q), key=lambda p: p.M)
            ax.plot([p.rate for p in line], [p.f_dB for p in line], "o-", label=f"HNLQ q={q}")
            for p in line:
                ax.annotate(f"M={p.M}", (p.rate, p.f_dB), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        vor = sorted((p for p in pts if p.code == "voronoi"), key=lambda p: p.rate)
        if vor:
            ax.plot([p.rate for p in vor], [p.f_dB for p in vor], "k^--",
                    label="Voronoi q² (M=1)")
            for p in vor:
                ax.annotate(f"q={p.q}", (p.rate, p.f_dB), fontsize=7, xytext=(3, -9),
                            textcoords="offset points")
        ax.axhline(10 * math.log10(math.pi * math.e / 6), color="gray", lw=0.8, ls=":",
                   label="πe/6 (1.53 dB): Z's granular loss")
        ax.set_title(name)
        ax.set_xlabel("R (bits/dim, incl. H(T)/d)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("f = MSE·2^(2R) (dB above D(R))")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""What each part of compensated rounding buys, on synthetic layers with a known Hessian.

For two layer shapes ``[out, in]`` (MiniLM's 384 x 1536 and 1536 x 384) and D4 / E8 at q = 4,
M = 2, float32: the proxy loss ``tr(dW H dW^T)`` of :func:`hnlq_jax.ptq.gptq_rows` in five
variants, relative to round-to-nearest at the calibrated beta (:func:`hnlq_jax.rows.rows_codes`),
in dB:

* ``compensated``: error feedback, beta fixed at the calibrated one;
* ``+ act order``: the same, block columns in decreasing order of their ``diag(H)``;
* ``+ search``: act order and the default per-row beta search;
* ``rotation + compensated``: after an incoherence rotation (:mod:`hnlq_jax.incoherence`);
* ``rotation + act order + search``: everything.

The layers: inputs ``X`` of 4096 tokens, Gaussian mixed by a random matrix (correlated
columns) with six outlier channels scaled by 20; Student-t(5) weights (heavy tails). Also the
entropy of T per block with and without the search (the search lowers the loss but overloads
more). Seeded: the same numbers on every machine up to float32 rounding.

Writes ``results/ptq_synthetic.json`` and the table of ``docs/ptq.md`` ("Measured effect");
``--report`` only rewrites the table. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

import hnlq_jax as hq
from hnlq_jax import ptq, rows
from hnlq_jax.incoherence import Rotation

from report import DOCS, RESULTS, add_report_flag, load_results, markdown_table, \
    write_between_markers

SHAPES = ((384, 1536), (1536, 384))
LATTICES = ("D4", "E8")
TOKENS, OUTLIERS, OUTLIER_GAIN = 4096, 6, 20.0
VARIANTS = {  # name: gptq_rows options; "beta": fixed at the calibrated beta
    "compensated": {"beta": True},
    "+ act order": {"beta": True, "act_order": True},
    "+ search": {"act_order": True},
    "rotation + compensated": {"beta": True, "rotation": True},
    "rotation + act order + search": {"act_order": True, "rotation": True},
}


def layer(out: int, n: int, seed: int = 0):
    """``(w [out, n], H [n, n])``, float32: the synthetic layer of the module docstring."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((TOKENS, n)) @ (rng.standard_normal((n, n)) / math.sqrt(n)
                                             + np.eye(n))
    X[:, rng.choice(n, OUTLIERS, replace=False)] *= OUTLIER_GAIN
    w = rng.standard_t(5, (out, n)) * 0.02
    return w.astype(np.float32), (X.T @ X).astype(np.float32)


def t_bits_per_block(codes, config) -> float:
    T = np.asarray(codes.T).ravel()
    p = np.bincount(T) / T.size
    return float(-(p[p > 0] * np.log2(p[p > 0])).sum())


def run() -> dict:
    points = []
    for out, n in SHAPES:
        w, H = layer(out, n)
        for lattice in LATTICES:
            config = hq.HNLQConfig(lattice, 4, 2)
            beta = float(rows.calibrate_rows(jnp.asarray(w), config))
            rtn = rows.rows_codes(jnp.asarray(w), config, beta)
            base = float(ptq.proxy_loss(w, hq.decode(rtn), H))
            point = {"shape": [out, n], "lattice": lattice, "beta": beta, "rtn_loss": base,
                     "rtn_t_bits_per_block": t_bits_per_block(rtn, config), "variants": {}}
            for name, opts in VARIANTS.items():
                kw = {"act_order": opts.get("act_order", False),
                      "beta": beta if opts.get("beta") else None,
                      "rotation": Rotation(n, 0) if opts.get("rotation") else None}
                r = ptq.gptq_rows(w, H, config, **kw)
                point["variants"][name] = {"loss": r.loss, "db": 10 * math.log10(r.loss / base),
                                           "t_bits_per_block": r.t_bits * config.d}
            points.append(point)
            print(f"{out}x{n} {lattice}: " + ", ".join(
                f"{k} {v['db']:+.1f} dB" for k, v in point["variants"].items()), flush=True)
    return {"tokens": TOKENS, "outliers": OUTLIERS, "outlier_gain": OUTLIER_GAIN,
            "config": "q=4 M=2, float32", "points": points, "jax": jax.__version__,
            "backend": jax.default_backend()}


def table(res: dict) -> str:
    body = [[f"{p['shape'][0]} × {p['shape'][1]}", p["lattice"]]
            + [f"{v['db']:+.1f} dB".replace("-", "−") for v in p["variants"].values()]
            + [f"{p['variants']['+ act order']['t_bits_per_block']:.2f} → "
               f"{p['variants']['+ search']['t_bits_per_block']:.2f}"]
            for p in res["points"]]
    return markdown_table(["layer [out × in]", "lattice", *VARIANTS,
                           "H(T) bits/block: act order → + search"], body)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_report_flag(ap)
    args = ap.parse_args()
    if args.report:
        res = load_results("ptq_synthetic")
    else:
        res = run()
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "ptq_synthetic.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    print(text)
    write_between_markers(DOCS / "ptq.md", "ptq_synthetic", text)


if __name__ == "__main__":
    main()

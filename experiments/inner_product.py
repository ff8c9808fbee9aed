"""Inner-product distortion of HNLQ versus Gamma(R): D4 and E8, q = 4, M = 1..4.

For 1000 pairs of iid N(0,1) vectors of length n = 512, both quantized with the same config:
D_ip = mean (<x_hat, y_hat> - <x, y>)^2 / n, against Gamma(R) = 2 2^(-2R) - 2^(-4R) with
R = M log2 q + H(T)/d. beta on the paper's grid beta_min (1 + 0.05 k), k < 40, minimizing
D_ip / Gamma(R). At the chosen beta the inner products are recomputed through the lookup
tables (two-sided for D4; E8 q=4 has no practical two-sided table, so one-sided against the
decoded y, on the first 16 pairs: its tables hold 65,536 entries per block) and compared with
decode-then-dot. The paper's D4 numbers are in docs/math.md ("Reference numbers").

Writes results/inner_product.{json,png} and the table into docs/performance.md. Run:
python experiments/inner_product.py (--report: only rewrite the docs table from
results/inner_product.json).
"""

import argparse
import functools
import json
import math
import pathlib
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

import hnlq_jax as hq  # noqa: E402
from hnlq_jax import lut  # noqa: E402
from hnlq_jax.codec import decode_blocks, encode_blocks  # noqa: E402
from hnlq_jax.codes import pack_t  # noqa: E402
from report import (DOCS, add_report_flag, load_results, markdown_table,  # noqa: E402
                    write_between_markers)

RESULTS = pathlib.Path(__file__).parent / "results"
N, PAIRS, Q, GRID = 512, 1000, 4, 40
LUT_CHECK_PAIRS = 16


def gamma(R):
    return 2 * 2 ** (-2 * R) - 2 ** (-4 * R)


@functools.partial(jax.jit, static_argnums=2)
def grid(x, y, cfg, betas):
    """D_ip and R for each beta (x, y: [PAIRS, N])."""
    true = jnp.sum(x * y, -1)

    def one(beta):
        blocks = jnp.concatenate([hq.to_blocks(x, cfg.d), hq.to_blocks(y, cfg.d)]).reshape(-1, cfg.d)
        index, T = encode_blocks(blocks, cfg, beta)  # beta is traced: no hq.encode here
        d = decode_blocks(index, T + 1, cfg, None, x.dtype, beta).reshape(2, PAIRS, N)
        est = jnp.sum(d[0] * d[1], -1)
        st = hq.rate_stats(hq.Codes(index, pack_t(T, cfg), cfg))
        fail = st.failure_rate > 0
        return jnp.where(fail, jnp.inf, jnp.mean((est - true) ** 2) / N), st.rate

    return jax.lax.map(one, betas, batch_size=4)


def run_config(name, M, x, y):
    cfg = hq.HNLQConfig(name, Q, M)
    betas = np.array([cfg.beta_min() * (1 + 0.05 * k) for k in range(GRID)])
    D, R = (np.asarray(v) for v in grid(x, y, cfg, jnp.asarray(betas)))
    ratio = D / gamma(R)
    k = int(np.argmin(ratio))
    cfg = cfg.replace(beta=float(betas[k]))
    cx, cy = (hq.encode(hq.to_blocks(v, cfg.d), cfg) for v in (x, y))
    dx, dy = (np.asarray(hq.decode(c)).reshape(PAIRS, N) for c in (cx, cy))
    dec = np.sum(dx * dy, -1)
    if Q ** (2 * cfg.d) <= lut.MAX_TWO_SIDED:
        path, est = "two-sided", np.asarray(lut.dot(cx, cy))
    else:  # q^d = 65536-entry tables per block: check the first pairs only (memory)
        few = slice(0, LUT_CHECK_PAIRS)
        path = f"one-sided vs decoded y, first {LUT_CHECK_PAIRS} pairs"
        first = hq.Codes(cx.index[few], cx.tfield[few], cfg)  # pairs axis: not the T pairing axis
        est = np.asarray(lut.dot_one_sided(first, dy[few]))
        dec = dec[few]
    return {"lattice": name, "q": Q, "M": M, "beta": float(betas[k]), "D_ip": float(D[k]),
            "R": float(R[k]), "Gamma_R": float(gamma(R[k])),
            "dB_above_Gamma": 10 * math.log10(ratio[k]), "lut_path": path,
            "lut_vs_decode_max_rel": float(np.max(np.abs(est - dec)) / np.max(np.abs(dec))),
            "grid": {"beta": betas.tolist(), "D_ip": D.tolist(), "R": R.tolist()}}


def plot(rows, path):
    fig, ax = plt.subplots(figsize=(5.5, 4))
    Rs = np.linspace(1.5, 8.5, 100)
    ax.semilogy(Rs, gamma(Rs), "k-", lw=1, label="Γ(R) = 2·2^-2R − 2^-4R")
    for name, mk in (("D4", "o-"), ("E8", "s-")):
        pts = [r for r in rows if r["lattice"] == name]
        ax.semilogy([r["R"] for r in pts], [r["D_ip"] for r in pts], mk, label=f"HNLQ {name} q={Q}")
        for r in pts:
            ax.annotate(f"M={r['M']}", (r["R"], r["D_ip"]), fontsize=7, xytext=(4, 2),
                        textcoords="offset points")
    ax.set_xlabel("R (bits/dim, incl. H(T)/d)")
    ax.set_ylabel("D_ip = E(<x̂,ŷ> − <x,y>)² / n")
    ax.set_title(f"inner products, n = {N}, iid N(0,1)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(res: dict) -> str:
    """The docs table of a result dict: one row per config at its chosen beta."""
    rows = [[f"{r['lattice']} q={r['q']} M={r['M']}", f"{r['beta']:.4f}", f"{r['R']:.3f}",
             f"{r['D_ip']:.3e}", f"{r['Gamma_R']:.3e}", f"{r['dB_above_Gamma']:.2f}",
             f"{r['lut_path']}: {r['lut_vs_decode_max_rel']:.1e}"] for r in res["rows"]]
    caption = f"{res['pairs']} pairs, n = {res['n']}, seed {res['seed']}:"
    return caption + "\n\n" + markdown_table(
        ["config", "β", "R (bits/dim)", "D_ip", "Γ(R)", "dB above Γ(R)",
         "LUT products: max rel. difference to decode-then-dot"], rows)


def run() -> dict:
    """Runs every config; writes and returns the result dict."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((PAIRS, N)), rng.standard_normal((PAIRS, N))
    t0 = time.perf_counter()
    jobs = [(name, M) for name in ("D4", "E8") for M in (1, 2, 3, 4)]
    rows = [run_config(name, M, x, y) for name, M in tqdm(jobs, desc="configs")]
    RESULTS.mkdir(exist_ok=True)
    out = {"n": N, "pairs": PAIRS, "seed": 0, "q": Q, "seconds": time.perf_counter() - t0,
           "criterion": "min D_ip / Gamma(R) on the beta grid", "rows": rows}
    (RESULTS / "inner_product.json").write_text(json.dumps(out, indent=1))
    plot(rows, RESULTS / "inner_product.png")
    print(f"wrote {RESULTS / 'inner_product.json'} and .png")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_report_flag(p)
    args = p.parse_args()
    text = table(load_results("inner_product") if args.report else run())
    print(text)
    write_between_markers(DOCS / "performance.md", "inner_product", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reproduces the paper's rate-distortion numbers for Z2, A2, D4 and E8.

For q in {3, 4, 8} and M in {1, 2, 3}, plus the Voronoi code at q^2 (M = 1): beta by the paper's
grid search on 4000 iid N(0,1) vectors (numpy default_rng(0)), MSE/dim, H(T), R and
f = MSE 2^(2R) in dB. Checks D4 M=2 against the paper's numbers (+-0.15 dB; docs/math.md,
"Reference numbers").

Writes results/rate_distortion.{json,png} and the tables into docs/performance.md. Run:
python experiments/rate_distortion.py (--report: only rewrite the docs tables from
results/rate_distortion.json).
"""

import argparse
import json
import pathlib
import sys
import time

from tqdm import tqdm

from hnlq_jax import rd
from report import DOCS, add_report_flag, load_results, markdown_table, write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"
# docs/math.md, "Reference numbers", M = 2: (beta, MSE/dim, R, f dB)
PAPER = {("D4", 3): (0.3721, 1.88e-2, 3.45, 3.48), ("D4", 4): (0.2016, 5.50e-3, 4.26, 3.05),
         ("D4", 8): (0.0465, 2.89e-4, 6.27, 2.35)}
TOLERANCE_DB = 0.15


def table(res: dict) -> str:
    """The docs tables of a result dict: f (dB) by lattice and code (bold: the configs checked
    against the paper; a dash where the file has no point), then the paper check."""
    f = {(p["lattice"], p["code"], p["q"], p["M"]): p["f_dB"] for p in res["points"]}
    hnlq = [p for p in res["points"] if p["code"] == "hnlq"]
    qs, Ms = sorted({p["q"] for p in hnlq}), sorted({p["M"] for p in hnlq})
    columns = [c for q in qs for c in [("hnlq", q, M) for M in Ms] + [("voronoi", q * q, 1)]]
    header = ["f (dB)"] + [f"Voronoi {q}" if code == "voronoi" else
                           f"q={q} M={M}" if M == Ms[0] else f"M={M}" for code, q, M in columns]
    checked = {c["config"] for c in res["paper_checks"]}

    def cell(name, code, q, M):
        if (name, code, q, M) not in f:
            return "–"
        v = f"{f[name, code, q, M]:.2f}"
        return f"**{v}**" if f"{name} q={q} M={M}" in checked else v

    rows = [[name] + [cell(name, *c) for c in columns]
            for name in dict.fromkeys(p["lattice"] for p in res["points"])]
    rd_table = markdown_table(header, rows)
    if any("–" in row for row in rows):
        rd_table += ("\n\n–: not in the result file (`hnlq_jax.rd` skips Voronoi codebooks of "
                     "more than 2^32 entries).")
    check = markdown_table(
        ["config", "f (dB)", "reference (dB)", "difference (dB)", "β", "reference β",
         f"within ±{TOLERANCE_DB} dB"],
        [[c["config"], f"{c['f_dB']:.3f}", c["paper_f_dB"], f"{c['delta_dB']:+.3f}",
          f"{c['beta']:.4f}", c["paper_beta"], "yes" if c["within"] else "**no**"]
         for c in res["paper_checks"]])
    return f"{rd_table}\n\n{check}"


def run() -> dict:
    """Runs the grid search for every config; writes and returns the result dict."""
    lattices, qs, Ms = ("Z2", "A2", "D4", "E8"), (3, 4, 8), (1, 2, 3)
    total = len(lattices) * len(qs) * (len(Ms) + 1)
    t0 = time.perf_counter()
    with tqdm(total=total, desc="configs") as bar:
        points = rd.rate_distortion(lattices, qs, Ms, callback=lambda p: bar.update())
    elapsed = time.perf_counter() - t0
    print(rd.format_table(points))
    checks = []
    for p in points:
        if p.code == "hnlq" and p.M == 2 and (p.lattice, p.q) in PAPER:
            beta, mse, R, f = PAPER[p.lattice, p.q]
            checks.append({"config": f"{p.lattice} q={p.q} M=2", "f_dB": p.f_dB, "paper_f_dB": f,
                           "delta_dB": p.f_dB - f, "beta": p.beta, "paper_beta": beta,
                           "within": abs(p.f_dB - f) <= TOLERANCE_DB})
    RESULTS.mkdir(exist_ok=True)
    out = {"n": 4000, "seed": 0, "alpha": 1 / 3, "grid": "beta_min (1 + 0.05 k), k < 40",
           "seconds": elapsed, "points": [p._asdict() for p in points], "paper_checks": checks}
    (RESULTS / "rate_distortion.json").write_text(json.dumps(out, indent=1))
    rd.plot(points, RESULTS / "rate_distortion.png")
    print(f"wrote {RESULTS / 'rate_distortion.json'} and .png ({elapsed:.0f} s)")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_report_flag(p)
    args = p.parse_args()
    out = load_results("rate_distortion") if args.report else run()
    text = table(out)
    print(text)
    write_between_markers(DOCS / "performance.md", "rate_distortion", text)
    return 0 if all(c["within"] for c in out["paper_checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())

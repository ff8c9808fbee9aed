"""Codec throughput: encode, decode and quantize beside a scalar int8 quantizer, one process.

For D4 and E8 (q=4, M=2, beta calibrated on 4000 Gaussian samples) and N in {1e4, 1e5, 1e6}
iid N(0,1) vectors, times the jitted ``encode``, ``decode`` and ``quantize`` (best of
``--repeat`` runs after a warm-up) and the simplest scalar quantizer, ``round(x/s)`` to int8 and
back, on the same data. Writes ``experiments/results/bench_codec.json`` and ``.png`` and prints
a Markdown table (also written into ``docs/performance.md``).

Usage: ``python experiments/bench_codec.py [--sizes 1e4 1e5 1e6] [--repeat 5]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

import jax
import jax.numpy as jnp
import numpy as np

import hnlq_jax as hq
from hnlq_jax.timing import best_time
from report import DOCS, add_report_flag, load_results, write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"


@jax.jit
def scalar_encode(x, s):
    return jnp.clip(jnp.round(x / s), -127, 127).astype(jnp.int8)


@jax.jit
def scalar_decode(c, s):
    return c.astype(jnp.float32) * s


def run(sizes, repeat):
    rows = []
    for name in ("D4", "E8"):
        cfg = hq.HNLQConfig(name, 4, 2)
        beta = hq.gaussian_beta(cfg)
        cfg = cfg.replace(beta=beta)
        enc = jax.jit(hq.encode, static_argnums=1)
        dec = jax.jit(hq.decode)
        quant = jax.jit(hq.quantize, static_argnums=1)
        for n in sizes:
            x = jnp.asarray(np.random.default_rng(1).standard_normal((n, cfg.d)), jnp.float32)
            codes = enc(x, cfg)
            s = jnp.float32(4 / 127)  # int8 over +-4 sigma
            c8 = scalar_encode(x, s)
            t = {
                "encode": best_time(enc, x, cfg, repeat=repeat),
                "decode": best_time(dec, codes, repeat=repeat),
                "quantize": best_time(quant, x, cfg, repeat=repeat),
                "scalar_encode": best_time(scalar_encode, x, s, repeat=repeat),
                "scalar_decode": best_time(scalar_decode, c8, s, repeat=repeat),
            }
            hnlq_ed = t["encode"] + t["decode"]
            scalar_ed = t["scalar_encode"] + t["scalar_decode"]
            row = {
                "lattice": name, "q": 4, "M": 2, "beta": beta, "n": n,
                **{f"{k}_s": v for k, v in t.items()},
                **{f"{k}_vec_per_s": n / v for k, v in t.items()},
                "encode_decode_vec_per_s": n / hnlq_ed,
                "scalar_encode_decode_vec_per_s": n / scalar_ed,
                "ratio_vs_scalar": hnlq_ed / scalar_ed,
                "overload_rate": float(jnp.mean(codes.T > 0)),
                "codes_bits_per_value": codes.bits_per_value(),
            }
            rows.append(row)
            print(f"{name} n={n:>9,}: enc {row['encode_vec_per_s']:.3g}/s dec "
                  f"{row['decode_vec_per_s']:.3g}/s enc+dec {row['encode_decode_vec_per_s']:.3g}"
                  f"/s scalar {row['scalar_encode_decode_vec_per_s']:.3g}/s "
                  f"ratio {row['ratio_vs_scalar']:.1f}x", flush=True)
    return rows


def table(rows) -> str:
    lines = ["| lattice | N | encode vec/s | decode vec/s | quantize vec/s | enc+dec vec/s | "
             "scalar int8 enc+dec vec/s | time ratio vs scalar |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['lattice']} q=4 M=2 | {r['n']:.0e} | {r['encode_vec_per_s']:.3g} | "
            f"{r['decode_vec_per_s']:.3g} | {r['quantize_vec_per_s']:.3g} | "
            f"{r['encode_decode_vec_per_s']:.3g} | {r['scalar_encode_decode_vec_per_s']:.3g} | "
            f"{r['ratio_vs_scalar']:.1f}x |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, style in (("D4", "o-"), ("E8", "s-")):
        rs = [r for r in rows if r["lattice"] == name]
        n = [r["n"] for r in rs]
        ax.loglog(n, [r["encode_vec_per_s"] for r in rs], style, label=f"{name} encode")
        ax.loglog(n, [r["decode_vec_per_s"] for r in rs], style, alpha=0.5, label=f"{name} decode")
    rs = [r for r in rows if r["lattice"] == "D4"]
    ax.loglog([r["n"] for r in rs], [r["scalar_encode_decode_vec_per_s"] for r in rs], "k--",
              label="scalar int8 enc+dec (4-dim vectors)")
    ax.set_xlabel("N vectors")
    ax.set_ylabel("vectors / s")
    ax.set_title(f"hnlq_jax codec throughput ({jax.default_backend()}, "
                 f"{jax.device_count()} device)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e5, 1e6])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "bench_codec"),
                   help="results path without suffix; another one leaves docs/performance.md")
    add_report_flag(p)
    a = p.parse_args()
    if a.report:
        write_between_markers(DOCS / "performance.md", "bench_codec",
                              table(load_results("bench_codec")["rows"]))
        return
    rows = run([int(s) for s in a.sizes], a.repeat)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "jax": jax.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": __import__("os").cpu_count()}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))
    if out.resolve() == (RESULTS / "bench_codec").resolve():  # the docs show the default run
        write_between_markers(DOCS / "performance.md", "bench_codec", table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()

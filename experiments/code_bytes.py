"""Bytes per weight of HNLQ codes in memory, packed and on the wire, beside bf16, int8 and int4;
CPU time of ``hq.matmul`` on compact codes.

Every figure is counted from the arrays a user holds (``nbytes`` of each array), for a Gaussian
weight ``W[rows, cols]`` coded by rows (``hq.encode_rows``, per-row scale, calibrated beta):

* ``memory``: the ``Codes`` pytree (index, T field, float32 row scales);
* ``packed``: ``hq.pack(codes)`` (mixed-radix labels + entropy-coded T);
* ``wire``: the payload one device sends per ``dist.compressed_mean`` of the same number of
  values at 8 devices with reduce_scatter, against a float32 ring all-reduce;
* baselines built as arrays: bf16; int8 with a float32 scale per row; int4 packed two per byte
  with a float16 scale per group of 128 (the usual GPTQ/AWQ storage).

Then times ``hq.matmul`` (xla: decode then dot; lut: one-sided tables; pallas: the fused kernel,
interpret mode on a CPU) against a float32 and a bf16 ``jnp.dot`` on the same shapes, batch 1
and 8, in one process, each weight cycling through ``ROTATE_MB`` MiB of copies: the dots'
medians of calls over every copy (none from cache), the codes' (compute-bound) medians of
``--repeat`` calls on the first copies.

Writes ``experiments/results/code_bytes.json`` and ``.png``.
Usage: ``python experiments/code_bytes.py [--rows 1024] [--cols 1024]``
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
from hnlq_jax import dist
from hnlq_jax.timing import ROTATE_MB, fresh_copies, median_time, n_copies
from report import DOCS, add_report_flag, load_results, write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"


def baselines(W: np.ndarray) -> dict:
    """Bits per weight of the usual formats, from the bytes of arrays that hold them."""
    rows, cols = W.shape
    n = W.size
    bf16 = jnp.asarray(W, jnp.bfloat16)
    int8 = (np.zeros((rows, cols), np.int8), np.zeros(rows, np.float32))
    groups = -(-cols // 128)
    int4 = (np.zeros((rows, -(-cols // 2)), np.uint8), np.zeros((rows, groups), np.float16))
    return {
        "float32": 32.0,
        "bf16": 8 * bf16.nbytes / n,
        "int8_per_row": 8 * sum(a.nbytes for a in int8) / n,
        "int4_g128": 8 * sum(a.nbytes for a in int4) / n,
    }


def sizes(W: np.ndarray, lattice: str, q: int, M: int = 2) -> dict:
    cfg = hq.HNLQConfig(lattice, q, M)
    cfg = cfg.replace(beta=hq.gaussian_beta(cfg))
    codes = hq.encode_rows(W, cfg)
    packed = hq.pack(codes)
    back = hq.unpack(packed)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(codes)))
    wire = dist.wire_bytes(W, cfg, 8, "reduce_scatter")
    n = W.size
    return {
        "lattice": lattice, "q": q, "M": M, "rate_nominal": cfg.rate,
        "H_T_per_block": float(hq.rate_stats(codes).entropy_T),
        "memory_bits": 8 * codes.nbytes / n,
        "packed_bits": 8 * packed.nbytes / n,
        # bits one device sends per value of the mean (a float32 ring all-reduce: 56 at 8)
        "wire_bits_sent": 8 * wire["sent"] / n,
        "float32_allreduce_bits_sent": 8 * wire["float32_allreduce"] / n,
        "wire_ratio_vs_float32_allreduce": 1 / wire["ratio_to_float32"],  # float32 / sent
    }


def timings(rows: int, cols: int, repeat: int) -> list:
    rng = np.random.default_rng(1)
    W = rng.standard_normal((rows, cols)).astype(np.float32)
    out = []
    for lattice in ("D4", "E8"):
        cfg = hq.HNLQConfig(lattice, 4, 2)
        codes = hq.encode_rows(W, cfg.replace(beta=hq.gaussian_beta(cfg)))
        W_hat = hq.decode(codes)
        copies = {dtype: fresh_copies(W_hat.astype(dtype), n_copies(W_hat.size * size))
                  for dtype, size in ((jnp.float32, 4), (jnp.bfloat16, 2))}
        code_copies = fresh_copies(codes, n_copies(codes.nbytes))
        dense = jax.jit(lambda a, w: a @ w.T)
        for batch in (1, 8):
            x = jnp.asarray(rng.standard_normal((batch, cols)), jnp.float32)
            row = {"lattice": lattice, "rows": rows, "cols": cols, "batch": batch}
            for name, dtype in (("float32", jnp.float32), ("bf16", jnp.bfloat16)):
                xd = x.astype(dtype)
                row[f"{name}_dot_s"] = median_time(lambda w: dense(xd, w), copies[dtype], repeat)
            for impl in ("xla", "lut", "pallas"):
                f = jax.jit(lambda a, c, impl=impl: hq.matmul(a, c, implementation=impl))
                row[f"matmul_{impl}_s"] = median_time(lambda c: f(x, c), code_copies, repeat,
                                                      stream=False)
            out.append(row)
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
    return out


def plot(rows, base, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['lattice']} q={r['q']}" for r in rows]
    xs = np.arange(len(rows))
    for i, (key, name) in enumerate((("memory_bits", "in memory (Codes)"),
                                     ("packed_bits", "packed"))):
        ax.bar(xs + (i - 0.5) * 0.38, [r[key] for r in rows], 0.38, label=name)
    for name, style in (("bf16", "--"), ("int8_per_row", ":"), ("int4_g128", "-.")):
        ax.axhline(base[name], color="k", linestyle=style, linewidth=1, label=name)
    ax.set_xticks(xs, labels)
    ax.set_ylabel("bits per weight")
    ax.set_title("HNLQ (M=2) codes: bits per weight, row codes with float32 scales")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(base, rows, times) -> str:
    """Markdown tables of the results (written into docs/performance.md between markers)."""
    out = ["| format | bits per weight (1024 x 1024, row codes with float32 scales) |",
           "| --- | --- |"]
    out += [f"| {k} | {v:.3f} |" for k, v in base.items()]
    out += ["", "| HNLQ M=2 | in memory (Codes) | packed | wire (8 devices, reduce_scatter) |",
            "| --- | --- | --- | --- |"]
    out += [f"| {r['lattice']} q={r['q']} | {r['memory_bits']:.3f} | {r['packed_bits']:.3f} | "
            f"{r['wire_bits_sent']:.2f} bits sent per value: "
            f"{r['wire_ratio_vs_float32_allreduce']:.2f}x fewer than float32 |" for r in rows]
    out += ["", "| weight | batch | float32 dot | bf16 dot | matmul xla | matmul lut | "
            "matmul pallas (interpret) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    out += [f"| {t['lattice']} q=4 {t['rows']}x{t['cols']} | {t['batch']} | "
            + " | ".join(f"{1e3 * t[k]:.3g} ms" for k in ("float32_dot_s", "bf16_dot_s",
                                                          "matmul_xla_s", "matmul_lut_s",
                                                          "matmul_pallas_s")) + " |"
            for t in times]
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "code_bytes"))
    add_report_flag(p)
    a = p.parse_args()
    if a.report:
        res = load_results("code_bytes")
        write_between_markers(DOCS / "performance.md", "code_bytes",
                              table(res["baselines_bits"], res["sizes"], res["matmul_times"]))
        return
    W = np.random.default_rng(0).standard_normal((a.rows, a.cols)).astype(np.float32)
    base = baselines(W)
    rows = []
    for lattice in ("D4", "E8"):
        for q in (3, 4, 5):
            rows.append(sizes(W, lattice, q))
            r = rows[-1]
            print(f"{lattice} q={q}: memory {r['memory_bits']:.3f}  packed {r['packed_bits']:.3f}  "
                  f"wire ratio {r['wire_ratio_vs_float32_allreduce']:.2f}x", flush=True)
    times = timings(a.rows, a.cols, a.repeat)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"backend": jax.default_backend(), "jax": jax.__version__,
            "python": platform.python_version(), "rows": a.rows, "cols": a.cols,
            "repeat": a.repeat, "rotate_mb": ROTATE_MB}
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "baselines_bits": base, "sizes": rows, "matmul_times": times}, indent=2))
    plot(rows, base, out.with_suffix(".png"))
    md = table(base, rows, times)
    write_between_markers(DOCS / "performance.md", "code_bytes", md)
    print(md)


if __name__ == "__main__":
    main()

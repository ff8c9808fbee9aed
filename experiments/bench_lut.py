"""Lookup-table products versus decode-then-dot and a float32 dot, one process, on this machine.

GEMV and small-batch GEMM, y = x @ W^T with W of shape n x k = 4096 x 4096 (``--size``), iid
N(0,1) entries, D4 q=4 M=2 codes (beta calibrated on N(0,1)), batch 1, 8 and 64:

* ``lut.matmul_one_sided(codes_W, x)``: real activations, weights as codes (one-sided tables);
* ``lut.matmul(codes_x, codes_W)``: both coded (two-sided table); the time to encode x is
  listed separately;
* decode-then-dot: ``x @ decode(codes_W)^T`` per call (the weights stay codes);
* ``float32``: the dense float32 weight, ``jnp.einsum`` (XLA's best form for batch 1).

Reports best-of-``--repeat`` seconds, rows of x per second, the time ratio to the float32 dot,
the relative error to the exact float32 product, and the memory of each weight representation.
Writes ``results/bench_lut.json`` and prints a Markdown table.

Usage: ``python experiments/bench_lut.py [--size 4096] [--batches 1 8 64] [--repeat 3]``
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
from hnlq_jax import lut
from hnlq_jax.timing import best_time

RESULTS = pathlib.Path(__file__).parent / "results"


def memory(cfg, n, k, batch):
    nb = -(-k // cfg.d)
    packed = hq.pack(hq.Codes(jnp.zeros((1, cfg.M, cfg.d), jnp.uint8), jnp.zeros(1, jnp.int8)), cfg)
    per_block = packed.data.nbytes  # bits_per_block rounded to whole bytes for one block
    return {
        "float32 weight": 4 * n * k,
        "codes, unpacked (uint8 labels + int8 T)": n * nb * (cfg.M * cfg.d + 1),
        "codes, packed (pack(): labels bitstream + int8 T)": n * nb * per_block + n * nb,
        "two-sided table (int8, per process)": int(lut.two_sided(cfg).nbytes),
        "one-sided tables (float32, per call)": 4 * batch * nb * cfg.q**cfg.d,
    }


def run(size, batches, repeat):
    n = k = size
    cfg = hq.HNLQConfig("D4", 4, 2)
    rng = np.random.default_rng(0)
    beta, _ = hq.calibrate_beta(rng.standard_normal((4000, cfg.d)), cfg)
    cfg = cfg.replace(beta=beta)
    W = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    cW = hq.encode(hq.to_blocks(W, cfg.d), cfg)
    Wq = hq.decode(cW, cfg).reshape(n, k)

    one_sided = jax.jit(lambda c, x: lut.matmul_one_sided(c, x, cfg))
    two_sided = jax.jit(lambda cx, c: lut.matmul(cx, c, cfg))
    encode_x = jax.jit(lambda x: hq.encode(hq.to_blocks(x, cfg.d), cfg))
    decode_dot = jax.jit(
        lambda c, x: jnp.einsum("bk,nk->bn", x, hq.decode(c, cfg).reshape(n, k)))
    dense = jax.jit(lambda w, x: jnp.einsum("bk,nk->bn", x, w))

    rows = []
    for batch in batches:
        x = jnp.asarray(rng.standard_normal((batch, k)), jnp.float32)
        cx = encode_x(x)
        xq = hq.decode(cx, cfg).reshape(batch, k)
        exact_w = np.asarray(x, np.float64) @ np.asarray(Wq, np.float64).T
        exact_xw = np.asarray(xq, np.float64) @ np.asarray(Wq, np.float64).T
        results = {
            "matmul_one_sided (LUT)": (best_time(one_sided, cW, x, repeat=repeat),
                                       one_sided(cW, x), exact_w),
            "matmul two-sided (LUT)": (best_time(two_sided, cx, cW, repeat=repeat),
                                       two_sided(cx, cW), exact_xw),
            "decode-then-dot": (best_time(decode_dot, cW, x, repeat=repeat),
                                decode_dot(cW, x), exact_w),
            "float32 dot (dense W)": (best_time(dense, W, x, repeat=repeat), dense(W, x),
                                      np.asarray(x, np.float64) @ np.asarray(W, np.float64).T),
        }
        t_enc = best_time(encode_x, x, repeat=repeat)
        base = results["float32 dot (dense W)"][0]
        for method, (t, out, ref) in results.items():
            err = float(np.max(np.abs(np.asarray(out) - ref)) / np.max(np.abs(ref)))
            rows.append({"batch": batch, "method": method, "seconds": t, "rows_per_s": batch / t,
                         "time_vs_float32": t / base, "max_rel_err_vs_float64": err})
        rows.append({"batch": batch, "method": "encode x (for two-sided)", "seconds": t_enc,
                     "rows_per_s": batch / t_enc, "time_vs_float32": t_enc / base,
                     "max_rel_err_vs_float64": None})
    return cfg, rows, memory(cfg, n, k, max(batches))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cfg, rows, mem = run(args.size, args.batches, args.repeat)
    print(f"D4 q=4 M=2 (beta {cfg.beta:.4f}), n = k = {args.size}, {jax.default_backend()}, "
          f"{jax.device_count()} device(s)\n")
    print("| batch | method | time (ms) | rows/s | time / float32 dot | max rel. error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        err = "" if r["max_rel_err_vs_float64"] is None else f"{r['max_rel_err_vs_float64']:.1e}"
        print(f"| {r['batch']} | {r['method']} | {1e3 * r['seconds']:.2f} | "
              f"{r['rows_per_s']:.3g} | {r['time_vs_float32']:.1f}x | {err} |")
    print("\n| weight representation | bytes |\n|---|---|")
    for name, b in mem.items():
        print(f"| {name} | {b:,} |")
    RESULTS.mkdir(exist_ok=True)
    out = {"config": "D4 q=4 M=2", "beta": cfg.beta, "n": args.size, "k": args.size,
           "repeat": args.repeat, "backend": jax.default_backend(), "jax": jax.__version__,
           "machine": platform.machine(), "cpus": jax.device_count(), "rows": rows,
           "memory_bytes": mem}
    (RESULTS / "bench_lut.json").write_text(json.dumps(out, indent=1))
    print(f"\nwrote {RESULTS / 'bench_lut.json'}")


if __name__ == "__main__":
    main()

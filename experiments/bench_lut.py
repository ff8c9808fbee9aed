"""Lookup-table products versus decode-then-dot and a float32 dot, one process, on this machine.

GEMV and small-batch GEMM, y = x @ W^T with W of shape n x k = 4096 x 4096 (``--size``), iid
N(0,1) entries, D4 q=4 M=2 row codes (``hq.encode_rows``, the layers' weight format: beta =
``gaussian_beta`` times each row's RMS), batch 1, 8 and 64:

* ``lut.matmul_one_sided(codes_W, x)``: real activations, weights as codes (one-sided tables);
* ``lut.matmul(codes_x, codes_W)``: both coded (two-sided table; x as row codes too); the time
  to encode x is listed separately;
* each LUT product with its sums by the native kernel (``implementation="native"``, where it is
  built) and by XLA's gathers (``"xla"``);
* ``hq.matmul(x, codes_W)``: the front door with its default implementation;
* decode-then-dot: ``x @ decode(codes_W)^T`` per call (the weights stay codes);
* ``float32``: the dense float32 weight, ``jnp.einsum`` (XLA's best form for batch 1).

Every weight (float or codes) cycles through copies of ``--rotate-mb`` MiB (320, beyond any L3
here), as a model's layers read their own weights: the float32 dot, the native paths and the
front door are timed in 3 interleaved rounds (so that a slow spell of the shared machine falls
on all alike), medians of at least ``--repeat`` calls each; the compute-bound paths (XLA's
gathers, decode-then-dot) are medians of ``--repeat`` calls. Reports seconds, rows of x per
second, the time ratio to the float32 dot, the relative error to the exact float32 product, and
the memory of each weight representation.
Writes ``results/bench_lut.json``, prints a Markdown table and writes the tables into
``docs/performance.md``.

Usage: ``python experiments/bench_lut.py [--size 4096] [--batches 1 8 64] [--repeat 5]
[--rotate-mb 320]``;
``--report`` only rewrites the docs tables from ``results/bench_lut.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform

import jax
import jax.numpy as jnp
import numpy as np

import hnlq_jax as hq
from hnlq_jax import lut
from hnlq_jax.timing import ROTATE_MB, fresh_copies, interleaved, median_time, n_copies
from report import DOCS, add_report_flag, load_results, markdown_table, write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"


def memory(cW, batch):
    """Bytes of each representation of the weight (and of the tables the LUT paths use)."""
    cfg, (n, nb), k = cW.config, cW.blocks_shape, cW.n
    return {
        "float32 weight": 4 * n * k,
        "bf16 weight": 2 * n * k,
        "codes (Codes.nbytes: uint8 index, 4-bit T field, float32 row scales)": cW.nbytes,
        "packed (hq.pack: label bitstream, entropy-coded T, row scales)": hq.pack(cW).nbytes,
        "two-sided table (int8, per process)": int(lut.two_sided(cfg).nbytes),
        "one-sided tables (float32, per call)": 4 * batch * nb * cfg.q**cfg.d,
    }


ROUNDS = 3  # interleaved rounds of the streamed paths


def _copies(a, rotate_mb):
    """``a`` (an array or Codes) and fresh copies of it, :func:`n_copies` in all."""
    return fresh_copies(a, n_copies(sum(v.nbytes for v in jax.tree.leaves(a)), rotate_mb))


def run(size, batches, repeat, rotate_mb=ROTATE_MB):
    n = k = size
    cfg = hq.HNLQConfig("D4", 4, 2)
    cfg = cfg.replace(beta=hq.gaussian_beta(cfg))
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    cW = hq.encode_rows(W, cfg)
    Wq = hq.decode(cW)
    Ws, cWs = _copies(W, rotate_mb), _copies(cW, rotate_mb)

    impls = ("native", "xla") if hq.kernels.cpu.available() else ("xla",)
    one_sided = {i: jax.jit(lambda c, x, i=i: lut.matmul_one_sided(c, x, implementation=i))
                 for i in impls}
    two_sided = {i: jax.jit(lambda a, b, i=i: lut.matmul(a, b, implementation=i)) for i in impls}
    sums = {"native": "native sums", "xla": "XLA gathers"}
    front_door = jax.jit(lambda x, c: hq.matmul(x, c))
    encode_x = jax.jit(lambda x: hq.encode_rows(x, cfg))
    decode_dot = jax.jit(lambda c, x: jnp.einsum("bk,nk->bn", x, hq.decode(c)))
    dense = jax.jit(lambda w, x: jnp.einsum("bk,nk->bn", x, w))

    rows = []
    for batch in batches:
        x = jnp.asarray(rng.standard_normal((batch, k)), jnp.float32)
        cx = encode_x(x)
        xq = hq.decode(cx)
        exact_w = np.asarray(x, np.float64) @ np.asarray(Wq, np.float64).T
        exact_xw = np.asarray(xq, np.float64) @ np.asarray(Wq, np.float64).T
        # {method: (f(weight), its copies, the exact product, streamed)}: streamed where
        # memory-bound at small batches (native, the front door, the float dot), the others
        # compute-bound (XLA's gathers, decode-then-dot)
        paths = {}
        for i in impls:
            paths[f"matmul_one_sided (LUT, {sums[i]})"] = (
                lambda c, i=i: one_sided[i](c, x), cWs, exact_w, i == "native")
        for i in impls:
            paths[f"matmul two-sided (LUT, {sums[i]})"] = (
                lambda c, i=i: two_sided[i](cx, c), cWs, exact_xw, i == "native")
        paths["hq.matmul (default implementation)"] = (lambda c: front_door(x, c), cWs,
                                                       exact_w, True)
        paths["decode-then-dot"] = (lambda c: decode_dot(c, x), cWs, exact_w, False)
        paths["float32 dot (dense W)"] = (
            lambda w: dense(w, x), Ws, np.asarray(x, np.float64) @ np.asarray(W, np.float64).T,
            True)
        times = interleaved({m: (f, ws, {}) for m, (f, ws, _, s) in paths.items() if s},
                            repeat, ROUNDS)
        times |= {m: median_time(f, ws, repeat, stream=False)
                  for m, (f, ws, _, s) in paths.items() if not s}
        results = {m: (times[m], f(ws[0]), ref) for m, (f, ws, ref, _) in paths.items()}
        t_enc = median_time(encode_x, [x], repeat)
        base = results["float32 dot (dense W)"][0]
        for method, (t, out, ref) in results.items():
            err = float(np.max(np.abs(np.asarray(out) - ref)) / np.max(np.abs(ref)))
            rows.append({"batch": batch, "method": method, "seconds": t, "rows_per_s": batch / t,
                         "time_vs_float32": t / base, "max_rel_err_vs_float64": err})
        rows.append({"batch": batch, "method": "encode x (for two-sided)", "seconds": t_enc,
                     "rows_per_s": batch / t_enc, "time_vs_float32": t_enc / base,
                     "max_rel_err_vs_float64": None})
    return cfg, rows, memory(cW, max(batches))


def _cell(row: dict) -> str:
    t, ratio = row["seconds"], row["time_vs_float32"]
    return (f"{t:.3g} s" if t >= 1 else f"{1e3 * t:.3g} ms") + (
        f" ({ratio:.0f}×)" if ratio >= 10 else f" ({ratio:.2g}×)")


def table(res: dict) -> str:
    """The docs tables of a result dict: time per call (and ratio to the float32 dot) by batch
    and method; the bytes of each representation of the weight."""
    batches = list(dict.fromkeys(r["batch"] for r in res["rows"]))
    methods = list(dict.fromkeys(r["method"] for r in res["rows"]))
    cell = {(r["batch"], r["method"]): r for r in res["rows"]}
    times = markdown_table(
        ["batch"] + [f"`{m}`" if m.startswith("matmul") else m for m in methods],
        [[b] + [_cell(cell[b, m]) for m in methods] for b in batches])
    weights = res["n"] * res["k"]
    memory = markdown_table(
        ["weight representation", "MiB", "bits per weight"],
        [[name + (f", batch {max(batches)}" if "per call" in name else ""),
          f"{b / 2**20:.3g}", "" if "table" in name else f"{8 * b / weights:.2f}"]
         for name, b in res["memory_bytes"].items()])
    caption = (f"y = x @ Wᵀ, W {res['n']} × {res['k']}, {res['config']} {res['weights']}, "
               f"β = {res['beta_relative_to_row_rms']:.4f} × row RMS, {res['backend']}; "
               "median time per call (time / float32 dot), each weight cycling through "
               f"{res['rotate_mb']:.0f} MiB of copies:")
    return f"{caption}\n\n{times}\n\n{memory}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rotate-mb", type=float, default=ROTATE_MB)
    add_report_flag(ap)
    args = ap.parse_args()
    if args.report:
        out = load_results("bench_lut")
    else:
        cfg, rows, mem = run(args.size, args.batches, args.repeat, args.rotate_mb)
        RESULTS.mkdir(exist_ok=True)
        out = {"config": "D4 q=4 M=2", "weights": "row codes (hq.encode_rows)",
               "beta_relative_to_row_rms": cfg.beta, "n": args.size, "k": args.size,
               "repeat": args.repeat, "rotate_mb": args.rotate_mb,
               "backend": jax.default_backend(), "jax": jax.__version__,
               "machine": platform.machine(), "cpus": os.cpu_count(),
               "devices": jax.device_count(), "rows": rows,
               "memory_bytes": mem}
        (RESULTS / "bench_lut.json").write_text(json.dumps(out, indent=1))
        print(f"wrote {RESULTS / 'bench_lut.json'}\n")
    text = table(out)
    print(text)
    write_between_markers(DOCS / "performance.md", "bench_lut", text)


if __name__ == "__main__":
    main()

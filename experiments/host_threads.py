"""How the torch layers' direct kernel calls should run (threads, route), measured where they run.

A ``QuantizedLinear`` on CPU tensors calls the native kernels directly (no XLA), with threads of
their own. In a model each call follows torch's own operations, whose OpenMP workers keep
spinning on the other cores for a while after a parallel region: a second thread of ours then
competes with them for a core. This script times a layer's fused product (below
``GEMM_ROWS`` activation rows) and a rotated layer's input rotation on one thread and on
torch's threads, both right after a torch GEMM (as in a model) and alone (the same call
repeated, as the micro-benchmarks run it), in interleaved rounds; and, after a torch GEMM, the
layer's two routes for a batch of rows: the fused product against the decoded weight in torch's
GEMM. The library's thresholds (``torch_bridge.ops.MATMUL_ONE_THREAD`` weights x rows,
``ROTATE_ONE_THREAD`` values, ``GEMM_ROWS`` rows) are read off these tables.

Writes ``results/host_threads.json`` and the table in ``docs/performance.md``. Usage:
``python experiments/host_threads.py [--repeat 30]``; ``--report`` only rewrites the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

import hnlq_jax as hq
import torch_bridge as tb
from hnlq_jax.buckets import row_bucket
from bench_cpu_matmul import config
from report import DOCS, RESULTS, add_report_flag, load_results, markdown_table, \
    write_between_markers

MATMULS = [(384, 384), (1536, 384), (1024, 1024), (2048, 2048), (4096, 4096)]  # [n_out, k]
MATMUL_ROWS = [1, 10, 64]  # the fused product at each (GEMM_ROWS held above them)
ROTATIONS = [(384, 64), (384, 640), (1536, 640), (384, 10240), (1536, 5120)]  # (n, rows)
POLICIES = {"one thread": 1 << 62, "torch's threads": 0}  # the threshold each policy sets
ROUTE_SHAPES = [(384, 384), (1536, 384), (384, 1536), (1024, 1024), (4096, 4096)]
ROUTE_ROWS = [16, 32, 40, 48, 64, 96]
ROUTES = {"fused": 1 << 62, "decoded + torch GEMM": 1}  # the GEMM_ROWS each route sets


def measure(call, threshold_name, repeat, choices=POLICIES, wheres=("after GEMM", "alone"),
            rounds=3):
    """``{where: {choice: median seconds}}`` of ``call()`` (the call alone is timed; ``where``
    "after GEMM" or "alone") with the threshold ``torch_bridge.ops.<threshold_name>`` set to
    each choice's value, in ``rounds`` interleaved rounds of ``repeat`` calls each."""
    a, b = torch.randn(600, 384), torch.randn(384, 384)
    saved = getattr(tb.ops, threshold_name)
    samples = {where: {p: [] for p in choices} for where in wheres}
    try:
        with torch.no_grad():
            for _ in range(rounds):
                for where, times in samples.items():
                    for policy, value in choices.items():
                        setattr(tb.ops, threshold_name, value)
                        call()  # warm-up
                        for _ in range(repeat):
                            if where == "after GEMM":
                                torch.addmm(a, a, b)  # torch's OpenMP workers left spinning
                            start = time.perf_counter()
                            call()
                            times[policy].append(time.perf_counter() - start)
    finally:
        setattr(tb.ops, threshold_name, saved)
    return {where: {p: float(np.median(v)) for p, v in times.items()}
            for where, times in samples.items()}


def bench(repeat):
    rng = np.random.default_rng(0)
    rows = []
    for n_out, k in MATMULS:
        linear = torch.nn.Linear(k, n_out, bias=False)
        layer = tb.QuantizedLinear.from_linear(linear, config("D4"), calibrate=False)
        for r in MATMUL_ROWS:
            x = torch.from_numpy(rng.standard_normal((r, k)).astype(np.float32))
            saved, tb.ops.GEMM_ROWS = tb.ops.GEMM_ROWS, 1 << 62
            try:
                rows.append({"op": "matmul", "shape": f"{n_out} x {k}", "rows": r,
                             "work": n_out * k * r,
                             **measure(lambda: layer(x), "MATMUL_ONE_THREAD", repeat)})
            finally:
                tb.ops.GEMM_ROWS = saved
            print(json.dumps(rows[-1]), flush=True)
    for n, r in ROTATIONS:
        x = torch.from_numpy(rng.standard_normal((r, n)).astype(np.float32))
        rows.append({"op": "rotate", "shape": f"{n}", "rows": r, "work": n * r,
                     **measure(lambda: tb.ops.rotate_direct(x, n, 0, False),
                               "ROTATE_ONE_THREAD", repeat)})
        print(json.dumps(rows[-1]), flush=True)
    routes = []
    for n_out, k in ROUTE_SHAPES:
        linear = torch.nn.Linear(k, n_out, bias=False)
        layer = tb.QuantizedLinear.from_linear(linear, config("D4"), calibrate=False)
        for r in ROUTE_ROWS:
            x = torch.from_numpy(rng.standard_normal((r, k)).astype(np.float32))
            routes.append({"shape": f"{n_out} x {k}", "rows": r, **measure(
                lambda: layer(x), "GEMM_ROWS", max(3, repeat // 4 if n_out * k > 2**22
                                                 else repeat), ROUTES, ("after GEMM",))})
            print(json.dumps(routes[-1]), flush=True)
    return {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                       f"torch {torch.__version__}, native kernel "
                       + (f"built ({hq.kernels.cpu.isa()})" if hq.kernels.cpu.available()
                          else "not built"),
            "repeat": repeat, "matmul_one_thread": tb.ops.MATMUL_ONE_THREAD,
            "rotate_one_thread": tb.ops.ROTATE_ONE_THREAD, "gemm_rows": tb.ops.GEMM_ROWS,
            "rows": rows, "routes": routes}


def table(res) -> str:
    out = []
    for r in res["rows"]:
        limit = res["matmul_one_thread"] if r["op"] == "matmul" else res["rotate_one_thread"]
        cells = [r["op"], r["shape"], r["rows"], f"{r['work']:,}"]
        for where in ("after GEMM", "alone"):
            one, many = r[where]["one thread"], r[where]["torch's threads"]
            cells += [f"{one * 1e3:.3f} ms", f"{many * 1e3:.3f} ms ({many / one:.2f}x)"]
        cells.append("one thread" if r["work"] < limit else "torch's threads")
        out.append(cells)
    return markdown_table(
        ["call", "weight / width", "rows", "work", "after a GEMM: 1 thread", "torch's threads",
         "alone: 1 thread", "torch's threads", "the layer uses"], out) + (
        f"\n\nMedians of {res['repeat']} calls in each of 3 interleaved rounds; {res['machine']}."
        f" Work: weights x rows (the fused product, D4 q=4 M=2) or values (the rotation); "
        f"one thread below {res['matmul_one_thread']:,} and {res['rotate_one_thread']:,}."
        ) + "\n\n" + route_table(res)


def route_table(res) -> str:
    out = []
    for r in res["routes"]:
        fused, gemm = (r["after GEMM"][k] for k in ROUTES)
        out.append([r["shape"], r["rows"], f"{fused * 1e3:.3f} ms",
                    f"{gemm * 1e3:.3f} ms ({gemm / fused:.2f}x)",
                    "decoded + torch GEMM" if row_bucket(r["rows"]) >= res["gemm_rows"]
                    else "fused"])
    return markdown_table(["weight", "rows", "fused product", "decoded + torch GEMM",
                           "the layer takes"], out) + (
        f"\n\nAfter a torch GEMM, as in a model; the layer decodes from {res['gemm_rows']} rows "
        "of the row bucket (`torch_bridge.ops.GEMM_ROWS`).")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=30)
    add_report_flag(parser)
    args = parser.parse_args()
    if not args.report:
        if not hq.kernels.cpu.available():
            raise SystemExit("host_threads: the native kernels are not built")
        (RESULTS / "host_threads.json").write_text(json.dumps(bench(args.repeat), indent=1))
    text = table(load_results("host_threads"))
    print(text)
    write_between_markers(DOCS / "performance.md", "host_threads", text)


if __name__ == "__main__":
    main()

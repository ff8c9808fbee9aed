"""First-call and steady-state latency of eager encode + decode over 20 batch sizes.

Eager calls pad their flat batch to a shape bucket (``hnlq_jax.ops.bucket``: the next power of
two, at least 1024), so a stream of different batch sizes compiles O(log n) programs instead of
one per size. For each of 20 batch sizes (drawn once, 100..100,000 vectors, D4 q=4 M=2) this
times the first call (including any compile) and the best of 3 later calls, and counts the
compiled programs. Writes ``experiments/results/compile_buckets.json`` and the table into
``docs/performance.md``.

Usage: ``python experiments/compile_buckets.py``; ``--report`` only rewrites the docs table from
``results/compile_buckets.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

import hnlq_jax as hq
from hnlq_jax import ops
from report import DOCS, add_report_flag, load_results, markdown_table, write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"


def _call(x, cfg):
    return jax.block_until_ready(hq.decode(hq.encode(x, cfg)))


def table(res: dict) -> str:
    """The docs table of a result dict: one row per batch size, then the program count."""
    rows = [[f"{r['n']:,}", f"{r['bucket']:,}", f"{r['first_s']:.2f} s",
             f"{1e3 * r['steady_s']:.2f} ms"] for r in res["rows"]]
    return markdown_table(["batch size", "bucket", "first call", "steady (best of 3)"], rows) + (
        f"\n\n{res['batch_sizes']} batch sizes, {res['buckets']} buckets: "
        f"{res['encode_programs']} encode and {res['decode_programs']} decode programs compiled "
        f"({res['backend']}, jax {res['jax']}).")


def run() -> dict:
    """Times every batch size; writes and returns the result dict."""
    cfg = hq.HNLQConfig("D4", 4, 2)
    cfg = cfg.replace(beta=hq.gaussian_beta(cfg))
    sizes = sorted({int(n) for n in np.geomspace(100, 100_000, 20).round()})
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        x = rng.standard_normal((n, 4)).astype(np.float32)
        t = time.perf_counter()
        _call(x, cfg)
        first = time.perf_counter() - t
        steady = min(_timed(_call, x, cfg) for _ in range(3))
        rows.append({"n": n, "bucket": ops.bucket(n), "first_s": first, "steady_s": steady})
        print(f"n={n:>7,} bucket={ops.bucket(n):>7,} first {first:.3f} s steady {steady:.4f} s",
              flush=True)
    out = {
        "config": str(cfg), "backend": jax.default_backend(), "jax": jax.__version__,
        "rows": rows, "batch_sizes": len(sizes),
        "buckets": len({r["bucket"] for r in rows}),
        "encode_programs": ops._encode_bucket._cache_size(),
        "decode_programs": ops._decode._cache_size(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compile_buckets.json").write_text(json.dumps(out, indent=2))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_report_flag(p)
    args = p.parse_args()
    text = table(load_results("compile_buckets") if args.report else run())
    print(text)
    write_between_markers(DOCS / "performance.md", "compile_buckets", text)


def _timed(fn, *args):
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()

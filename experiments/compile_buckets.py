"""First-call and steady-state latency of eager encode + decode over 20 batch sizes.

Eager calls pad their flat batch to a shape bucket (``hnlq_jax.ops.bucket``: the next power of
two, at least 1024), so a stream of different batch sizes compiles O(log n) programs instead of
one per size. For each of 20 batch sizes (drawn once, 100..100,000 vectors, D4 q=4 M=2) this
times the first call (including any compile) and the best of 3 later calls, and counts the
compiled programs. Writes ``experiments/results/compile_buckets.json``.

Usage: ``python experiments/compile_buckets.py``
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import numpy as np

import hnlq_jax as hq
from hnlq_jax import ops

RESULTS = pathlib.Path(__file__).parent / "results"


def _call(x, cfg):
    return jax.block_until_ready(hq.decode(hq.encode(x, cfg)))


def main():
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
    print(f"{out['batch_sizes']} batch sizes -> {out['buckets']} buckets, "
          f"{out['encode_programs']} encode / {out['decode_programs']} decode programs")


def _timed(fn, *args):
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()

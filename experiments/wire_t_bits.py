"""Bits of the wire format's T stream against the entropy of T, across a chunk's RMS window.

The wire format (:mod:`hnlq_jax.wire`, version 2) codes a chunk's T as one flag bit per block
and unary codes of the flagged blocks' T: ``1 + E[T]`` bits per block, against ``H(T)`` for an
ideal entropy coder (``pack``'s stream comes within about 0.03 of it). A chunk's power-of-two
scale leaves its RMS anywhere in ``[0.71, 1.41)``, and its stream must fit a fixed capacity
(``wire.default_t_capacity``: ``1.25 + d/4`` bits per block). For iid Gaussian chunks of 256
blocks at the calibrated beta, scaled to the bottom, middle and top of that window, this reports
H(T), the stream's mean and largest bits per block over the chunks, and the share of chunks
over the capacity (which the rate control would encode again at twice the scale).

Usage: ``python experiments/wire_t_bits.py [--chunks 64]`` (under a minute after the beta
searches); ``--report`` only rewrites the docs table from ``results/wire_t_bits.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import hnlq_jax as hq  # noqa: E402
from hnlq_jax import wire  # noqa: E402
from report import (DOCS, RESULTS, add_report_flag, load_results, markdown_table,  # noqa: E402
                    write_between_markers)

CONFIGS = [("Z2", 4, 2), ("A2", 4, 2), ("D4", 4, 1), ("D4", 4, 2), ("D4", 3, 2), ("E8", 4, 2)]
RMS = (0.71, 1.0, 1.41)


def measure(chunks: int) -> list:
    rng = np.random.default_rng(0)
    rows = []
    for lattice, q, M in CONFIGS:
        cfg = hq.HNLQConfig(lattice, q, M)
        cfg = cfg.replace(beta=hq.gaussian_beta(cfg))
        capacity = wire.default_t_capacity(cfg)
        for r in RMS:
            x = (r * rng.standard_normal((chunks * wire.CHUNK, cfg.d))).astype(np.float32)
            T = np.asarray(hq.encode(x, cfg).T).reshape(chunks, wire.CHUNK)
            v = np.where(T < 0, cfg.max_T + 1, T)  # a failed block's symbol
            bits = 1 + v.mean(axis=1)  # per block, per chunk
            p = np.bincount(v.reshape(-1)) / v.size
            rows.append({"config": f"{lattice} q={q} M={M}", "rms": r,
                         "entropy": float(-np.sum(p[p > 0] * np.log2(p[p > 0]))),
                         "mean_bits": float(bits.mean()), "max_bits": float(bits.max()),
                         "capacity": capacity, "over": float(np.mean(bits > capacity))})
        print(lattice, q, M, "done", flush=True)
    return rows


def table(res: dict) -> str:
    rows = [[r["config"], f"{r['rms']:.2f}", f"{r['entropy']:.2f}", f"{r['mean_bits']:.2f}",
             f"{r['max_bits']:.2f}", f"{r['capacity']:.2f}", f"{100 * r['over']:.0f} %"]
            for r in res["rows"]]
    return (f"{res['chunks']} Gaussian chunks of {wire.CHUNK} blocks per row, calibrated beta; "
            "bits per block:\n\n" + markdown_table(
                ["config", "chunk RMS", "H(T)", "wire T stream (mean)", "largest chunk",
                 "capacity", "chunks over capacity"], rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=64)
    add_report_flag(p)
    args = p.parse_args(argv)
    if args.report:
        res = load_results("wire_t_bits")
    else:
        res = {"chunks": args.chunks, "jax": jax.__version__, "rows": measure(args.chunks)}
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "wire_t_bits.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    print(text)
    write_between_markers(DOCS / "performance.md", "wire_t_bits", text)


if __name__ == "__main__":
    main()

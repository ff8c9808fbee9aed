"""Where an encode spends its time: the stages of the XLA encoder, timed one by one.

For D4 and E8 (q=4, M=2, beta calibrated on Gaussian data) on one chunk of 2^15 iid N(0,1)
blocks (the size the encoder works in; larger inputs are a ``lax.map`` over such chunks), times
in one process (best of ``--repeat``):

* ``level 0``: the nearest point of the scaled input (float, the tie rule on exact ties);
* ``one attempt``: a whole Algorithm 1 pass at one scale for every block (level 0, the M - 1
  inner levels on integer coordinates, the labels and the overload test);
* ``search``: the whole overload search (every block until it fits), what ``encode`` runs;
* ``encode``: the front door (search + codebook index + 4-bit T field + ``Codes``);

and reports the share of blocks that each rescaling step sees (``T - t0`` histogram: t0 is the
norm-based lower bound every block starts from), the work of the search in units of one
attempt over all blocks, the GPU encode kernel's work in attempts a block (its tiles' loops
run as long as their slowest block: one pass, or two as ``kernels.encode`` runs them), and
the optimized HLO's size (fusions and instructions) of one
attempt, and the time XLA takes to compile the search for one chunk (the encoder's compile cost:
a first call per shape bucket pays it). Writes ``experiments/results/profile_encode.json`` and
the table into ``docs/performance.md``.

Usage: ``python experiments/profile_encode.py [--repeat 9]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import hnlq_jax as hq
from hnlq_jax import codec
from hnlq_jax.lattices import nearest_float
from hnlq_jax.timing import best_time
from report import DOCS, add_report_flag, load_results, write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"
N = 2**15


def hlo_size(fn, *args) -> dict:
    """Fusions and instructions in the optimized HLO of ``fn(*args)``."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {"fusions": len(re.findall(r"^\s*\S+ = \S+ fusion\(", text, re.M)),
            "instructions": len(re.findall(r"^\s*(ROOT )?%?\S+ = ", text, re.M))}


def compile_seconds(fn, *args) -> float:
    """Seconds to lower and compile ``fn(*args)``, from no cache (in memory or on disk)."""
    jax.config.update("jax_enable_compilation_cache", False)
    jax.clear_caches()
    t = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t


def profile(name: str, repeat: int) -> dict:
    cfg = hq.HNLQConfig(name, 4, 2)
    beta = hq.gaussian_beta(cfg)
    cfg = cfg.replace(beta=beta)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((N, cfg.d)), jnp.float32)
    xt = x.T

    def level0(xt):
        return nearest_float([xt[j] / beta for j in range(cfg.d)], cfg.lat)

    def attempt(xt):
        return codec.encode_at([xt[j] / beta for j in range(cfg.d)], cfg)

    def search(x):
        return codec.encode_blocks(x, cfg, beta)

    def front(x):
        return hq.encode(x, cfg)

    times = {k: best_time(jax.jit(f), a, repeat=repeat) for k, f, a in (
        ("level 0", level0, xt), ("one attempt", attempt, xt), ("search", search, x),
        ("encode", front, x))}
    _, T = codec.encode_blocks(x, cfg, beta)
    _, thresholds = codec.scale_tables(cfg, beta, jnp.float32)
    t0 = np.searchsorted(np.asarray(thresholds), np.linalg.norm(np.asarray(x), axis=1))
    steps = np.bincount(np.asarray(T) - t0)
    # Blocks still unresolved before step k (k = 0 is the first attempt, over all blocks).
    unresolved = [int(steps[k:].sum()) for k in range(len(steps))]
    attempts = np.asarray(T) - t0 + 1
    return {
        "lattice": name, "q": 4, "M": 2, "beta": beta, "n": N,
        "seconds": times,
        "vec_per_s": {k: N / v for k, v in times.items()},
        "steps_histogram": steps.tolist(),
        "unresolved_before_step": unresolved,
        "ideal_attempts": sum(unresolved) / N,
        "search_in_attempts": times["search"] / times["one attempt"],
        "kernel_attempts": kernel_attempts(attempts),
        "hlo_one_attempt": hlo_size(attempt, xt),
        "compile_search_s": compile_seconds(search, x),
    }


def kernel_attempts(attempts, tile: int = 256) -> dict:
    """The GPU encode kernel's work in attempts a block (a tile's loop runs as long as its
    slowest block): one pass over all blocks, and one attempt over all then the loop over the
    blocks left, in order, a tile at a time (``kernels.encode``; the last tile's empty slots
    try nothing)."""
    n = attempts.size
    one = np.max(attempts.reshape(-1, tile), axis=1).sum() * tile / n
    left = attempts[attempts > 1] - 1
    buf = np.zeros(-(-left.size // tile) * tile, np.int64)
    buf[:left.size] = left
    two = 1 + np.max(buf.reshape(-1, tile), axis=1).sum() * tile / n
    return {"tile": tile, "one_pass": float(one), "two_passes": float(two)}


def table(rows) -> str:
    lines = ["| lattice | level 0 | one attempt | search (= attempts) | encode | ideal attempts "
             "| blocks per step (% of N) | GPU kernel, tiles of 256: one pass / two passes "
             "| HLO of one attempt | compile of the search |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = {k: f"{1e3 * v:.2f} ms" for k, v in r["seconds"].items()}
        share = " / ".join(f"{100 * u / r['n']:.1f}" for u in r["unresolved_before_step"])
        h = r["hlo_one_attempt"]
        lines.append(f"| {r['lattice']} q=4 M=2 | {t['level 0']} | {t['one attempt']} | "
                     f"{t['search']} ({r['search_in_attempts']:.1f}) | {t['encode']} "
                     f"({r['vec_per_s']['encode']:.3g} vec/s) | {r['ideal_attempts']:.2f} | "
                     f"{share} | {r['kernel_attempts']['one_pass']:.2f} / "
                     f"{r['kernel_attempts']['two_passes']:.2f} attempts | "
                     f"{h['fusions']} fusions, {h['instructions']} instructions | "
                     f"{r['compile_search_s']:.1f} s |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=9)
    add_report_flag(p)
    a = p.parse_args()
    if a.report:
        write_between_markers(DOCS / "performance.md", "profile_encode",
                              table(load_results("profile_encode")["rows"]))
        return
    rows = [profile(name, a.repeat) for name in ("D4", "E8")]
    meta = {"backend": jax.default_backend(), "jax": jax.__version__,
            "cpu_count": __import__("os").cpu_count(), "chunk_blocks": N}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "profile_encode.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                            indent=2))
    text = table(rows)
    write_between_markers(DOCS / "performance.md", "profile_encode", text)
    print(text)


if __name__ == "__main__":
    main()

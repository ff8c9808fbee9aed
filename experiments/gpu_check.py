"""The kernels on a real GPU: native tests, then the benchmarks of issue 4's targets.

1. ``pytest tests/test_kernels.py``: on a GPU the kernels run natively (``interpret=None``
   means compiled there), so the bit-exactness tests compare compiled Triton kernels with XLA.
2. encode and decode of N D4 vectors (q=4, M=2): effective bandwidth (bytes in + bytes out over
   time) against the device's HBM peak; target >= 50 % for N >= 1e8.
3. the fused decode-matmul for a 8192 x 8192 D4 q=4 M=2 weight at batch 1-16, bfloat16
   activations, against a bfloat16 ``jnp.dot`` with the dense weight; target faster (goal 2x).
4. every op of ``bench_kernels.py`` (XLA versus the kernel) at GPU sizes.

Prints a Markdown table and writes ``results/gpu_check.json`` and ``results/gpu_check.md``
(copy the latter into ``docs/gpu.md``). Without a GPU it stops with exit status 2 unless
``--allow-cpu`` (a smoke run at tiny sizes, interpret mode).

Usage: ``python experiments/gpu_check.py [--n 100000000] [--allow-cpu] [--skip-tests]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import hnlq_jax as hq
from hnlq_jax import kernels
from hnlq_jax.timing import best_time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_kernels  # noqa: E402  (the shared cases, next to this file)

RESULTS = pathlib.Path(__file__).parent / "results"
ROOT = pathlib.Path(__file__).parent.parent
# HBM peak by device kind (vendor figures, bytes/s); unknown devices report no roofline.
HBM_PEAK = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "H100": 3.35e12}


def peak_bandwidth(kind: str):
    for name, bw in HBM_PEAK.items():
        if name in kind:
            return bw
    return None


def run_tests():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist",
                        "tests/test_kernels.py"], cwd=ROOT, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
    return {"returncode": r.returncode, "summary": tail}


def codec_bandwidth(cfg, n, repeat):
    """encode and decode of n blocks in chunks that fit memory; GB/s of bytes in + out."""
    d = cfg.d
    x = jax.random.normal(jax.random.key(0), (n, d), jnp.float32)
    enc = jax.jit(lambda v: kernels.encode(v, cfg, implementation="pallas"))
    codes = enc(x)
    dec = jax.jit(lambda c: kernels.decode(c, cfg, implementation="pallas"))
    enc_x = jax.jit(lambda v: kernels.encode(v, cfg, implementation="xla"))
    dec_x = jax.jit(lambda c: kernels.decode(c, cfg, implementation="xla"))
    nbytes = n * (4 * d + cfg.M * d + 1)
    rows = []
    for op, f, arg in (("encode", enc, x), ("encode", enc_x, x), ("decode", dec, codes),
                       ("decode", dec_x, codes)):
        t = best_time(f, arg, repeat=repeat)
        rows.append({"op": op, "implementation": "pallas" if f in (enc, dec) else "xla", "N": n,
                     "seconds": t, "GBps": nbytes / t / 1e9})
    return rows


def matmul_vs_bf16(cfg, size, batches, repeat):
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.standard_normal((size, size)), jnp.float32)
    cW = hq.encode(hq.to_blocks(W, cfg.d), cfg)
    Wb = hq.from_blocks(hq.decode(cW, cfg), size).astype(jnp.bfloat16)
    fused = jax.jit(lambda x, c: kernels.decode_matmul(x, c, cfg, implementation="pallas"))
    dense = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
    rows = []
    for b in batches:
        x = jnp.asarray(rng.standard_normal((b, size)), jnp.bfloat16)
        t_fused = best_time(fused, x, cW, repeat=repeat)
        t_dense = best_time(dense, x, Wb, repeat=repeat)
        err = float(jnp.max(jnp.abs(fused(x, cW).astype(jnp.float32) - dense(x, Wb)))
                    / jnp.max(jnp.abs(dense(x, Wb))))
        rows.append({"batch": b, "fused_s": t_fused, "bf16_dot_s": t_dense,
                     "speedup": t_dense / t_fused, "rel_diff": err})
    return rows


def markdown(env, tests, bw, mm, ops, peak):
    lines = [f"Device: {env['device']} ({env['backend']}); jax {env['jax']}; "
             f"Python {env['python']}.", ""]
    if tests:
        lines += [f"`pytest tests/test_kernels.py` natively: {' '.join(tests['summary'])}", ""]
    lines += ["| op | implementation | N | time | GB/s | % of HBM peak |", "|---|---|---|---|---|---|"]
    for r in bw:
        pct = f"{100 * r['GBps'] * 1e9 / peak:.0f} %" if peak else "n/a"
        lines.append(f"| {r['op']} | {r['implementation']} | {r['N']:.0e} | "
                     f"{r['seconds'] * 1e3:.2f} ms | {r['GBps']:.1f} | {pct} |")
    lines += ["", "| decode_matmul batch | fused (codes) | bf16 dot (dense) | speedup | rel. diff |",
              "|---|---|---|---|---|"]
    for r in mm:
        lines.append(f"| {r['batch']} | {r['fused_s'] * 1e6:.0f} µs | {r['bf16_dot_s'] * 1e6:.0f} µs"
                     f" | {r['speedup']:.2f}x | {r['rel_diff']:.1e} |")
    lines += ["", bench_kernels.table(ops)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10**8, help="vectors for encode/decode bandwidth")
    p.add_argument("--size", type=int, default=8192, help="decode_matmul weight size")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without a GPU")
    p.add_argument("--skip-tests", action="store_true")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        if not args.allow_cpu:
            print(f"gpu_check: no GPU (backend {jax.default_backend()!r}); run it on a GPU "
                  "machine, or pass --allow-cpu for a smoke run", file=sys.stderr)
            return 2
        args.n, args.size, args.repeat = 4096, 256, 1
    env = bench_kernels.environment()
    peak = peak_bandwidth(env["device"])
    cfg = bench_kernels.config()
    tests = None if args.skip_tests else run_tests()
    bw = codec_bandwidth(cfg, args.n, args.repeat)
    mm = matmul_vs_bf16(cfg, args.size, (1, 2, 4, 8, 16), args.repeat)
    scale = 1 if args.allow_cpu else 16
    ops = [bench_kernels.measure(c, args.repeat, cfg)
           for c in bench_kernels.cases(cfg, 2**16 * scale, 512 * scale, (1, 16), jnp.bfloat16)]
    out = {"environment": env, "hbm_peak_Bps": peak, "tests": tests, "bandwidth": bw,
           "decode_matmul_vs_bf16": mm, "ops": ops}
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if jax.default_backend() == "gpu" else "_cpu_smoke"
    (RESULTS / f"gpu_check{suffix}.json").write_text(json.dumps(out, indent=1))
    md = markdown(env, tests, bw, mm, ops, peak)
    (RESULTS / f"gpu_check{suffix}.md").write_text(md + "\n")
    print(md)
    return 0 if tests is None or tests["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

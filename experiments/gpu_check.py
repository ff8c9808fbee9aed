"""The kernels on a real GPU: native tests, then the benchmarks the kernels are built for.

1. ``pytest tests/test_kernels.py`` (or the files ``--tests`` names): on a GPU the kernels run
   natively (``interpret=None`` means compiled there), so the bit-exactness tests compare
   compiled Triton kernels with XLA, and the golden tests hold XLA on the GPU to the reference.
2. encode and decode of N D4 vectors (q=4, M=2) through the front doors: effective bandwidth
   (bytes in + bytes out, the codes as stored, over time) against the device's HBM peak.
3. the codebook in the decode kernel, a gathered table against computing it from the digits
   (``use_table=``), for D4 q=4 (a 4 KiB table) and E8 q=4 (2 MiB).
4. ``hq.matmul`` of row codes (D4 q=4 M=2) with bfloat16 activations at 4096^2 and 8192^2,
   batch 1, 8 and 32: the fused decode-matmul kernel against a bfloat16 ``jnp.dot`` with the
   dense weight and against decode-then-dot (``implementation="xla"``); goal >= 2x the bfloat16
   dot at batch 1, 8192^2.
5. every op of ``bench_kernels.py`` (XLA versus the kernel) at GPU sizes.

Prints a Markdown table and writes ``results/gpu_check.json`` (after every part, so a run cut
off keeps what it measured) and ``results/gpu_check.md`` (copy it into ``docs/gpu.md``). A part
that fails is recorded and the run goes on; the exit status is then 1. Without a GPU it stops with exit status 2 unless
``--allow-cpu`` (a smoke run at tiny sizes, interpret mode).

Usage: ``python experiments/gpu_check.py [--n 100000000] [--allow-cpu] [--skip-tests]
[--tests FILE ...]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import traceback

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


def pytest_command(*targets: str) -> list:
    """The pytest command line run from the repository root. ``-n 0`` (not ``-p no:xdist``):
    the project's pytest options carry xdist's ``-n auto``, which needs the plugin loaded."""
    return [sys.executable, "-m", "pytest", "-q", "-n", "0",
            *(targets or ("tests/test_kernels.py",))]


def run_tests(targets):
    r = subprocess.run(pytest_command(*targets), cwd=ROOT, capture_output=True, text=True)
    lines = (r.stdout + r.stderr).strip().splitlines()
    # the failures' short summary (pytest's last lines) says what broke
    return {"targets": list(targets), "returncode": r.returncode, "summary": lines[-15:]}


def section(out, name, f, *args):
    """Runs one part of the check into ``out[name]``. A part that raises is recorded under
    ``out["errors"]`` (and its traceback printed) so that it does not lose the parts after it:
    a lease on a GPU is short, and a first run on a new device is when parts break."""
    try:
        out[name] = f(*args)
    except Exception as e:  # noqa: BLE001  (reported, not handled)
        traceback.print_exc()
        out[name] = None
        out.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]


def codec_bandwidth(cfg, n, repeat):
    """encode and decode of n blocks through the front doors; GB/s of bytes in + out."""
    x = jax.random.normal(jax.random.key(0), (n, cfg.d), jnp.float32)
    rows = []
    for impl in ("pallas", "xla"):
        enc = jax.jit(lambda v, impl=impl: hq.encode(v, cfg, implementation=impl))
        dec = jax.jit(lambda c, impl=impl: hq.decode(c, implementation=impl))
        codes = enc(x)
        nbytes = x.nbytes + codes.nbytes
        for op, f, arg in (("encode", enc, x), ("decode", dec, codes)):
            t = best_time(f, arg, repeat=repeat)
            rows.append({"op": op, "implementation": impl, "N": n, "seconds": t,
                         "GBps": nbytes / t / 1e9})
    return rows


def codebook_choice(n, repeat):
    """The decode kernel with the codebook gathered from a table or computed from the digits."""
    rows = []
    for lattice in ("D4", "E8"):
        cfg = hq.HNLQConfig(lattice, 4, 2)
        cfg = cfg.replace(beta=hq.gaussian_beta(cfg))
        nb = n * 4 // cfg.d  # the same number of values
        x = jax.random.normal(jax.random.key(1), (nb, cfg.d), jnp.float32)
        codes = jax.jit(lambda v, cfg=cfg: hq.encode(v, cfg, implementation="pallas"))(x)
        for use_table in (True, False):
            f = jax.jit(lambda c, t=use_table: kernels.decode(c, None, jnp.float32, use_table=t))
            rows.append({"lattice": lattice, "q": 4, "N": nb, "use_table": use_table,
                         "seconds": best_time(f, codes, repeat=repeat)})
    return rows


def matmul_table(cfg, sizes, batches, repeat):
    """Fused decode-matmul against a bfloat16 dense dot and against decode-then-dot."""
    rng = np.random.default_rng(0)
    fused = jax.jit(lambda x, c: hq.matmul(x, c, implementation="pallas"))
    unfused = jax.jit(lambda x, c: hq.matmul(x, c, implementation="xla"))
    dense = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
    rows = []
    for size in sizes:
        W = jnp.asarray(rng.standard_normal((size, size)), jnp.float32)
        cW = hq.encode_rows(W, cfg)
        Wb = hq.decode(cW, implementation="xla").astype(jnp.bfloat16)
        for b in batches:
            x = jnp.asarray(rng.standard_normal((b, size)), jnp.bfloat16)
            t_fused = best_time(fused, x, cW, repeat=repeat)
            t_dense = best_time(dense, x, Wb, repeat=repeat)
            t_unfused = best_time(unfused, x, cW, repeat=repeat)
            ref = dense(x, Wb)
            err = float(jnp.max(jnp.abs(fused(x, cW).astype(jnp.float32) - ref))
                        / jnp.max(jnp.abs(ref)))
            rows.append({"size": size, "batch": b, "fused_s": t_fused, "bf16_dot_s": t_dense,
                         "decode_then_dot_s": t_unfused, "speedup_vs_bf16": t_dense / t_fused,
                         "code_bytes": cW.nbytes, "bf16_bytes": Wb.nbytes, "rel_diff": err})
    return rows


def markdown(env, tests, bw, books, mm, ops, peak, errors):
    lines = [f"Device: {env['device']} ({env['backend']}); jax {env['jax']}; "
             f"Python {env['python']}.", ""]
    if tests:
        lines += [f"`pytest {' '.join(tests['targets'])}` natively: {tests['summary'][-1]}", ""]
    for name, err in errors.items():
        lines += [f"**{name} failed**: `{err.splitlines()[0][:300]}`", ""]
    lines += ["| op | implementation | N | time | GB/s | % of HBM peak |",
              "|---|---|---|---|---|---|"]
    for r in bw or ():
        pct = f"{100 * r['GBps'] * 1e9 / peak:.0f} %" if peak else "n/a"
        lines.append(f"| {r['op']} | {r['implementation']} | {r['N']:.0e} | "
                     f"{r['seconds'] * 1e3:.2f} ms | {r['GBps']:.1f} | {pct} |")
    lines += ["", "Decode kernel, codebook gathered (`use_table=True`) or from the digits "
              "(the default: a table for D4 q=4, digits for E8 q=4):", "",
              "| lattice | N blocks | use_table | time |", "|---|---|---|---|"]
    for r in books or ():
        lines.append(f"| {r['lattice']} q={r['q']} | {r['N']:.0e} | {r['use_table']} | "
                     f"{r['seconds'] * 1e3:.2f} ms |")
    lines += ["", "| matmul | batch | fused (codes) | bf16 dot (dense) | decode then dot | "
              "fused vs bf16 | rel. diff |", "|---|---|---|---|---|---|---|"]
    for r in mm or ():
        lines.append(f"| {r['size']}² | {r['batch']} | {r['fused_s'] * 1e6:.0f} µs | "
                     f"{r['bf16_dot_s'] * 1e6:.0f} µs | {r['decode_then_dot_s'] * 1e6:.0f} µs | "
                     f"{r['speedup_vs_bf16']:.2f}x | {r['rel_diff']:.1e} |")
    if ops:
        lines += ["", bench_kernels.table(ops)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10**8, help="vectors for encode/decode bandwidth")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192],
                   help="matmul weight sizes")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without a GPU")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--tests", nargs="+", default=["tests/test_kernels.py"],
                   help="test files (or node ids) to run natively first")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        if not args.allow_cpu:
            print(f"gpu_check: no GPU (backend {jax.default_backend()!r}); run it on a GPU "
                  "machine, or pass --allow-cpu for a smoke run", file=sys.stderr)
            return 2
        args.n, args.sizes, args.repeat = 4096, [256], 1
    env = bench_kernels.environment()
    peak = peak_bandwidth(env["device"])
    cfg = bench_kernels.config()
    scale = 1 if args.allow_cpu else 16
    out = {"environment": {**env, "hbm_peak_Bps": peak}, "tests": None}
    suffix = "" if jax.default_backend() == "gpu" else "_cpu_smoke"
    RESULTS.mkdir(exist_ok=True)
    steps = [("bandwidth", codec_bandwidth, cfg, args.n, args.repeat),
             ("codebook", codebook_choice, args.n // 10, args.repeat),
             ("matmul", matmul_table, cfg, args.sizes, (1, 8, 32), args.repeat),
             ("ops", lambda: [bench_kernels.measure(c, args.repeat, cfg) for c in
                              bench_kernels.cases(cfg, 2**16 * scale, 512 * scale, (1, 16),
                                                  jnp.bfloat16)])]
    if not args.skip_tests:
        steps.insert(0, ("tests", run_tests, args.tests))
    for name, f, *f_args in steps:
        section(out, name, f, *f_args)
        # written after every part, so a run cut off at its time limit keeps what it measured
        (RESULTS / f"gpu_check{suffix}.json").write_text(json.dumps(out, indent=1))
    md = markdown(env, out["tests"], out["bandwidth"], out["codebook"], out["matmul"],
                  out["ops"], peak, out.get("errors", {}))
    (RESULTS / f"gpu_check{suffix}.md").write_text(md + "\n")
    print(md)
    tests_ok = out["tests"] is None or out["tests"]["returncode"] == 0
    return 0 if tests_ok and not out.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())

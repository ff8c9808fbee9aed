"""The Pallas kernels against their XLA references, per op and size, in one process.

For each op of :mod:`hnlq_jax.kernels` (encode, decode, decode_matmul, lut_gemv, modq_sum) and
each size: best-of-``--repeat`` seconds of ``implementation="xla"`` and ``"pallas"`` (interpret
mode on a CPU, the real kernel on a GPU), their ratio, a check that both give the same result
(codes exactly, products to float rounding), and what ``implementation=None`` picks on this
backend, with the reason. D4 q=4 M=2, beta calibrated on N(0,1), iid N(0,1) data.

Writes ``results/bench_kernels.json`` and prints a Markdown table. ``gpu_check.py`` reuses
:func:`cases` and :func:`measure` at GPU sizes.

Usage: ``python experiments/bench_kernels.py [--scale 1] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform

import jax
import jax.numpy as jnp
import numpy as np

import hnlq_jax as hq
from hnlq_jax import kernels
from hnlq_jax.timing import best_time

RESULTS = pathlib.Path(__file__).parent / "results"


def config():
    cfg = hq.HNLQConfig("D4", 4, 2)
    beta, _ = hq.calibrate_beta(np.random.default_rng(0).standard_normal((4000, 4)), cfg)
    return cfg.replace(beta=beta)


def cases(cfg, n_blocks, matrix, batches, dtype=jnp.float32):
    """``(name, size, fn(implementation, *args), args, bytes moved by one call)`` per case.

    The inputs are arguments of the jitted call, not closed-over constants (XLA would fold
    those at compile time).
    """
    rng = np.random.default_rng(1)
    d = cfg.d
    x = jnp.asarray(rng.standard_normal((n_blocks, d)), jnp.float32)
    codes = hq.encode(x, cfg)
    n = k = matrix
    cW = hq.encode(hq.to_blocks(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), d), cfg)
    code_bytes = cfg.M * d + 1  # uint8 labels + int8 T per block
    w_bytes = n * (k // d) * code_bytes
    out = [
        ("encode", f"N={n_blocks}", lambda impl, x: kernels.encode(x, cfg, implementation=impl),
         (x,), n_blocks * (4 * d + code_bytes)),
        ("decode", f"N={n_blocks}", lambda impl, c: kernels.decode(c, cfg, implementation=impl),
         (codes,), n_blocks * (4 * d + code_bytes)),
    ]
    for b in batches:
        xa = jnp.asarray(rng.standard_normal((b, k)), dtype)
        out.append((f"decode_matmul {jnp.dtype(dtype).name}", f"{n}x{k} batch {b}",
                    lambda impl, xa, c: kernels.decode_matmul(xa, c, cfg, implementation=impl),
                    (xa, cW), w_bytes))
    for b in batches:
        xa = jnp.asarray(rng.standard_normal((b, k)), jnp.float32)
        out.append(("lut_gemv", f"{n}x{k} batch {b}",
                    lambda impl, xa, c: kernels.lut_gemv(c, xa, cfg, implementation=impl),
                    (xa, cW), w_bytes))
    terms = hq.encode(jnp.asarray(rng.standard_normal((8, n_blocks // 8, d)) * 0.2, jnp.float32),
                      cfg)
    out.append(("modq_sum", f"8 x {n_blocks // 8}",
                lambda impl, c: kernels.modq_sum(c, cfg, 0, implementation=impl), (terms,),
                (n_blocks + n_blocks // 8) * code_bytes))
    return out


def same(a, b) -> str:
    """'exact' for equal codes, else the relative max difference of float results."""
    if isinstance(a, hq.Codes):
        ok = np.array_equal(a.labels, b.labels) and np.array_equal(a.T, b.T)
        return "exact" if ok else "DIFFERENT"
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.array_equal(a, b, equal_nan=True):
        return "exact"
    return f"{np.nanmax(np.abs(a - b)) / max(np.nanmax(np.abs(b)), 1e-30):.1e}"


def measure(case, repeat, cfg):
    name, size, fn, args, nbytes = case
    batch = int(size.rsplit(" ", 1)[1]) if "batch" in size else None
    row = {"op": name, "size": size,
           "none_picks": kernels.default_implementation(name.split()[0], cfg, batch)}
    results = {}
    for impl in ("xla", "pallas"):
        f = jax.jit(functools.partial(fn, impl))
        row[f"{impl}_s"] = best_time(f, *args, repeat=repeat)
        results[impl] = f(*args)
        row[f"{impl}_GBps"] = nbytes / row[f"{impl}_s"] / 1e9
    row["pallas_over_xla"] = row["pallas_s"] / row["xla_s"]
    row["agreement"] = same(results["pallas"], results["xla"])
    return row


def table(rows) -> str:
    lines = ["| op | size | XLA | Pallas | Pallas / XLA | agreement | `None` picks |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['size']} | {r['xla_s'] * 1e3:.2f} ms | "
                     f"{r['pallas_s'] * 1e3:.2f} ms | {r['pallas_over_xla']:.2f} | "
                     f"{r['agreement']} | {r['none_picks']} |")
    return "\n".join(lines)


def environment():
    return {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=1, help="multiplies the sizes")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    cfg = config()
    rows = [measure(c, args.repeat, cfg)
            for c in cases(cfg, 2**16 * args.scale, 1024 * args.scale, (1, 16))]
    out = {"environment": environment(), "config": repr(cfg),
           "default": " ".join(kernels.default_implementation.__doc__.split("\n\n")[1].split()),
           "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_kernels.json").write_text(json.dumps(out, indent=1))
    print(table(rows))
    print(f"\nimplementation=None: {out['default']}")
    return out


if __name__ == "__main__":
    main()

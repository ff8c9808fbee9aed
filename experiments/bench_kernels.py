"""The Pallas kernels against their XLA references, per op and size, in one process.

For each op (encode, decode, matmul through the front doors; the LUT GEMV and the mod-q sum
kernels against :func:`hnlq_jax.lut.matmul_one_sided` and :func:`hnlq_jax.modq.accumulate`) and
each size: best-of-``--repeat`` seconds of the XLA path and the kernel (interpret mode on a CPU,
the real kernel on a GPU), their ratio, a check that both give the same result (codes exactly,
products to float rounding), and what ``implementation=None`` picks on this backend. D4 q=4 M=2,
beta calibrated on N(0,1), iid N(0,1) data; the weights are row codes (``hq.encode_rows``).
Bytes moved count the compact codes as stored (``Codes.nbytes``).

Writes ``results/bench_kernels.json``, prints a Markdown table and writes it into
``docs/performance.md``. ``gpu_check.py`` reuses :func:`cases`, :func:`measure` and
:func:`table` at GPU sizes.

Usage: ``python experiments/bench_kernels.py [--scale 1] [--repeat 3]``; ``--report`` only
rewrites the docs table from ``results/bench_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

import jax
import jax.numpy as jnp
import numpy as np

import hnlq_jax as hq
from hnlq_jax import kernels, ops
from hnlq_jax.timing import best_time
from report import DOCS, add_report_flag, load_results, write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"


def config():
    cfg = hq.HNLQConfig("D4", 4, 2)
    return cfg.replace(beta=hq.gaussian_beta(cfg))


def _front_door(fn):
    """``{"xla": ..., "pallas": ...}`` of a front door taking ``implementation=``."""
    return {impl: (lambda *a, impl=impl: fn(*a, implementation=impl)) for impl in ("xla", "pallas")}


def cases(cfg, n_blocks, matrix, batches, dtype=jnp.float32):
    """``(op, size, {"xla": f, "pallas": f}, args, bytes moved by one call, None-pick key)``.

    The inputs are arguments of the jitted call, not closed-over constants (XLA would fold
    those at compile time).
    """
    rng = np.random.default_rng(1)
    d = cfg.d
    x = jnp.asarray(rng.standard_normal((n_blocks, d)), jnp.float32)
    codes = hq.encode(x, cfg, failures="mark")
    n = k = matrix
    cW = hq.encode_rows(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), cfg)
    out = [
        ("encode", f"N={n_blocks}",
         _front_door(lambda v, **kw: hq.encode(v, cfg, **kw)), (x,), x.nbytes + codes.nbytes,
         "encode"),
        ("decode", f"N={n_blocks}", _front_door(hq.decode), (codes,), x.nbytes + codes.nbytes,
         "decode"),
    ]
    for b in batches:
        xa = jnp.asarray(rng.standard_normal((b, k)), dtype)
        out.append((f"matmul {jnp.dtype(dtype).name}", f"{n}x{k} batch {b}",
                    _front_door(hq.matmul), (xa, cW), cW.nbytes + xa.nbytes, "matmul"))
    for b in (b for b in batches if b <= kernels.GEMV_ROWS):
        xa = jnp.asarray(rng.standard_normal((b, k)), jnp.float32)
        out.append(("one-sided LUT product", f"{n}x{k} batch {b}",
                    {"xla": lambda v, c: hq.lut.matmul_one_sided(c, v),
                     "pallas": lambda v, c: kernels.gemv(v, c, jnp.float32, lut_tables=True)},
                    (xa, cW), cW.nbytes + xa.nbytes, None))
    terms = hq.encode(jnp.asarray(rng.standard_normal((8, n_blocks // 8, d)) * 0.2, jnp.float32),
                      cfg)
    out.append(("modq_sum", f"8 x {n_blocks // 8}",
                {"xla": hq.modq.accumulate, "pallas": kernels.modq_sum}, (terms,),
                terms.nbytes * 9 // 8, None))
    return out


def same(a, b) -> str:
    """'exact' for equal codes, else the relative max difference of float results."""
    if isinstance(a, hq.Codes):
        ok = np.array_equal(a.index, b.index) and np.array_equal(a.tfield, b.tfield)
        return "exact" if ok else "DIFFERENT"
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.array_equal(a, b, equal_nan=True):
        return "exact"
    return f"{np.nanmax(np.abs(a - b)) / max(np.nanmax(np.abs(b)), 1e-30):.1e}"


def measure(case, repeat, cfg):
    name, size, fns, args, nbytes, door = case
    row = {"op": name, "size": size,
           "none_picks": ops.default_implementation(door, cfg) if door else "n/a"}
    results = {}
    for impl in ("xla", "pallas"):
        f = jax.jit(fns[impl])
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
    add_report_flag(p)
    args = p.parse_args(argv)
    if args.report:
        out = load_results("bench_kernels")
    else:
        cfg = config()
        rows = [measure(c, args.repeat, cfg)
                for c in cases(cfg, 2**16 * args.scale, 1024 * args.scale, (1, 16))]
        out = {"environment": environment(), "config": repr(cfg),
               "default": " ".join(ops.default_implementation.__doc__.split("\n\n")[1].split()),
               "rows": rows}
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "bench_kernels.json").write_text(json.dumps(out, indent=1))
        print(f"implementation=None: {out['default']}\n")
    text = table(out["rows"])
    print(text)
    write_between_markers(DOCS / "performance.md", "bench_kernels", text)
    return out


if __name__ == "__main__":
    main()

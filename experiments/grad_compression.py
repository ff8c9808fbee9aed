"""Data-parallel training with compressed gradient means on 8 devices (fake CPU devices here).

scikit-learn's digits (no download), MLP 64-256-256-10, Adam 1e-3, 8 devices x 16 examples per
step, ``--epochs`` epochs, several seeds. The gradient mean across devices is:

* ``float32``: ``lax.pmean`` (a ring all-reduce of float32);
* ``int8``: two-phase int8 (all-to-all of per-slice absmax int8, average, re-quantize, all-gather),
  the usual low-bit baseline at 8 bits/value;
* ``hnlq all_gather M=1|2`` and ``hnlq reduce_scatter M=1|2``: :func:`hnlq_jax.dist.compress_gradients`
  with D4 q=4 (beta from ``gaussian_beta``), error feedback, 10 warm-up steps, ``min_size=1024``
  (the biases take the exact mean); the payload is :mod:`hnlq_jax.wire`'s (T as flags and unary codes in
  a fixed capacity per chunk).

Reports final test accuracy (mean, min, max over seeds), bytes each device sends per step and
the ratio to float32, the overload rate, the fraction of chunks the wire's rate control coded at
a larger scale (their T stream did not fit its capacity), and the step time (median over the run, same process,
2 cores simulating 8 devices: the collectives are memory copies, so this is the compute cost of
compression, not a network measurement). Writes ``results/grad_compression.{json,png}`` and the
table into ``docs/performance.md``.

Usage: ``python experiments/grad_compression.py [--seeds 0 1 2] [--epochs 30]``; ``--report``
only rewrites the docs table from ``results/grad_compression.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import hnlq_jax as hq  # noqa: E402
from hnlq_jax import dist, wire  # noqa: E402
from qat_digits import data  # noqa: E402  (the same split and normalization)
from report import (DOCS, add_report_flag, load_results, markdown_table,  # noqa: E402
                    write_between_markers)
from hnlq_jax.timing import best_time  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
N_DEV, PER_DEV = 8, 16


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for n in (256, 256):
            x = nn.relu(nn.Dense(n)(x))
        return nn.Dense(10)(x)


def int8_mean(axis_name):
    """Two-phase int8 mean per leaf, a GradientTransformation (no state); bytes per step."""
    def mean(g):
        n = jax.lax.axis_size(axis_name)
        v = g.reshape(-1).astype(jnp.float32)
        v = jnp.pad(v, (0, (-v.size) % n)).reshape(n, -1)
        s = jnp.max(jnp.abs(v), axis=1, keepdims=True) / 127
        s = jnp.where(s > 0, s, 1.0)
        q = jnp.round(v / s).astype(jnp.int8)
        q, s = (jax.lax.all_to_all(a, axis_name, 0, 0) for a in (q, s))
        avg = jnp.mean(q.astype(jnp.float32) * s, axis=0)
        s2 = jnp.max(jnp.abs(avg)) / 127
        s2 = jnp.where(s2 > 0, s2, 1.0)
        q2 = jnp.round(avg / s2).astype(jnp.int8)
        q2, s2 = (jax.lax.all_gather(a, axis_name, to="invarying") for a in (q2, s2))
        return (q2.astype(jnp.float32) * s2[:, None]).reshape(-1)[: g.size].reshape(g.shape)

    def update(updates, state, params=None):
        return jax.tree.map(mean, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def int8_bytes(params, n):
    """All-to-all of (n-1)/n of the int8 values + scales, all-gather of the 1/n slice to n-1."""
    total = 0
    for p in jax.tree.leaves(params):
        m = -(-p.size // n) * n
        total += (n - 1) * (m + 4 * n) // n + (n - 1) * (m // n + 4)
    return total


def float32_bytes(params, n):
    return sum(2 * (n - 1) * 4 * p.size / n for p in jax.tree.leaves(params))


def methods(cfg):
    out = {"float32": None, "int8": "int8"}
    for method in dist.METHODS:
        for M in (1, 2):
            c = cfg.replace(M=M)
            out[f"hnlq {method} M={M}"] = (c.replace(beta=hq.gaussian_beta(c)), method)
    return out


def build(spec):
    """``(optimizer, jitted data-parallel step, jitted evaluation)`` for one method."""
    model = MLP()
    if spec is None:
        comm, mean = optax.identity(), True
    elif spec == "int8":
        comm, mean = int8_mean("i"), False
    else:
        cfg, method = spec
        comm, mean = dist.compress_gradients(cfg, "i", method, warmup_steps=10), False
    opt = optax.chain(comm, optax.adam(1e-3))
    mesh = jax.make_mesh((N_DEV,), ("i",), axis_types=(AxisType.Auto,))

    def step(params, state, x, y):
        state = jax.tree.map(lambda a: a[0], state)

        def loss(p):
            logits = model.apply({"params": p}, x[0])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y[0]).mean()

        lval, g = jax.value_and_grad(loss)(params)
        if mean:
            g = jax.lax.pmean(g, "i")
        u, state = opt.update(g, state, params)
        return (optax.apply_updates(params, u), jax.tree.map(lambda a: a[None], state),
                jax.lax.pmean(lval, "i"))

    # The optimizer state is per device (it holds the residuals), so shard_map cannot prove the
    # new params replicated; they are: every device applies the same mean, bit for bit.
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("i"), P("i"), P("i")),
                                 out_specs=(P(), P("i"), P()), check_vma=False))

    @jax.jit
    def evaluate(p, x, y):
        logits = model.apply({"params": p}, x)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
                jnp.mean(jnp.argmax(logits, -1) == y))

    return opt, step, evaluate


def train(spec, built, seed, epochs, xtr, ytr, xte, yte):
    opt, step, evaluate = built
    params = MLP().init(jax.random.key(seed), xtr[:1])["params"]
    # Per-device optimizer state (error-feedback residuals differ between devices).
    state = jax.tree.map(lambda a: jnp.broadcast_to(a, (N_DEV,) + jnp.shape(a)), opt.init(params))
    rng = np.random.default_rng(seed)
    per_step = N_DEV * PER_DEV
    curve, times, stats = [], [], None
    for _ in range(epochs):
        order = rng.permutation(len(xtr))
        for i in range(len(order) // per_step):
            idx = order[i * per_step:(i + 1) * per_step]
            x = xtr[idx].reshape(N_DEV, PER_DEV, -1)
            y = ytr[idx].reshape(N_DEV, PER_DEV)
            t = time.perf_counter()
            params, state, lval = step(params, state, x, y)
            lval.block_until_ready()
            times.append(time.perf_counter() - t)
        tl, acc = evaluate(params, xte, yte)
        curve.append({"train_loss": float(lval), "test_loss": float(tl), "test_acc": float(acc)})
        stats = dist.compression_stats(state)
    rescaled = 0.0
    if spec is None:
        sent = float32_bytes(params, N_DEV)
        over = 0.0
    elif spec == "int8":
        sent, over = int8_bytes(params, N_DEV), 0.0
    else:
        sent, over = float(stats["bytes_sent"][0]), float(stats["overload_rate"][0])
        cfg, method = spec
        parts = N_DEV if method == "reduce_scatter" else 1
        chunks = sum(parts * wire.layout(p.size, cfg, parts).chunks
                     for p in jax.tree.leaves(params) if p.size >= 1024)  # per device
        rescaled = float(stats["rescaled_chunks"][0]) / (N_DEV * chunks)
    return {"curve": curve, "step_time_s": float(np.median(times[len(times) // 10:])),
            "bytes_sent": sent, "overload_rate": over, "rescaled_chunk_rate": rescaled}


def table(res: dict) -> str:
    """The docs table of a result dict: one row per method of ``res["summary"]``."""
    rows = [[s["method"],
             f"{100 * s['acc_mean']:.2f} % ({100 * s['acc_min']:.2f}-{100 * s['acc_max']:.2f})",
             f"{s['bytes_per_step']:,.0f}", f"{s['fewer_bytes_than_float32']:.2f}x fewer",
             f"{s['overload_rate']:.3f}", f"{s['rescaled_chunk_rate']:.3f}",
             f"{s['step_time_ms']:.1f} ms", f"{s['step_time_vs_float32']:.2f}x"]
            for s in res["summary"]]
    caption = (f"{res['params']:,} parameters, {res['devices']} devices × "
               f"{res['per_device_batch']} examples, {res['epochs']} epochs, seeds {res['seeds']}:")
    text = caption + "\n\n" + markdown_table(
        ["method", "test accuracy (mean, min-max)", "bytes/step/device", "vs float32",
         "overload rate", "rescaled chunks", "step time", "vs float32"], rows)
    if "breakdown" in res:
        text += "\n\n" + breakdown_table(res["breakdown"])
    return text


def breakdown(cfg, params, repeat=20) -> list:
    """Milliseconds of one device's wire encode and decode, beside the lattice codec inside them.

    The weight gradients (the leaves the compressor codes) as one flat array, Gaussian at the
    gradients' RMS scale, in the all-gather layout; jitted, best of ``repeat``, same process.
    The rest of the wire time is its T-stream coding, the label bitstream and the rate control.
    """
    size = sum(p.size for p in jax.tree.leaves(params) if p.size >= 1024)
    v = jnp.asarray(1e-3 * np.random.default_rng(0).standard_normal(size), jnp.float32)
    rows = []
    for M in (1, 2):
        c = cfg.replace(M=M)
        lay = wire.layout(size, c.replace(beta=hq.gaussian_beta(c)))
        enc = jax.jit(lambda v: wire.encode(v, lay)[0])
        dec = jax.jit(lambda p: wire.decode(p, lay))
        blocks = hq.to_blocks(v / jnp.std(v), c.d)
        lenc = jax.jit(lambda b: hq.encode(b, lay.config))
        ldec = jax.jit(hq.decode)
        payload, codes = enc(v), lenc(blocks)
        rows.append({"config": f"{c.lattice} q={c.q} M={M}", "values": size,
                     "wire_encode_ms": 1e3 * best_time(enc, v, repeat=repeat),
                     "wire_decode_ms": 1e3 * best_time(dec, payload, repeat=repeat),
                     "lattice_encode_ms": 1e3 * best_time(lenc, blocks, repeat=repeat),
                     "lattice_decode_ms": 1e3 * best_time(ldec, codes, repeat=repeat)})
    return rows


def breakdown_table(rows) -> str:
    return markdown_table(
        ["one device's gradient", "wire.encode", "lattice encode inside it", "wire.decode",
         "lattice decode inside it"],
        [[f"{r['values']:,} values, {r['config']}", f"{r['wire_encode_ms']:.2f} ms",
          f"{r['lattice_encode_ms']:.2f} ms", f"{r['wire_decode_ms']:.2f} ms",
          f"{r['lattice_decode_ms']:.2f} ms"] for r in rows])


def run(seeds, epochs) -> dict:
    """Trains every method over ``seeds``; writes and returns the result dict."""
    xtr, xte, ytr, yte = data()
    cfg = hq.HNLQConfig("D4", 4, 2)
    runs = {}
    for name, spec in methods(cfg).items():
        built = build(spec)
        runs[name] = [train(spec, built, s, epochs, xtr, ytr, xte, yte) for s in seeds]
        print(name, "done", flush=True)
    params = MLP().init(jax.random.key(0), xtr[:1])["params"]
    f32 = float32_bytes(params, N_DEV)
    base_t = np.median([r["step_time_s"] for r in runs["float32"]])
    summary = []
    for name, rs in runs.items():
        acc = [r["curve"][-1]["test_acc"] for r in rs]
        t = float(np.median([r["step_time_s"] for r in rs]))
        summary.append({"method": name, "acc_mean": float(np.mean(acc)), "acc_min": min(acc),
                        "acc_max": max(acc), "bytes_per_step": rs[0]["bytes_sent"],
                        "fewer_bytes_than_float32": f32 / rs[0]["bytes_sent"],
                        "overload_rate": rs[0]["overload_rate"],
                        "rescaled_chunk_rate": rs[0]["rescaled_chunk_rate"],
                        "step_time_ms": 1e3 * t,
                        "step_time_vs_float32": t / base_t})
    out = {"devices": N_DEV, "per_device_batch": PER_DEV, "epochs": epochs,
           "seeds": seeds, "params": int(sum(a.size for a in jax.tree.leaves(params))),
           "jax": jax.__version__, "summary": summary,
           "breakdown": breakdown(cfg, params),
           "curves": {k: [r["curve"] for r in v] for k, v in runs.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grad_compression.json").write_text(json.dumps(out, indent=1))
    plot(runs)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=30)
    add_report_flag(p)
    args = p.parse_args(argv)
    out = load_results("grad_compression") if args.report else run(args.seeds, args.epochs)
    text = table(out)
    print(text)
    write_between_markers(DOCS / "performance.md", "grad_compression", text)
    return out


def plot(runs):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rs in runs.items():
        for key, ax in zip(("train_loss", "test_acc"), axes):
            c = np.mean([[e[key] for e in r["curve"]] for r in rs], axis=0)
            ax.plot(np.arange(1, len(c) + 1), c, label=name)
    axes[0].set(xlabel="epoch", ylabel="train loss (last step)", yscale="log")
    axes[1].set(xlabel="epoch", ylabel="test accuracy", ylim=(0.85, 1.0))
    axes[1].legend(fontsize=8)
    fig.suptitle("Digits MLP, 8 data-parallel devices: gradient mean by method (mean of seeds)")
    fig.tight_layout()
    fig.savefig(RESULTS / "grad_compression.png", dpi=120)


if __name__ == "__main__":
    main()

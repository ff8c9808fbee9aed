"""Quantization-aware training on scikit-learn's handwritten digits (no download).

An MLP 64-256-256-10 trained with optax Adam (batch 64, 40 epochs, several seeds) as:

* float32 (nn.Dense);
* QAT, weights only: QDense, D4 q=4 M=2 (compact codes: 4 bits of codebook index and 1 bit of
  T field per weight, one float32 scale per output unit), at the default refresh schedule
  (``quantize_every = hnlq_jax.flax.QUANTIZE_EVERY``) and refreshing every step;
* QAT, weights + activations (per-token activation quantization, same config, default schedule);
* PTQ: the float32 model's weights quantized after training (no retraining).

The quantized models are evaluated in their inference form (export_params: codes, scales and
biases only, computed with hnlq_jax.matmul), checked to predict exactly as the training form.
Reports test accuracy (mean, min, max over seeds), test loss, agreement of the predictions
with float32's, loss curves (PNG), model sizes (float32 vs the inference form) and the time of
one jitted training step (QAT at quantize_every = 1, 8 and 32, and with quantize_every = 0 plus
refresh_codes from the loop every 32 steps, against float32, same process, interleaved rounds).
Writes <out>/qat_digits.{json,png} (default: results/) and, for the default output folder, the
tables into docs/performance.md.

Usage: python experiments/qat_digits.py [--seeds 0 1 2] [--epochs 40] [--iters 320] [--out DIR]
(a smoke run: --seeds 0 --epochs 1 --iters 8 --out some/folder)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import hnlq_jax as hq  # noqa: E402
from hnlq_jax.flax import QUANTIZE_EVERY, QDense, export_params, refresh_codes  # noqa: E402
from report import DOCS, add_report_flag, load_results, write_between_markers  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
CFG = hq.HNLQConfig("D4", 4, 2)
BATCH = 64


class MLP(nn.Module):
    kind: str = "float"  # float | qat_w | qat_wa
    quantize_every: int = QUANTIZE_EVERY

    @nn.compact
    def __call__(self, x, deterministic: bool = False):
        def dense(n, name):  # same names in every variant: a float checkpoint loads into QAT
            if self.kind == "float":
                return nn.Dense(n, name=name)
            return QDense(n, CFG, quantize_activations=self.kind == "qat_wa",
                          quantize_every=self.quantize_every, deterministic=deterministic,
                          name=name)
        for i, n in enumerate((256, 256)):
            x = nn.relu(dense(n, f"dense{i}")(x))
        return dense(10, "out")(x)


def data(seed=0):
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return train_test_split(x, d.target.astype(np.int32), test_size=0.2, random_state=seed,
                            stratify=d.target)


def make_step(model, opt):
    @jax.jit
    def step(v, state, x, y):
        def loss(p):
            out = model.apply({**v, "params": p}, x, mutable=["hnlq"])
            logits, upd = out if isinstance(out, tuple) else (out, {})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd
        (l, upd), g = jax.value_and_grad(loss, has_aux=True)(v["params"])
        u, state = opt.update(g, state, v["params"])
        return {**v, **upd, "params": optax.apply_updates(v["params"], u)}, state, l
    return step


def evaluate(model, v, x, y):
    """``(accuracy, mean test cross-entropy, predictions)``; a quantized model in its inference
    form, whose logits must equal the training form's."""
    if model.kind == "float":
        logits = model.apply(v, x)
    else:
        logits = model.apply(export_params(v, CFG)[0], x)
        np.testing.assert_array_equal(logits, model.apply(v, x, deterministic=True))
    pred = jnp.argmax(logits, -1)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return float(jnp.mean(pred == y)), float(loss), np.asarray(pred)


def train(kind, seed, epochs, xtr, ytr, quantize_every=QUANTIZE_EVERY):
    model = MLP(kind, quantize_every)
    v = model.init(jax.random.key(seed), xtr[:1])
    v = dict(v)
    opt = optax.adam(1e-3)
    state = opt.init(v["params"])
    step = make_step(model, opt)
    rng = np.random.default_rng(seed)
    losses = []
    n = len(xtr) // BATCH * BATCH
    for _ in range(epochs):
        perm = rng.permutation(len(xtr))[:n].reshape(-1, BATCH)
        ep = []
        for idx in perm:
            v, state, l = step(v, state, xtr[idx], ytr[idx])
            ep.append(l)
        losses.append(float(np.mean(jax.device_get(ep))))
    if kind != "float":
        v = refresh_codes(v, CFG)  # inference on the final weights' codes
    return model, v, losses


def ptq(float_model_vars, xtr):
    """The float32 model's weights quantized: beta calibrated on them and their codes (QDense's
    initializers run on the trained kernels)."""
    q = MLP("qat_w")
    params = float_model_vars["params"]
    _, hnlq = q.apply({"params": params}, xtr[:1], deterministic=True, mutable=["hnlq"])
    return q, {"params": params, **hnlq}


def stepper(kind, quantize_every, xtr, ytr, manual_every=None):
    """A function timing ``iters`` training steps (mean seconds per step). ``manual_every``:
    quantize_every=0 and a ``refresh_codes`` call from the loop every that many steps,
    included in the time."""
    model = MLP(kind, quantize_every)
    v = dict(model.init(jax.random.key(0), xtr[:1]))
    opt = optax.adam(1e-3)
    state = [v, opt.init(v["params"])]
    step = make_step(model, opt)
    x, y = xtr[:BATCH], ytr[:BATCH]

    def run(iters):
        v, st = state
        t = time.perf_counter()
        for i in range(iters):
            v, st, l = step(v, st, x, y)
            if manual_every and i % manual_every == manual_every - 1:
                v = refresh_codes(v, CFG)
        jax.block_until_ready((l, v))
        state[:] = [v, st]
        return (time.perf_counter() - t) / iters

    run(manual_every or 1)  # compile
    return run


def tables(res) -> str:
    """The Markdown tables of a run's results (accuracy, step time, size)."""
    acc, test_loss, agree = res["accuracy"], res["test_loss"], res["agreement_with_float32"]
    times, sizes = res["step_seconds"], res["sizes"]
    lines = [f"MLP 64-256-256-10, D4 q=4 M=2, {res['epochs']} epochs, seeds {res['seeds']}, "
             f"{res['backend']}", "",
             "| model | test accuracy mean (min–max) | vs float32 (pp) | test loss | same "
             "prediction as float32 |", "|---|---|---|---|---|"]
    base = np.mean(acc["float32"])
    for k, a in acc.items():
        lines.append(f"| {k} | {100 * np.mean(a):.2f} % ({100 * min(a):.2f}–{100 * max(a):.2f}) "
                     f"| {100 * (np.mean(a) - base):+.2f} | {np.mean(test_loss[k]):.4f} | "
                     f"{100 * np.mean(agree[k]):.1f} % |")
    lines += ["", "| training step (batch 64) | ms | vs float32 |", "|---|---|---|"]
    for k, t in times.items():
        lines.append(f"| {k} | {1e3 * t:.3f} | {t / times['float32']:.2f}x |")
    lines += ["", f"Model size: float32 {sizes['float32_bytes']:,} bytes, inference form "
              f"{sizes['deployed_bytes']:,} bytes ({sizes['ratio']:.2f}x smaller; "
              f"{sizes['bits_per_weight']:.3f} bits per quantized weight)."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--iters", type=int, default=320, help="timed training steps per round")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="output directory")
    add_report_flag(ap)
    args = ap.parse_args()
    if args.report:
        write_between_markers(DOCS / "performance.md", "qat_digits",
                              tables(load_results("qat_digits")))
        return
    args.out.mkdir(parents=True, exist_ok=True)  # fail now, not after the runs
    xtr, xte, ytr, yte = data()
    default = f"quantize_every={QUANTIZE_EVERY} (default)"
    acc = {k: [] for k in ("float32", f"QAT weights, {default}", "QAT weights, quantize_every=1",
                           f"QAT weights+acts, {default}", "PTQ weights")}
    test_loss = {k: [] for k in acc}
    agree = {k: [] for k in acc}  # fraction of test predictions equal to float32's
    curves = {k: [] for k in list(acc)[:4]}
    sizes = None
    for seed in tqdm(args.seeds, desc="seeds"):
        fm, fv, fl = train("float", seed, args.epochs, xtr, ytr)
        wm, wv, wl = train("qat_w", seed, args.epochs, xtr, ytr)
        w1m, w1v, w1l = train("qat_w", seed, args.epochs, xtr, ytr, quantize_every=1)
        am, av, al = train("qat_wa", seed, args.epochs, xtr, ytr)
        pm, pv = ptq(fv, xtr)
        ref = None
        for name, (m, v) in zip(acc, ((fm, fv), (wm, wv), (w1m, w1v), (am, av), (pm, pv))):
            a, loss, pred = evaluate(m, v, xte, yte)
            ref = pred if ref is None else ref
            acc[name].append(a)
            test_loss[name].append(loss)
            agree[name].append(float(np.mean(pred == ref)))
        for k, c in zip(curves, (fl, wl, w1l, al)):
            curves[k].append(c)
        if sizes is None:
            s = export_params(wv, CFG)[1].sizes  # every layer quantized: the whole model
            sizes = {"float32_bytes": s.float32_bytes, "deployed_bytes": s.quantized_bytes,
                     "ratio": 1 / s.ratio_to_float32, "bits_per_weight": s.bits_per_weight}
    runs = {"float32": stepper("float", 1, xtr, ytr),
            f"QAT weights, {default}": stepper("qat_w", QUANTIZE_EVERY, xtr, ytr)}
    for every in (1, 8, 32):
        runs[f"QAT weights, quantize_every={every}"] = stepper("qat_w", every, xtr, ytr)
    runs["QAT weights, quantize_every=0 + refresh_codes every 32"] = stepper(
        "qat_w", 0, xtr, ytr, manual_every=32)
    runs[f"QAT weights+acts, {default}"] = stepper("qat_wa", QUANTIZE_EVERY, xtr, ytr)
    runs["QAT weights+acts, quantize_every=1"] = stepper("qat_wa", 1, xtr, ytr)
    times = {k: np.inf for k in runs}
    for _ in range(5):  # interleaved rounds: every variant sees the same machine noise
        for k, run in runs.items():
            times[k] = min(times[k], run(args.iters))

    out = {"config": "D4 q=4 M=2", "epochs": args.epochs, "seeds": args.seeds, "batch": BATCH,
           "accuracy": acc, "test_loss": test_loss, "agreement_with_float32": agree,
           "step_seconds": times, "sizes": sizes, "loss_curves": curves,
           "jax": jax.__version__, "backend": jax.default_backend()}
    text = tables(out)
    print(text)
    if args.out.resolve() == RESULTS.resolve():
        write_between_markers(DOCS / "performance.md", "qat_digits", text)

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for (k, cs), col in zip(curves.items(), ("k", "C0", "C2", "C1")):
        for i, c in enumerate(cs):
            ax.plot(np.arange(1, len(c) + 1), c, color=col, alpha=0.7, label=k if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_title("digits MLP: float32 vs HNLQ QAT (D4 q=4 M=2)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / "qat_digits.png", dpi=120)
    (args.out / "qat_digits.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out / 'qat_digits.json'} and .png")


if __name__ == "__main__":
    main()

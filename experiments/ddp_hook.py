"""PyTorch DDP with communication hooks: HNLQ against DDP's own hooks, two gloo ranks on a CPU.

scikit-learn's digits (no download), MLP 64-256-256-10 (85 k parameters, one DDP bucket),
SGD with momentum 0.9 and learning rate 0.05, 2 ranks x 32 examples per step, ``--steps`` steps,
several seeds. Every run starts from the same weights and sees the same batches. Hooks:

* ``allreduce``: ``default_hooks.allreduce_hook`` (float32, the same as no hook);
* ``fp16``: ``default_hooks.fp16_compress_hook``;
* ``powersgd_r2``: ``powerSGD_hook`` with matrix approximation rank 2, error feedback, 10 warm-up
  steps (PyTorch's recommended set-up for a first try);
* ``hnlq_q4_m2`` / ``hnlq_q4_m1``: :func:`torch_bridge.hnlq_hook`, D4 q=4 with M=2 / M=1
  (beta from ``gaussian_beta``), error feedback, 10 warm-up steps.

Bytes are counted, not modelled: the collectives the hooks call (``all_reduce`` and
``all_gather_single``) are wrapped, and each call adds what one rank sends on a ring,
``2 (n - 1) / n`` of an all-reduce's operand and ``(n - 1)`` times an all-gather's input.
Reported per method: training loss curves, final test accuracy (mean over seeds), bytes per
step after the warm-up and the ratio to float32, and the median step time (both ranks share 2
cores and gloo runs over loopback: the compute cost of each hook, not a network measurement).
Writes ``results/ddp_hook.{json,png}`` and the table into ``docs/performance.md``.

Usage: ``python experiments/ddp_hook.py [--steps 400] [--seeds 0 1 2]`` (about 3 minutes);
``--report`` only rewrites the docs table from ``results/ddp_hook.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import hnlq_jax as hq  # noqa: E402
import torch_bridge as tb  # noqa: E402
from qat_digits import data  # noqa: E402  (the same split and normalization)
from report import (DOCS, add_report_flag, load_results, markdown_table,  # noqa: E402
                    write_between_markers)

RESULTS = pathlib.Path(__file__).parent / "results"
WORLD, BATCH, WARMUP = 2, 32, 10
METHODS = ("allreduce", "fp16", "powersgd_r2", "hnlq_q4_m2", "hnlq_q4_m1")
LABELS = {"allreduce": "`allreduce_hook` (float32)", "fp16": "`fp16_compress_hook`",
          "powersgd_r2": "`powerSGD_hook`, rank 2", "hnlq_q4_m2": "`hnlq_hook`, D4 q=4 M=2",
          "hnlq_q4_m1": "`hnlq_hook`, D4 q=4 M=1"}


def hook_for(method: str):
    """``(state, hook)`` to register, fresh for each run."""
    if method == "allreduce":
        return None, default_hooks.allreduce_hook
    if method == "fp16":
        return None, default_hooks.fp16_compress_hook
    if method == "powersgd_r2":
        return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                      start_powerSGD_iter=WARMUP), powersgd.powerSGD_hook
    M = int(method[-1])
    cfg = hq.HNLQConfig("D4", 4, M)
    return tb.HNLQHookState(cfg.replace(beta=hq.gaussian_beta(cfg)),
                            warmup_steps=WARMUP), tb.hnlq_hook


class Counter:
    """Wraps the collectives the hooks call and adds up what this rank sends."""

    def __init__(self):
        self.sent = 0.0
        self._all_reduce, self._all_gather_single = dist.all_reduce, dist.all_gather_single
        self._all_to_all_single = dist.all_to_all_single

    def install(self):
        def all_reduce(tensor, *args, **kw):
            self.sent += 2 * (WORLD - 1) / WORLD * tensor.numel() * tensor.element_size()
            return self._all_reduce(tensor, *args, **kw)

        def all_gather_single(out, inp, *args, **kw):
            self.sent += (WORLD - 1) * inp.numel() * inp.element_size()
            return self._all_gather_single(out, inp, *args, **kw)

        def all_to_all_single(out, inp, *args, **kw):  # (a reduce_scatter hook's first step)
            self.sent += (WORLD - 1) / WORLD * inp.numel() * inp.element_size()
            return self._all_to_all_single(out, inp, *args, **kw)

        dist.all_reduce, dist.all_gather_single = all_reduce, all_gather_single
        dist.all_to_all_single = all_to_all_single


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def train(method, seed, steps, rank, counter, split):
    x_tr, x_te, y_tr, y_te = (torch.from_numpy(a) for a in split)
    m = DDP(model(seed))
    state, hook = hook_for(method)
    m.register_comm_hook(state, hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    order = np.random.default_rng(seed).permutation(np.arange(steps * WORLD * BATCH) % len(y_tr))
    losses, times, sent = [], [], []
    for s in range(steps):
        idx = order[(s * WORLD + rank) * BATCH:(s * WORLD + rank + 1) * BATCH]
        before, t = counter.sent, time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x_tr[idx]), y_tr[idx].long())
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        sent.append(counter.sent - before)
        losses.append(loss.item())
    with torch.no_grad():
        acc = (m(x_te).argmax(1) == y_te).float().mean().item()
    return {"losses": losses, "test_accuracy": acc,
            "bytes_per_step": float(np.mean(sent[WARMUP:])),
            "step_seconds": float(np.median(times[WARMUP:]))}


def worker(rank, port, steps, seeds, out):
    torch.set_num_threads(1)  # 2 ranks on 2 cores: more threads oversubscribe (30x slower)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    counter = Counter()
    counter.install()
    res = {}
    for seed in seeds:
        split = data(seed)
        for method in METHODS:
            res.setdefault(method, []).append(train(method, seed, steps, rank, counter, split))
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def summarize(runs: dict, n_params: int) -> dict:
    f32 = 2 * (WORLD - 1) / WORLD * 4 * n_params
    out = {}
    for method, rs in runs.items():
        acc = [r["test_accuracy"] for r in rs]
        b = float(np.mean([r["bytes_per_step"] for r in rs]))
        if b <= 0:  # its collectives went past the Counter
            raise RuntimeError(f"ddp_hook: no byte of {method} was counted")
        out[method] = {"test_accuracy_mean": float(np.mean(acc)), "test_accuracy": acc,
                       "final_loss": float(np.mean([np.mean(r["losses"][-20:]) for r in rs])),
                       "bytes_per_step": b, "ratio_to_float32": f32 / b,
                       "step_ms": 1e3 * float(np.median([r["step_seconds"] for r in rs])),
                       "losses": np.mean([r["losses"] for r in rs], axis=0).tolist()}
    base = out["allreduce"]["step_ms"]
    for r in out.values():
        r["step_time_ratio"] = r["step_ms"] / base
    return out


def plot(res: dict, path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    k = 10
    for method, r in res["methods"].items():
        loss = np.convolve(r["losses"], np.ones(k) / k, mode="valid")
        a.plot(loss, label=f"{method} ({r['test_accuracy_mean']:.3f})")
    a.set_xlabel("step")
    a.set_ylabel(f"training loss (mean of seeds, {k}-step average)")
    a.set_yscale("log")
    a.legend(title="test accuracy")
    a.grid(alpha=0.3)
    names = list(res["methods"])
    b.bar(names, [res["methods"][m]["bytes_per_step"] / 1e3 for m in names])
    b.set_ylabel("kB sent per rank per step")
    b.tick_params(axis="x", rotation=30)
    b.grid(alpha=0.3, axis="y")
    fig.suptitle("DDP, 2 gloo ranks, digits MLP")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(res: dict) -> str:
    """The docs table of a result dict: one row per hook."""
    rows = [[LABELS.get(m, m), f"{100 * r['test_accuracy_mean']:.2f} %",
             f"{r['bytes_per_step'] / 1e3:.1f} k", f"{r['ratio_to_float32']:.2f}×",
             f"{r['step_ms']:.1f}", f"{r['step_time_ratio']:.1f}"]
            for m, r in res["methods"].items()]
    caption = (f"{res['parameters']:,} parameters, {res['world']} ranks × "
               f"{res['batch_per_rank']} examples, {res['steps']} steps, seeds {res['seeds']}, "
               f"test accuracy the mean over seeds:")
    return caption + "\n\n" + markdown_table(
        ["hook", "test accuracy", "bytes/step/rank", "fewer than float32", "step time (ms)",
         "× allreduce"], rows)


def run(steps, seeds) -> dict:
    """Trains every hook on ``WORLD`` spawned ranks; writes and returns the result dict."""
    # One XLA thread per rank (set before the ranks import JAX): 2 ranks share 2 cores.
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                                       "intra_op_parallelism_threads=1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        mp.spawn(worker, args=(port, steps, seeds, out), nprocs=WORLD)
        runs = json.loads(pathlib.Path(out).read_text())
    n_params = sum(p.numel() for p in model(0).parameters())
    res = {"world": WORLD, "batch_per_rank": BATCH, "steps": steps, "seeds": seeds,
           "warmup_steps": WARMUP, "parameters": n_params,
           "methods": summarize(runs, n_params),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "jax": __import__("jax").__version__}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ddp_hook.json").write_text(json.dumps(res, indent=1))
    plot(res, RESULTS / "ddp_hook.png")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add_report_flag(ap)
    args = ap.parse_args()
    res = load_results("ddp_hook") if args.report else run(args.steps, args.seeds)
    text = table(res)
    print(text)
    write_between_markers(DOCS / "performance.md", "ddp_hook", text)


if __name__ == "__main__":
    main()

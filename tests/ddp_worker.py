"""Two spawned gloo ranks exercising ``hnlq_hook`` (run by tests/test_ddp.py).

Usage: ``python ddp_worker.py PORT OUT_DIR``. Each rank writes ``OUT_DIR/rank{r}.json``:

* ``bucket``: the hook's mean of ``bucket_data()`` (row r on rank r) for each method, called
  directly with a stand-in ``GradBucket``;
* ``rebuild``: a bucket's result after a step with the same layout, after a step with another
  layout of the same size (DDP's bucket rebuild), and with a fresh state;
* ``feedback_off``: a bucket's result once ``error_feedback`` was turned off after a step, and
  with a fresh state without it;
* ``no_bias``: per method, the largest error of the average of 12 means of the same data (and
  of the first alone);
* ``exact``: max |grad - built-in grad| over the steps that must be exact (a warm-up step, and
  every step of a bucket below ``min_size``), and the relative error of a coded step (both
  methods; the reduce-scatter gradients too, to compare the ranks);
* ``high_rate``: max relative gradient error against the built-in all-reduce at q=16, M=4;
* ``float64``: the same for a float64 model (gradient dtypes and relative error);
* ``train``: per-step losses with D4 q=4 M=2 and with the built-in all-reduce, this rank's
  final parameters (so the test can check that the ranks agree bit for bit) and statistics;
* ``mismatch``: the error raised when the ranks build the state with different configs.
"""

import json
import os
import sys

import jax
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import numpy as np

import hnlq_jax as hq
from torch_bridge import HNLQHookState, hnlq_hook
from torch_bridge.ddp import (METHODS, _compress, _decode_parts, _mean, _requantize,
                              _saturated)

D4_Q4_M2 = hq.HNLQConfig("D4", 4, 2, beta=0.2016)  # hq.gaussian_beta, rounded
D4_Q16_M4 = hq.HNLQConfig("D4", 16, 4, beta=4.353e-5)


# The model's one gradient bucket holds N values (not a multiple of d = 4): every call of the
# hook below, direct or through DDP, codes one layout per config and method, so each rank
# compiles the coder once for it.
N = 63 * (32 + 1) + 8 * (63 + 1)  # 2591


def bucket_data(n=N):
    return np.random.default_rng(7).standard_normal((2, n)).astype(np.float32)


class Bucket:
    """A stand-in for ``dist.GradBucket`` (what the hook calls on it)."""

    def __init__(self, buffer, params, index=0):
        self._buffer, self._params, self._index = buffer, params, index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return True


def hook(state, values, params):
    return hnlq_hook(state, Bucket(torch.tensor(values), params)).wait().tolist()


def buckets(rank):
    """The hook called directly: both methods, and a bucket rebuild."""
    x = bucket_data()[rank]
    res = {"bucket": {m: hook(HNLQHookState(D4_Q4_M2, min_size=0, method=m), x,
                              [torch.zeros(x.size)]) for m in ("all_gather", "reduce_scatter")}}
    a, b = torch.zeros(1000), torch.zeros(N - 1000)
    state = HNLQHookState(D4_Q4_M2, min_size=0)
    hook(state, x, [a, b])  # leaves a residual for bucket 0
    same = hook(state, x, [a, b])
    hook(state, x, [a, b])
    rebuilt = hook(state, x, [b, a])  # same size, other layout
    res["rebuild"] = {"same": same, "rebuilt": rebuilt,
                      "fresh": hook(HNLQHookState(D4_Q4_M2, min_size=0), x, [b, a])}
    # error feedback turned off after a step: its residual is not added to the next
    hook(state, x, [b, a])
    state.error_feedback = False
    res["feedback_off"] = {"after": hook(state, x, [b, a]), "fresh": hook(HNLQHookState(
        D4_Q4_M2, min_size=0, error_feedback=False), x, [b, a])}
    # the same gradient 12 times: max |average of the means - the true mean|, and of the first
    true = bucket_data().astype(np.float64).mean(0)
    res["no_bias"] = {}
    for m in METHODS:
        state, params = HNLQHookState(D4_Q4_M2, min_size=0, method=m), [torch.zeros(x.size)]
        means = np.array([hook(state, x, params) for _ in range(12)])  # one layout
        res["no_bias"][m] = [float(np.abs(means.mean(0) - true).max()),
                             float(np.abs(means[0] - true).max())]
    return res


def hook_programs():
    """``(jitted function, args, kwargs)`` for each program the hook runs below, called as the
    hook calls it: the same static layouts, shapes, dtypes and placements (the bucket, the
    residual, fresh or carried, and the received bytes are committed to the device)."""
    dev = jax.devices()[0]

    def committed(shape, dtype):
        return jax.device_put(np.zeros(shape, dtype), dev)

    progs = []
    for cfg, methods in ((D4_Q4_M2, METHODS), (D4_Q16_M4, ("all_gather",))):
        for m in methods:
            lay = HNLQHookState(cfg, method=m).layout(N, 2)
            kw = {"lay": lay, "implementation": None}
            v = committed(N, np.float32)
            progs.append((_compress, (v, committed(N, np.float32)), kw))
            progs.append((_mean, (committed((2, lay.part_bytes), np.uint8),), kw))
            progs.append((_saturated, (committed(lay.parts * lay.part_values, np.float32),),
                          {"n": N, "dtype": np.dtype(np.float32)}))
            if lay.parts > 1:
                part = committed(lay.part_values, np.float32)  # (with its residual)
                progs.append((_requantize, (part, part), kw))
                progs.append((_decode_parts,
                              (committed((2, lay.slice().part_bytes), np.uint8),), kw))
    return progs


def warm_up(rank, out_dir):
    """Each rank compiles half of the hook's programs into a shared persistent compilation
    cache, and loads the other half from it.

    Every hook call is a collective, so the ranks would compile the same programs at the same
    moment, on a small machine each twice. The cache holds the executables that the hook's own
    calls would build (a warm-up call whose signature does not match the hook's costs a compile
    later, never a different result).
    """
    jax.config.update("jax_compilation_cache_dir", os.path.join(out_dir, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    for fn, args, kw in hook_programs()[rank::2]:
        jax.block_until_ready(fn(*args, **kw))
    dist.barrier()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 63), torch.nn.Tanh(), torch.nn.Linear(63, 8))


def batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(64, 32, generator=g, dtype=dtype)
    w = torch.linspace(-1, 1, 32 * 8, dtype=dtype).reshape(32, 8)
    return x, torch.tanh(x @ w)


def ddp(state=None):
    m = DDP(model())  # one bucket of N values
    if state is not None:
        m.register_comm_hook(state, hnlq_hook)
    return m


def grads(m, rank, step):
    m.zero_grad()
    x, y = batch(rank, step, next(m.parameters()).dtype)
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in m.parameters()]


def rel(a, b):
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))


def run(rank, port, out_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    warm_up(rank, out_dir)
    res = buckets(rank)
    steps = 3
    builtin = ddp()
    ref = [grads(builtin, rank, s)[1] for s in range(steps)]

    state = HNLQHookState(D4_Q4_M2, warmup_steps=1)
    hooked = ddp(state)
    got = [grads(hooked, rank, s)[1] for s in range(steps)]
    small = ddp(HNLQHookState(D4_Q4_M2, min_size=10_000))
    res["exact"] = {
        "warmup": max((a - b).abs().max().item() for a, b in zip(got[0], ref[0])),
        "small": max((a - b).abs().max().item()
                     for s in range(steps) for a, b in zip(grads(small, rank, s)[1], ref[s])),
        "coded_rel": rel(got[2], ref[2]), "iter": state.iter, "stats": state.stats}
    hooked = ddp(HNLQHookState(D4_Q4_M2, warmup_steps=1, method="reduce_scatter"))
    rs = [grads(hooked, rank, s)[1] for s in range(steps)]
    res["exact"]["reduce_scatter_rel"] = rel(rs[2], ref[2])
    res["exact"]["reduce_scatter_grads"] = [g.tolist() for g in rs[2]]

    hooked = ddp(HNLQHookState(D4_Q16_M4, min_size=0))
    res["high_rate"] = max(rel(grads(hooked, rank, s)[1], ref[s]) for s in range(2))

    # A float64 model: its buckets are coded in float32 and come back as float64.
    ref64 = grads(DDP(model().double()), rank, 0)[1]
    hooked = DDP(model().double())
    hooked.register_comm_hook(HNLQHookState(D4_Q16_M4, min_size=0), hnlq_hook)
    got64 = grads(hooked, rank, 0)[1]
    res["float64"] = {"dtypes": sorted({str(g.dtype) for g in got64}), "rel": rel(got64, ref64)}

    def train(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for s in range(30):
            losses.append(grads(m, rank, s % 4)[0])
            opt.step()
        return losses

    state = HNLQHookState(D4_Q4_M2, min_size=0)
    m = ddp(state)
    res["train"] = {"losses": train(m), "builtin": train(ddp()),
                    "params": [p.tolist() for p in m.parameters()], "stats": state.stats,
                    "total_bytes": state.total_bytes_sent}

    cfg = D4_Q4_M2 if rank == 0 else hq.HNLQConfig("D4", 8, 2, beta=0.1)
    try:
        grads(ddp(HNLQHookState(cfg, min_size=0)), rank, 0)
        res["mismatch"] = None
    except Exception as e:  # the hook's ValueError arrives through autograd's engine
        res["mismatch"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)

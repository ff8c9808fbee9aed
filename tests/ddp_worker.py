"""Two spawned gloo ranks exercising ``hnlq_hook`` (run by tests/test_ddp.py).

Usage: ``python ddp_worker.py PORT OUT_DIR``. Each rank writes ``OUT_DIR/rank{r}.json``:

* ``exact``: max |grad - built-in grad| over the steps that must be exact (a warm-up step, and
  every step of a bucket below ``min_size``), and the relative error of a coded step;
* ``high_rate``: max relative gradient error against the built-in all-reduce at q=16, M=4;
* ``float64``: the same for a float64 model (gradient dtypes and relative error);
* ``train``: per-step losses with D4 q=4 M=2 and with the built-in all-reduce, this rank's
  final parameters (so the test can check that the ranks agree bit for bit) and statistics;
* ``mismatch``: the error raised when the ranks build the state with different configs.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import hnlq_jax as hq
from torch_bridge import HNLQHookState, hnlq_hook

D4_Q4_M2 = hq.HNLQConfig("D4", 4, 2, beta=0.2016)  # hq.gaussian_beta, rounded
D4_Q16_M4 = hq.HNLQConfig("D4", 16, 4, beta=4.353e-5)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(64, 32, generator=g, dtype=dtype)
    w = torch.linspace(-1, 1, 32 * 8, dtype=dtype).reshape(32, 8)
    return x, torch.tanh(x @ w)


def ddp(state=None):
    m = DDP(model())  # one bucket of 2632 values
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
    res = {}
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

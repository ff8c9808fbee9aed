"""One process of the two-process jax.distributed test (run by tests/test_dist.py).

Usage: ``python dist_worker.py PORT PROCESS_ID OUT.npy``. Each process has 2 CPU devices; the
mesh spans the 4 devices of both processes. Every device holds one row of ``data(4, n)`` and
the compressed means (both methods) are written by each process.
"""

import sys

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import hnlq_jax as hq
from hnlq_jax import dist

N = 3001


def data(rows, n=N):
    return np.random.default_rng(7).standard_normal((rows, n)).astype(np.float32)


def config():
    return hq.HNLQConfig("D4", 4, 2, beta=0.2016)  # hq.gaussian_beta, rounded


def means(mesh, x):
    """``[method, n]``: each method's mean over the mesh's devices (rows of x)."""
    cfg, out = config(), []
    for method in dist.METHODS:
        f = jax.jit(jax.shard_map(
            lambda v, m=method: dist.compressed_mean(v[0], "i", cfg, m)[None],
            mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        out.append(f(x))
    return out


def main(port, pid, path):
    jax.config.update("jax_num_cpu_devices", 2)  # before any JAX op of this process
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    mesh = jax.make_mesh((4,), ("i",), axis_types=(AxisType.Auto,))
    local = data(4)[2 * pid: 2 * pid + 2]
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), local)
    res = [np.asarray(m.addressable_data(0))[0] for m in means(mesh, x)]
    np.save(path, np.stack(res))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

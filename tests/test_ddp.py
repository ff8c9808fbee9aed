"""torch_bridge.ddp: the HNLQ DDP communication hook (two spawned gloo ranks) and its wire format."""

import json
import os
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import hnlq_jax as hq
from hnlq_jax import dist
from torch_bridge import HNLQHookState, hnlq_hook
from torch_bridge.ddp import _compress, _mean

CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2016)


def test_wire_format_equals_compressed_mean():
    """Payload bytes -> rank-order mean equals hnlq_jax.dist's all_gather mean bit for bit."""
    n = 3001
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, n)) * [[1e-3], [5.0]],
                    jnp.float32)
    kw = {"config": CFG, "chunk": 256, "implementation": None}
    wires = [_compress(x[i], jnp.zeros(n, jnp.float32), **kw)[0] for i in range(2)]
    got = _mean(jnp.stack(wires), numel=n, **kw)
    mesh = jax.make_mesh((2,), ("i",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    ref = jax.jit(jax.shard_map(lambda v: dist.compressed_mean(v[0], "i", CFG)[None],
                                mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)[0]
    np.testing.assert_array_equal(got, ref)
    assert wires[0].dtype == jnp.uint8
    assert wires[0].size == dist.wire_bytes(x[0], CFG, 2)["payload"]


def test_residual_is_what_was_not_sent():
    v = jnp.asarray(np.random.default_rng(1).standard_normal(1000), jnp.float32)
    r = jnp.full(1000, 0.01, jnp.float32)
    kw = {"config": CFG, "chunk": 256, "implementation": None}
    wire, r2, _ = _compress(v, r, **kw)
    sent = _mean(wire[None], numel=1000, **kw)
    np.testing.assert_array_equal(r2, (v + r) - sent)


def test_state_validation_and_pickling():
    with pytest.raises(TypeError, match="HNLQConfig"):
        HNLQHookState("D4")
    with pytest.raises(ValueError, match="chunk"):
        HNLQHookState(CFG, chunk=12)
    with pytest.raises(ValueError, match="warmup_steps"):
        HNLQHookState(CFG, warmup_steps=-1)
    with pytest.raises(ValueError, match="min_size"):
        HNLQHookState(CFG, min_size=1.5)
    s = pickle.loads(pickle.dumps(HNLQHookState(CFG, process_group=object(), warmup_steps=3)))
    assert s.config == CFG and s.warmup_steps == 3 and s.process_group is None
    with pytest.raises(TypeError, match="HNLQHookState"):
        hnlq_hook(CFG, None)
    with pytest.raises(RuntimeError, match="not initialized"):
        hnlq_hook(s, None)


@pytest.mark.slow
def test_two_ranks_gloo(tmp_path, free_port):
    worker = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, worker, str(free_port), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        e = r["exact"]
        # Warm-up steps and buckets below min_size are DDP's own all-reduce, exactly.
        assert e["warmup"] == 0.0 and e["small"] == 0.0
        assert 0.0 < e["coded_rel"] < 0.6  # the coded steps really were quantized
        assert e["iter"] == 3 and e["stats"]["ratio"] > 4
        assert r["high_rate"] < 1e-3  # q=16, M=4: the built-in all-reduce to 1e-4
        assert r["float64"]["dtypes"] == ["torch.float64"] and r["float64"]["rel"] < 1e-3
        t = r["train"]
        assert np.mean(t["losses"][-4:]) < 0.5 * np.mean(t["losses"][:4])
        assert np.mean(t["losses"][-4:]) < 1.25 * np.mean(t["builtin"][-4:])
        assert t["total_bytes"] == 30 * t["stats"]["bytes_sent"]
        assert "ranks disagree" in r["mismatch"] and "q=8" in r["mismatch"]
    # Every rank decodes the same payloads in the same order: parameters agree bit for bit.
    for a, b in zip(r0["train"]["params"], r1["train"]["params"]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert r0["train"]["losses"] != r1["train"]["losses"]  # the ranks did see different data

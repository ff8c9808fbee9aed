"""torch_bridge.ddp: the HNLQ DDP communication hook (two spawned gloo ranks) and its wire format."""

import functools
import json
import os
import pickle
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import hnlq_jax as hq
from hnlq_jax import dist, wire
from torch_bridge import HNLQHookState, hnlq_hook
import torch_bridge.ddp as tb_ddp
from torch_bridge.ddp import _compress, _mean

CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2016)
# The size of ddp_worker's gradient bucket (not a multiple of d): the tests here code the same
# layout as the spawned ranks, so in one process the coders compile once.
N = 2591


@functools.cache
def _two_device_mean(cfg, method):
    mesh = jax.make_mesh((2,), ("i",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    return jax.jit(jax.shard_map(lambda v: dist.compressed_mean(v[0], "i", cfg, method)[None],
                                 mesh=mesh, in_specs=P("i"), out_specs=P("i")))


def two_device_means(x, cfg=CFG, methods=dist.METHODS):
    """``[method, n]``: hnlq_jax.dist's compressed means of the rows of x on 2 devices."""
    return [np.asarray(_two_device_mean(cfg, m)(x))[0] for m in methods]


def test_wire_format_equals_compressed_mean():
    """Payload bytes -> rank-order mean equals hnlq_jax.dist's all_gather mean bit for bit."""
    n = N
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, n)) * [[1e-3], [5.0]],
                    jnp.float32)
    lay = wire.layout(n, CFG)
    kw = {"lay": lay, "implementation": None}
    wires = [_compress(x[i], jnp.zeros(n, jnp.float32), **kw)[0] for i in range(2)]
    got = _mean(jnp.concatenate(wires), **kw)[:n]
    np.testing.assert_array_equal(got, two_device_means(x, methods=("all_gather",))[0])
    assert wires[0].dtype == jnp.uint8
    assert wires[0].size == dist.wire_bytes(x[0], CFG, 2)["payload"]


def test_residual_is_what_was_not_sent():
    v = jnp.asarray(np.random.default_rng(1).standard_normal(N), jnp.float32)
    r = jnp.full(N, 0.01, jnp.float32)
    kw = {"lay": wire.layout(N, CFG), "implementation": None}
    payload, r2, info = _compress(v, r, **kw)
    sent = _mean(payload, **kw)[:N]
    np.testing.assert_array_equal(r2, (v + r) - sent)
    assert int(info.overloaded) > 0 and int(info.failed) == 0


def test_a_failed_chunk_keeps_its_residual():
    """A chunk with an Inf is sent as NaN; its residual stays what it was (one overflowed
    step must not make the chunk NaN on every later step), the other chunks' as before."""
    rng = np.random.default_rng(2)
    v = rng.standard_normal(N).astype(np.float32)
    v[5] = np.inf
    r = jnp.asarray(rng.standard_normal(N) * 0.01, jnp.float32)
    kw = {"lay": wire.layout(N, CFG), "implementation": None}
    payload, r2, info = _compress(jnp.asarray(v), r, **kw)
    sent = np.asarray(_mean(payload, **kw)[:N])
    chunk = kw["lay"].chunk * CFG.d  # the first chunk's values
    assert int(info.failed) == 1 and np.isnan(sent[:chunk]).all()
    np.testing.assert_array_equal(r2[:chunk], r[:chunk])
    np.testing.assert_array_equal(r2[chunk:], (v + r)[chunk:] - sent[chunk:])


def test_means_into_half_precision_buckets_saturate():
    """A float16 bucket takes the float32 mean saturated at 65504, not rounded to Inf."""
    import torch
    buffer = torch.zeros(4, dtype=torch.float16)
    values = jnp.asarray([70000.0, -1e6, 1.5, np.nan, 9.0], jnp.float32)  # one of padding
    out = tb_ddp._into(buffer, values)
    assert out is buffer
    np.testing.assert_array_equal(buffer.float().numpy(), [65504, -65504, 1.5, np.nan])
    wide = torch.zeros(4, dtype=torch.float64)  # widened, not clipped (and no warning)
    tb_ddp._into(wide, values)
    np.testing.assert_array_equal(wide.numpy(), [70000.0, -1e6, 1.5, np.nan])


def test_fresh_residual_is_placed_like_a_carried_one():
    """A new bucket's zero residual is committed to the bucket's device like the residual a
    later step carries, so the hook's compress step compiles once per layout, not twice."""

    class Bucket:  # what the state reads of DDP's GradBucket
        def index(self):
            return 0

        def parameters(self):
            return []

    state = HNLQHookState(CFG)
    v = jax.device_put(jnp.ones(N, jnp.float32), jax.devices()[0])
    fresh = state._residual(Bucket(), v)
    assert fresh.committed and fresh.sharding == v.sharding
    np.testing.assert_array_equal(fresh, np.zeros(N, np.float32))
    kw = {"lay": wire.layout(N, CFG), "implementation": None}
    _compress.__wrapped__.clear_cache()
    carried = _compress(v, fresh, **kw)[1]
    state.residuals[0] = ((), carried)
    assert state._residual(Bucket(), v) is carried
    _compress(v, carried, **kw)
    assert _compress.__wrapped__._cache_size() == 1


@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_cpu_buckets_on_a_gpu_machine_take_the_cpus_paths(monkeypatch, implementation):
    """On a GPU machine (its default backend made "gpu" in kernels.pallas alone) the coders of
    a CPU bucket take the CPU's implementation (None) or run the Pallas kernels in interpret
    mode, and code as the XLA path: inside the coders' jit the codec saw tracers, took the
    default backend's choice and compiled the kernels for the GPU ("Only interpret mode is
    supported on CPU backend")."""
    K = hq.kernels
    fake = types.SimpleNamespace(**{k: getattr(jax, k) for k in dir(jax)
                                    if not k.startswith("__")})
    fake.default_backend = lambda: "gpu"
    monkeypatch.setattr(K.pallas, "jax", fake)
    monkeypatch.setattr(K.pallas, "gpu_target", lambda: ("sm90", 132))
    n = 600
    lay = wire.layout(n, CFG, 2)
    rng = np.random.default_rng(3)
    v = jax.device_put(rng.standard_normal(n).astype(np.float32), jax.devices("cpu")[0])
    kw = {"lay": lay, "implementation": implementation}
    ref = {"lay": lay, "implementation": "xla"}
    r = jnp.zeros(n, jnp.float32)
    got, want = _compress(v, r, **kw), _compress(v, r, **ref)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(_mean(got[0], **kw), _mean(want[0], **ref))
    np.testing.assert_array_equal(tb_ddp._decode_parts(got[0], **kw),
                                  tb_ddp._decode_parts(want[0], **ref))
    avg = v[:lay.part_values]
    part = tb_ddp._requantize(avg, r[:lay.part_values], **kw)
    jax.tree.map(np.testing.assert_array_equal, part,
                 tb_ddp._requantize(avg, r[:lay.part_values], **ref))


def test_the_hooks_all_gather_is_torchs_at_each_call(monkeypatch):
    """The hook's all-gather is looked up on torch.distributed at each call: a wrapper
    installed after import (experiments/ddp_hook.py's byte counter) sees it (bound at
    import, it counted no byte of the HNLQ hooks)."""
    import torch
    calls = []
    monkeypatch.setattr(torch.distributed, "all_gather_single",
                        lambda out, inp, **kw: calls.append((out, inp, kw)) or "work")
    out, inp = torch.empty(4, dtype=torch.uint8), torch.ones(2, dtype=torch.uint8)
    assert tb_ddp._all_gather(out, inp, async_op=True) == "work"
    assert calls == [(out, inp, {"async_op": True})]


def test_state_validation_and_pickling():
    with pytest.raises(TypeError, match="HNLQConfig"):
        HNLQHookState("D4")
    with pytest.raises(ValueError, match="chunk"):
        HNLQHookState(CFG, chunk=12)
    with pytest.raises(ValueError, match="method must be one of"):
        HNLQHookState(CFG, method="psum")
    with pytest.raises(ValueError, match="warmup_steps"):
        HNLQHookState(CFG, warmup_steps=-1)
    with pytest.raises(ValueError, match="min_size"):
        HNLQHookState(CFG, min_size=1.5)
    for impl in ("native", "lut", "palas"):  # at once, not after the warm-up's iterations
        with pytest.raises(ValueError, match=r"HNLQHookState: encode: implementation must be"):
            HNLQHookState(CFG, implementation=impl)
    state = HNLQHookState(CFG, process_group=object(), warmup_steps=3)
    state.residuals[0] = (((1, (2,)),), jnp.ones(2))
    state._agreed = True  # its group's ranks agreed; a restored state's new group must again
    s = pickle.loads(pickle.dumps(state))
    assert s.config == CFG and s.warmup_steps == 3 and s.process_group is None
    assert not s._agreed
    np.testing.assert_array_equal(s.residuals[0][1], [1, 1])
    with pytest.raises(TypeError, match="HNLQHookState"):
        hnlq_hook(CFG, None)
    with pytest.raises(RuntimeError, match="not initialized"):
        hnlq_hook(s, None)


@pytest.mark.parametrize("module,name", [(wire, "WIRE_VERSION"), (tb_ddp, "FORMAT_VERSION")])
def test_ranks_running_another_format_disagree(monkeypatch, module, name):
    """A peer on another wire or codes format version is refused at the first bucket, even with
    the same config (its payloads would decode to garbage)."""
    sent = []

    def all_gather_object(out, mine, group=None):  # rank 0: the peer, rank 1: this process
        sent.append(mine)
        out[:] = sent[-len(out):]

    monkeypatch.setattr(tb_ddp.dist, "all_gather_object", all_gather_object)
    with monkeypatch.context() as m:  # the peer: same config, the next version
        m.setattr(module, name, getattr(module, name) + 1)
        peer = f"{tb_ddp.FORMAT_VERSION}/{wire.WIRE_VERSION}"
        HNLQHookState(CFG)._check_agreement(None, 1)
    with pytest.raises(ValueError, match="ranks disagree") as e:
        HNLQHookState(CFG)._check_agreement(None, 2)
    assert f"rank 0: format/wire version {peer}, config=" in str(e.value)
    assert f"rank 1: format/wire version {tb_ddp.FORMAT_VERSION}/{wire.WIRE_VERSION}," in str(
        e.value)


@pytest.mark.parametrize("knob,iters,shown", [
    ({"min_size": 5000}, 0, "min_size=5000"), ({"warmup_steps": 2}, 0, "warmup_steps=2"),
    ({"warmup_steps": 3}, 5, "warmup_steps=3 (3 done)")])  # a peer restored past warm-up
def test_ranks_disagreeing_on_which_buckets_are_coded_are_refused(monkeypatch, knob, iters,
                                                                  shown):
    """warmup_steps, the warm-up iterations done (a restored state's own) and min_size decide
    whether a bucket takes the exact all-reduce or the coded exchange: ranks that disagree
    would wait on different collectives, so the first bucket refuses them with a clear error
    instead of a hang until the group's timeout."""
    sent = []

    def all_gather_object(out, mine, group=None):  # rank 0: the peer, rank 1: this process
        sent.append(mine)
        out[:] = sent[-len(out):]

    monkeypatch.setattr(tb_ddp.dist, "all_gather_object", all_gather_object)
    peer = HNLQHookState(CFG, **knob)
    peer.iter = iters
    peer._check_agreement(None, 1)
    with pytest.raises(ValueError, match="ranks disagree") as e:
        HNLQHookState(CFG, **({"warmup_steps": 3} if iters else {}))._check_agreement(None, 2)
    assert "rank 0: " in str(e.value) and shown in str(e.value)
    assert "warmup_steps and min_size" in str(e.value)


@pytest.mark.slow
def test_two_ranks_gloo(tmp_path, free_port):
    worker = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, worker, str(free_port), str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        sys.path.insert(0, os.path.dirname(__file__))
        import ddp_worker

        assert ddp_worker.N == N
        # The reference (compiled here while the ranks run): hnlq_jax.dist's mean of the data.
        ref = two_device_means(jnp.asarray(ddp_worker.bucket_data()), ddp_worker.D4_Q4_M2)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # The hook on a bucket equals hnlq_jax.dist's mean of the same data, for both methods.
    for r in (r0, r1):
        for k, method in enumerate(dist.METHODS):
            np.testing.assert_array_equal(np.asarray(r["bucket"][method], np.float32), ref[k])
        # A bucket whose layout changed (DDP's rebuild) restarts from a zero residual; the
        # same layout keeps its residual.
        rb = r["rebuild"]
        assert rb["rebuilt"] == rb["fresh"] and rb["same"] != rb["fresh"]
        # error feedback turned off: the last residual is not added again (a frozen bias)
        assert r["feedback_off"]["after"] == r["feedback_off"]["fresh"]
        # error feedback leaves no bias: with reduce_scatter the re-encoding of a rank's part
        # of the mean is fed back too (its error repeated every step, ~10x all_gather's)
        nb = r["no_bias"]
        for average, first in nb.values():
            assert average < first / 4, nb
        assert nb["reduce_scatter"][0] < 2 * nb["all_gather"][0]
        e = r["exact"]
        # Warm-up steps and buckets below min_size are DDP's own all-reduce, exactly.
        assert e["warmup"] == 0.0 and e["small"] == 0.0
        assert 0.0 < e["coded_rel"] < 0.6  # the coded steps really were quantized
        assert 0.0 < e["reduce_scatter_rel"] < 0.6
        assert e["iter"] == 3 and e["stats"]["ratio_to_float32"] < 0.25
        assert r["high_rate"] < 1e-3  # q=16, M=4: the built-in all-reduce to 1e-4
        assert r["float64"]["dtypes"] == ["torch.float64"] and r["float64"]["rel"] < 1e-3
        t = r["train"]
        assert np.mean(t["losses"][-4:]) < 0.5 * np.mean(t["losses"][:4])
        assert np.mean(t["losses"][-4:]) < 1.25 * np.mean(t["builtin"][-4:])
        assert t["total_bytes"] == 30 * t["stats"]["bytes_sent"]
        assert "ranks disagree" in r["mismatch"] and "q=8" in r["mismatch"]
    # Every rank decodes the same payloads in the same order: gradients and parameters agree
    # bit for bit.
    assert r0["exact"]["reduce_scatter_grads"] == r1["exact"]["reduce_scatter_grads"]
    for a, b in zip(r0["train"]["params"], r1["train"]["params"]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert r0["train"]["losses"] != r1["train"]["losses"]  # the ranks did see different data

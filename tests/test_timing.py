"""hnlq_jax.timing: device time per call and its split by kernel."""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hnlq_jax import timing


def test_per_kernel_splits_runs_by_name():
    """Per call: the median run's total over the calls, and each kernel name's median summed
    duration (a name launched once a call, by each of 2 calls), in first-launch order."""
    runs = [[("fold", 0.002), ("gemv", 0.040), ("fold", 0.002), ("gemv", 0.044),
             ("sum", 0.001)],
            [("fold", 0.004), ("gemv", 0.050), ("fold", 0.004), ("gemv", 0.050),
             ("sum", 0.003)],
            [("fold", 0.002), ("gemv", 0.042), ("fold", 0.002), ("gemv", 0.042),
             ("sum", 0.001)]]
    t, kernels = timing.per_kernel(runs, calls=2)
    assert t == pytest.approx(0.089 / 2 / 1e3)  # the totals 0.089, 0.111, 0.089
    assert list(kernels) == ["fold", "gemv", "sum"]
    assert kernels["fold"] == pytest.approx(0.004 / 2 / 1e3)
    assert kernels["gemv"] == pytest.approx(0.084 / 2 / 1e3)
    assert kernels["sum"] == pytest.approx(0.001 / 2 / 1e3)


def test_device_time_without_cupti_is_wall_clock(monkeypatch):
    """Off a GPU: the program's wall clock over the copies, its first output, no split."""
    monkeypatch.setattr(timing.jax, "default_backend", lambda: "cpu")  # a GPU machine too
    ws = [jnp.full((4, 4), float(i)) for i in range(3)]
    t, how, y, kernels = timing.device_time(lambda x, w: x @ w, jnp.ones((1, 4)), ws,
                                            iterations=2)
    assert how == "wall" and kernels is None and 0 < t < 1
    np.testing.assert_array_equal(y, np.zeros((1, 4)))


def test_device_time_raises_a_kernels_error_at_once(monkeypatch):
    """On a GPU a call that fails (a compile, a launch: a RuntimeError like CUPTI's own) is
    raised from its first compile, not taken for a missing CUPTI and compiled again."""
    monkeypatch.setattr(timing.jax, "default_backend", lambda: "gpu")
    gpu = types.ModuleType("jax.experimental.mosaic.gpu")  # CUPTI's measure, as jax's calls
    gpu.profiler = types.SimpleNamespace(  # the function it measures (here: a failing one)
        measure=lambda f, **_: lambda *args: (f(*args), None))
    monkeypatch.setitem(sys.modules, "jax.experimental.mosaic.gpu", gpu)
    traced = []

    def failing(x, w):
        traced.append(1)
        raise RuntimeError("INTERNAL: ptxas fatal: out of registers")

    with pytest.raises(RuntimeError, match="ptxas"):
        timing.device_time(failing, jnp.ones((1, 4)), [jnp.ones((4, 4))], iterations=2)
    assert traced == [1]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="CUPTI times a GPU's kernels")
def test_device_time_on_a_gpu_is_cuptis_sum_by_kernel():
    """On a GPU (gpu_check's native tests): CUPTI's time, the kernels' shares summing to it."""
    ws = [jnp.full((256, 256), float(i)) for i in range(4)]
    t, how, y, kernels = timing.device_time(lambda x, w: jnp.tanh(x @ w) + 1, jnp.ones((8, 256)),
                                            ws, iterations=3)
    assert how == "cupti" and kernels and 0 < t < 1e-2
    assert sum(kernels.values()) == pytest.approx(t, rel=0.2)
    np.testing.assert_allclose(y, np.ones((8, 256)))


@pytest.mark.parametrize("repeat,stream,calls", [(5, True, 7), (9, True, 9), (5, False, 5)])
def test_sample_times_cycle_through_every_copy(repeat, stream, calls):
    """A warm-up call on the first copy, then the copies in turn: streamed, at least one call
    a copy (a copy is back in use only after the others), else ``repeat`` calls."""
    seen = []
    copies = list(range(7))
    times = timing.sample_times(lambda c: seen.append(c) or jnp.zeros(()), copies, repeat,
                                stream=stream)
    assert seen == [0] + [i % 7 for i in range(calls)]
    assert len(times) == calls and all(t >= 0 for t in times)
    seen.clear()
    timing.sample_times(lambda c: seen.append(c) or jnp.zeros(()), copies, 1, warm_all=True)
    assert seen[:7] == copies  # every copy warmed (a layer checks its codes on its first call)


def test_interleaved_takes_every_candidate_each_round():
    """Rounds of every candidate in turn: a slow spell falls on all of them alike."""
    order = []
    out = timing.interleaved({name: (lambda c, n=name: order.append(n) or jnp.zeros(()), [0],
                                     {}) for name in ("a", "b")}, repeat=2, rounds=3)
    assert order == (["a"] * 3 + ["b"] * 3) * 3  # (a warm-up call, then 2) each, 3 rounds
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())


@pytest.mark.parametrize("nbytes,mb,want", [(64 * 2**20, 320, 5), (10 * 2**20, 320, 32),
                                            (2**30, 320, 2), (3 * 2**20, 10, 4)])
def test_n_copies_cover_the_rotation(nbytes, mb, want):
    assert timing.n_copies(nbytes, mb) == want


def test_chained_calls_share_no_computation():
    """device_time's calls each take the one before's output: XLA computed sin(x), common to
    every call, once for all of them (each call charged a third of its own work)."""
    fn = lambda x, w: jnp.sin(x) @ w  # noqa: E731
    x, ws = jnp.ones((2, 8)), [jnp.full((8, 8), 0.1 * i) for i in range(3)]
    hlo = jax.jit(lambda x, ws: timing.chained(fn, x, ws)).lower(x, ws).compile().as_text()
    assert hlo.count(" sine(") == 3
    ys = timing.chained(fn, x, ws)
    np.testing.assert_allclose(ys[1], np.sin(ys[0]) @ ws[1], rtol=1e-6)  # x_1 = y_0
    # 16 columns out of 8 in: the next input is the first 8, in x's dtype
    wide = timing.chained(lambda x, w: x.astype(jnp.float32) @ w, x.astype(jnp.bfloat16),
                          [jnp.eye(8, 16), 2 * jnp.eye(8, 16)])
    np.testing.assert_array_equal(wide[1][:, :8], 2 * wide[0][:, :8])
    # an output that cannot be an input (a decode's, a scalar x): x throughout
    dec = timing.chained(lambda x, w: w * 2, jnp.zeros(()), ws)
    np.testing.assert_array_equal(dec[2], 2 * ws[2])


def test_fresh_copies_are_equal_at_their_own_addresses():
    w = jnp.arange(6.0).reshape(2, 3)
    copies = timing.fresh_copies({"w": w, "s": jnp.ones(2)}, 3)
    assert len(copies) == 3 and copies[0]["w"] is w
    pointers = {c["w"].unsafe_buffer_pointer() for c in copies}
    assert len(pointers) == 3  # (a copy sharing a buffer would be read from cache)
    for c in copies[1:]:
        np.testing.assert_array_equal(c["w"], w)

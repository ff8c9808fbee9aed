"""Compressed means and the optax transformation on 8 fake CPU devices; two real processes."""

import functools
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from conftest import sum_of_squares_in_numpy
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import hnlq_jax as hq
from hnlq_jax import dist, wire

# beta = hq.gaussian_beta(config), rounded (its grid search costs seconds per process).
CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2016)
N_DEV = 8


def mesh(n=N_DEV):
    return jax.make_mesh((n,), ("i",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def sharded(f, n=N_DEV):
    """``f(local)`` on each of n devices; rows of the input are the devices' values."""
    return jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=mesh(n), in_specs=P("i"),
                                 out_specs=P("i")))


@functools.cache
def mean_fn(cfg=CFG, method="all_gather"):
    """The compressed mean on N_DEV devices, one jitted function per config and method: a shape
    it has seen (in any test of this process) does not compile again."""
    return sharded(functools.partial(dist.compressed_mean, axis_name="i", config=cfg,
                                     method=method))


def placed(tree, spec, n=N_DEV):
    """``tree`` placed as a shard_map over n devices returns it (``spec``): a jitted step fed
    its own outputs then sees the same input shardings on its first call as on later ones
    (uncommitted inputs on the first call would compile the step a second time)."""
    return jax.device_put(tree, NamedSharding(mesh(n), spec))


def rows(shape, seed=0, n=N_DEV):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n,) + shape), jnp.float32)


def reference_mean(x, cfg, method, chunk=dist.CHUNK):
    """float64 numpy reference of the same quantized mean, from the codec directly."""
    n = x.shape[0]
    flat = np.asarray(x, np.float32).reshape(n, -1)
    size = flat.shape[1]

    def code(v, parts):
        lay = wire.layout(v.shape[0], cfg, parts, chunk=chunk)
        nc = lay.parts * lay.chunks
        v = np.pad(v, (0, nc * lay.chunk * cfg.d - v.shape[0])).reshape(nc, -1)
        rms = np.sqrt(np.mean(np.square(v, dtype=np.float64), axis=1))
        e = np.where(rms > 0, np.round(np.log2(np.where(rms > 0, rms, 1))), 0)  # nearest 2^e
        s = (2.0 ** e)[:, None]
        blocks = (v / s).reshape(-1, cfg.d).astype(np.float32)
        dec = np.asarray(hq.decode(hq.encode(blocks, cfg)), np.float64)
        return (dec.reshape(nc, -1) * s).reshape(-1)

    if method == "all_gather":
        return np.mean([code(v, 1) for v in flat], axis=0)[:size]
    dec = np.stack([code(v, n) for v in flat]).astype(np.float32)  # [n, padded]
    # The slice means are re-encoded: average in float32, in device order, as the devices do
    # (a float64 mean moves a few blocks across a decision boundary).
    avg = dec[0]
    for row in dec[1:]:
        avg = avg + row
    avg = np.split(avg / np.float32(n), n)
    return np.concatenate([code(a, 1) for a in avg])[:size]


@pytest.mark.parametrize("method", dist.METHODS)
def test_mean_matches_reference_and_pmap(method):
    x = rows((37, 29))  # 1073 values: ragged, not a multiple of d or of a chunk
    f = functools.partial(dist.compressed_mean, axis_name="i", config=CFG, method=method)
    got = mean_fn(CFG, method)(x)
    assert got.shape == x.shape and got.dtype == jnp.float32
    # Identical on every device, equal to the pmap path bit for bit.
    assert bool(jnp.all(got == got[0]))
    if method == "all_gather":  # one method suffices: the collectives are the same calls
        np.testing.assert_array_equal(jax.pmap(f, axis_name="i")(x), got)
    ref = reference_mean(x, CFG, method).reshape(x.shape[1:])
    np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-6)
    exact = np.mean(np.asarray(x, np.float64), axis=0)
    err = np.linalg.norm(got[0] - exact) / np.linalg.norm(exact)
    assert 0.01 < err < (0.12 if method == "all_gather" else 0.2)


def test_high_rate_approaches_exact_mean():
    x = rows((500,), seed=1)
    exact = np.mean(np.asarray(x, np.float64), axis=0)
    errs = []
    for q, M, beta in ((4, 1, 0.7752), (4, 3, 0.05039), (16, 4, 4.353e-5)):  # gaussian_beta
        cfg = hq.HNLQConfig("D4", q, M, beta=beta)
        got = mean_fn(cfg)(x)[0]
        errs.append(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-4


def test_shapes_dtypes_and_scalars():
    for shape, dtype in (((), jnp.float32), ((3,), jnp.bfloat16), ((4, 4, 3), jnp.float32)):
        x = rows(shape, seed=2).astype(dtype)
        got = mean_fn()(x)
        assert got.shape == x.shape and got.dtype == dtype
        exact = jnp.mean(x.astype(jnp.float32), axis=0)
        assert float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - exact))) < 0.5
    zeros = mean_fn()(jnp.zeros((N_DEV, 4, 4, 3)))  # the last case's shape: no new compile
    np.testing.assert_array_equal(zeros, 0)


def _collective_bytes(jaxpr, names):
    """Operand bytes of the collectives named ``names`` anywhere in a jaxpr."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            total += sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _collective_bytes(sub, names)
    return total


@pytest.mark.parametrize("method", dist.METHODS)
def test_wire_payload_is_what_wire_bytes_says(method):
    shape = (300, 17)
    f = sharded(functools.partial(dist.compressed_mean, axis_name="i", config=CFG, method=method))
    jaxpr = jax.make_jaxpr(f)(rows(shape)).jaxpr
    w = dist.wire_bytes(np.zeros(shape), CFG, N_DEV, method)
    gathered = _collective_bytes(jaxpr, {"all_gather", "all_gather_invariant"})
    if method == "all_gather":
        assert gathered == w["payload"]
        assert w["sent"] == (N_DEV - 1) * gathered
    else:
        a2a = _collective_bytes(jaxpr, {"all_to_all"})
        assert a2a == w["payload"] and gathered == w["payload"] // N_DEV
        assert w["sent"] == (N_DEV - 1) * (a2a // N_DEV) + (N_DEV - 1) * gathered
    # No float32 array of the data's size crosses the wire: payload well under 1 byte/value.
    assert _collective_bytes(jaxpr, {"psum", "psum_invariant", "pmean", "all_reduce"}) == 0
    assert w["payload"] < 0.9 * 300 * 17 * (1 if method == "all_gather" else 1.1)
    assert w["float32_allreduce"] == 2 * (N_DEV - 1) * 4 * 300 * 17 / N_DEV


def test_optax_error_feedback_invariant():
    tx = dist.compress_gradients(CFG, "i", min_size=16)
    params = {"w": jnp.zeros((40, 10)), "b": jnp.zeros((5,)), "s": jnp.zeros(()),
              "h": jnp.zeros((3, 7), jnp.bfloat16)}  # ragged bfloat16 leaf, compressed
    state = placed(jax.tree.map(lambda a: jnp.broadcast_to(a, (N_DEV,) + a.shape),
                                tx.init(params)), P("i"))

    def step(g, st):
        st = jax.tree.map(lambda a: a[0], st)
        g = jax.tree.map(lambda a: a[0], g)
        u, new = tx.update(g, st)
        # What this device put on the wire for w, decoded as every receiver decodes it.
        lay = wire.layout(400, CFG)
        own, _ = wire.encode((g["w"] + st.residual["w"]).reshape(-1), lay)
        sent = wire.decode(own, lay).reshape(40, 10)
        return u, jax.tree.map(lambda a: a[None], new), sent[None]

    f = jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(P("i"), P("i")),
                              out_specs=(P(), P("i"), P("i"))))
    rng = np.random.default_rng(3)
    for _ in range(3):
        g = {k: jnp.asarray(rng.standard_normal((N_DEV,) + v.shape), v.dtype)
             for k, v in params.items()}
        old = state.residual["w"]
        u, state, sent = f(g, state)
        new, sent = np.asarray(state.residual["w"]), np.asarray(sent)
        v = np.asarray(g["w"] + old)  # gradient + old residual, per device
        np.testing.assert_array_equal(new, v - sent)  # r' = (g + r) - sent, bit for bit
        np.testing.assert_allclose(sent + new, v, rtol=0, atol=1e-6)
        assert np.abs(sent - v).max() > 1e-3  # the codes did lose something
        assert float(jnp.abs(new).max()) > 0
        # Small leaves (b: 5, s: scalar) take the exact mean and keep no residual.
        np.testing.assert_allclose(u["b"], jnp.mean(g["b"], axis=0), rtol=1e-6)
        assert state.residual["b"] == () and state.residual["s"] == ()
        assert u["h"].dtype == jnp.bfloat16 and state.residual["h"].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(u["h"], np.float32),
                                   np.mean(np.asarray(g["h"], np.float32), axis=0), atol=0.25)
    stats = dist.compression_stats(state)
    assert float(stats["bytes_sent"][0]) < float(stats["float32_bytes"][0])
    assert 0 <= float(stats["overload_rate"][0]) < 1


def test_error_feedback_leaves_no_bias_with_either_method():
    """The same gradients every step (a slowly changing gradient): error feedback makes the
    updates' average over K steps approach the true mean like 1/K. With reduce_scatter the
    owner's re-encoding of its part of the mean is fed back too; before, its error repeated
    every step as a bias (the average stayed ~10x further off than all_gather's)."""
    rng = np.random.default_rng(11)
    g = {"w": jnp.asarray(rng.standard_normal((N_DEV, 64, 40)), jnp.float32)}
    true = np.asarray(g["w"], np.float64).mean(0)
    errors = {}
    for method in dist.METHODS:
        tx = dist.compress_gradients(CFG, "i", method=method, min_size=16)
        state = placed(jax.tree.map(lambda a: jnp.broadcast_to(a, (N_DEV,) + a.shape),
                                    tx.init({"w": jnp.zeros((64, 40))})), P("i"))

        def step(g, st, tx=tx):
            u, st = tx.update(jax.tree.map(lambda a: a[0], g),
                              jax.tree.map(lambda a: a[0], st))
            return u, jax.tree.map(lambda a: a[None], st)

        f = jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(P("i"), P("i")),
                                  out_specs=(P(), P("i"))))
        total = np.zeros_like(true)
        for k in range(24):
            u, state = f(g, state)
            total += np.asarray(u["w"], np.float64)
            if k == 0:
                first = np.abs(np.asarray(u["w"]) - true).max()
        errors[method] = np.abs(total / 24 - true).max()
        assert errors[method] < first / 5, (method, errors[method], first)
    assert errors["reduce_scatter"] < 2 * errors["all_gather"], errors


def test_reduce_scatter_state_can_be_donated_and_old_states_are_refused():
    """The pair of residuals a reduce_scatter leaf keeps are two buffers (one array twice
    could not be donated: "Attempt to donate the same buffer twice"); a state holding one
    array per leaf (made before the pair) is refused with a message."""
    tx = dist.compress_gradients(CFG, "i", method="reduce_scatter", min_size=16)
    state = tx.init({"w": jnp.zeros((64, 40))})
    r, r_mean = state.residual["w"]
    assert r.unsafe_buffer_pointer() != r_mean.unsafe_buffer_pointer()
    jax.block_until_ready(jax.jit(lambda s: s, donate_argnums=0)(state))
    old = state._replace(residual={"w": jnp.zeros((64, 40))})
    f = jax.shard_map(lambda g, st: tx.update(jax.tree.map(lambda a: a[0], g), st)[0],
                      mesh=mesh(), in_specs=(P("i"), P()), out_specs=P())
    with pytest.raises(ValueError, match="residual is a pair .* this state holds one array"):
        jax.jit(f)({"w": jnp.zeros((N_DEV, 64, 40))}, old)


def test_optax_warmup_chain_and_training():
    """Warm-up steps are exact; the chain trains a least-squares problem to the same loss."""
    rng = np.random.default_rng(4)
    A = jnp.asarray(rng.standard_normal((N_DEV, 64, 32)), jnp.float32)
    w_true = jnp.asarray(rng.standard_normal(32), jnp.float32)
    b = A @ w_true

    def run(tx, steps=60):
        w = placed(jnp.zeros(32), P())
        state = placed(jax.tree.map(lambda a: jnp.broadcast_to(a, (N_DEV,) + a.shape),
                                    tx.init(w)), P("i"))

        def step(w, st, A, b):
            st = jax.tree.map(lambda a: a[0], st)
            g = jax.grad(lambda w: jnp.mean((A[0] @ w - b[0]) ** 2))(w)
            u, st = tx.update(g, st, w)
            return optax.apply_updates(w, u), jax.tree.map(lambda a: a[None], st)

        # check_vma=False: per-device gradients. With the checks on, JAX already sums the
        # gradient of the replicated w over the axis (the transpose of its implicit pvary).
        f = jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(P(), P("i"), P("i"), P("i")),
                                  out_specs=(P(), P("i")), check_vma=False))
        ws = []
        for _ in range(steps):
            w, state = f(w, state, A, b)
            ws.append(w)
        return ws, state

    plain, _ = run(optax.chain(dist.compress_gradients(CFG, "i", warmup_steps=100, min_size=1),
                               optax.sgd(0.05)))
    pmean = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda g: jax.lax.pmean(g, "i"), u), s))
    exact, _ = run(optax.chain(pmean, optax.sgd(0.05)))
    np.testing.assert_allclose(plain[-1], exact[-1], rtol=1e-5, atol=1e-6)  # all warm-up
    nothing, _ = run(dist.compress_gradients(CFG, "i", min_size=10**9), steps=1)  # all exact
    np.testing.assert_allclose(nothing[0], jnp.mean(jax.vmap(jax.grad(
        lambda w, A, b: jnp.mean((A @ w - b) ** 2)), (None, 0, 0))(jnp.zeros(32), A, b), 0),
        rtol=1e-5, atol=1e-6)
    coded, state = run(optax.chain(dist.compress_gradients(CFG, "i", warmup_steps=2, min_size=1),
                                   optax.sgd(0.05)))
    np.testing.assert_allclose(coded[1], exact[1], rtol=1e-5, atol=1e-6)  # warm-up steps
    assert not np.allclose(coded[5], exact[5], rtol=1e-6)  # then coded
    err = float(jnp.linalg.norm(coded[-1] - w_true) / jnp.linalg.norm(w_true))
    assert err < 0.05
    assert 0 < float(dist.compression_stats(state)["ratio_to_float32"][0]) < 1


def test_ratio_target_and_accuracy():
    """D4 q=4 M=2, 8 devices, reduce_scatter: >= 6.5x fewer bytes than a float32 ring
    all-reduce (the T field entropy coded), at the accuracy of two quantizations."""
    w = dist.wire_bytes(np.zeros(2**20), CFG, N_DEV, "reduce_scatter")
    assert w["ratio_to_float32"] <= 1 / 6.5
    x = rows((4096,), seed=5)  # test_spike_is_coded_not_nan's shape: compiled once
    got = np.asarray(mean_fn(CFG, "reduce_scatter")(x)[0], np.float64)
    exact = np.mean(np.asarray(x, np.float64), axis=0)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.15
    assert dist.wire_bytes(x[0], CFG, N_DEV, "reduce_scatter")["ratio_to_float32"] <= 1 / 6.5


def test_uncalibrated_config_gets_gaussian_beta():
    """beta = 1.0 (HNLQConfig's default) is not a beta for unit-RMS chunks: the gaussian_beta
    of the config is used, the same as passing it."""
    x = rows((2000,), seed=6)
    plain = hq.HNLQConfig("D4", 4, 2)
    assert wire.chunk_config(plain).beta == hq.gaussian_beta(plain)
    got, calibrated = (mean_fn(c)(x) for c in (plain, wire.chunk_config(plain)))
    np.testing.assert_array_equal(got, calibrated)
    exact = np.mean(np.asarray(x, np.float64), axis=0)
    assert np.linalg.norm(got[0] - exact) / np.linalg.norm(exact) < 0.12


@pytest.mark.parametrize("method", dist.METHODS)
def test_spike_is_coded_not_nan(method):
    """A 1e20 gradient spike (its square overflows float32) is sent, not turned into NaN; it
    costs the resolution of its own chunk only."""
    x = np.array(rows((4096,), seed=7))
    x[3, 100] = 1e20
    f = mean_fn(CFG, method)
    got = np.asarray(f(jnp.asarray(x))[0], np.float64)
    assert np.all(np.isfinite(got))
    exact = np.mean(x.astype(np.float64), axis=0)
    assert abs(got[100] / exact[100] - 1) < 0.2
    # The spike's chunk (1024 values) aside, the error is as without the spike.
    far = slice(2048, None)
    clean = x.copy()
    clean[3, 100] = 0
    ref = np.asarray(f(jnp.asarray(clean))[0], np.float64)
    np.testing.assert_array_equal(got[far], ref[far])


# Jitted once per layout (op by op, each layout would compile ~90 small programs).
_wire_encode = jax.jit(wire.encode, static_argnums=1)
_wire_decode = jax.jit(wire.decode, static_argnums=1)


def test_wire_values_near_float32_max_decode_finite():
    """Values up to the float32 maximum decode finite (saturated), within the chunk's usual
    relative error: an Inf would make error feedback's residual infinite from then on."""
    big = np.finfo(np.float32).max
    v = np.random.default_rng(9).standard_normal(1024).astype(np.float32)
    v = (v / np.abs(v).max() * big).astype(np.float32)  # the largest entry is the maximum
    lay = wire.layout(v.size, CFG)
    payload, info = _wire_encode(jnp.asarray(v), lay)
    out = np.asarray(_wire_decode(payload, lay), np.float64)
    assert int(info.failed) == 0 and np.all(np.isfinite(out))
    assert np.linalg.norm(out - v) / np.linalg.norm(v.astype(np.float64)) < 0.12


@pytest.mark.parametrize("scale", [1e-5, 1e-36])
def test_subnormal_entries_leave_their_chunk_scaled(scale):
    """One subnormal entry (1e-5 data), or a chunk of RMS 1e-36 (some entries subnormal):
    jnp.ldexp of a subnormal depends on the fused program, and the jitted encoder took a
    scale 2^11 too large (or an infinite RMS) for the chunk, which then decoded to 0. Jitted
    and eager give the same payload, and the chunk its usual relative error."""
    v = np.random.default_rng(10).standard_normal(2048).astype(np.float32) * np.float32(scale)
    v[10] = 1e-40
    lay = wire.layout(v.size, CFG)
    payload, info = _wire_encode(jnp.asarray(v), lay)
    np.testing.assert_array_equal(payload, wire.encode(jnp.asarray(v), lay)[0])
    out = np.asarray(_wire_decode(payload, lay), np.float64).reshape(2, -1)
    ref = v.astype(np.float64).reshape(2, -1)
    assert int(info.failed) == 0
    assert np.all(np.linalg.norm(out - ref, axis=1) / np.linalg.norm(ref, axis=1) < 0.12)


def test_rate_control_and_failed_chunks():
    """Chunks whose T stream overflows a small capacity are coded at a larger scale (never
    dropped); a chunk with a NaN is marked and decodes to NaN, its neighbours do not."""
    cfg = CFG
    v = np.random.default_rng(8).standard_normal(8 * 1024).astype(np.float32)
    v *= np.repeat(np.float32(2.0) ** np.linspace(-0.5, 0.49, 8), 1024)  # RMS ratios across
    tight = wire.layout(v.size, cfg, t_capacity=1.25)  # the [0.71, 1.41) window
    loose = wire.layout(v.size, cfg)
    enc, dec = _wire_encode, _wire_decode
    p_tight, info_tight = enc(jnp.asarray(v), tight)
    p_loose, info_loose = enc(jnp.asarray(v), loose)
    assert int(info_loose.rescaled) == 0 and int(info_tight.rescaled) > 0
    assert p_tight.shape[1] < p_loose.shape[1]
    for p, lay, bound in ((p_tight, tight, 0.12), (p_loose, loose, 0.085)):
        out = np.asarray(dec(p, lay))
        assert np.linalg.norm(out - v) / np.linalg.norm(v) < bound
    v[5000] = np.nan
    p, info = enc(jnp.asarray(v), loose)
    out = np.asarray(dec(p, loose))
    assert int(info.failed) == 1
    chunk = np.s_[4096:5120]  # the NaN's chunk of 256 blocks
    assert np.all(np.isnan(out[chunk])) and np.all(np.isfinite(np.delete(out, chunk)))


def test_a_chunk_failing_at_the_largest_exponent_counts_as_failed():
    """A chunk that cannot be coded even at the largest exponent is failed (NaN) and counted
    so, also while another chunk's rescaling keeps the loop going (its exponent does not
    wrap into the FAILED byte uncounted)."""
    lay = wire.layout(512, CFG, chunk=64, t_capacity=1.0)  # 2 chunks
    big = np.full(256, 3e38, np.float32)
    for rest, rescaled in ((np.zeros(256, np.float32), 0),
                           (np.random.default_rng(0).standard_normal(256).astype(np.float32),
                            1)):
        payload, info = wire.encode(jnp.asarray(np.concatenate([big, rest])), lay)
        assert (int(info.failed), int(info.rescaled)) == (1, rescaled)
        out = np.asarray(wire.decode(payload, lay))
        assert np.isnan(out[:256]).all() and np.isfinite(out[256:]).all()


@pytest.mark.parametrize("max_T", [14, 5])
def test_wire_exponent_at_a_power_of_two_is_ieees(max_T):
    """A chunk's exponent is one value on every backend: its largest block's norm is the
    fixed-order sum of exact squares and IEEE's root, its ratio to the reach of T = max_T
    IEEE's quotient, so that a ratio at or a unit beside 2^k raises the exponent as NumPy's
    arithmetic says. A GPU divides and takes roots approximately (XLA's ``div.full`` and
    ``sqrt.approx``), which can move r = 2^k across the step: the GPU run checks it natively
    (gpu.md's quick list). XLA's CPU divides by the broadcast reach through its reciprocal, a unit off for a
    third of quotients, though not at these ratios."""
    cfg = CFG.replace(max_T=max_T)
    reach = np.float32(hq.codec.scale_tables(cfg, cfg.beta, jnp.float32)[1][max_T])
    k = int(np.floor(np.log2(32 / reach)))  # reach 2^k in (16, 32]: the chunk's RMS stays 1
    chunks = []
    for j in range(-3, 4):  # the float32 values j units from reach 2^k
        a = np.float32(np.ldexp(reach, k))
        for _ in range(abs(j)):
            a = np.nextafter(a, np.float32(np.inf if j > 0 else 0))
        x = np.full(256 * 4, np.sqrt((1024 - a * a) / 1020), np.float32)  # RMS 1: e = 0
        x[:4] = [a, 0, 0, 0]
        chunks.append(x)
    e, finite = wire._exponents(jnp.asarray(np.stack(chunks)), cfg)
    assert np.all(finite)
    for x, got in zip(chunks, np.asarray(e)):
        r = np.float32(np.sqrt(sum_of_squares_in_numpy(x[:4]))) / reach  # IEEE's, in NumPy
        m, lift = np.frexp(max(r, np.float32(1)))
        assert got == (lift if m > 0.5 else lift - 1)


@settings(max_examples=40)
@given(size=st.integers(1, 200_000), parts=st.integers(1, 16),
       chunk=st.sampled_from([8, 64, 256]))
def test_wire_layout_pads_under_8_blocks_a_chunk(size, parts, chunk):
    """A part takes the fewest chunks of at most ``chunk`` blocks that hold its share, each
    the smallest multiple of 8 that does: 8196 values over 8 parts took 2 chunks of 256
    blocks a part (2047 blocks of padding, 1.9x the bytes)."""
    lay = wire.layout(size, CFG, parts, chunk=chunk)
    blocks = -(-size // CFG.d)
    share = -(-blocks // parts)
    assert lay.chunk % 8 == 0 and lay.chunk <= chunk
    assert lay.chunks == -(-share // chunk)
    assert lay.chunks * lay.chunk >= share
    assert parts * lay.chunks * lay.chunk - blocks < 8 * parts * lay.chunks + parts


def test_wire_t_stream_bit_layout():
    """docs/format.md, wire format: T = (0, 2, 0, 1, 0, 0, 3, 0) in a chunk of 8 blocks is the
    flag byte 0b01001010 (blocks 1, 3, 6), then the unary codes 1 0 | 0 | 1 1 0 from bit 0:
    0b011001 = 25; 8 + 2 + 1 + 3 = 14 bits."""
    lay = wire.layout(32, CFG, t_capacity=3)  # one chunk of 8 blocks, 3 bytes of T stream
    assert (lay.chunk, lay.t_bytes) == (8, 3)
    u = jnp.asarray([[1, 3, 1, 2, 1, 1, 4, 1]], jnp.int32)  # u = T + 1
    data, bits = wire._t_streams(u, lay)
    np.testing.assert_array_equal(data, [[0b01001010, 25, 0]])
    assert int(bits[0]) == 14
    back, ok = wire._t_from_streams(data, lay)
    np.testing.assert_array_equal(back, u)
    assert bool(ok[0])


@pytest.mark.parametrize("max_T", [3, 15, 127])
@settings(max_examples=15)
@given(seed=st.integers(0, 2**31 - 1), p=st.floats(0.0, 0.9))
def test_wire_t_streams_round_trip(max_T, seed, p):
    """Any T that fits comes back exactly; a chunk holding a failed block (never sent) is
    refused; a chunk that overflows is reported (its bits) and never spills into the next
    chunk's stream."""
    cfg = CFG.replace(max_T=max_T)
    lay = wire.layout(4 * 64 * 4, cfg, chunk=64, t_capacity=4)  # 4 chunks of 64 blocks
    rng = np.random.default_rng(seed)
    u = np.minimum(rng.geometric(1 - p, (4, 64)), max_T + 2) % (max_T + 2)  # 0: failed
    u[0, 5] = max_T + 1  # the longest code, T = max_T (up to 127 bits)
    u[2] = 0  # failed blocks (v = max_T + 1): a chunk over its capacity, between two others
    u = jnp.asarray(u, jnp.int32)
    data, bits = wire._t_streams(u, lay)
    v = np.where(np.asarray(u) == 0, max_T + 1, np.asarray(u) - 1)
    np.testing.assert_array_equal(bits, 64 + v.sum(axis=1))
    back, ok = wire._t_from_streams(data, lay)
    fits = np.asarray(bits) <= 8 * lay.t_bytes
    assert not fits[2]
    sendable = fits & np.all(np.asarray(u) > 0, axis=1)
    np.testing.assert_array_equal(np.asarray(ok)[fits], sendable[fits])
    np.testing.assert_array_equal(np.asarray(back)[sendable], np.asarray(u)[sendable])
    alone, _ = wire._t_streams(u[3:], lay)  # the chunk after the overflow, coded alone
    np.testing.assert_array_equal(data[3], alone[0])


def _t_stream(flags, tail_bits, lay):
    """A hand-made T stream: the flag bits of ``lay.chunk`` blocks, then the tail bits."""
    tail = np.zeros(8 * lay.t_bytes - lay.chunk, np.uint8)
    tail[:len(tail_bits)] = tail_bits
    f = np.zeros(lay.chunk, np.uint8)
    f[list(flags)] = 1
    return jnp.asarray(np.concatenate([np.packbits(f, bitorder="little"),
                                       np.packbits(tail, bitorder="little")])[None])


@pytest.mark.parametrize("max_T, flags, tail_bits, ok, T0", [
    # tail 16 bits: a code filling it exactly is valid; each bad stream trips one check only
    (127, [0], [1] * 15 + [0], True, 16),      # v = 16: 15 ones and the zero, exactly full
    (14, [0], [0, 1], False, None),            # a one after the last code (the ones count)
    (14, [0], [1] * 14 + [0], False, None),    # v = 15 = max_T + 1: a failed block, never sent
    (14, [0], [1] * 15 + [0], False, None),    # v = 16 > max_T + 1
    (127, [0], [1] * 16, False, None),         # no terminating zero: the code runs past the tail
    (127, [0, 3], [1] * 15 + [0], False, None),  # two flagged blocks, one code fills the tail
])
def test_wire_t_stream_checks(max_T, flags, tail_bits, ok, T0):
    lay = wire.layout(32, CFG.replace(max_T=max_T), t_capacity=3)  # 8 blocks, 16 tail bits
    assert (lay.chunk, 8 * lay.t_bytes - lay.chunk) == (8, 16)
    data = _t_stream(flags, tail_bits, lay)
    u, good = wire._t_from_streams(data, lay)
    assert bool(good[0]) == ok
    if ok:
        assert int(u[0, 0]) == T0 + 1 and np.all(np.asarray(u[0, 1:]) == 1)
        back, bits = wire._t_streams(u, lay)  # and the encoder writes exactly this stream
        np.testing.assert_array_equal(back, data)
        assert int(bits[0]) == 8 * lay.t_bytes
        over, bits = wire._t_streams(u.at[0, 0].add(1), lay)  # one bit more does not fit
        assert int(bits[0]) == 8 * lay.t_bytes + 1


def test_wire_corrupted_t_stream_decodes_to_nan():
    """A T stream that cannot have been written (more flagged blocks than codes: the tail all
    ones) turns its chunk into NaN; the other chunks decode as before."""
    v = np.random.default_rng(9).standard_normal(8 * 1024).astype(np.float32)
    lay = wire.layout(v.size, CFG)  # test_rate_control_and_failed_chunks's loose layout
    payload, _ = _wire_encode(jnp.asarray(v), lay)
    good = np.asarray(_wire_decode(payload, lay))
    start = lay.label_bytes + lay.chunk // 8  # chunk 0's tail
    bad = payload.at[0, start:start + lay.t_bytes - lay.chunk // 8].set(255)
    out = np.asarray(_wire_decode(bad, lay))
    per = lay.chunk * CFG.d
    assert np.all(np.isnan(out[:per]))
    np.testing.assert_array_equal(out[per:], good[per:])


def test_bad_input():
    with pytest.raises(ValueError, match="method must be one of"):
        dist.wire_bytes(np.zeros(10), CFG, 8, "psum")
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 8"):
        dist.compress_gradients(CFG, "i", chunk=12)
    with pytest.raises(ValueError, match="t_capacity must be a positive number"):
        dist.compress_gradients(CFG, "i", t_capacity=0)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        dist.compress_gradients(CFG, "i", warmup_steps=-1)
    with pytest.raises(TypeError, match="HNLQConfig"):
        dist.compressed_mean(jnp.zeros(3), "i", "D4")
    with pytest.raises(TypeError, match="must be floating"):
        mean_fn()(jnp.zeros((N_DEV, 3), jnp.int32))
    one = dist.wire_bytes(np.zeros(1000), CFG, 1)  # one device: nothing sent either way
    assert one["sent"] == 0 and one["float32_allreduce"] == 0 and one["ratio_to_float32"] == 1.0


def test_one_device_sends_nothing_and_reports_ratio_one():
    """As wire_bytes: on one device nothing is sent either way (the ratio was 0/0 -> 0)."""
    tx = dist.compress_gradients(CFG, "i", min_size=1)
    g = jnp.asarray(np.random.default_rng(0).standard_normal(256), jnp.float32)
    f = jax.jit(jax.shard_map(lambda u, s: tx.update(u, s), mesh=mesh(1), in_specs=(P(), P()),
                              out_specs=(P(), P()), check_vma=False))
    u, state = f(g, tx.init(g))
    stats = dist.compression_stats(state)
    assert float(stats["bytes_sent"]) == 0 and float(stats["float32_bytes"]) == 0
    assert float(stats["ratio_to_float32"]) == 1.0
    # nothing is sent, so nothing is quantized (as compressed_mean on one device)
    np.testing.assert_array_equal(u, g)
    assert float(stats["overload_rate"]) == 0


def test_bytes_sent_count_plain_leaves_in_their_dtype():
    """A leaf that takes the exact mean sends a ring all-reduce of its own dtype (a bfloat16
    bias: 2 bytes a value), as the DDP hook counts it; the float32 baseline stays float32."""
    tx = dist.compress_gradients(CFG, "i", min_size=16)
    params = {"w": jnp.zeros(2048), "b": jnp.zeros(8, jnp.bfloat16)}
    state = placed(jax.tree.map(lambda a: jnp.broadcast_to(a, (2,) + a.shape), tx.init(params)),
                   P("i"), n=2)

    def step(g, st):
        u, st = tx.update(jax.tree.map(lambda a: a[0], g), jax.tree.map(lambda a: a[0], st))
        return jax.tree.map(lambda a: a[None], st)

    f = jax.jit(jax.shard_map(step, mesh=mesh(2), in_specs=(P("i"), P("i")), out_specs=P("i")))
    g = jax.tree.map(lambda a: jnp.ones((2,) + a.shape, a.dtype), params)
    stats = dist.compression_stats(f(g, state))
    coded = dist.wire_bytes(params["w"], CFG, 2)["sent"]
    assert float(stats["bytes_sent"][0]) == coded + 2 * 1 * 2 * 8 / 2
    assert float(stats["float32_bytes"][0]) == 2 * 1 * 4 * (2048 + 8) / 2


def test_one_nonfinite_step_leaves_later_steps_finite():
    """An Inf in one device's gradient makes its chunk's mean NaN at that step only (a loss
    scaler skips the step): the chunk's residual stays as it was instead of turning NaN, so
    every later step with finite gradients is finite again."""
    tx = dist.compress_gradients(CFG, "i", min_size=16)
    w = jnp.zeros(4096)
    state = placed(jax.tree.map(lambda a: jnp.broadcast_to(a, (2,) + a.shape), tx.init(w)),
                   P("i"), n=2)

    def step(g, st):
        u, st = tx.update(g[0], jax.tree.map(lambda a: a[0], st))
        return u, jax.tree.map(lambda a: a[None], st)

    f = jax.jit(jax.shard_map(step, mesh=mesh(2), in_specs=(P("i"), P("i")),
                              out_specs=(P(), P("i"))))
    rng = np.random.default_rng(9)
    for t in range(3):
        g = rng.standard_normal((2, 4096)).astype(np.float32)
        if t == 0:
            g[0, 5] = np.inf
        before = np.asarray(state.residual)
        u, state = f(jnp.asarray(g), state)
        u, r = np.asarray(u), np.asarray(state.residual)
        assert np.isfinite(r).all()
        if t == 0:  # the first chunk (256 blocks of 4) failed; its residual is the old one
            assert np.isnan(u[:1024]).all() and np.isfinite(u[1024:]).all()
            np.testing.assert_array_equal(r[0, :1024], before[0, :1024])
            assert int(dist.compression_stats(state)["failed_chunks"][0]) == 1
        else:
            assert np.isfinite(u).all()


@pytest.mark.parametrize("n", [2, 3, 8])
def test_ordered_mean_is_the_plain_sum_unless_it_overflows(n):
    """The devices' mean is XLA's sum / n in device order, bit for bit, tiny values too
    (scaling them would flush bits); only where that sum overflows is it the scaled values'
    mean."""
    rng = np.random.default_rng(n)
    plain = jax.jit(lambda d: functools.reduce(jnp.add, list(d)) / d.shape[0])
    for scale in (1.0, 1e-37, 3e-38):
        d = (rng.standard_normal((n, 512)) * scale).astype(np.float32)
        np.testing.assert_array_equal(jax.jit(dist._ordered_mean)(d), plain(d))
    big = np.full((n, 4), 3e38, np.float32)
    np.testing.assert_allclose(jax.jit(dist._ordered_mean)(big), 3e38, rtol=1e-6)


@pytest.mark.parametrize("method", dist.METHODS)
def test_means_near_the_float_maximum_stay_finite(method):
    """A finite mean stays finite: float16 values near 65504 (a loss scaler's range) come back
    saturated, not Inf, and 4 devices' float32 values of 1e38 (the wire codes them; their sum
    is beyond float32) do not overflow the sum."""
    rng = np.random.default_rng(2)
    f16 = rng.uniform(60000, 65504, (4, 64)).astype(np.float16)
    f32 = rng.uniform(0.9e38, 1e38, (4, 64)).astype(np.float32)
    for x, big in ((f16, 65504), (f32, np.finfo(np.float32).max)):
        got = np.asarray(sharded(functools.partial(dist.compressed_mean, axis_name="i",
                                                   config=CFG, method=method), n=4)(x))
        assert got.dtype == x.dtype and np.isfinite(got).all() and np.abs(got).max() <= big
        exact = np.mean(x.astype(np.float64), axis=0)
        np.testing.assert_allclose(got[0], exact, rtol=0.15)


@pytest.mark.parametrize("method", ["all_gather", "reduce_scatter"])
def test_one_device_mean_is_exact(method):
    """Nothing is sent on one device, so nothing is quantized: the mean is x itself."""
    x = np.random.default_rng(1).standard_normal((1, 3, 50)).astype(np.float32)
    f = sharded(functools.partial(dist.compressed_mean, axis_name="i", config=CFG,
                                  method=method), n=1)
    np.testing.assert_array_equal(f(x), x)


@pytest.mark.slow
def test_two_processes_jax_distributed(tmp_path, free_port):
    """Two processes (gloo collectives) give the same means as 4 devices in one process."""
    worker = os.path.join(os.path.dirname(__file__), "dist_worker.py")
    # Each worker sets its own device count; the run's other XLA flags (conftest's) stay.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, worker, str(free_port), str(i),
                               str(tmp_path / f"out{i}.npy")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    try:
        sys.path.insert(0, os.path.dirname(__file__))
        import dist_worker

        # The reference, computed (and compiled) here while the processes run.
        local = dist_worker.means(mesh(4), jnp.asarray(dist_worker.data(4)))
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, out.decode()[-3000:]
    finally:
        for p in procs:
            p.kill()
    for i in range(2):
        got = np.load(tmp_path / f"out{i}.npy")
        for k in range(len(dist.METHODS)):
            np.testing.assert_array_equal(got[k], np.asarray(local[k])[0])


@pytest.mark.parametrize("method", ["all_gather", "reduce_scatter"])
def test_one_device_axis_is_replicated_as_pmean(method):
    """On a one-device axis the mean is x, typed as pmean's (the same on every device), so
    out_specs=P() takes it as docs/dist.md's example does."""
    cfg = hq.HNLQConfig("D4", 4, 2)
    g = jax.random.normal(jax.random.key(0), (1, 1000))
    run = jax.jit(jax.shard_map(lambda g: dist.compressed_mean(g[0], "i", cfg, method),
                                mesh=mesh(1), in_specs=P("i"), out_specs=P()))
    np.testing.assert_array_equal(np.asarray(run(g)), np.asarray(g[0]))


@pytest.mark.parametrize("dither", [None, (0.1, -0.05, 0.02, 0.0)])
def test_all_zero_chunks_decode_to_zero(dither):
    """An all-zero chunk (a frozen parameter's gradient) is sent with the exponent ZERO and
    decodes to exactly 0, with a dither too; the chunk beside it as before."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2016, dither=dither)
    lay = wire.layout(2 * wire.CHUNK * 4, cfg)
    v = np.zeros(lay.size, np.float32)
    v[lay.size // 2:] = np.random.default_rng(5).standard_normal(lay.size // 2)
    payload, info = wire.encode(jnp.asarray(v), lay)
    exponents = np.asarray(payload).reshape(-1, lay.record_bytes)[:, -1].view(np.int8)
    np.testing.assert_array_equal(exponents, [wire.ZERO, exponents[1]])
    assert exponents[1] > wire.ZERO and int(info.failed) == 0
    out = np.asarray(wire.decode(payload, lay))
    np.testing.assert_array_equal(out[:lay.size // 2], 0)
    assert np.abs(out[lay.size // 2:] - v[lay.size // 2:]).max() < 0.5

"""QDense and QuantDotGeneral: Dense parity, compact cached codes, straight-through gradients,
compute paths, the inference form and its saved forms, config checks."""

import dataclasses
import functools
import re

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hnlq_jax as hq
import hnlq_jax.flax as hf
from hnlq_jax.flax import QDense, QuantDotGeneral
from hnlq_jax.rows import calibrate_rows, rows_codes, unit

CFG = hq.HNLQConfig("D4", 4, 2)
X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 30)), jnp.float32)  # 30: padded to 32


@pytest.fixture(scope="module")
def variables():
    return QDense(16, CFG).init(jax.random.key(0), X)


@pytest.fixture(scope="module")
def exported(variables):
    return hf.export_params(variables, CFG)


def _with_kernel(variables, kernel):
    return {**variables, "params": {**variables["params"], "kernel": kernel}}


def _init_on(module, params, x):
    """The variables of ``module`` initialized on ``params`` (beta and codes of that kernel)."""
    return {"params": params,
            **module.apply({"params": params}, x, deterministic=True, mutable=["hnlq"])[1]}


def test_parameter_tree_matches_dense(variables):
    dense = nn.Dense(16).init(jax.random.key(0), X)
    shapes = jax.tree.map(jnp.shape, {"params": variables["params"]})
    assert jax.tree.map(jnp.shape, dense) == shapes
    # A Dense checkpoint drives QDense, and QDense's parameters drive Dense.
    y = QDense(16, CFG).apply({**variables, "params": dense["params"]}, X, mutable=["hnlq"])[0]
    yd = nn.Dense(16).apply(dense, X)
    assert y.shape == yd.shape == (6, 16) and y.dtype == jnp.float32
    assert float(jnp.linalg.norm(y - yd) / jnp.linalg.norm(yd)) < 0.15  # ~4 bits per weight
    nn.Dense(16).apply({"params": variables["params"]}, X)
    h = variables["hnlq"]
    assert set(h) == {"beta", "codes", "error", "step"}
    np.testing.assert_allclose(h["error"], hq.decode(h["codes"]) - variables["params"]["kernel"].T,
                               rtol=0, atol=1e-6)  # the quantization error, [out, in]
    codes = h["codes"]
    assert isinstance(codes, hq.Codes) and codes.config == unit(CFG) and codes.n == 30
    assert codes.index.shape == (16, 8, 2) and codes.index.dtype == jnp.uint8
    assert codes.tfield.shape == (16, 4) and codes.tfield.dtype == jnp.uint8  # 4-bit T pairs
    assert codes.scale.shape == (16,) and codes.scale.dtype == jnp.float32
    # The one calibration routine, on the kernel's rows (output units).
    assert h["beta"].dtype == jnp.float32
    assert h["beta"] == calibrate_rows(variables["params"]["kernel"].T, CFG)
    assert 0.15 < float(h["beta"]) < 0.3
    v = QDense(16, CFG.replace(beta=0.3), calibrate=False).init(jax.random.key(0), X)
    assert v["hnlq"]["beta"] == np.float32(0.3)


def test_compact_memory():
    """A [1024, 1024] kernel at D4 q=4 M=2: 4 bits of index + 1 bit of T field per weight, plus
    one float32 scale per output unit; refreshing every step caches nothing else of the
    kernel's size, a refresh interval one float array of that size (the last refresh's
    quantization error).
    (The sizes follow from shapes and dtypes: traced, not computed.)"""
    x = jax.ShapeDtypeStruct((1, 1024), jnp.float32)
    v = jax.eval_shape(QDense(1024, CFG, use_bias=False, quantize_every=1).init,
                       jax.random.key(0), x)
    codes = v["hnlq"]["codes"]
    assert isinstance(codes, hq.Codes) and codes.shape == (1024, 1024)
    nbytes = {name: a.size * a.dtype.itemsize for name, a in
              (("index", codes.index), ("tfield", codes.tfield), ("scale", codes.scale))}
    assert 8 * (nbytes["index"] + nbytes["tfield"]) / 1024**2 == 5.0
    assert 8 * sum(nbytes.values()) / 1024**2 == 5.0 + 32 / 1024  # scales: 0.03 bit per weight
    floats = [a for a in jax.tree.leaves(v["hnlq"]) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert sum(a.size for a in floats) == 1024 + 1  # scales and beta: no w_hat
    cached = jax.eval_shape(QDense(1024, CFG, use_bias=False).init, jax.random.key(0), x)
    assert cached["hnlq"]["error"].shape == (1024, 1024)  # W_hat - kernel^T
    floats = [a for a in jax.tree.leaves(cached["hnlq"]) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert sum(a.size for a in floats) == 1024**2 + 1024 + 1


def test_half_precision_dtype_like_dense(variables):
    """dtype=bfloat16 computes in bfloat16 like nn.Dense; the codes are made in float32."""
    m = QDense(16, CFG, dtype=jnp.bfloat16)
    y = m.apply(variables, X, deterministic=True)
    yd = nn.Dense(16, dtype=jnp.bfloat16).apply({"params": variables["params"]}, X)
    assert y.dtype == yd.dtype == jnp.bfloat16
    y32 = QDense(16, CFG).apply(variables, X, deterministic=True)
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=0.05, atol=0.05)
    _, upd = m.apply(variables, X, mutable=["hnlq"])
    np.testing.assert_array_equal(upd["hnlq"]["codes"].index, variables["hnlq"]["codes"].index)


def test_quantized_kernel_is_the_codec(variables):
    """The cached codes are the codec's at unit beta on W^T / c (the numerics of the uint8
    labels / T / w_hat cache they replace), and the layer computes x @ W_hat."""
    W = np.asarray(variables["params"]["kernel"])
    codes = variables["hnlq"]["codes"]
    c = np.asarray(codes.scale)
    rms = np.sqrt(np.mean(W.T.astype(np.float64) ** 2, axis=1))
    # within 2^-11: hnlq_jax._numerics.mean_square rounds the entries to 12 significant bits
    np.testing.assert_allclose(c, float(variables["hnlq"]["beta"]) * rms, rtol=2**-11)
    ref = hq.encode(hq.to_blocks(jnp.asarray(W.T / c[:, None]), 4), unit(CFG))
    np.testing.assert_array_equal(codes.labels, ref.labels)
    np.testing.assert_array_equal(codes.T, ref.T)
    assert int(jnp.sum(codes.T > 0)) > 0  # some blocks overloaded
    w_hat = np.asarray(hq.from_blocks(hq.decode(ref), 30)) * c[:, None]
    np.testing.assert_array_equal(hq.decode(codes), w_hat)
    m = QDense(16, CFG, use_bias=False)
    v = {"params": {"kernel": variables["params"]["kernel"]}, "hnlq": variables["hnlq"]}
    np.testing.assert_allclose(m.apply(v, X, deterministic=True), np.asarray(X) @ w_hat.T,
                               rtol=1e-5, atol=1e-5)
    y, upd = m.apply(v, X, mutable=["hnlq"])  # a training call: fresh codes, the same
    np.testing.assert_array_equal(upd["hnlq"]["codes"].index, codes.index)
    np.testing.assert_allclose(y, np.asarray(X) @ w_hat.T, rtol=1e-5, atol=1e-5)


def _loss(module, variables, x, **kw):
    def f(params):
        out = module.apply({**variables, "params": params}, x, **kw)
        y = out[0] if isinstance(out, tuple) else out
        return jnp.sum(y * jnp.arange(y.shape[-1]))
    return f


def test_straight_through_gradients(variables):
    dense_grad = jax.grad(_loss(nn.Dense(16), {}, X))(variables["params"])
    g = jax.grad(_loss(QDense(16, CFG), variables, X, mutable=["hnlq"]))(variables["params"])
    np.testing.assert_allclose(g["kernel"], dense_grad["kernel"], rtol=1e-6)  # identity STE
    np.testing.assert_allclose(g["bias"], dense_grad["bias"], rtol=1e-6)
    gc = jax.grad(_loss(QDense(16, CFG, ste="clipped"), variables, X, mutable=["hnlq"]))(
        variables["params"])
    T = np.asarray(variables["hnlq"]["codes"].T)  # [16 out, 8 blocks]
    assert 0 < np.sum(T > 0) < T.size
    keep = np.repeat(T == 0, 4, axis=1)[:, :30].T  # [30 in, 16 out]
    np.testing.assert_array_equal(np.asarray(gc["kernel"])[~keep], 0)
    np.testing.assert_allclose(np.asarray(gc["kernel"])[keep],
                               np.asarray(dense_grad["kernel"])[keep], rtol=1e-6)
    # dL/dx goes through W_hat, not the float kernel.
    w_hat = hq.decode(variables["hnlq"]["codes"])  # [16, 30]
    gx = jax.grad(lambda x: jnp.sum(QDense(16, CFG).apply(variables, x, deterministic=True)
                                    * jnp.arange(16)))(X)
    np.testing.assert_allclose(gx, jnp.broadcast_to(jnp.arange(16.0) @ w_hat, X.shape),
                               rtol=1e-5, atol=1e-6)


def test_activation_quantization_gradient_and_values(variables):
    m = QDense(16, CFG, quantize_activations=True)
    y = m.apply(variables, X, deterministic=True)
    xq = hq.decode(rows_codes(X, CFG, hq.gaussian_beta(CFG)))
    assert float(jnp.abs(xq - X).max()) > 0
    y_ref = QDense(16, CFG).apply(variables, xq, deterministic=True)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    gx = jax.grad(lambda x: jnp.sum(m.apply(variables, x, deterministic=True)))(X)
    gx_ref = jax.grad(lambda x: jnp.sum(QDense(16, CFG).apply(variables, x, deterministic=True)))(X)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-6)  # straight through the activations
    y_jit = jax.jit(functools.partial(m.apply, deterministic=True))(variables, X)
    np.testing.assert_allclose(y_jit, y, rtol=1e-6, atol=1e-6)  # unpadded under jit


@pytest.mark.parametrize("compute,acts", [("lut", False), ("lut", True), ("kernel", False)])
def test_compute_paths_agree(variables, exported, compute, acts):
    y = QDense(16, CFG, quantize_activations=acts).apply(variables, X, deterministic=True)
    m = QDense(16, CFG, quantize_activations=acts, compute=compute)
    np.testing.assert_allclose(m.apply(variables, X, deterministic=True), y, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(m.apply(exported[0], X), y, rtol=1e-5, atol=1e-5)
    f = _loss(QDense(16, CFG, compute=compute), variables, X, deterministic=True)
    g_c = jax.grad(f)(variables["params"])
    g = jax.grad(_loss(QDense(16, CFG), variables, X, deterministic=True))(variables["params"])
    np.testing.assert_allclose(g_c["kernel"], g["kernel"], rtol=1e-5, atol=1e-6)


def test_deterministic_calls_use_the_current_kernel(variables):
    """Evaluation quantizes the kernel as it is (a cache may be steps old) and changes no
    training state; the inference form refuses codes cut from a training cache."""
    m = QDense(16, CFG, quantize_every=4)
    moved = _with_kernel(variables, variables["params"]["kernel"] * 3.0)
    fresh = QDense(16, CFG, quantize_every=1).apply(moved, X)  # codes of the moved kernel
    y, upd = m.apply(moved, X, deterministic=True, mutable=["hnlq"])
    np.testing.assert_array_equal(y, fresh)
    for a, b in zip(jax.tree.leaves(upd["hnlq"]), jax.tree.leaves(variables["hnlq"])):
        np.testing.assert_array_equal(a, b)  # cache, error and step untouched
    assert not np.array_equal(y, m.apply(variables, X, deterministic=True))
    cut = {"params": {"bias": moved["params"]["bias"]}, "hnlq": upd["hnlq"]}
    with pytest.raises(ValueError, match="hnlq/step, a training cache.*export_params"):
        m.apply(cut, X)


def test_quantize_every(variables):
    m = QDense(16, CFG, quantize_every=3)
    train = jax.jit(functools.partial(m.apply, mutable=["hnlq"]))
    v = variables
    kernels, cached, outputs = [], [], []
    for i in range(7):
        v = _with_kernel(v, variables["params"]["kernel"] * (1 + i / 8))
        y, upd = train(v, X)
        v = {**v, "hnlq": upd["hnlq"]}
        kernels.append(v["params"]["kernel"])
        cached.append(v["hnlq"]["codes"])
        outputs.append(y)
    assert int(v["hnlq"]["step"]) == 7
    for i in range(7):
        src = i - i % 3  # refreshed at steps 0, 3, 6
        fresh = hf._kernel_codes(kernels[src], CFG, v["hnlq"]["beta"]).scale
        np.testing.assert_allclose(cached[i].scale, fresh, rtol=1e-6)
        # Between refreshes the forward weight is the cached codes' plus the kernel's drift
        # since they were made (zero at a refresh): the layer follows its kernel.
        w = hq.decode(cached[i]).T + (kernels[i] - kernels[src])
        np.testing.assert_allclose(outputs[i], X @ w + v["params"]["bias"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v["hnlq"]["error"], hq.decode(cached[6]) - kernels[6].T, rtol=0,
                               atol=1e-6)
    assert not np.allclose(cached[2].scale, cached[3].scale)
    assert not np.allclose(outputs[1], outputs[0])  # a cached step still moves
    # Without a mutable collection there is no cache to keep: the call quantizes afresh.
    moved = _with_kernel(v, kernels[-1] * 3)
    fresh_y = QDense(16, CFG, quantize_every=1).apply(moved, X)
    np.testing.assert_array_equal(m.apply(moved, X), fresh_y)
    np.testing.assert_array_equal(m.apply(moved, X, deterministic=True), fresh_y)
    refreshed = hf.refresh_codes(v, CFG)
    np.testing.assert_allclose(refreshed["hnlq"]["codes"].scale,
                               hf._kernel_codes(kernels[-1], CFG, v["hnlq"]["beta"]).scale,
                               rtol=1e-6)


def test_quantize_every_zero_is_manual(variables):
    """quantize_every=0: training calls use the cache (gradients still flow); refresh_codes
    from the loop updates it."""
    m = QDense(16, CFG, quantize_every=0)
    kernel = variables["params"]["kernel"]
    moved = _with_kernel(variables, kernel * 2.0)
    y, upd = m.apply(moved, X, mutable=["hnlq"])
    for a, b in zip(jax.tree.leaves(upd["hnlq"]["codes"]),
                    jax.tree.leaves(variables["hnlq"]["codes"])):
        np.testing.assert_array_equal(a, b)
    # The cached codes' weights plus how far the kernel moved since they were made.
    w_hat = hq.decode(variables["hnlq"]["codes"]).T
    np.testing.assert_allclose(y, X @ (w_hat + kernel) + moved["params"]["bias"], rtol=1e-5,
                               atol=1e-5)
    g = jax.grad(_loss(m, moved, X, mutable=["hnlq"]))(moved["params"])
    assert float(jnp.abs(g["kernel"]).sum()) > 0
    fresh = hf.refresh_codes(moved, CFG)["hnlq"]["codes"]
    np.testing.assert_allclose(fresh.scale, 2.0 * np.asarray(variables["hnlq"]["codes"].scale),
                               rtol=1e-6)
    refreshed = hf.refresh_codes(moved, CFG)["hnlq"]
    np.testing.assert_allclose(refreshed["error"], hq.decode(refreshed["codes"]) - 2.0 * kernel.T,
                               rtol=0, atol=1e-6)


def test_variables_without_error_train_with_another_interval():
    """Variables made at quantize_every=1 hold no error: an immutable training apply at another
    interval computes without it (exactly the cached codes' weights, or fresh codes), a mutable
    one adds it (W_hat - kernel^T of the cached codes)."""
    v1 = QDense(16, CFG, quantize_every=1).init(jax.random.key(0), X)
    assert "error" not in v1["hnlq"]
    w_hat = hq.decode(v1["hnlq"]["codes"]).T
    expect = X @ w_hat + v1["params"]["bias"]
    for every in (0, 16):
        m = QDense(16, CFG, quantize_every=every)
        np.testing.assert_allclose(m.apply(v1, X), expect, rtol=1e-5, atol=1e-5)
        _, upd = m.apply(v1, X, mutable=["hnlq"])
        np.testing.assert_allclose(upd["hnlq"]["error"], w_hat.T - v1["params"]["kernel"].T,
                                   rtol=0, atol=1e-6)


def test_jit_vmap_and_batch_sizes(variables, exported):
    m = QDense(16, CFG, quantize_activations=True)
    f = jax.jit(functools.partial(m.apply, deterministic=True))
    np.testing.assert_allclose(f(variables, X), m.apply(variables, X, deterministic=True),
                               rtol=1e-6, atol=1e-6)
    xs = jnp.stack([X, 2 * X])
    yv = jax.vmap(lambda x: m.apply(variables, x, deterministic=True))(xs)
    np.testing.assert_allclose(yv[1], m.apply(variables, 2 * X, deterministic=True), rtol=1e-5,
                               atol=1e-5)
    assert m.apply(variables, xs, deterministic=True).shape == (2, 6, 16)  # leading dims
    # Every batch size under one jitted function (training form and inference form) gives the
    # rows of the full batch.
    g = jax.jit(functools.partial(QDense(16, CFG).apply, deterministic=True))
    y_full, y_inf = g(variables, X), g(exported[0], X)
    np.testing.assert_array_equal(y_inf, y_full)
    for b in (1, 2, 5):
        np.testing.assert_allclose(g(variables, X[:b]), y_full[:b], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(g(exported[0], X[:b]), y_full[:b], rtol=1e-6, atol=1e-6)


def test_eager_batch_sizes_compile_log_many_times(variables, compiles):
    """Eager activation quantization pads the rows to an ops.bucket of blocks (at least 1024):
    batches of 3, 4, 5 and 7 rows of 8 blocks compile the encoder at most once, for 128 rows
    (none when the kernel's codes, 64 rows of 8 blocks, compiled that bucket already)."""
    m = QDense(16, CFG, quantize_activations=True)
    ys = {b: m.apply(variables, X[:1].repeat(b, 0), deterministic=True) for b in (3, 4, 5, 7)}
    assert compiles.count("jit(encode_flat)") <= 1, compiles
    for b, y in ys.items():
        np.testing.assert_array_equal(y, jnp.broadcast_to(ys[3][0], y.shape))


def test_empty_batch(variables, exported):
    x0 = jnp.zeros((0, 30), jnp.float32)
    for compute in ("decode", "lut"):
        for acts in (False, True):
            m = QDense(16, CFG, compute=compute, quantize_activations=acts)
            assert m.apply(variables, x0, deterministic=True).shape == (0, 16)
            assert m.apply(exported[0], x0).shape == (0, 16)
            assert m.apply(variables, x0, mutable=["hnlq"])[0].shape == (0, 16)
    m = QDense(16, CFG, quantize_activations=True)
    y, _ = jax.jit(functools.partial(m.apply, mutable=["hnlq"]))(variables, x0)  # unpadded
    assert y.shape == (0, 16)
    g = jax.grad(_loss(QDense(16, CFG), variables, x0, mutable=["hnlq"]))(variables["params"])
    np.testing.assert_array_equal(g["kernel"], 0)


def _train(net, x, y, steps=60):
    v = net.init(jax.random.key(1), x)
    opt = optax.adam(1e-2)
    state = opt.init(v["params"])

    @jax.jit
    def step(v, state):
        def loss(p):
            out, upd = net.apply({**v, "params": p}, x, mutable=["hnlq"])
            return jnp.mean((out - y) ** 2), upd
        (l, upd), g = jax.value_and_grad(loss, has_aux=True)(v["params"])
        u, state = opt.update(g, state)
        return {**v, **upd, "params": optax.apply_updates(v["params"], u)}, state, l

    losses = []
    for _ in range(steps):
        v, state, l = step(v, state)
        losses.append(float(l))
    return v, losses


def test_refresh_interval_trains_like_every_step():
    """Adam 1e-2 on a small regression MLP: with the default refresh interval the loss falls
    as with re-quantizing every step (a layer that stood still between refreshes made Adam
    overshoot: the loss rose above its start)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 16)), jnp.float32)
    y = jnp.sin(jnp.sum(x, axis=1, keepdims=True))

    class Net(nn.Module):
        every: int

        @nn.compact
        def __call__(self, x):
            dense = functools.partial(QDense, config=CFG, quantize_every=self.every)
            return dense(1)(nn.relu(dense(64)(x)))

    _, cached = _train(Net(hf.QUANTIZE_EVERY), x, y)
    _, every = _train(Net(1), x, y)
    assert max(cached[1:]) < cached[0]
    assert cached[-1] < 0.3 * cached[0] and cached[-1] < 1.5 * every[-1]


def test_training_reduces_loss_like_float():
    """QAT (two QDense layers) against the same network in float32 (nn.Dense)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(128, 12)), jnp.float32)
    y = x @ jnp.asarray(rng.normal(size=(12, 3)), jnp.float32)

    class Net(nn.Module):
        quantized: bool

        @nn.compact
        def __call__(self, x):
            if self.quantized:
                hidden = QDense(32, CFG, quantize_every=1)
                return QDense(3, CFG, quantize_every=2)(nn.relu(hidden(x)))
            return nn.Dense(3)(nn.relu(nn.Dense(32)(x)))

    v, q_losses = _train(Net(True), x, y)
    _, f_losses = _train(Net(False), x, y)
    assert q_losses[-1] < 0.3 * q_losses[0]
    assert q_losses[-1] < 2.0 * f_losses[-1] + 0.05
    inference, _ = hf.export_params(v, CFG)  # the trained model deploys as codes
    out = Net(True).apply(inference, x)
    assert float(jnp.mean((out - y) ** 2)) < 0.3 * q_losses[0]


@pytest.mark.parametrize("calibrate", [True, False])
def test_dot_general_hook_same_beta_as_qdense(calibrate):
    """linen Dense(dot_general_cls) and nnx.Linear(dot_general) give the outputs and gradients
    of a QDense initialized on the same kernel exactly: the same beta rule, the same codes."""
    cfg = CFG.replace(beta=0.3)
    hook = functools.partial(QuantDotGeneral, config=cfg, calibrate=calibrate)
    dense = nn.Dense(16, dot_general_cls=hook)
    p = dense.init(jax.random.key(2), X)
    qd = QDense(16, cfg, calibrate=calibrate, quantize_every=1)  # as the hook: no cache
    v = _init_on(qd, p["params"], X)
    kernel_t = p["params"]["kernel"].T
    assert v["hnlq"]["beta"] == (calibrate_rows(kernel_t, cfg) if calibrate else np.float32(0.3))
    y_ref = qd.apply(v, X, mutable=["hnlq"])[0]
    np.testing.assert_array_equal(dense.apply(p, X), y_ref)
    # Another beta gives other outputs: the equality above is not vacuous.
    qd_other = QDense(16, cfg, calibrate=not calibrate, quantize_every=1)
    other = qd_other.apply(_init_on(qd_other, p["params"], X), X, mutable=["hnlq"])[0]
    assert float(jnp.abs(other - y_ref).max()) > 1e-3
    lin = nnx.Linear(30, 16, dot_general=QuantDotGeneral(cfg, calibrate=calibrate),
                     rngs=nnx.Rngs(0))
    params = {"kernel": lin.kernel[...], "bias": lin.bias[...]}
    y_q = qd.apply(_init_on(qd, params, X), X, mutable=["hnlq"])[0]
    np.testing.assert_array_equal(lin(X), y_q)
    dn = (((1,), (0,)), ((), ()))
    g = jax.grad(lambda k: jnp.sum(QuantDotGeneral(cfg, calibrate=calibrate)(X, k, dn)))(
        lin.kernel[...])
    np.testing.assert_allclose(g, jnp.broadcast_to(X.sum(0)[:, None], g.shape), rtol=1e-6)


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(x, y)


def test_export_holds_codes_scales_and_bias_only(variables, exported):
    inference, report = exported
    assert set(inference) == {"params", "hnlq"}
    assert set(inference["params"]) == {"bias"} and set(inference["hnlq"]) == {"codes"}
    codes = inference["hnlq"]["codes"]
    assert isinstance(codes, hq.Codes) and codes.config == unit(CFG)
    # 30 x 16 float32 kernel + bias vs 16 x 8 blocks of 2 index bytes, 16 x 4 T-field bytes,
    # 16 float32 scales and the bias.
    sizes = report.sizes
    assert report.converted == [("", "QDense", (16, 30))] and sizes == hf.model_sizes(inference)
    assert sizes.layers == 1 and sizes.weights == 16 * 30
    assert sizes.float32_bytes == 4 * (30 * 16 + 16)
    assert sizes.quantized_bytes == 16 * 8 * 2 + 16 * 4 + 4 * 16 + 4 * 16
    assert sizes.quantized_bytes == sum(a.nbytes for a in jax.tree.leaves(inference))
    assert sizes.bits_per_weight == codes.bits_per_value() == 8 * codes.nbytes / (16 * 30)
    assert sizes.packed_code_bytes == hq.pack(codes).nbytes < sizes.code_bytes
    assert sizes.ratio_to_float32 == sizes.quantized_bytes / sizes.float32_bytes
    m = QDense(16, CFG)
    np.testing.assert_array_equal(m.apply(inference, X),
                                  m.apply(hf.refresh_codes(variables, CFG), X, deterministic=True))
    with pytest.raises(ValueError, match="no kernel"):
        hf.refresh_codes(inference, CFG)


def test_saved_inference_form_round_trips_bit_exact(exported, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    inference = exported[0]
    m = QDense(16, CFG)
    y = m.apply(inference, X)
    data = flax.serialization.to_bytes(inference)
    back = flax.serialization.from_bytes(inference, data)  # restored into a template
    _assert_tree_equal(back, inference)
    np.testing.assert_array_equal(m.apply(back, X), y)
    state = flax.serialization.msgpack_restore(data)
    assert state["hnlq"]["codes"]["format_version"] == hq.FORMAT_VERSION
    assert hq.HNLQConfig(**state["hnlq"]["codes"]["config"]) == unit(CFG)
    imported = hf.import_params(state, CFG)  # no template needed
    _assert_tree_equal(imported, inference)
    np.testing.assert_array_equal(m.apply(imported, X), y)
    _assert_tree_equal(hf.import_params(state), inference)  # the saved config itself
    saved = jax.device_get(flax.serialization.to_state_dict(inference))
    as_numpy = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray)
                            if isinstance(a, np.ndarray) else ocp.RestoreArgs(), saved)
    with ocp.PyTreeCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", saved)
        restored = hf.import_params(ckpt.restore(tmp_path / "ckpt", restore_args=as_numpy), CFG)
    _assert_tree_equal(restored, inference)
    np.testing.assert_array_equal(m.apply(restored, X), y)
    # beta lives in the scales: a model built with another beta reads the same codes.
    np.testing.assert_array_equal(QDense(16, CFG.replace(beta=0.5)).apply(
        hf.import_params(state, CFG.replace(beta=0.5)), X), y)


def test_codes_of_a_dithered_config_round_trip_through_msgpack():
    """The saved config's dither is a list: flax's msgpack refuses tuples."""
    cfg = hq.HNLQConfig(dither=(0.1, 0.2, 0.3, 0.4))
    codes = hq.encode(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32), cfg)
    back = flax.serialization.from_bytes({"c": codes},
                                         flax.serialization.to_bytes({"c": codes}))["c"]
    assert back.config == cfg
    np.testing.assert_array_equal(back.index, codes.index)
    np.testing.assert_array_equal(back.tfield, codes.tfield)
    np.testing.assert_array_equal(hq.decode(back), hq.decode(codes))


def test_saved_training_form_round_trips(variables):
    data = flax.serialization.to_bytes(variables)
    back = flax.serialization.from_bytes(variables, data)
    _assert_tree_equal(back, variables)
    m = QDense(16, CFG)
    np.testing.assert_array_equal(m.apply(back, X, deterministic=True),
                                  m.apply(variables, X, deterministic=True))


def test_other_config_or_format_version_refused(variables, exported):
    inference = exported[0]
    state = flax.serialization.msgpack_restore(flax.serialization.to_bytes(inference))
    z4 = hq.HNLQConfig("Z4", 4, 2)
    for other in (z4, CFG.replace(alpha=0.5), CFG.replace(max_T=20)):
        with pytest.raises(ValueError, match=re.escape(f"saved with {unit(CFG)}, but "
                                                       f"{unit(other)} is expected")):
            hf.import_params(state, other)
        with pytest.raises(ValueError, match="were made with"):  # in memory: the layer checks
            QDense(16, other).apply(inference, X)
        with pytest.raises(ValueError, match="were made with"):
            QDense(16, other).apply(variables, X, deterministic=True)
    with pytest.raises(ValueError, match="saved with"):  # a template of another config
        target = QDense(16, z4).init(jax.random.key(0), X)
        flax.serialization.from_bytes(target, flax.serialization.to_bytes(variables))
    codes_state = state["hnlq"]["codes"]
    newer = {**state, "hnlq": {"codes": {**codes_state,
                                         "format_version": hq.FORMAT_VERSION + 1}}}
    with pytest.raises(ValueError, match=f"format version {hq.FORMAT_VERSION + 1}.*reads format "
                                         f"version {hq.FORMAT_VERSION}"):
        hf.import_params(newer, CFG)
    old = {**state, "hnlq": {"codes": {"data": np.zeros(4, np.uint8), "T": np.zeros(2)}}}
    with pytest.raises(ValueError, match="holds no QDense codes"):
        hf.import_params(old, CFG)
    # One T field byte per block (the 8-bit layout) where this config packs two.
    corrupted = {**state, "hnlq": {"codes": {**codes_state, "tfield": np.zeros((16, 8), np.uint8)}}}
    with pytest.raises(ValueError, match=r"expected a uint8 T field of shape \[16, 4\]"):
        hf.import_params(corrupted, CFG)
    with pytest.raises(ValueError, match=r"expected row codes of a kernel\^T \[8, 30\]"):
        QDense(8, CFG).apply(inference, X)
    with pytest.raises(ValueError, match="holds training state.*export_params"):
        hf.import_params(flax.serialization.to_state_dict(variables), CFG)
    # Codes without their row scales would decode W / c: refused however they arrive.
    # (without a checksum too, which would refuse the edit before the layer sees it)
    unscaled = {**state, "hnlq": {"codes": {**{k: v for k, v in codes_state.items()
                                                if "crc32" not in k}, "scale": None}}}
    with pytest.raises(ValueError, match="do not match their saved CRC-32"):
        hf.import_params({**state, "hnlq": {"codes": {**codes_state, "scale": None}}}, CFG)
    for restored in (hf.import_params(unscaled, CFG),
                     flax.serialization.from_state_dict(inference, unscaled)):
        with pytest.raises(ValueError, match="codes have no row scales"):
            QDense(16, CFG).apply(restored, X)
    # the row length is an int as saved: 29.9 is refused, not truncated to 29
    for n in (29.9, "30", [30]):
        edited = {**state, "hnlq": {"codes": {**codes_state, "n": n}}}
        with pytest.raises(ValueError, match=r"saved row length n must be an int >= 0 or None"):
            hf.import_params(edited, CFG)
    with pytest.raises(ValueError, match="expected variables with a 'hnlq' collection"):
        hf.import_params({**state, "hnlq": 3}, CFG)
    frozen = hf.import_params({**state, "hnlq": flax.core.freeze(state["hnlq"])}, CFG)
    np.testing.assert_array_equal(frozen["hnlq"]["codes"].index, codes_state["index"])
    with pytest.raises(ValueError, match="expected variables with a 'hnlq' collection"):
        hf.import_params(None, CFG)


@pytest.mark.parametrize("field", ["index", "tfield", "scale"])
def test_saved_codes_checksum(exported, field):
    """A flipped bit that keeps every value in range is refused by the CRC-32 the saved codes
    carry, on import and on a restore into a template; without a checksum (saved before they
    were recorded) they load."""
    inference = exported[0]
    state = flax.serialization.msgpack_restore(flax.serialization.to_bytes(inference))
    codes_state = state["hnlq"]["codes"]
    arr = np.array(codes_state[field])
    arr.reshape(-1).view(np.uint8)[0] ^= 1 if field != "scale" else 0x10
    flipped = {**state, "hnlq": {"codes": {**codes_state, field: arr}}}
    match = r"import_params: layer \(root\): the code arrays do not match their saved CRC-32"
    with pytest.raises(ValueError, match=match):
        hf.import_params(flipped, CFG)
    with pytest.raises(ValueError, match="do not match their saved CRC-32"):
        flax.serialization.from_state_dict(inference, flipped)
    # both checksums gone: saved before they were recorded (one alone: an edit)
    unchecked = {**state, "hnlq": {"codes": {k: v for k, v in flipped["hnlq"]["codes"].items()
                                             if "crc32" not in k}}}
    hf.import_params(unchecked, CFG)
    renamed = {**state, "hnlq": {"codes": {("crc3x" if k == "crc32" else k): v
                                           for k, v in flipped["hnlq"]["codes"].items()}}}
    with pytest.raises(ValueError, match="a header checksum but no checksum of their arrays"):
        hf.import_params(renamed, CFG)
    assert codes_state["crc32"] == hq.codes.checksum(*(inference["hnlq"]["codes"].index,
                                                       inference["hnlq"]["codes"].tfield,
                                                       inference["hnlq"]["codes"].scale))


@pytest.mark.parametrize("edit", [("alpha", 2.0), ("max_T", 13), ("n", 29)])
def test_saved_codes_header_checksum(exported, edit):
    """A saved header edited into another valid one (alpha, max_T, the row length), which
    import_params without a config would take, is refused by the header's CRC-32; codes saved
    before it was recorded load."""
    inference = exported[0]
    state = flax.serialization.msgpack_restore(flax.serialization.to_bytes(inference))
    codes_state = dict(state["hnlq"]["codes"])
    key, value = edit
    if key == "n":
        codes_state["n"] = value
    else:
        codes_state["config"] = {**codes_state["config"], key: value}
    edited = {**state, "hnlq": {"codes": codes_state}}
    with pytest.raises(ValueError, match=r"import_params: layer \(root\): the saved header "
                                         r".* does not match its saved CRC-32"):
        hf.import_params(edited)
    del codes_state["header_crc32"]
    hf.import_params(edited)  # unchecked: the older form


def test_bad_knobs():
    for kw, msg in (({"ste": "round"}, "ste must be one of"),
                    ({"compute": "fast"}, "compute must be one of"),
                    ({"quantize_every": -1}, "quantize_every must be an int >= 0")):
        with pytest.raises(ValueError, match=msg):
            QDense(4, CFG, **kw).init(jax.random.key(0), X)
    with pytest.raises(TypeError, match="HNLQConfig"):
        QDense(4, "D4").init(jax.random.key(0), X)
    with pytest.raises(ValueError, match="ste must be one of"):
        QuantDotGeneral(CFG, ste="x")
    with pytest.raises(ValueError, match="Dense contraction"):
        QuantDotGeneral(CFG)(X, jnp.ones((16, 30)), (((0,), (1,)), ((), ())))
    with pytest.raises(ValueError, match="'hnlq' collection"):
        hf.export_params({"params": {}}, CFG)
    with pytest.raises(ValueError, match="neither params/kernel nor hnlq/codes"):
        QDense(4, CFG).apply({"params": {}}, X)
    with pytest.raises(TypeError, match="config must be an HNLQConfig"):
        hf.import_params({}, dataclasses.asdict(CFG))


def test_corrupted_error_cache_refused():
    # The training forward adds hnlq/error to the kernel: a NaN made NaN outputs, another
    # shape a NumPy broadcasting error.
    module = QDense(4, CFG, quantize_every=4)
    variables = module.init(jax.random.key(0), X)
    error = variables["hnlq"]["error"]
    for bad, msg in ((error.at[1, 2].set(jnp.nan), r"hnlq/error: the cached quantization error"),
                     (jnp.zeros((3, 3)), r"hnlq/error must be \[4, 30\]")):
        broken = {**variables, "hnlq": {**variables["hnlq"], "error": bad, "step": 1}}
        with pytest.raises(ValueError, match=msg):
            module.apply(broken, X, mutable=["hnlq"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
def test_corrupted_beta_refused(bad):
    # A restored training form with a bad beta: every eager call refuses it, the training
    # call included (it would code the kernel at that beta).
    module = QDense(4, CFG)
    variables = module.init(jax.random.key(0), X)
    broken = {**variables, "hnlq": {**variables["hnlq"], "beta": jnp.float32(bad)}}
    for kw in ({}, {"mutable": ["hnlq"]}):
        with pytest.raises(ValueError, match=r"hnlq/beta: beta must be a positive finite"):
            module.apply(broken, X, **kw)

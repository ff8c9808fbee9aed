"""QDense and QuantDotGeneral: Dense parity, straight-through gradients, caching, compute paths."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hnlq_jax as hq
import hnlq_jax.flax as hf
from hnlq_jax.rows import rows_codes, rows_decode
from hnlq_jax.flax import QDense, QuantDotGeneral

CFG = hq.HNLQConfig("D4", 4, 2)
X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 30)), jnp.float32)  # 30: padded to 32


@pytest.fixture(scope="module")
def variables():
    return QDense(16, CFG).init(jax.random.key(0), X)


def test_parameter_tree_matches_dense(variables):
    dense = nn.Dense(16).init(jax.random.key(0), X)
    assert jax.tree.map(jnp.shape, dense) == jax.tree.map(jnp.shape, {"params": variables["params"]})
    # A Dense checkpoint drives QDense, and QDense's parameters drive Dense.
    y = QDense(16, CFG).apply({**variables, "params": dense["params"]}, X, mutable=["hnlq"])[0]
    yd = nn.Dense(16).apply(dense, X)
    assert y.shape == yd.shape == (6, 16) and y.dtype == jnp.float32
    assert float(jnp.linalg.norm(y - yd) / jnp.linalg.norm(yd)) < 0.15  # ~4 bits per weight
    nn.Dense(16).apply({"params": variables["params"]}, X)
    h = variables["hnlq"]
    assert h["labels"].shape == (16, 8, 2, 4) and h["labels"].dtype == jnp.uint8
    assert h["T"].shape == (16, 8) and h["T"].dtype == jnp.int8
    assert 0.15 < float(h["beta"]) < 0.3  # calibrated on the normalized Gaussian kernel


def test_half_precision_dtype_like_dense(variables):
    """dtype=bfloat16 computes in bfloat16 like nn.Dense; the codes are made in float32."""
    m = QDense(16, CFG, dtype=jnp.bfloat16)
    y = m.apply(variables, X, deterministic=True)
    yd = nn.Dense(16, dtype=jnp.bfloat16).apply({"params": variables["params"]}, X)
    assert y.dtype == yd.dtype == jnp.bfloat16
    y32 = QDense(16, CFG).apply(variables, X, deterministic=True)
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=0.05, atol=0.05)
    _, upd = m.apply(variables, X, mutable=["hnlq"])
    np.testing.assert_array_equal(upd["hnlq"]["labels"], variables["hnlq"]["labels"])


def test_quantized_kernel_is_the_codec(variables):
    """W_hat column j = c_j * decode(encode(W[:, j] / c_j)) with the codec at unit beta."""
    W = np.asarray(variables["params"]["kernel"])
    c = np.asarray(variables["hnlq"]["scale"])
    cfg1 = CFG.replace(beta=1.0)
    codes = hq.encode(hq.to_blocks(jnp.asarray(W.T / c[:, None]), 4), cfg1)
    np.testing.assert_array_equal(codes.labels, variables["hnlq"]["labels"])
    np.testing.assert_array_equal(codes.T, variables["hnlq"]["T"])
    rms = np.sqrt(np.mean(W.T.astype(np.float64) ** 2, axis=1))
    np.testing.assert_allclose(c, float(variables["hnlq"]["beta"]) * rms, rtol=1e-6)
    w_hat = np.asarray(hq.from_blocks(hq.decode(codes, cfg1), 30)) * c[:, None]
    y = QDense(16, CFG, use_bias=False).apply(
        {"params": {"kernel": variables["params"]["kernel"]}, "hnlq": variables["hnlq"]}, X,
        deterministic=True)
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
    T = np.asarray(variables["hnlq"]["T"])  # [16 out, 8 blocks]
    assert 0 < np.sum(T > 0) < T.size
    keep = np.repeat(T == 0, 4, axis=1)[:, :30].T  # [30 in, 16 out]
    np.testing.assert_array_equal(np.asarray(gc["kernel"])[~keep], 0)
    np.testing.assert_allclose(np.asarray(gc["kernel"])[keep],
                               np.asarray(dense_grad["kernel"])[keep], rtol=1e-6)


def test_activation_quantization_gradient_and_values(variables):
    m = QDense(16, CFG, quantize_activations=True)
    y = m.apply(variables, X, deterministic=True)
    beta = hf.gaussian_beta(CFG)
    xq = rows_decode(*rows_codes(X, CFG, beta), CFG, 30, jnp.float32)
    assert float(jnp.abs(xq - X).max()) > 0
    y_ref = QDense(16, CFG).apply(variables, xq, deterministic=True)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    gx = jax.grad(lambda x: jnp.sum(m.apply(variables, x, deterministic=True)))(X)
    gx_ref = jax.grad(lambda x: jnp.sum(QDense(16, CFG).apply(variables, x, deterministic=True)))(X)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-6)  # straight through the activations


@pytest.mark.parametrize("compute,acts", [("lut", False), ("lut", True), ("kernel", False)])
def test_compute_paths_agree(variables, compute, acts):
    y = QDense(16, CFG, quantize_activations=acts).apply(variables, X, deterministic=True)
    yc = QDense(16, CFG, quantize_activations=acts, compute=compute).apply(variables, X,
                                                                           deterministic=True)
    np.testing.assert_allclose(yc, y, rtol=1e-5, atol=1e-5)
    f = _loss(QDense(16, CFG, compute=compute), variables, X, deterministic=True)
    g_c = jax.grad(f)(variables["params"])
    g = jax.grad(_loss(QDense(16, CFG), variables, X, deterministic=True))(variables["params"])
    np.testing.assert_allclose(g_c["kernel"], g["kernel"], rtol=1e-5, atol=1e-6)


def test_inference_uses_cached_codes(variables, monkeypatch):
    calls = []
    real = hf._kernel_codes
    monkeypatch.setattr(hf, "_kernel_codes", lambda *a: calls.append(1) or real(*a))
    m = QDense(16, CFG)
    y0 = m.apply(variables, X, deterministic=True)
    moved = {**variables, "params": {**variables["params"],
                                     "kernel": variables["params"]["kernel"] * 3.0}}
    y1 = m.apply(moved, X, deterministic=True)
    assert calls == []  # never re-quantized in inference
    np.testing.assert_array_equal(y0, y1)  # the cached codes, not the moved kernel
    m.apply(moved, X, mutable=["hnlq"])
    assert len(calls) == 1  # training re-quantizes


def test_quantize_every(variables):
    m = QDense(16, CFG, quantize_every=3)
    train = jax.jit(functools.partial(m.apply, mutable=["hnlq"]))
    v = variables
    kernels, cached = [], []
    for i in range(7):
        v = {**v, "params": {**v["params"], "kernel": variables["params"]["kernel"] * (1 + i / 8)}}
        _, upd = train(v, X)
        v = {**v, "hnlq": upd["hnlq"]}
        kernels.append(v["params"]["kernel"])
        cached.append(np.asarray(v["hnlq"]["scale"]))
    assert int(v["hnlq"]["step"]) == 7
    for i in range(7):
        src = i - i % 3  # refreshed at steps 0, 3, 6
        fresh = hf._kernel_codes(kernels[src], CFG, v["hnlq"]["beta"])[1]
        np.testing.assert_allclose(cached[i], fresh, rtol=1e-6)
    assert not np.allclose(cached[2], cached[3])
    with pytest.raises(ValueError, match=r"mutable=\['hnlq'\]"):
        m.apply(v, X)
    refreshed = hf.refresh_codes(v, CFG)
    np.testing.assert_allclose(refreshed["hnlq"]["scale"],
                               hf._kernel_codes(kernels[-1], CFG, v["hnlq"]["beta"])[1], rtol=1e-6)


def test_quantize_every_zero_is_manual(variables):
    """quantize_every=0: training calls use the cache (gradients still flow); refresh_codes
    from the loop updates it."""
    m = QDense(16, CFG, quantize_every=0)
    moved = {**variables, "params": {**variables["params"],
                                     "kernel": variables["params"]["kernel"] * 2.0}}
    y, upd = m.apply(moved, X, mutable=["hnlq"])
    for name in ("labels", "T", "scale", "w_hat"):
        np.testing.assert_array_equal(upd["hnlq"][name], variables["hnlq"][name])
    np.testing.assert_array_equal(y, m.apply(variables, X, deterministic=True))
    g = jax.grad(_loss(m, moved, X, mutable=["hnlq"]))(moved["params"])
    assert float(jnp.abs(g["kernel"]).sum()) > 0
    fresh = hf.refresh_codes(moved, CFG)["hnlq"]
    np.testing.assert_allclose(fresh["scale"], 2.0 * np.asarray(variables["hnlq"]["scale"]),
                               rtol=1e-6)


def test_jit_and_vmap(variables):
    m = QDense(16, CFG, quantize_activations=True)
    f = jax.jit(functools.partial(m.apply, deterministic=True))
    np.testing.assert_allclose(f(variables, X), m.apply(variables, X, deterministic=True),
                               rtol=1e-6, atol=1e-6)
    xs = jnp.stack([X, 2 * X])
    yv = jax.vmap(lambda x: m.apply(variables, x, deterministic=True))(xs)
    np.testing.assert_allclose(yv[1], m.apply(variables, 2 * X, deterministic=True), rtol=1e-5,
                               atol=1e-5)
    y3 = m.apply(variables, xs, deterministic=True)  # [2, 6, 30] leading dims
    assert y3.shape == (2, 6, 16)


def test_training_reduces_loss():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(128, 12)), jnp.float32)
    y = x @ jnp.asarray(rng.normal(size=(12, 3)), jnp.float32)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return QDense(3, CFG, quantize_every=2)(nn.relu(QDense(32, CFG)(x)))

    net = Net()
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
        return {"params": optax.apply_updates(v["params"], u), **upd}, state, l

    losses = []
    for _ in range(60):
        v, state, l = step(v, state)
        losses.append(float(l))
    assert losses[-1] < 0.3 * losses[0]


def test_dot_general_hook():
    """linen Dense(dot_general_cls) and nnx.Linear(dot_general) = QDense with the same beta."""
    beta = hf.gaussian_beta(CFG)
    hook = functools.partial(QuantDotGeneral, config=CFG)
    dense = nn.Dense(16, dot_general_cls=hook)
    p = dense.init(jax.random.key(2), X)
    fixed = QDense(16, CFG.replace(beta=beta), calibrate=False)
    v = fixed.init(jax.random.key(2), X)
    y_ref = fixed.apply({**v, "params": p["params"]}, X, mutable=["hnlq"])[0]
    # The same codes; the channel scales may differ by an ulp between eager and compiled code.
    np.testing.assert_allclose(dense.apply(p, X), y_ref, rtol=1e-5, atol=1e-6)
    lin = nnx.Linear(30, 16, dot_general=QuantDotGeneral(CFG), rngs=nnx.Rngs(0))
    y = lin(X)
    y_q = fixed.apply({"params": {"kernel": lin.kernel[...], "bias": lin.bias[...]},
                       "hnlq": v["hnlq"]}, X, mutable=["hnlq"])[0]
    np.testing.assert_allclose(y, y_q, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda k: jnp.sum(QuantDotGeneral(CFG)(X, k, (((1,), (0,)), ((), ())))))(
        lin.kernel[...])
    np.testing.assert_allclose(g, jnp.broadcast_to(X.sum(0)[:, None], g.shape), rtol=1e-6)


def test_export_roundtrip(variables):
    dep, report = hf.export_params(variables, CFG)
    assert set(dep["codes"]) == {""} and "kernel" not in dep["params"]
    # 30 x 16 float32 kernel + bias vs 16 x 8 blocks of 16 bits + int8 T + scales, beta, bias.
    assert report["float32_bytes"] == 4 * (30 * 16 + 16)
    assert report["deployed_bytes"] == 16 * 8 * 2 + 16 * 8 + 4 * 16 + 4 + 4 * 16
    back = hf.import_params(dep, CFG)
    m = QDense(16, CFG)
    np.testing.assert_allclose(m.apply(back, X, deterministic=True),
                               m.apply(hf.refresh_codes(variables, CFG), X, deterministic=True),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expected data uint8"):
        hf.import_params(dep, CFG.replace(M=3))


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

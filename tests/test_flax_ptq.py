"""hnlq_jax.flax.quantize_params: post-training quantization of a Flax model's Dense layers into
the QDense inference form. The codes equal ptq.gptq_rows on the same H bit for bit (one pass
and sequential), calibration beats round-to-nearest, rotated forms save and load exactly and
refuse another rotation, and bad calls get clear errors."""

import flax.core
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import hnlq_jax as hq
from hnlq_jax import ptq
from hnlq_jax.flax import QDense, import_params, quantize_params, use_codes
from hnlq_jax.incoherence import Rotation
from hnlq_jax.layouts import KernelLayout
from hnlq_jax.rows import calibrate_rows, rows_codes

CFG = hq.HNLQConfig("D4", 4, 2)


class MLP(nn.Module):
    """Two dense layers; ``quantized`` builds them as QDense (same params layout)."""

    quantized: bool = False

    def dense(self, features, name):
        if self.quantized:
            return QDense(features, config=CFG, name=name)
        return nn.Dense(features, name=name)

    @nn.compact
    def __call__(self, x):
        return self.dense(8, "b")(nn.relu(self.dense(40, "a")(x)))


class First(nn.Module):
    """MLP's layer a alone: a calibration that never reaches b."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(40, name="a")(x)


def _inputs(seed, n=256):
    # correlated, anisotropic inputs: where compensation beats plain rounding
    mix = jax.random.normal(jax.random.key(99), (24, 24)) * jnp.linspace(0.1, 2.0, 24)
    return jax.random.normal(jax.random.key(seed), (n, 24)) @ mix


CAL, TEST = _inputs(1), _inputs(2)
FLOAT, QUANT = MLP(), MLP(quantized=True)
VARS = FLOAT.init(jax.random.key(0), CAL[:1])


def _run(variables):
    for chunk in jnp.split(CAL, 4):
        FLOAT.apply(variables, chunk)


def _err(inference):
    return float(jnp.mean((QUANT.apply(inference, TEST) - FLOAT.apply(VARS, TEST)) ** 2))


def _same_codes(a, b):
    np.testing.assert_array_equal(np.asarray(a.index), np.asarray(b.index))
    np.testing.assert_array_equal(np.asarray(a.tfield), np.asarray(b.tfield))
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


def _hessian(xs):
    H, rows = None, 0
    for x in xs:
        H, rows = ptq.hessian_update(H, x, rows)
    return H


@pytest.mark.parametrize("kwargs", [
    {"rotate": False, "act_order": False, "criterion": "loss"}, {},
    {"rotate": False, "criterion": "f", "grid": (1.0, 1.5, 2.0), "t_budget": 0.1}],
    ids=["plain", "recommended", "budget"])
def test_codes_equal_gptq_rows(kwargs):
    """The codes are gptq_rows' on the same H, with each option left out at its recommended
    value (hnlq_jax.ptq.RECOMMENDED)."""
    inference, report = quantize_params(VARS, CFG, _run, seed=5, damp=0.02, **kwargs)
    options = {**ptq.RECOMMENDED, "damp": 0.02, **kwargs}
    rotate = options.pop("rotate")
    p = VARS["params"]
    hidden = [nn.relu(c @ p["a"]["kernel"] + p["a"]["bias"]) for c in jnp.split(CAL, 4)]
    for name, xs, k in (("a", jnp.split(CAL, 4), 0), ("b", hidden, 1)):
        rotation = Rotation(p[name]["kernel"].shape[0], 5 + k) if rotate else None
        want = ptq.gptq_rows(p[name]["kernel"].T, _hessian(xs), CFG, rotation=rotation,
                             **options)
        if "t_budget" in kwargs:  # the budget changed the choice
            free = ptq.gptq_rows(p[name]["kernel"].T, _hessian(xs), CFG,
                                 **{**options, "t_budget": None})
            assert want.t_bits <= kwargs["t_budget"] < free.t_bits
        layer = inference["hnlq"][name]
        _same_codes(layer["rotated_codes" if rotate else "codes"], want.codes)
        assert set(layer) == ({"rotated_codes", "rotation"} if rotate else {"codes"})
        assert layer.get("rotation") == rotation
        assert report.proxy_loss[name] == pytest.approx(want.loss, rel=1e-6)
        assert report.t_bits[name] == want.t_bits
    assert "kernel" not in inference["params"]["a"] and "bias" in inference["params"]["a"]
    assert [n for n, *_ in report.converted] == ["a", "b"]
    assert report.clipped == {"a": 0, "b": 0}


def test_sequential_calibrates_through_the_quantized_layers():
    inference, _ = quantize_params(VARS, CFG, _run, sequential=True, rotate=False,
                                   act_order=False, criterion="loss", damp=ptq.DAMP)
    p = VARS["params"]
    codes_a = inference["hnlq"]["a"]["codes"]
    _same_codes(codes_a, ptq.gptq_rows(p["a"]["kernel"].T, _hessian(jnp.split(CAL, 4)),
                                       CFG).codes)
    # layer b's H comes from the outputs of the *quantized* layer a
    w_a = hq.decode(codes_a).T
    hidden = [nn.relu(c @ w_a + p["a"]["bias"]) for c in jnp.split(CAL, 4)]
    _same_codes(inference["hnlq"]["b"]["codes"],
                ptq.gptq_rows(p["b"]["kernel"].T, _hessian(hidden), CFG).codes)


def test_calibration_beats_round_to_nearest():
    rtn, report = quantize_params(VARS, CFG)
    assert report.proxy_loss == {}
    # without calibration: rows_codes of kernel^T at the calibrated beta, as QDense exports
    _same_codes(rtn["hnlq"]["b"]["codes"],
                rows_codes(VARS["params"]["b"]["kernel"].T, CFG,
                           calibrate_rows(VARS["params"]["b"]["kernel"].T, CFG)))
    e_rtn = _err(rtn)
    for kwargs in ({}, {"rotate": False, "act_order": False}, {"sequential": True}):
        e = _err(quantize_params(VARS, CFG, _run, **kwargs)[0])
        assert e < 0.8 * e_rtn, (kwargs, e, e_rtn)


def test_rotated_form_saves_and_loads_bit_exact(tmp_path):
    inference, _ = quantize_params(VARS, CFG, _run, rotate=True)
    y = jax.jit(QUANT.apply)(inference, TEST)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(QUANT.apply(inference, TEST)))
    path = tmp_path / "model.msgpack"
    path.write_bytes(serialization.to_bytes(inference))
    loaded = import_params(serialization.msgpack_restore(path.read_bytes()), CFG)
    assert loaded["hnlq"]["a"]["rotation"] == Rotation(24, 0)
    np.testing.assert_array_equal(np.asarray(QUANT.apply(loaded, TEST)), np.asarray(y))
    restored = serialization.from_bytes(inference, path.read_bytes())
    np.testing.assert_array_equal(np.asarray(QUANT.apply(restored, TEST)), np.asarray(y))
    other, _ = quantize_params(VARS, CFG, _run, rotate=True, seed=1)
    with pytest.raises(ValueError, match="Rotation"):
        serialization.from_bytes(other, path.read_bytes())
    # Into a target without rotations (or the reverse): the codes of W R must not restore
    # where they would be applied to unrotated inputs.
    plain, _ = quantize_params(VARS, CFG, _run, rotate=False)
    with pytest.raises(ValueError, match="codes"):
        serialization.from_bytes(plain, path.read_bytes())
    with pytest.raises(ValueError, match="rotated_codes"):
        serialization.from_bytes(inference, serialization.to_bytes(plain))


def _old_layout(state):
    """A rotated export as saved before rotated codes had their own key."""
    return {"params": state["params"], "hnlq": {
        name: {"codes": layer["rotated_codes"], "rotation": layer["rotation"]}
        for name, layer in state["hnlq"].items()}}


def test_rotated_layouts_read_by_import_params():
    inference, _ = quantize_params(VARS, CFG, _run, rotate=True)
    y = np.asarray(QUANT.apply(inference, TEST))
    state = serialization.msgpack_restore(serialization.to_bytes(inference))
    old = import_params(_old_layout(state), CFG)
    assert set(old["hnlq"]["a"]) == {"rotated_codes", "rotation"}
    np.testing.assert_array_equal(np.asarray(QUANT.apply(old, TEST)), y)
    both = {**state, "hnlq": {**state["hnlq"], "a": {**state["hnlq"]["a"],
                                                       "codes": state["hnlq"]["a"]["rotated_codes"]}}}
    with pytest.raises(ValueError, match="both"):
        import_params(both, CFG)
    lost = {**state, "hnlq": {**state["hnlq"], "b": {
        "rotated_codes": state["hnlq"]["b"]["rotated_codes"]}}}
    with pytest.raises(ValueError, match="without their 'rotation'"):
        import_params(lost, CFG)
    # The model refuses rotated codes without their rotation, and a rotation beside plain codes.
    for layer in ({"rotated_codes": inference["hnlq"]["a"]["rotated_codes"]},
                  {"codes": inference["hnlq"]["a"]["rotated_codes"],
                   "rotation": inference["hnlq"]["a"]["rotation"]}):
        with pytest.raises(ValueError, match="come together"):
            QUANT.apply({**inference, "hnlq": {**inference["hnlq"], "a": layer}}, TEST)


def test_filter_fn_keeps_layers_in_float():
    inference, report = quantize_params(VARS, CFG, _run, filter_fn=lambda path, k: path != ("b",))
    assert [n for n, *_ in report.converted] == ["a"] and "b" not in inference["hnlq"]
    assert "kernel" in inference["params"]["b"]


def test_clear_errors():
    with pytest.raises(ValueError, match="under a jax transformation"):
        quantize_params(VARS, CFG, jax.jit(lambda v: FLOAT.apply(v, CAL)))
    # The first layer's input is the constant CAL itself, yet jit traces its statistics.
    with pytest.raises(ValueError, match="under a jax transformation"):
        quantize_params(VARS, CFG, jax.jit(lambda v: FLOAT.apply(v, CAL)),
                        filter_fn=lambda path, k: path == ("a",))
    with pytest.raises(ValueError, match="never ran 1 of the layers to quantize: 'b';"):
        quantize_params(VARS, CFG, lambda v: First().apply({"params": {"a": v["params"]["a"]}},
                                                            CAL))
    root = nn.Dense(4).init(jax.random.key(0), CAL)  # the model itself is the layer
    with pytest.raises(ValueError, match=r"never ran 1 of the layers to quantize: \(root\);"):
        quantize_params(root, CFG, lambda v: None)
    with pytest.raises(ValueError, match=r"converted nothing.*a \(Dense\): filter_fn"):
        quantize_params(VARS, CFG, filter_fn=lambda path, k: False)
    with pytest.raises(TypeError, match="calibration must be None or a callable"):
        quantize_params(VARS, CFG, calibration=CAL)
    with pytest.raises(ValueError, match="variables"):
        quantize_params(VARS["params"], CFG)
    with pytest.raises(TypeError):
        quantize_params(VARS, "D4")


# ------------------------------------------------------- DenseGeneral and Einsum kernels


class Layouts(nn.Module):
    """Dense-like layers of every kernel layout: an einsum projection ``[in, heads, dim]``,
    a DenseGeneral over two axes ``[heads, dim, out]``, Flax's attention (DenseGeneral q/k/v
    and out), a transposed 2-D einsum kernel ``[out, in]`` and a Dense."""

    @nn.compact
    def __call__(self, x):  # [batch, seq, 16]
        h = nn.Einsum((16, 2, 8), "bsd,dhk->bshk", name="proj")(x)
        h = nn.DenseGeneral(16, axis=(-2, -1), name="merge")(h)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, name="attn")(h)
        h = nn.Einsum((12, 16), "...d,hd->...h", name="t")(h)
        return nn.Dense(16, name="out")(nn.relu(h))


LAYOUTS = Layouts()
X3 = jax.random.normal(jax.random.key(3), (4, 6, 16))
VARS3 = LAYOUTS.init(jax.random.key(4), X3)
# Each kernel as [out, in] (the codes' matrix), written out by hand per layer.
AS_MATRIX = {("proj",): lambda k: k.reshape(16, 16).T, ("merge",): lambda k: k.reshape(16, 16).T,
             ("attn", "query"): lambda k: k.reshape(16, 8).T,
             ("attn", "key"): lambda k: k.reshape(16, 8).T,
             ("attn", "value"): lambda k: k.reshape(16, 8).T,
             ("attn", "out"): lambda k: k.reshape(8, 16).T, ("t",): lambda k: k,
             ("out",): lambda k: k.T}


def _run3(variables):
    for chunk in jnp.split(X3, 2):
        LAYOUTS.apply(variables, chunk)


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def test_dense_general_and_einsum_codes_equal_gptq_rows():
    """A kernel of any layout is coded as its [out, in] matrix against the Hessian of its
    inputs arranged alike (computed here by hand from the float model's intermediates)."""
    options = {"damp": 0.01, "act_order": False, "criterion": "f"}
    inputs = {("proj",): [], ("merge",): [], ("t",): []}
    inference, report = quantize_params(VARS3, CFG, _run3, rotate=False,
                                        filter_fn=lambda path, k: path in inputs
                                        or path == ("out",), **options)
    for chunk in jnp.split(X3, 2):
        _, state = LAYOUTS.apply(VARS3, chunk, capture_intermediates=True)
        inter = state["intermediates"]
        inputs[("proj",)].append(chunk)
        inputs[("merge",)].append(inter["proj"]["__call__"][0].reshape(4 // 2, 6, 16))
        inputs[("t",)].append(inter["attn"]["__call__"][0])
    for path, xs in inputs.items():
        kernel = _at(VARS3["params"], path)["kernel"]
        want = ptq.gptq_rows(AS_MATRIX[path](kernel), _hessian(xs), CFG, **options)
        _same_codes(_at(inference["hnlq"], path)["codes"], want.codes)
    kinds = dict((name, kind) for name, kind, _ in report.converted + report.skipped)
    assert kinds == {"proj": "Einsum", "merge": "DenseGeneral", "attn/query": "DenseGeneral",
                     "attn/key": "DenseGeneral", "attn/value": "DenseGeneral",
                     "attn/out": "DenseGeneral", "t": "Einsum", "out": "Dense"}
    assert [n for n, *_ in report.converted] == ["proj", "merge", "t", "out"]  # call order
    assert {why for *_, why in report.skipped} == {"filter_fn"}
    assert inference["hnlq"]["merge"]["layout"] == KernelLayout((2, 8, 16), "iio")
    assert inference["hnlq"]["t"]["layout"] == KernelLayout((12, 16), "oi")
    assert "layout" not in inference["hnlq"]["out"]  # [in, out]: the Dense form as before


def _decoded_model(inference):
    """The float model's variables with every kernel decoded from the codes (by hand)."""
    params = flax.core.unfreeze(VARS3["params"])
    for path in AS_MATRIX:
        layer = _at(inference["hnlq"], path)
        w = hq.decode(layer.get("codes", layer.get("rotated_codes")))
        if "rotation" in layer:
            w = layer["rotation"].inverse(w)
        kernel = _at(params, path)["kernel"]
        # AS_MATRIX undone: every kernel but t's has its input axes first
        _at(params, path)["kernel"] = (w if path == ("t",) else w.T).reshape(kernel.shape)
    return {"params": params}


@pytest.mark.parametrize("rotate", [True, False])
def test_use_codes_computes_the_decoded_float_model(rotate):
    inference, _ = quantize_params(VARS3, CFG, _run3, rotate=rotate)
    want = LAYOUTS.apply(_decoded_model(inference), X3)
    with use_codes():
        eager = LAYOUTS.apply(inference, X3)
        jitted = jax.jit(LAYOUTS.apply)(inference, X3)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(want - LAYOUTS.apply(VARS3, X3)))) > 1e-3  # quantized
    with pytest.raises(Exception, match="kernel"):  # no codes used outside the context
        LAYOUTS.apply(inference, X3)


def test_layouts_save_and_load(tmp_path):
    inference, _ = quantize_params(VARS3, CFG, _run3)
    with use_codes():
        y = np.asarray(LAYOUTS.apply(inference, X3))
    saved = serialization.to_bytes(inference)
    loaded = import_params(serialization.msgpack_restore(saved), CFG)
    restored = serialization.from_bytes(inference, saved)
    with use_codes():
        for variables in (loaded, restored):
            np.testing.assert_array_equal(np.asarray(LAYOUTS.apply(variables, X3)), y)
    assert loaded["hnlq"]["merge"]["layout"] == inference["hnlq"]["merge"]["layout"]
    state = serialization.msgpack_restore(saved)
    state["hnlq"]["merge"]["layout"]["roles"] = "ioo"  # another split of the same kernel
    with pytest.raises(ValueError, match="do not hold a kernel"):
        import_params(state, CFG)
    with pytest.raises(ValueError, match="KernelLayout"):
        serialization.from_state_dict(inference, state)


def test_without_calibration_only_dense_layouts():
    """Round-to-nearest cannot know a >= 3-D kernel's input axes: they stay float, with the
    reason; a 2-D einsum kernel [out, in] quantized as [in, out] is refused where it is used."""
    inference, report = quantize_params(VARS3, CFG)
    assert sorted(n for n, *_ in report.converted) == ["out", "t"]
    kept = {name: why for name, _, why in report.skipped}
    assert set(kept) == {"proj", "merge", "attn/query", "attn/key", "attn/value", "attn/out"}
    assert all("calibration=" in why for why in kept.values())
    with use_codes(), pytest.raises(ValueError, match="layer 't'.*roles='oi'.*calibration="):
        LAYOUTS.apply(inference, X3)


class Batched(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral(8, batch_dims=(0,), name="b")(x)


def test_batched_products_stay_float_with_the_reason():
    variables = Batched().init(jax.random.key(0), X3)
    with pytest.raises(ValueError, match=r"converted nothing.*b \(DenseGeneral\): DenseGeneral "
                                         "with batch_dims"):
        quantize_params(variables, CFG, lambda v: Batched().apply(v, X3))


class TwoWays(nn.Module):
    """One square einsum kernel used as [in, out] and as [out, in]."""

    @nn.compact
    def __call__(self, x):
        layer = nn.Einsum((16, 16), name="e")
        return layer(layer(x, "...d,dh->...h"), "...d,hd->...h") + nn.Dense(16, name="d")(x)


def test_a_kernel_used_two_ways_stays_float():
    x = X3[0]
    variables = TwoWays().init(jax.random.key(0), x)
    inference, report = quantize_params(variables, CFG, lambda v: TwoWays().apply(v, x))
    assert report.skipped == [("e", "Einsum", "called with two kernel layouts (io, then oi)")]
    assert [n for n, *_ in report.converted] == ["d"]
    with use_codes():  # the float layer computes from its kernel, the other from its codes
        np.testing.assert_allclose(np.asarray(TwoWays().apply(inference, x)),
                                   np.asarray(TwoWays().apply(_decoded_dense(variables,
                                                                             inference), x)),
                                   rtol=1e-5, atol=1e-5)


def _decoded_dense(variables, inference):
    params = flax.core.unfreeze(variables["params"])
    layer = inference["hnlq"]["d"]
    w = layer["rotation"].inverse(hq.decode(layer["rotated_codes"]))
    params["d"]["kernel"] = w.T
    return {"params": params}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, None])
def test_use_codes_computes_in_the_layers_dtype(dtype):
    """As the float layer: in its dtype, else in the promotion of input and parameters."""
    model = nn.DenseGeneral((2, 8), dtype=dtype)
    x = X3.astype(jnp.bfloat16)
    variables = model.init(jax.random.key(0), x)
    inference, _ = quantize_params(variables, CFG, lambda v: model.apply(v, x))
    with use_codes():
        y = model.apply(inference, x)
    layer = inference["hnlq"]
    w = layer["rotation"].inverse(hq.decode(layer["rotated_codes"]))  # [16 out, 16 in]
    decoded = {"params": {**variables["params"], "kernel": w.T.reshape(16, 2, 8)}}
    want = model.apply(decoded, x)
    assert y.dtype == want.dtype and y.shape == want.shape
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32),
                               rtol=0.02, atol=0.02)  # bfloat16 rounding


def test_quantize_params_keeps_other_collections_and_refuses_overload():
    """batch_stats travel into the inference form (export_params' too), a FrozenDict is
    taken, and a kernel whose block lies beyond max_T's reach is refused (it would decode to
    NaN), as export_params refuses it."""
    class WithNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.BatchNorm(use_running_average=True)(nn.Dense(16)(x)))

    x = np.random.default_rng(6).standard_normal((8, 256)).astype(np.float32)
    model = WithNorm()
    variables = model.init(jax.random.key(0), x)
    variables = {**variables, "batch_stats": jax.tree.map(lambda a: a + 0.5,
                                                          variables["batch_stats"])}
    inference, _ = quantize_params(flax.core.freeze(variables), CFG)
    assert set(inference) == {"params", "batch_stats", "hnlq"}
    with use_codes():
        y = model.apply(inference, x)
    assert np.all(np.isfinite(np.asarray(y)))
    # saved and imported, they are kept too (import_params returned params and hnlq alone)
    restored = import_params(serialization.msgpack_restore(
        serialization.to_bytes(inference)))
    assert set(restored) == {"params", "batch_stats", "hnlq"}
    with use_codes():
        np.testing.assert_array_equal(model.apply(restored, x), y)
    tight = CFG.replace(max_T=2)
    first = variables["params"]["Dense_1"]  # Dense(16) of the 256 inputs (created second)
    kernel = first["kernel"].at[0, 0].set(3.0)  # ~50 times its row's RMS
    spiky = {**variables, "params": {**variables["params"], "Dense_1": {**first,
                                                                        "kernel": kernel}}}
    with pytest.raises(ValueError, match=r"quantize_params: layer 'Dense_1': .*still overload "
                                         r"at max_T = 2"):
        quantize_params(spiky, tight)

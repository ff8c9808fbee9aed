"""quantize_model with calibration (compensated rounding, hnlq_jax.ptq.gptq_rows) and rotation
(incoherence): lower output error than round-to-nearest, the same codes as gptq_rows in JAX bit
for bit, rotated state dicts that reload exactly and refuse other rotations, clear errors."""

import io

import numpy as np
import pytest
import torch

import hnlq_jax as hq
from hnlq_jax.incoherence import Rotation
import torch_bridge as tb
from torch_bridge import QLinear, QuantizedLinear, load_quantized, ops, quantize_model

# CPU tensors: the JAX references run on the CPU too (conftest.jax_on_cpu)
pytestmark = pytest.mark.usefixtures("jax_on_cpu")

CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))


def _inputs(seed, n=256):
    # correlated, anisotropic inputs: where compensation beats plain rounding
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(24, 24, generator=torch.Generator().manual_seed(99)) * torch.linspace(
        0.1, 2.0, 24)
    return torch.randn(n, 24, generator=g) @ mix


CAL, TEST = _inputs(1), _inputs(2)


def _run(model):
    for chunk in CAL.split(64):
        model(chunk)


def _err(model, ref):
    with torch.no_grad():
        return float(((model(TEST) - ref(TEST)) ** 2).mean())


def _copy(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_calibrated_beats_round_to_nearest_and_reports_losses():
    ref = _mlp()
    rtn, gptq, rot = _copy(ref), _copy(ref), _copy(ref)
    r0 = quantize_model(rtn, CFG)
    assert r0.proxy_loss == {}
    r1 = quantize_model(gptq, CFG, calibration=_run, rotate=False)
    r2 = quantize_model(rot, CFG, calibration=_run)  # the recommended setting: rotated
    e_rtn, e_gptq, e_rot = _err(rtn, ref), _err(gptq, ref), _err(rot, ref)
    assert e_gptq < 0.8 * e_rtn and e_rot < 0.8 * e_rtn, (e_rtn, e_gptq, e_rot)
    for r in (r1, r2):
        assert set(r.proxy_loss) == {"0", "2"} and all(v > 0 for v in r.proxy_loss.values())
        assert r.tokens == {"0": 256, "2": 256} and r.clipped == {"0": 0, "2": 0}
        assert set(r.t_bits) == {"0", "2"} and all(0 < v < 1 for v in r.t_bits.values())
        assert "0: proxy loss" in str(r) and "bits/weight" in str(r)
    assert rot[0].rotation == Rotation(24, 0) and rot[2].rotation == Rotation(40, 1)
    assert gptq[0].rotation is None


# t_budget = 0.1 binds in both layers (the free "f" choice takes > 0.2 bits per weight of T)
BUDGET = {"criterion": "f", "grid": (1.0, 1.5, 2.0), "t_budget": 0.1}


@pytest.mark.parametrize("kwargs", [{}, {"rotate": False, "act_order": False}, BUDGET],
                         ids=["recommended", "plain", "budget"])
def test_codes_equal_gptq_rows_in_jax(kwargs):
    """The codes are gptq_rows' on the same H, with each option left out at its recommended
    value (hnlq_jax.ptq.RECOMMENDED)."""
    ref = _mlp(3)
    model = _copy(ref)
    report = quantize_model(model, CFG, calibration=_run, seed=7, damp=0.02, **kwargs)
    options = {**hq.ptq.RECOMMENDED, "damp": 0.02, **kwargs}
    rotate = options.pop("rotate")
    # The same H, accumulated the same way (hessian_update per call), and gptq_rows in JAX.
    seen = {0: [], 2: []}
    hooks = [ref[i].register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].detach()))
             for i in seen]
    with torch.no_grad():
        _run(ref)
    for h in hooks:
        h.remove()
    for k, i in enumerate(seen):
        rotation = Rotation(ref[i].in_features, 7 + k) if rotate else None
        w, H = ref[i].weight.detach().numpy(), _hessian(seen[i])
        want = hq.ptq.gptq_rows(w, H, CFG, rotation=rotation, **options)
        _assert_codes(model[i].codes(), want.codes)
        if "t_budget" in kwargs:  # the budget changed the choice
            free = hq.ptq.gptq_rows(w, H, CFG, rotation=rotation,
                                    **{**options, "t_budget": None})
            assert want.t_bits <= 0.1 < free.t_bits
        assert report.t_bits[str(i)] == want.t_bits
        # the layer's forward is PTQResult.matmul plus the bias, bit for bit (on the fused
        # product's rows: 16, below ops.GEMM_ROWS, from where the layer sums in torch's GEMM)
        x = seen[i][0][:16]
        assert hq.buckets.row_bucket(len(x)) < ops.GEMM_ROWS
        with torch.no_grad():
            y = model[i](x).numpy()
        np.testing.assert_array_equal(
            y, np.asarray(want.matmul(x.numpy())) + ref[i].bias.detach().numpy())


def _hessian(xs):
    H, rows = None, 0
    for x in xs:
        H, rows = hq.ptq.hessian_update(H, x.numpy(), rows)
    return H


def _assert_codes(got, want):
    for field in ("index", "tfield", "scale"):
        np.testing.assert_array_equal(getattr(got, field).numpy(),
                                      np.asarray(getattr(want, field)))


def test_sequential_calibrates_through_the_quantized_layers():
    ref = _mlp(4)
    model = _copy(ref)
    r = quantize_model(model, CFG, calibration=_run, sequential=True, criterion="f",
                       rotate=False, act_order=False, damp=hq.ptq.DAMP)
    assert r.tokens == {"0": 256, "2": 256}
    w0 = ref[0].weight.detach().numpy()
    _assert_codes(model[0].codes(),
                  hq.ptq.gptq_rows(w0, _hessian(CAL.split(64)), CFG, criterion="f").codes)
    # layer 2's H comes from the GELU of the *quantized* layer 0's outputs
    with torch.no_grad():
        hidden = [ref[1](model[0](c)) for c in CAL.split(64)]
    w2 = ref[2].weight.detach().numpy()
    _assert_codes(model[2].codes(),
                  hq.ptq.gptq_rows(w2, _hessian(hidden), CFG, criterion="f").codes)
    assert _err(model, ref) < 0.8 * _err(_rtn(ref), ref)


def _rtn(ref):
    model = _copy(ref)
    quantize_model(model, CFG)
    return model


def test_rotated_state_dict_round_trip_and_mismatch():
    model = _mlp()
    quantize_model(model, CFG, calibration=_run, rotate=True, seed=5)
    assert model[0].get_extra_state()["rotation"] == Rotation(24, 5).to_dict()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)  # weights_only: the extra state is plain data
    fresh = torch.nn.Sequential(
        QuantizedLinear(24, 40, CFG, rotation=Rotation(24, 5)), torch.nn.GELU(),
        QuantizedLinear(40, 8, CFG, rotation=Rotation(40, 6)))
    fresh.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(fresh(TEST), model(TEST))
    # the decoded weight is in the original basis
    with torch.no_grad():
        torch.testing.assert_close(TEST @ model[0].weight.T + model[0].bias, model[0](TEST),
                                   rtol=1e-5, atol=1e-5)
    # compiled, no graph break
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(TEST), fresh(TEST))
    one = {k.removeprefix("0."): v for k, v in sd.items() if k.startswith("0.")}
    for layer, match in [
            (QuantizedLinear(24, 40, CFG), r"saved with Rotation\(n=24, seed=5\), but the "
                                           r"layer has no rotation"),
            (QuantizedLinear(24, 40, CFG, rotation=Rotation(24, 6)),
             r"Rotation\(n=24, seed=5\), but the layer has Rotation\(n=24, seed=6\); build the "
             r"layer with the saved rotation .* or a model with quantize_model\(\.\.\., "
             r"rotate=True, seed=\.\.\.\) given the seed it was saved with")]:
        before = layer.index.clone()
        with pytest.raises(ValueError, match=match):
            layer.load_state_dict(one)
        assert torch.equal(layer.index, before)  # nothing written
    plain = _mlp()
    quantize_model(plain, CFG)
    with pytest.raises(ValueError, match="saved with no rotation, but the layer has Rotation"):
        fresh.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="rotation must be None or an"):
        QuantizedLinear(24, 40, CFG, rotation=Rotation(40, 0))


@pytest.mark.parametrize("field, value, match", [
    ("index", 200, r"QuantizedLinear \(root\): .*codebook index out of range"),
    ("scale", float("nan"), r"QuantizedLinear \(root\): .*row scales hold NaN or Inf")])
def test_corrupted_state_dict_refused_before_anything_is_written(field, value, match):
    cfg = hq.HNLQConfig("D4", 3, 2, beta=0.3)  # q^d = 81: index 200 is out of range
    layer = QuantizedLinear.from_linear(torch.nn.Linear(24, 4), cfg)
    sd = {k: v.clone() if isinstance(v, torch.Tensor) else v
          for k, v in layer.state_dict().items()}
    sd[field].view(-1)[0] = value
    fresh = QuantizedLinear(24, 4, cfg)
    before = {k: v.clone() for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k  # the refused load wrote nothing
    fresh.load_state_dict(layer.state_dict())  # the intact one loads
    with torch.no_grad():
        assert torch.equal(fresh(TEST), layer(TEST))


def test_rotated_model_compiles_nothing_for_new_shapes_in_a_bucket(compiles):
    """Served rotated layers: after one call per bucket, new (batch, sequence) shapes in it
    compile nothing (on a CPU the rotations and products call the native kernels; elsewhere
    every layer's rotation shares one program), and the op is Rotation.apply bit for bit."""
    model = torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.GELU(), torch.nn.Linear(24, 8))
    quantize_model(model, CFG, rotate=True, seed=5)  # two rotations of size 24
    shapes = [(18, 24), (3, 6, 24), (2, 10, 24), (19, 24)]
    xs = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    with torch.no_grad():
        model(torch.ones(17, 24))  # bucket 20
        Rotation(24, 5).apply(np.ones((17, 24), np.float32))  # the reference's program
        compiles.clear()
        for x in xs:
            assert model(x).shape == x.shape[:-1] + (8,)
            y = torch.ops.hnlq.rotate(x, 24, 5, False)
            assert torch.equal(y, torch.from_numpy(np.array(Rotation(24, 5).apply(x.numpy()))))
    assert compiles == []


@pytest.mark.parametrize("rotate", [True, False])
def test_load_quantized_restores_without_encoding(rotate, monkeypatch):
    model = _mlp()
    quantize_model(model, CFG, filter_fn=lambda name, m: name != "2", calibration=_run,
                   rotate=rotate, seed=5)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)  # weights_only
    import torch_bridge.quantized as tq

    def no_encoding(*args, **kwargs):
        raise AssertionError("load_quantized encoded a weight")

    monkeypatch.setattr(tq, "encode_rows", no_encoding)
    monkeypatch.setattr(tq.hptq, "gptq_rows", no_encoding)
    fresh = load_quantized(_mlp(seed=1), sd)  # other float weights: all replaced or loaded
    assert isinstance(fresh[0], QuantizedLinear) and type(fresh[2]) is torch.nn.Linear
    assert fresh[0].rotation == (Rotation(24, 5) if rotate else None)
    with torch.no_grad():
        assert torch.equal(fresh(TEST), model(TEST))
    assert load_quantized(fresh, sd) is fresh  # already quantized: loads in place


def test_load_quantized_clear_errors():
    model = _mlp()
    quantize_model(model, CFG)
    sd = model.state_dict()
    other = torch.nn.Sequential(torch.nn.Linear(24, 41), torch.nn.GELU(), torch.nn.Linear(41, 8))
    with pytest.raises(ValueError, match=r"layer 0: codes of a weight \[40, 24\] do not fit the "
                                         r"model's Linear \[41, 24\]"):
        load_quantized(other, sd)
    with pytest.raises(ValueError, match="layer 2: the state dict holds codes for it, but the "
                                         "model has no such module"):
        load_quantized(torch.nn.Sequential(torch.nn.Linear(24, 40)), sd)
    with pytest.raises(ValueError, match=r"layer 0: the codes were saved in format version"):
        load_quantized(_mlp(), {**sd, "0._extra_state": {**sd["0._extra_state"],
                                                         "format_version": 0}})
    bad = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    bad["0.scale"][0] = float("nan")
    with pytest.raises(ValueError, match=r"QuantizedLinear 0: .*row scales hold NaN or Inf"):
        load_quantized(_mlp(), bad)
    with pytest.raises(ValueError, match="the state dict is one layer's"):
        load_quantized(torch.nn.Linear(24, 40), model[0].state_dict())


@pytest.mark.parametrize("field", ["index", "tfield", "scale"])
def test_state_dict_checksum_catches_a_valid_looking_flip(field):
    """A flipped bit that leaves every value in range is caught by the CRC-32 of the extra
    state; a state dict saved before checksums were recorded still loads."""
    layer = QuantizedLinear.from_linear(torch.nn.Linear(24, 4), CFG)
    sd = {k: v.clone() if isinstance(v, torch.Tensor) else dict(v) for k, v in
          layer.state_dict().items()}
    raw = sd[field].view(torch.uint8).view(-1)
    raw[0] ^= 1 if field != "scale" else 0x10  # index 0 <-> 1, T 0 <-> 1, a scale's mantissa
    fresh = QuantizedLinear(24, 4, CFG)
    with pytest.raises(ValueError, match=r"QuantizedLinear \(root\): the code arrays do not "
                                         r"match their saved CRC-32"):
        fresh.load_state_dict(sd)
    header_crc = sd["_extra_state"].pop("header_crc32")
    del sd["_extra_state"]["crc32"]
    fresh.load_state_dict(sd)  # unchecked: the older form, saved before either was recorded
    sd["_extra_state"]["header_crc32"] = header_crc  # one without the other: edited
    with pytest.raises(ValueError, match="a header checksum but no checksum of their arrays"):
        fresh.load_state_dict(sd)
    sd["_extra_state"]["crc32"] = "abc"
    with pytest.raises(ValueError, match="saved checksum 'abc' is not an int"):
        fresh.load_state_dict(sd)


@pytest.mark.parametrize("edit", ["alpha", "max_T", "seed"])
def test_state_dict_header_checksum(edit):
    """An edited header (a flipped bit in the saved config, the rotation's seed) that
    load_quantized would build its layer from is refused by the header's CRC-32; a state dict
    saved before it was recorded still loads."""
    make = lambda: torch.nn.Sequential(torch.nn.Linear(24, 8))  # noqa: E731
    model = make()
    quantize_model(model, CFG, rotate=True)
    sd = model.state_dict()
    state = {**sd["0._extra_state"]}
    if edit == "seed":
        state["rotation"] = {**state["rotation"], "seed": state["rotation"]["seed"] + 1}
    else:
        state["config"] = {**state["config"], edit: {"alpha": 2.0, "max_T": 13}[edit]}
    edited = {**sd, "0._extra_state": state}
    with pytest.raises(ValueError, match=r"QuantizedLinear 0: the saved header .* does not "
                                         r"match its saved CRC-32"):
        load_quantized(make(), edited)
    del state["header_crc32"]
    load_quantized(make(), edited)  # unchecked: the older form


def test_rotation_gradient_and_rtn_rotation():
    layer = QuantizedLinear.from_linear(torch.nn.Linear(24, 4), CFG, rotation=Rotation(24, 3))
    x = torch.randn(5, 24, requires_grad=True)
    layer(x).sum().backward()
    # y = (x R) W'^T: dy/dx = 1 W'^T R^T = ones @ weight (the decoded weight, original basis)
    torch.testing.assert_close(x.grad, torch.ones(5, 4) @ layer.weight.detach(), rtol=1e-5,
                               atol=1e-5)


def test_clear_errors():
    with pytest.raises(TypeError, match="calibration must be None or a callable"):
        quantize_model(_mlp(), CFG, calibration=CAL)
    model = _mlp()
    with pytest.raises(ValueError, match=r"calibration never ran 1 of the layers.*: '2';"):
        quantize_model(model, CFG, calibration=lambda m: m[0](CAL))
    assert isinstance(model[0], torch.nn.Linear) and not model[0]._forward_pre_hooks  # untouched
    def boom(m):
        m[0](CAL)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        quantize_model(model, CFG, calibration=boom)
    assert not model[0]._forward_pre_hooks
    # a filter that leaves out the layer calibration does not reach: fine
    r = quantize_model(model, CFG, lambda name, m: name == "0", calibration=lambda m: m[0](CAL))
    assert list(r.proxy_loss) == ["0"] and isinstance(model[2], torch.nn.Linear)
    with pytest.raises(ValueError, match="damp"):
        quantize_model(_mlp(), CFG, calibration=_run, damp=-1.0)
    with pytest.raises(ValueError, match="criterion must be 'loss' or 'f'"):
        quantize_model(_mlp(), CFG, calibration=_run, criterion="mse")
    with pytest.raises(TypeError, match="sequential must be a bool"):
        quantize_model(_mlp(), CFG, calibration=_run, sequential="yes")
    for flag in ("rotate", "calibrate", "progress"):
        with pytest.raises(TypeError, match=f"quantize_model: {flag} must be a bool, got 'yes'"):
            quantize_model(_mlp(), CFG, **{flag: "yes"})
    for shape in [(0, 4), (4, 0), (-1, 4), (2.0, 4)]:
        with pytest.raises(ValueError, match="features must be an int >= 1"):
            QuantizedLinear(*shape, CFG)
    with pytest.raises(TypeError, match="bias must be a bool"):
        QuantizedLinear(4, 4, CFG, bias="no")
    # "lut" multiplies only: refused before any work (it failed in the first layer's
    # conversion, after the calibration run)
    ran = []
    model = _mlp()
    with pytest.raises(ValueError, match="quantize_model: implementation must be None or one"):
        quantize_model(model, CFG, calibration=ran.append, implementation="lut")
    assert ran == [] and type(model[0]) is torch.nn.Linear
    with pytest.raises(ValueError, match="load_quantized: implementation must be None or one"):
        load_quantized(_mlp(), {}, implementation="lut")


def test_progress_bar(capsys):
    quantize_model(_mlp(), CFG, calibration=_run, progress=True)
    assert "quantize_model" in capsys.readouterr().err


def test_a_float_qlinear_is_calibrated_as_an_nn_linear():
    """A QLinear with quantize_weights=False is a float layer: quantize_model hooks it for H,
    rotates it and reports its proxy loss, as for the nn.Linear it equals (it was coded
    round-to-nearest, unrotated, with no word)."""
    ref, mixed = _mlp(), _mlp()
    mixed[0] = QLinear.from_linear(mixed[0], CFG, quantize_weights=False)
    r_ref = quantize_model(ref, CFG, calibration=_run)
    r_mixed = quantize_model(mixed, CFG, calibration=_run)
    assert r_mixed.proxy_loss == r_ref.proxy_loss and mixed[0].rotation == Rotation(24, 0)
    assert torch.equal(mixed(TEST), ref(TEST))


def test_float64_models_and_hessians():
    """A float64 model's size report and a float64 H as a tensor: both converted to JAX with
    x64 off (a TypeError after the layers had been replaced)."""
    ref = _mlp().double()
    report = quantize_model(ref, CFG)
    assert report.sizes == tb.model_sizes(ref) and ref[0].scale.dtype == torch.float64
    x = CAL.double()
    H = x.T @ x
    layer = QuantizedLinear.from_linear(_mlp()[0].double(), CFG, hessian=H)
    want = QuantizedLinear.from_linear(_mlp()[0].double(), CFG, hessian=H.numpy())
    assert torch.equal(layer.index, want.index) and torch.equal(layer.scale, want.scale)


def test_set_codes_owns_its_buffers():
    """Codes from JAX (Codes.from_jax views them) are copied: a later load_state_dict writes
    the layer's buffers in place, and JAX arrays must not change."""
    w = np.random.default_rng(0).standard_normal((40, 24)).astype(np.float32)
    jax_codes = hq.encode_rows(w, CFG)
    before = np.asarray(jax_codes.index).copy()
    layer = QuantizedLinear(24, 40, CFG)
    layer.set_codes(tb.Codes.from_jax(jax_codes))
    other = QuantizedLinear.from_linear(_mlp()[0].requires_grad_(False), CFG)
    layer.load_state_dict(other.state_dict())
    np.testing.assert_array_equal(np.asarray(jax_codes.index), before)


def test_load_quantized_keeps_shared_layers_and_builds_on_meta():
    """A layer shared under two names stays one layer (it was built twice: twice the memory
    and model_sizes' count); a model built on the meta device takes the state dict with
    assign=True (its codes stayed on meta) and computes as the saved one."""
    def make():
        shared, out = torch.nn.Linear(24, 24), torch.nn.Linear(24, 8)
        return torch.nn.Sequential(shared, torch.nn.GELU(), shared, out)

    torch.manual_seed(0)
    model = make()
    quantize_model(model, CFG)
    sd, x = model.state_dict(), TEST[:5]
    restored = load_quantized(make(), sd)
    assert restored[0] is restored[2] and tb.model_sizes(restored) == tb.model_sizes(model)
    assert torch.equal(restored(x), model(x))
    with torch.device("meta"):
        skeleton = make()
    restored = load_quantized(skeleton, sd, assign=True)
    assert restored[0].index.device.type == "cpu" and restored[0] is restored[2]
    assert torch.equal(restored(x), model(x))

"""QLinear (QAT) and quantize_model / QuantizedLinear (PTQ): the same codes and beta as QDense,
straight-through gradients, state dicts that reload exactly and refuse other configs and
versions, no float weight after PTQ, the JAX path bit for bit, torch.compile."""

import copy
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hnlq_jax as hq
import hnlq_jax.flax as hf
import torch_bridge as tb
from torch_bridge import QLinear, QuantizedLinear, quantize_model

# CPU tensors: the JAX references run on the CPU too (conftest.jax_on_cpu)
pytestmark = pytest.mark.usefixtures("jax_on_cpu")

CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2)


def _linear(seed=0, n_in=30, n_out=16):
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out)


def _reload(module, state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    module.load_state_dict(torch.load(buf))  # weights_only: the state holds no objects
    return module


def _jax_linear(layer, x: torch.Tensor) -> np.ndarray:
    """The layer's output on the JAX path: hq.matmul on its codes, plus the bias."""
    y = np.asarray(hq.matmul(x.detach().numpy(), layer.codes().to_jax()))
    return y if layer.bias is None else y + layer.bias.detach().numpy()


# ----------------------------------------------------------------------------------- QLinear


def test_matches_qdense_on_the_same_weights():
    """Calibration on: the same beta and the same codes as QDense, and the same outputs."""
    lin = _linear()
    q = QLinear.from_linear(lin, CFG).eval()
    x = torch.randn(5, 30)
    kernel = jnp.asarray(lin.weight.detach().numpy().T)
    m = hf.QDense(16, CFG, kernel_init=lambda *_: kernel)
    X = jnp.asarray(x.numpy())
    v = m.init(jax.random.key(0), X)
    v = {**v, "params": {**v["params"], "bias": jnp.asarray(lin.bias.detach().numpy())}}
    assert float(q.beta) == float(v["hnlq"]["beta"]) != CFG.beta
    ref = v["hnlq"]["codes"]
    got = q.codes()
    assert got.config == ref.config and got.n == ref.n
    for a, b in ((got.index, ref.index), (got.tfield, ref.tfield), (got.scale, ref.scale)):
        np.testing.assert_array_equal(a.numpy(), b)
    y = q(x).detach().numpy()
    np.testing.assert_array_equal(y, m.apply(v, X, deterministic=True))
    np.testing.assert_array_equal(y, _jax_linear(q, x))


def test_straight_through_gradients_and_clipping():
    lin = _linear(1)
    q = QLinear.from_linear(lin, CFG, calibrate=False)
    x = torch.randn(7, 30, requires_grad=True)
    q(x).square().sum().backward()
    dense = torch.nn.Linear(30, 16)
    with torch.no_grad():
        dense.weight.copy_(tb.decode(q.codes()))  # W_hat
        dense.bias.copy_(q.bias)
    xd = x.detach().clone().requires_grad_(True)
    dense(xd).square().sum().backward()
    torch.testing.assert_close(q.weight.grad, dense.weight.grad)  # identity STE
    torch.testing.assert_close(x.grad, xd.grad)
    torch.testing.assert_close(q.bias.grad, dense.bias.grad)
    qc = QLinear.from_linear(lin, CFG, calibrate=False, ste="clipped")
    qc(x.detach()).square().sum().backward()
    keep = (qc.codes().T == 0).repeat_interleave(4, dim=1)[:, :30]
    assert bool((~keep).any()) and bool(keep.any())
    assert torch.all(qc.weight.grad[~keep] == 0)
    torch.testing.assert_close(qc.weight.grad[keep], dense.weight.grad[keep])


def test_quantize_every_caches_codes():
    q = QLinear(30, 16, CFG, quantize_every=2, calibrate=False)
    x = torch.randn(3, 30)
    w0 = q.weight.detach().clone()
    y0 = q(x)  # step 0: refresh, exactly the codes' weights
    before = q.index.clone()
    w_hat = tb.decode(q.codes())
    with torch.no_grad():
        torch.testing.assert_close(y0, q.codes_matmul(x) + q.bias, rtol=0, atol=0)
        torch.testing.assert_close(q.error, w_hat - w0)  # the refresh's quantization error
        q.weight.add_(torch.randn_like(q.weight))  # (rescaled rows would keep their codes)
    y1 = q(x)  # step 1: cached codes, the weight followed with the last refresh's error
    assert torch.equal(q.index, before)
    with torch.no_grad():
        torch.testing.assert_close(y1, x @ (w_hat + q.weight - w0).T + q.bias, rtol=1e-5,
                                   atol=1e-5)
    assert not torch.allclose(y1, y0)
    q(x)  # step 2: refreshed from the new weight
    assert not torch.equal(q.index, before)
    assert "error" in q.state_dict() and "error" not in QLinear(30, 16, CFG).state_dict()
    q.eval()
    y0 = q(x)
    with torch.no_grad():
        q.weight.add_(torch.randn_like(q.weight))
    torch.testing.assert_close(q(x), y0, rtol=0, atol=0)  # eval: the cached codes


def test_quantize_every_can_change_after_construction():
    """From 1 to N the error buffer appears holding the current codes' error (the first cached
    step computes with exactly W_hat, not the float weight); back to 1 it goes."""
    q = QLinear(30, 16, CFG, calibrate=False)
    x = torch.randn(3, 30)
    q(x)  # step 0 at N = 1: a refresh
    w_hat = tb.decode(q.codes())
    q.quantize_every = 4  # step 1 is not a refresh: cached codes
    assert torch.equal(q.error, w_hat - q.weight.detach())
    with torch.no_grad():
        torch.testing.assert_close(q(x), x @ w_hat.T + q.bias, rtol=1e-6, atol=1e-6)
    assert "error" in q.state_dict()
    q.quantize_every = 1
    assert "error" not in q.state_dict() and not hasattr(q, "error")
    q(x)  # refreshes every call again, no error buffer needed
    with pytest.raises(ValueError, match="quantize_every must be an int >= 0"):
        q.quantize_every = 2.0


def test_state_dict_moves_between_refresh_intervals():
    """The error cache of quantize_every != 1 is dropped by a layer that keeps none, and
    computed from the loaded codes and weight by one that does (as when quantize_every is
    raised from 1: the next cached step computes with exactly W_hat); the codes load exactly
    either way."""
    x = torch.randn(3, 30)
    every4 = QLinear(30, 16, CFG, quantize_every=4, calibrate=False)
    every4(x)
    with torch.no_grad():
        every4.weight.add_(0.1 * torch.randn_like(every4.weight))  # codes now 1 step old
    every1 = QLinear(30, 16, CFG, calibrate=False)
    every1.load_state_dict(every4.state_dict())  # strict: no unexpected 'error'
    assert torch.equal(every1.index, every4.index) and torch.equal(every1.tfield, every4.tfield)
    again = QLinear(30, 16, CFG, quantize_every=4, calibrate=False)
    again.load_state_dict(every1.state_dict())  # strict: no missing 'error'
    assert torch.equal(again.error, tb.decode(again.codes()) - again.weight.detach())
    assert not torch.equal(again.error, torch.zeros_like(again.error))
    # A corrupted cache would make every cached training step NaN: refused, nothing written.
    state = every4.state_dict()
    state["error"][2, 3] = float("nan")
    kept = again.error.clone()
    with pytest.raises(RuntimeError, match=r"loading error\): the cached quantization error"):
        again.load_state_dict(state)
    assert torch.equal(again.error, kept)


def test_state_dict_reloads_exactly_and_refuses_other_configs():
    a = QLinear(64, 8, CFG).eval()
    x = torch.randn(5, 64)
    sd = a.state_dict()
    assert {"weight", "bias", "beta", "index", "tfield", "scale", "step", "_extra_state"} == set(sd)
    raw = [sd[k].contiguous().view(torch.uint8).numpy() for k in ("index", "tfield", "scale")]
    header = {"format_version": hq.FORMAT_VERSION,
              "config": dataclasses.asdict(CFG.replace(beta=1.0)), "in_features": 64}
    assert sd["_extra_state"] == {**header, "crc32": hq.codes.checksum(*raw),
                                  "header_crc32": hq.codes.header_checksum(header)}
    b = _reload(QLinear(64, 8, CFG), sd).eval()  # another random init, then the saved state
    assert torch.equal(b(x), a(x)) and float(b.beta) == float(a.beta)
    # another config: refused before anything is written, naming both configs
    q8 = QLinear(64, 8, CFG.replace(q=8))
    before = {k: v.clone() for k, v in q8.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"q=4.*q=8"):
        q8.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in q8.state_dict().items()
               if isinstance(v, torch.Tensor))
    with pytest.raises(ValueError, match="format version 0"):
        QLinear(64, 8, CFG).load_state_dict({**sd, "_extra_state": {**sd["_extra_state"],
                                                                    "format_version": 0}})
    with pytest.raises(ValueError, match="earlier unversioned format"):
        QLinear(64, 8, CFG).load_state_dict({**sd, "labels": torch.zeros(1), "T": torch.zeros(1)})
    # a corrupted beta: refused on loading (training would code at it), nothing written
    for bad in (float("nan"), float("inf"), 0.0, -0.25):
        fresh = QLinear(64, 8, CFG)
        kept = fresh.beta.clone()
        with pytest.raises(RuntimeError, match=r"loading beta\): beta must be a positive finite"):
            fresh.load_state_dict({**sd, "beta": torch.tensor(bad)})
        assert torch.equal(fresh.beta, kept)
    # a float nn.Linear checkpoint (strict=False): the codes are made from the loaded weight
    lin = _linear(3, 64, 8)
    c = QLinear(64, 8, CFG)
    c.load_state_dict(lin.state_dict(), strict=False)
    ref = QLinear.from_linear(lin, CFG)
    assert torch.equal(c.index, ref.index) and torch.equal(c.beta, ref.beta)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_layers_train_save_and_load_exactly(dtype):
    # A refresh makes float32 scales in a half-precision layer; a fresh layer of that dtype
    # must load them as saved (copied into its own half-precision buffer they rounded).
    x = torch.randn(5, 30, dtype=dtype)
    a = QLinear.from_linear(_linear(4), CFG).to(dtype)
    a.train()(x)  # a training step: refresh at the stored beta
    b = _reload(QLinear(30, 16, CFG).to(dtype), a.state_dict())
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(b(x), a(x))
    assert b.scale.dtype == a.scale.dtype == torch.float32
    # Frozen codes: float32 scales loaded into a layer built for half-precision ones stay as
    # saved (they are part of the codes; the bias follows torch's rule and takes the dtype).
    frozen = QuantizedLinear.from_linear(_linear(4), CFG)
    c = _reload(QuantizedLinear(30, 16, CFG, dtype=dtype), frozen.state_dict())
    assert c.scale.dtype == torch.float32 and torch.equal(c.scale, frozen.scale)


@torch.no_grad()  # float() of an output that requires grad warns (once per process)
def test_high_rate_approaches_linear_and_activations():
    lin = _linear(2)
    x = torch.randn(4, 30)
    hi = QLinear.from_linear(lin, hq.HNLQConfig("D4", 16, 4, beta=4.353e-5),  # gaussian_beta
                             calibrate=False).eval()
    err = (hi(x) - lin(x)).norm() / lin(x).norm()
    assert float(err) < 1e-3
    lo = QLinear.from_linear(lin, CFG, quantize_activations=True).eval()  # calibrated beta
    assert float(lo.beta) != CFG.beta
    assert 1e-3 < float((lo(x) - lin(x)).norm() / lin(x).norm()) < 0.3
    # the activations are quantized per row, as hq's row codes at gaussian_beta
    x_hat = hq.decode(hq.encode_rows(x.numpy(), CFG.replace(beta=hq.gaussian_beta(CFG))))
    np.testing.assert_array_equal(lo(x).numpy(),
                                  _jax_linear(lo, torch.from_numpy(np.array(x_hat))))


def test_qat_against_float_baseline():
    """QAT of a small regression from scratch: as good as the float model quantized after the
    same training, and far below the start (a broken straight-through gradient fails this)."""
    torch.manual_seed(0)
    teacher = torch.randn(8, 32)
    x = torch.randn(512, 32)
    y = x @ teacher.T

    def train(layer, steps=150):
        opt = torch.optim.Adam(layer.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        for _ in range(steps):
            opt.zero_grad()
            (layer(x) - y).square().mean().backward()
            opt.step()
            schedule.step()
        return layer.eval()

    def loss(layer):
        with torch.no_grad():
            return float((layer(x) - y).square().mean())

    start = float(y.square().mean())
    float_model = train(torch.nn.Linear(32, 8))
    qat = train(QLinear(32, 8, CFG))
    ptq = QuantizedLinear.from_linear(float_model, CFG)
    assert loss(float_model) < 0.005 * start
    assert loss(qat) < 0.02 * start  # measured: 0.23 of 29.5
    assert loss(qat) < 1.5 * loss(ptq)  # measured: 1.03x


@torch.no_grad()
def test_extreme_weight_stays_in_its_row():
    """A weight of 1e30 neither gives NaN nor changes the other rows (per-row scales)."""
    lin = _linear(4, 16, 4)
    spiked = copy.deepcopy(lin)
    spiked.weight[1, 3] = 1e30
    x = torch.randn(5, 16)
    for make in (QLinear.from_linear, QuantizedLinear.from_linear):
        a, b = make(lin, CFG, calibrate=False).eval(), make(spiked, CFG, calibrate=False).eval()
        y = b(x)
        assert bool(torch.isfinite(y).all())
        assert torch.equal(y[:, [0, 2, 3]], a(x)[:, [0, 2, 3]])


def test_qlinear_bad_input():
    with pytest.raises(TypeError, match="HNLQConfig"):
        QLinear(4, 4, "D4")
    with pytest.raises(ValueError, match="ste must be one of"):
        QLinear(4, 4, CFG, ste="round", calibrate=False)
    with pytest.raises(ValueError, match="quantize_every must be an int >= 0"):
        QLinear(4, 4, CFG, quantize_every=-1, calibrate=False)
    with pytest.raises(ValueError, match=r"expected input \[\.\.\., 8\]"):
        QLinear(8, 4, CFG, calibrate=False)(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="expected an nn.Linear"):
        QLinear.from_linear(torch.nn.ReLU(), CFG)
    with pytest.raises(ValueError, match="made with"):
        QLinear(8, 4, CFG).set_codes(tb.encode_rows(torch.randn(4, 8), CFG.replace(q=8)))


# ------------------------------------------------------------------------------------- PTQ


class _Scaled(torch.nn.Linear):
    """A subclass with its own forward: quantize_model must keep it (and say so)."""

    def forward(self, x):
        return 2 * super().forward(x)


def _model():
    torch.manual_seed(0)
    shared = torch.nn.Linear(16, 16)
    return torch.nn.ModuleDict({
        "a": torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), shared),
        "b": torch.nn.Sequential(shared, torch.nn.Linear(16, 4, bias=False)),
        "attn": torch.nn.MultiheadAttention(16, 2, batch_first=True),
        "odd": _Scaled(16, 16),
    })


def _run(m, x):
    h = m["a"](x)
    h = h + m["attn"](h, h, h, need_weights=False)[0]
    return m["b"](m["odd"](h))


def test_quantize_model_report_and_no_float_weight():
    model = _model()
    with pytest.warns(UserWarning, match=r"kept 1 weight layer\(s\) in float: odd \(_Scaled\)"):
        report = quantize_model(model, CFG, filter_fn=lambda name, m: name != "a.0")
    attention = [f"attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
    assert [n for n, *_ in report.converted] == ["a.2", "b.0", "b.1", *attention]
    assert {(n, why) for n, _, why in report.skipped} >= {("a.0", "filter_fn")}
    assert model["a"][2] is model["b"][0]  # a shared layer: converted once, replaced everywhere
    assert isinstance(model["attn"], tb.SplitMultiheadAttention)
    assert isinstance(model["attn"].out_proj, QuantizedLinear)
    assert type(model["a"][0]) is torch.nn.Linear and type(model["odd"]) is _Scaled
    sd = model.state_dict()
    for name in ("a.2", "b.1", *attention):
        assert f"{name}.weight" not in sd
        assert sd[f"{name}.index"].dtype == torch.uint8 and sd[f"{name}.tfield"].dtype == \
            torch.uint8
        assert sd[f"{name}._extra_state"]["format_version"] == hq.FORMAT_VERSION
    quantized = {id(m): m for m in model.modules() if isinstance(m, QuantizedLinear)}.values()
    sizes = report.sizes
    assert sizes == tb.model_sizes(model) and sizes.layers == 6  # the shared one once
    assert sizes.quantized_bytes == sum(
        t.nbytes for m in quantized for t in m.state_dict().values()
        if isinstance(t, torch.Tensor))
    assert sizes.float32_bytes == 4 * (16 * 16 + 16 + 16 * 4 + 4 * (16 * 16 + 16))
    assert sizes.weights == sum(m.out_features * m.in_features for m in quantized) == 1344
    assert sizes.code_bytes == sum(m.codes().nbytes for m in quantized)
    assert sizes.bits_per_weight == 8 * sizes.code_bytes / 1344
    assert sizes.packed_code_bytes == sum(hq.pack(m.codes().to_jax()).nbytes for m in quantized)
    assert sizes.packed_bits_per_weight == 8 * sizes.packed_code_bytes / 1344
    assert str(report).startswith("6 quantized layer(s), 1,344 weights: "
                                  f"{sizes.bits_per_weight:.3f} bits/weight in memory, "
                                  f"{sizes.packed_bits_per_weight:.3f} packed; 5,696 bytes")
    assert "kept odd (_Scaled)" in str(report)
    # forward: the JAX path bit for bit
    x = torch.randn(3, 16)
    for m in quantized:
        np.testing.assert_array_equal(m(x).detach().numpy(), _jax_linear(m, x))
    # a second call finds the converted layers already quantized and converts nothing
    with pytest.warns(UserWarning, match="odd"):
        again = quantize_model(model, CFG)
    assert [n for n, *_ in again.converted] == ["a.0"]
    with pytest.raises(ValueError, match="itself an nn.Linear"):
        quantize_model(torch.nn.Linear(4, 4), CFG)
    with pytest.raises(TypeError, match="HNLQConfig"):
        quantize_model(_model(), "D4")


def test_quantized_state_dict_round_trip_and_errors():
    model = _model()
    with pytest.warns(UserWarning):
        quantize_model(model, CFG)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        y = _run(model, x)
    fresh = _model()  # other weights, then the saved state
    torch.manual_seed(5)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    with pytest.warns(UserWarning):
        quantize_model(fresh, CFG, calibrate=False)
    _reload(fresh, model.state_dict())
    with torch.no_grad():
        assert torch.equal(_run(fresh, x), y)
    sd = model["b"].state_dict()
    other = torch.nn.Sequential(QuantizedLinear(16, 16, CFG.replace(q=8)),
                                QuantizedLinear(16, 4, CFG.replace(q=8), bias=False))
    with pytest.raises(ValueError, match=r"saved with HNLQConfig\(.*q=4.*but HNLQConfig\(.*q=8.* is expected"):
        other.load_state_dict(sd)
    layer = QuantizedLinear(16, 4, CFG, bias=False)
    one = {k.removeprefix("1."): v for k, v in sd.items() if k.startswith("1.")}
    with pytest.raises(ValueError, match="format version 7"):
        layer.load_state_dict({**one, "_extra_state": {**one["_extra_state"],
                                                       "format_version": 7}})
    with pytest.raises(ValueError, match="saved index is torch.int64"):
        layer.load_state_dict({**one, "index": one["index"].long()})
    with pytest.raises(ValueError, match="expected saved HNLQ codes with a format_version and a config"):
        layer.load_state_dict({**one, "_extra_state": None})
    # in_features 13 and 16 have the same block shape: only the saved row length tells them apart
    # (columns 13-15 would be dropped silently); codes without their header are refused even
    # under strict=False (nothing says their config), before any buffer is written
    short = QuantizedLinear(13, 4, CFG, bias=False)
    before = {k: v.clone() for k, v in short.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match="in_features = 16, the layer has in_features = 13"):
        short.load_state_dict(one)
    headless = {k: v for k, v in one.items() if k != "_extra_state"}
    with pytest.raises(ValueError, match="holds codes but no '_extra_state'"):
        short.load_state_dict(headless, strict=False)
    assert all(torch.equal(before[k], v) for k, v in short.state_dict().items()
               if isinstance(v, torch.Tensor))
    layer.load_state_dict({**one, "_extra_state": {k: v for k, v in one["_extra_state"].items()
                                                   if k != "in_features"}})  # written before
    bad = QuantizedLinear(16, 4, CFG.replace(q=3, max_T=6), bias=False)
    with pytest.raises(ValueError, match="codebook index out of range"):  # 3^4 = 81 <= index
        bad.load_state_dict({**one, "index": torch.full_like(one["index"], 200),
                             "_extra_state": bad.get_extra_state()})
    with pytest.raises(TypeError, match="expected an nn.Linear"):
        QuantizedLinear.from_linear(torch.nn.ReLU(), CFG)
    with pytest.raises(ValueError, match=r"expected input \[\.\.\., 16\]"):
        layer(torch.zeros(2, 3))


def test_state_dict_bytes_at_most_0_17_of_float32():
    """A 384 -> 1536 -> 384 MLP (the shape of MiniLM's feed-forward) at D4 q=4 M=2."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(384, 1536), torch.nn.GELU(),
                              torch.nn.Linear(1536, 384))
    float_bytes = sum(t.nbytes for t in mlp.state_dict().values())
    report = quantize_model(mlp, CFG)  # D4 q=4 M=2
    q_bytes = sum(t.nbytes for t in mlp.state_dict().values() if isinstance(t, torch.Tensor))
    assert report.sizes.float32_bytes == float_bytes and report.sizes.quantized_bytes == q_bytes
    assert report.sizes.ratio_to_float32 == q_bytes / float_bytes
    assert q_bytes <= 0.17 * float_bytes, q_bytes / float_bytes  # measured 0.159
    saved = io.BytesIO()
    torch.save(mlp.state_dict(), saved)  # the file too (extra state and pickling included)
    assert saved.tell() <= 0.17 * float_bytes


def test_compiled_quantized_model_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))
    quantize_model(model, CFG)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 12)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        h = torch.nn.functional.gelu(torch.from_numpy(_jax_linear(model[0], x)))
        np.testing.assert_array_equal(model(x).numpy(), _jax_linear(model[2], h))


# Dynamo, resuming after the graph break, traces QLinear's autograd.Function and warns with a
# torch-internal DeprecationWarning (torch 2.13) that the suite's filterwarnings turns into an error.
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_compiled_qlinear_training_steps_match_eager():
    """A training QLinear (refreshing its codes, quantizing activations) under torch.compile
    breaks its graph at the JAX encoder instead of failing in Dynamo on the DLPack hand-over;
    outputs and gradients equal eager ones step for step."""
    torch.manual_seed(0)
    eager = QLinear(12, 5, CFG, quantize_activations=True)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager")
    for step in range(2):
        x = torch.randn(4, 12)
        ya, yb = eager(x), compiled(x)
        assert torch.equal(ya, yb), step
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert torch.equal(eager.weight.grad, twin.weight.grad)
        with torch.no_grad():  # the same update on both, so the next refresh sees new weights
            for layer in (eager, twin):
                layer.weight -= 0.1 * layer.weight.grad
                layer.weight.grad = None
        assert torch.equal(eager.index, twin.index) and int(eager.step) == int(twin.step)


def test_converting_nothing_raises_and_says_why():
    """A model without linears, one whose linears are all filtered out and one already
    quantized each raise, naming every layer kept and why (as quantize_params does)."""
    with pytest.raises(ValueError, match=r"^quantize_model: converted nothing: the model has "
                                         r"no weight layer this converts$"):
        quantize_model(torch.nn.Sequential(torch.nn.ReLU()), CFG)
    with pytest.raises(ValueError, match=r"^quantize_model: converted nothing: all 1 weight "
                                         r"layer\(s\) were kept \(below\)\n  kept 0 \(Linear\): "
                                         r"filter_fn$"):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), CFG,
                       filter_fn=lambda name, m: False)
    assert str(tb.model_sizes(torch.nn.ReLU())) == "no quantized layers"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    quantize_model(model, CFG)
    before = {k: v.clone() for k, v in model.state_dict().items()
              if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"kept 0 \(QuantizedLinear\): already quantized$"):
        quantize_model(model, CFG)
    assert isinstance(model[0], QuantizedLinear)  # the raise left the model as it was
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_qlinear_freezes_into_quantized_linear():
    model = torch.nn.Sequential(QLinear(12, 8, CFG), torch.nn.ReLU(),
                                QLinear(8, 4, CFG, quantize_activations=True))
    model.eval()
    x = torch.randn(3, 12)
    with torch.no_grad():
        h = model[0](x)
        with pytest.warns(UserWarning, match="quantizes its activations"):
            report = quantize_model(model, CFG)
    assert [n for n, *_ in report.converted] == ["0"] and isinstance(model[0], QuantizedLinear)
    with torch.no_grad():
        assert torch.equal(model[0](x), h)  # the QLinear's own codes
    with pytest.raises(ValueError, match="quantizes its activations"):
        QuantizedLinear.from_linear(model[2], CFG)


def test_a_layer_held_twice_by_one_parent_is_converted_at_both():
    """nn.Sequential(lin, act, lin): one QuantizedLinear in both places (named_children
    would list the layer once), both named in the report."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(lin, torch.nn.ReLU(), lin)
    x = torch.randn(3, 16)
    report = quantize_model(model, CFG)
    assert isinstance(model[0], QuantizedLinear) and model[0] is model[2]
    assert [n for n, *_ in report.converted] == ["0", "2"]
    assert "2.weight" not in model.state_dict()
    assert torch.equal(model(x), model[0](torch.relu(model[0](x))))


def test_layers_are_coded_in_named_modules_order():
    """A head after a nested block is coded last: with sequential=True each layer's
    calibration runs through the layers before it already quantized, and rotation k goes to
    the k-th linear of named_modules."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)),
        torch.nn.Linear(16, 8))
    quantized_at_call = []

    def run(m):
        quantized_at_call.append([n for n, x in m.named_modules()
                                  if isinstance(x, QuantizedLinear)])
        m(torch.randn(32, 16))

    report = quantize_model(model, CFG, calibration=run, sequential=True, rotate=True, seed=5)
    order = ["0.0", "0.2", "1"]
    assert [n for n, *_ in report.converted] == order
    assert quantized_at_call == [[], ["0.0"], ["0.0", "0.2"]]
    assert [model.get_submodule(n).rotation.seed for n in order] == [5, 6, 7]


def test_load_quantized_into_the_qat_model():
    """The QLinear model quantize_model converted takes the saved QuantizedLinear codes (its
    QLinears replaced); a QLinear state dict still loads into QLinears."""
    def make():
        torch.manual_seed(3)
        return torch.nn.Sequential(QLinear(16, 32, CFG), torch.nn.ReLU(), QLinear(32, 8, CFG))

    qat = make()
    trained = qat.state_dict()
    quantize_model(qat, CFG)
    x = torch.randn(5, 16)
    restored = tb.load_quantized(make(), qat.state_dict())
    assert all(isinstance(restored[i], QuantizedLinear) for i in (0, 2))
    assert torch.equal(restored(x), qat(x))
    again = tb.load_quantized(make(), trained)
    assert isinstance(again[0], QLinear) and torch.equal(again[0].index, trained["0.index"])


@pytest.mark.parametrize("convert", ["half", "bfloat16", "double"])
def test_qlinear_dtype_conversion_keeps_beta(convert):
    """.half() / .bfloat16() / .double() keep the calibrated beta in float32, as a layer built
    in that dtype keeps it: later refreshes code with the same beta."""
    torch.manual_seed(4)
    layer = QLinear(64, 32, CFG)
    beta = layer.beta.clone()
    converted = getattr(copy.deepcopy(layer), convert)()
    assert converted.beta.dtype == torch.float32 and torch.equal(converted.beta, beta)
    assert converted.weight.dtype == getattr(torch, {"half": "float16"}.get(convert, convert))
    built = QLinear(64, 32, CFG, dtype=converted.weight.dtype)
    with torch.no_grad():
        built.weight.copy_(converted.weight)
        built.bias.copy_(converted.bias)
    built.calibrate_beta()
    converted.calibrate_beta()
    assert torch.equal(built.beta, converted.beta)
    # the row scales too (at least float32, as the built layer's): rounded to half precision
    # the eval outputs differed from the built layer's by 1e-3
    assert converted.scale.dtype == built.scale.dtype
    built.set_codes(converted.codes())
    x = torch.randn(3, 64, dtype=built.weight.dtype)
    assert torch.equal(converted.eval()(x), built.eval()(x))


def test_a_layer_that_never_coded_its_weight_is_not_read_as_codes():
    """QLinear(quantize_weights=False) holds codes never made (every block failed): loaded
    into a quantizing QLinear, or the flag turned on, they gave NaN outputs without a word;
    now the weight is coded then, as QLinear.from_linear codes it. load_quantized leaves such
    a layer in float (its state holds a float weight)."""
    plain = QLinear.from_linear(_linear(), CFG, quantize_weights=False)
    want = QLinear.from_linear(_linear(), CFG).eval()
    x = torch.randn(4, 30)
    loaded = QLinear(30, 16, CFG)
    loaded.load_state_dict(plain.state_dict())
    assert torch.equal(loaded.eval()(x), want(x))
    flipped = copy.deepcopy(plain)
    flipped.quantize_weights = True
    assert torch.equal(flipped.eval()(x), want(x)) and torch.equal(flipped.beta, want.beta)
    # turned off and on again, it codes the weight as it is now (at the beta it has)
    with torch.no_grad():
        flipped.weight.mul_(2)
    flipped.quantize_weights = False
    flipped.quantize_weights = True
    assert torch.equal(flipped.beta, want.beta)
    torch.testing.assert_close(flipped(x) - flipped.bias, 2 * (want(x) - want.bias))
    # a weight that cannot be coded leaves the flag (and beta) as they were: not a layer that
    # quantizes with codes never made
    broken = copy.deepcopy(plain)
    with torch.no_grad():
        broken.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        broken.quantize_weights = True
    assert broken.quantize_weights is False and torch.equal(broken.beta, plain.beta)
    model = tb.load_quantized(torch.nn.Sequential(torch.nn.Linear(30, 16)),
                              torch.nn.Sequential(plain).state_dict(), strict=False)
    assert type(model[0]) is torch.nn.Linear and torch.equal(model[0](x), plain(x))


def test_qlinear_builds_on_the_meta_device():
    """As nn.Linear: built on meta (no values to calibrate or code), it takes a state dict by
    assignment, or after to_empty, and computes as the saved layer (it raised a DLPack
    error)."""
    saved = QLinear.from_linear(_linear(), CFG).eval()
    x = torch.randn(3, 30)
    with torch.device("meta"):
        layer = QLinear(30, 16, CFG)
    assert layer.index.device.type == "meta"
    layer.load_state_dict(saved.state_dict(), assign=True)
    assert torch.equal(layer.eval()(x), saved(x))
    empty = QLinear(30, 16, CFG, device="meta").to_empty(device="cpu")
    empty.load_state_dict(saved.state_dict())
    assert torch.equal(empty.eval()(x), saved(x))


def test_a_refresh_that_overloads_names_the_layers_remedies():
    """An outlier grown past the stored beta's reach: the error names the stored beta and the
    layer's remedies (it said "raise config.beta", which a calibrated layer ignores), the
    codes stay as they were, and calibrate_beta() then refreshes."""
    layer = QLinear(4096, 2, CFG)
    before = layer.index.clone()
    with torch.no_grad():
        layer.weight[1, 5] = 150 * layer.weight[1].std()  # ~60x its row's RMS
    with pytest.raises(ValueError, match=r"QLinear.refresh_codes: 1 block\(s\) still overload "
                                         r"at max_T = 14 \(the first at block \[1, 1\]\).*stored "
                                         r"beta = 0\.\d+; call layer.calibrate_beta\(\)"):
        layer.refresh_codes()
    assert torch.equal(layer.index, before)
    layer.calibrate_beta()
    layer.refresh_codes()
    assert bool((layer.codes().T >= 0).all())


def test_a_layer_pickled_before_the_flag_was_a_property_loads():
    """quantize_weights became a property over _quantize_weights: a layer pickled with the
    plain attribute unpickles with its flag (the property raised AttributeError)."""
    layer = QLinear(8, 4, CFG, quantize_weights=False)
    state = dict(layer.__dict__)
    state["quantize_weights"] = state.pop("_quantize_weights")
    old = QLinear.__new__(QLinear)
    old.__setstate__(state)
    assert old.quantize_weights is False
    x = torch.randn(2, 8)
    assert torch.equal(old(x), layer(x))

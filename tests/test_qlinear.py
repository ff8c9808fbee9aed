"""QLinear and quantize_model: QDense equivalence, straight-through gradients, caching."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hnlq_jax as hq
import hnlq_jax.flax as hf
from torch_bridge import QLinear, quantize_model

CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2)


def _linear(seed=0, n_in=30, n_out=16):
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out)


def test_matches_qdense_on_the_same_weights():
    lin = _linear()
    q = QLinear.from_linear(lin, CFG, calibrate=False).eval()
    x = torch.randn(5, 30)
    m = hf.QDense(16, CFG, calibrate=False)
    X = jnp.asarray(x.numpy())
    v = m.init(jax.random.key(0), X)
    v = {**v, "params": {"kernel": jnp.asarray(lin.weight.detach().numpy().T),
                         "bias": jnp.asarray(lin.bias.detach().numpy())}}
    v = hf.refresh_codes(v, CFG)
    h = v["hnlq"]["QuantDense_0"] if "QuantDense_0" in v["hnlq"] else v["hnlq"]
    np.testing.assert_array_equal(q.labels.numpy(), np.asarray(h["labels"]))
    np.testing.assert_array_equal(q.T.numpy(), np.asarray(h["T"]))
    np.testing.assert_allclose(q(x).detach().numpy(), m.apply(v, X, deterministic=True),
                               rtol=1e-5, atol=1e-5)


def test_straight_through_gradients_and_clipping():
    lin = _linear(1)
    q = QLinear.from_linear(lin, CFG, calibrate=False)
    x = torch.randn(7, 30)
    q(x).square().sum().backward()
    w_hat = q.w_hat.clone()
    dense = torch.nn.Linear(30, 16)
    with torch.no_grad():
        dense.weight.copy_(w_hat)
        dense.bias.copy_(q.bias)
    dense(x).square().sum().backward()
    torch.testing.assert_close(q.weight.grad, dense.weight.grad)  # identity STE
    qc = QLinear.from_linear(lin, CFG, calibrate=False, ste="clipped")
    qc(x).square().sum().backward()
    keep = (qc.T == 0).repeat_interleave(4, dim=1)[:, :30]
    assert bool((~keep).any()) and bool(keep.any())
    assert torch.all(qc.weight.grad[~keep] == 0)
    torch.testing.assert_close(qc.weight.grad[keep], dense.weight.grad[keep])


def test_quantize_every_caches_codes():
    q = QLinear(30, 16, CFG, quantize_every=2, calibrate=False)
    x = torch.randn(3, 30)
    q(x)  # step 0: refresh
    before = q.labels.clone()
    with torch.no_grad():  # (a rescaled row would keep its codes: the scales are per row)
        q.weight.add_(torch.randn_like(q.weight))
    q(x)  # step 1: cached
    assert torch.equal(q.labels, before)
    q(x)  # step 2: refreshed from the new weight
    assert not torch.equal(q.labels, before)
    q.eval()
    y0 = q(x)
    with torch.no_grad():
        q.weight.add_(torch.randn_like(q.weight))
    torch.testing.assert_close(q(x), y0)  # eval: the cached codes, never re-quantized


@torch.no_grad()
def test_high_rate_approaches_linear_and_activations():
    lin = _linear(2)
    x = torch.randn(4, 30)
    hi = QLinear.from_linear(lin, hq.HNLQConfig("D4", 16, 4, beta=4.353e-5),  # gaussian_beta
                             calibrate=False).eval()
    err = (hi(x) - lin(x)).norm() / lin(x).norm()
    assert float(err) < 1e-3
    lo = QLinear.from_linear(lin, CFG, quantize_activations=True).eval()  # calibrated beta
    assert lo.beta != CFG.beta
    assert 1e-3 < float((lo(x) - lin(x)).norm() / lin(x).norm()) < 0.3


def test_quantize_model_and_state_dict():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(16, 4)))
    quantize_model(model, CFG, filter_fn=lambda name, m: name != "0")
    assert type(model[0]) is torch.nn.Linear and isinstance(model[2][0], QLinear)
    quantize_model(model, CFG)
    assert isinstance(model[0], QLinear)
    sd = model.state_dict()
    assert {"0.weight", "0.bias", "0.labels", "0.T", "0.scale"} <= set(sd)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(16, 4)))
    plain.load_state_dict(sd, strict=False)  # the float parameters move back to nn.Linear
    torch.testing.assert_close(plain[0].weight, model[0].weight)


def test_bad_input():
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

"""SplitMultiheadAttention: nn.MultiheadAttention's function with its projections as modules, so
that quantize_model converts (and calibrates) them; transformer layers converted whole; saved
models reload without encoding; attentions it cannot split stay float and say why."""

import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hnlq_jax as hq
from torch_bridge import (QuantizedLinear, SplitMultiheadAttention, load_quantized,
                          quantize_model)

pytestmark = pytest.mark.usefixtures("jax_on_cpu")

CFG = hq.HNLQConfig("D4", 4, 2)
E, HEADS = 16, 4


def _inputs(seed, batch_first, kdim, n=3, length=5, source=7, batched=True):
    g = torch.Generator().manual_seed(seed)

    def t(rows, width):
        shape = ((n, rows) if batch_first else (rows, n)) if batched else (rows,)
        return torch.randn(*shape, width, generator=g)

    return t(length, E), t(source, kdim or E), t(source, kdim or E)


def _masks(seed, n=3, length=5, source=7, batched=True):
    g = torch.Generator().manual_seed(seed)
    padding = torch.rand(n, source, generator=g) < 0.3
    mask = torch.randn(length, source, generator=g)
    padding[:, 0], mask[:, 0] = False, 0.0  # every query attends to key 0 (else NaN)
    return (padding if batched else padding[0]), mask


def _float_twin(split: SplitMultiheadAttention, batch_first: bool) -> torch.nn.MultiheadAttention:
    """The float nn.MultiheadAttention holding the split one's (decoded) weights."""
    same = split.kdim == split.vdim == split.embed_dim
    mha = torch.nn.MultiheadAttention(split.embed_dim, split.num_heads, batch_first=batch_first,
                                      kdim=split.kdim, vdim=split.vdim).eval()
    with torch.no_grad():
        ws = [split.q_proj.weight, split.k_proj.weight, split.v_proj.weight]
        if same:
            mha.in_proj_weight.copy_(torch.cat(ws))
        else:
            for name, w in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), ws):
                getattr(mha, name).copy_(w)
        mha.in_proj_bias.copy_(torch.cat([split.q_proj.bias, split.k_proj.bias,
                                          split.v_proj.bias]))
        mha.out_proj.weight.copy_(split.out_proj.weight)
        mha.out_proj.bias.copy_(split.out_proj.bias)
    return mha


def _both(a, b, *args, tol=1e-6, **kwargs):
    with torch.no_grad():
        (ya, wa), (yb, wb) = a(*args, **kwargs), b(*args, **kwargs)
    torch.testing.assert_close(yb, ya, atol=tol, rtol=tol)
    assert (wa is None) == (wb is None)
    if wa is not None:
        torch.testing.assert_close(wb, wa, atol=tol, rtol=tol)
    return yb, wb


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 12])
@given(seed=st.integers(0, 2**16), need_weights=st.booleans(), average=st.booleans(),
       batched=st.booleans())
def test_split_computes_the_float_attention(batch_first, kdim, seed, need_weights, average,
                                            batched):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kdim,
                                      vdim=kdim).eval()
    split = SplitMultiheadAttention.from_attention(mha)
    assert isinstance(split.q_proj, torch.nn.Linear) and split.kdim == (kdim or E)
    q, k, v = _inputs(seed, batch_first, kdim, batched=batched)
    padding, mask = _masks(seed, batched=batched)
    kw = dict(need_weights=need_weights, average_attn_weights=average)
    y, w = _both(mha, split, q, k, v, **kw)
    assert y.shape == q.shape[:-1] + (E,)
    if need_weights:
        assert w.shape == ((3,) if batched else ()) + (() if average else (HEADS,)) + (5, 7)
    # boolean masks (True: not attended) and additive float ones (torch deprecates a mix)
    _both(mha, split, q, k, v, key_padding_mask=padding, attn_mask=mask < -1, **kw)
    _both(mha, split, q, k, v, key_padding_mask=padding.float() * -1e4, attn_mask=mask, **kw)
    if batched:
        per_head = torch.randn(3 * HEADS, 5, 7, generator=torch.Generator().manual_seed(seed))
        _both(mha, split, q, k, v, attn_mask=per_head, **kw)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    q2 = q[..., :kdim] if kdim else q  # self-attention shapes: source = target
    _both(mha, split, q, q2, q2, attn_mask=causal, is_causal=True, **kw)


def test_split_trains_like_the_float_attention():
    """Dropout in training mode, none in eval; gradients reach the projections."""
    torch.manual_seed(0)
    split = SplitMultiheadAttention.from_attention(
        torch.nn.MultiheadAttention(E, HEADS, dropout=0.5, batch_first=True))
    q = torch.randn(2, 5, E)
    torch.manual_seed(1)
    a = split(q, q, q)[0]
    torch.manual_seed(2)
    assert not torch.equal(a, split(q, q, q)[0])  # dropout differs per call
    split.eval()
    assert torch.equal(split(q, q, q)[0], split(q, q, q)[0])
    split(q, q, q, need_weights=False)[0].sum().backward()
    assert all(p.grad is not None for p in split.parameters())


@pytest.mark.parametrize("average", [True, False])
def test_training_weights_are_after_dropout_as_torchs(average):
    """With dropout in training mode nn.MultiheadAttention returns the weights v was
    weighted with (after dropout); the split one returned them before it."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, HEADS, dropout=0.5, batch_first=True).train()
    split = SplitMultiheadAttention.from_attention(mha).train()
    q = torch.randn(2, 5, E)
    torch.manual_seed(1)
    out, weights = mha(q, q, q, average_attn_weights=average)
    torch.manual_seed(1)
    out_s, weights_s = split(q, q, q, average_attn_weights=average)
    torch.testing.assert_close(out_s, out)
    torch.testing.assert_close(weights_s, weights)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_quantized_attention_equals_its_decoded_float_twin(rotate, batch_first):
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(
        E, HEADS, batch_first=batch_first, kdim=12, vdim=12)}).eval()
    report = quantize_model(model, CFG, rotate=rotate)
    split = model["attn"]
    assert isinstance(split, SplitMultiheadAttention)
    assert [n for n, *_ in report.converted] == [f"attn.{p}" for p in
                                                 ("q_proj", "k_proj", "v_proj", "out_proj")]
    assert all(isinstance(getattr(split, p), QuantizedLinear) for p in ("q_proj", "out_proj"))
    assert (split.k_proj.in_features, split.k_proj.rotation is None) == (12, not rotate)
    q, k, v = _inputs(4, batch_first, 12)
    padding, mask = _masks(4)
    for need_weights in (True, False):
        _both(_float_twin(split, batch_first), split, q, k, v, key_padding_mask=padding,
              attn_mask=mask < -1, need_weights=need_weights, tol=2e-5)
    assert not any(key.endswith("weight") for key in model.state_dict())


def _encoder():
    torch.manual_seed(5)
    layer = torch.nn.TransformerEncoderLayer(E, HEADS, 32, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()


def test_transformer_encoder_converts_whole_calibrates_and_reloads(monkeypatch):
    x = torch.randn(4, 6, E, generator=torch.Generator().manual_seed(6))
    padding = torch.zeros(4, 6, dtype=torch.bool)
    padding[1, 4:] = True
    model = _encoder()
    assert model.use_nested_tensor
    ref = model(x, src_key_padding_mask=padding).detach()  # with grad: the standard path
    report = quantize_model(model, CFG, calibration=lambda m: m(x, src_key_padding_mask=padding),
                            rotate=True)
    names = [n for n, *_ in report.converted]
    assert len(names) == 12 and "layers.1.self_attn.v_proj" in names and report.skipped == []
    assert set(report.proxy_loss) == set(names)  # calibration reached every projection
    assert not model.use_nested_tensor  # its nested path would feed the layers nested tensors
    with torch.no_grad():
        y = model(x, src_key_padding_mask=padding)
    assert torch.nn.functional.cosine_similarity(y, ref, dim=-1).min() > 0.99
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    import torch_bridge.quantized as tq

    def no_encoding(*args, **kwargs):
        raise AssertionError("load_quantized encoded a weight")

    monkeypatch.setattr(tq, "encode_rows", no_encoding)
    monkeypatch.setattr(tq.hptq, "gptq_rows", no_encoding)
    fresh = load_quantized(_encoder(), torch.load(buf))
    assert isinstance(fresh.layers[0].self_attn, SplitMultiheadAttention)
    assert not fresh.use_nested_tensor
    with torch.no_grad():
        assert torch.equal(fresh(x, src_key_padding_mask=padding), y)


def test_filter_and_unsplittable_attentions_stay_float_and_say_why():
    torch.manual_seed(7)
    model = torch.nn.ModuleDict({
        "kv": torch.nn.MultiheadAttention(E, HEADS, add_bias_kv=True),
        "zero": torch.nn.MultiheadAttention(E, HEADS, add_zero_attn=True),
        "left": torch.nn.MultiheadAttention(E, HEADS),
        "only_out": torch.nn.MultiheadAttention(E, HEADS),
    })
    with pytest.warns(UserWarning, match=r"kept 4 weight layer\(s\) in float: kv \("):
        report = quantize_model(model, CFG, filter_fn=lambda name, m: not name.startswith(
            "left") and name != "only_out.q_proj")
    skipped = {n: why for n, _, why in report.skipped}
    assert "add_bias_kv and add_zero_attn are not supported" in skipped["kv"]
    assert "kept in float (above)" in skipped["zero.out_proj"]
    assert type(model["kv"]) is type(model["left"]) is torch.nn.MultiheadAttention
    assert skipped["left.out_proj"] == skipped["only_out.q_proj"] == "filter_fn"
    split = model["only_out"]  # split: some of its projections are converted
    assert type(split.q_proj) is torch.nn.Linear and isinstance(split.v_proj, QuantizedLinear)
    assert "kept kv (MultiheadAttention): add_bias_kv" in str(report)


def test_bad_attention_input_is_refused():
    torch.manual_seed(8)
    split = SplitMultiheadAttention.from_attention(torch.nn.MultiheadAttention(E, HEADS))
    q = torch.randn(5, 2, E)
    with pytest.raises(ValueError, match=r"attn_mask must be \(5, 5\), got \(5, 4\)"):
        split(q, q, q, attn_mask=torch.zeros(5, 4))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(2, 5\)"):
        split(q, q, q, key_padding_mask=torch.zeros(5, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or floating tensor, got torch.int64"):
        split(q, q, q, attn_mask=torch.zeros(5, 5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="is_causal .* needs that attn_mask"):
        split(q, q, q, is_causal=True)
    with pytest.raises(ValueError, match="all be 3-D .* or 2-D"):
        split(q, q[0], q)
    with pytest.raises(ValueError, match="key and value must agree"):
        split(q, q, q[:3])
    linear = torch.nn.Linear(E, E)
    with pytest.raises(ValueError, match="num_heads must be an int >= 1 dividing embed_dim"):
        SplitMultiheadAttention(linear, linear, linear, linear, 5)
    with pytest.raises(ValueError, match=r"expected linear projections .* got \[\(16, 16\), "
                                         r"\(16, 16\), \(16, 16\), \(8, 16\)\]"):
        SplitMultiheadAttention(linear, linear, linear, torch.nn.Linear(E, 8), 4)
    with pytest.raises(TypeError, match="expected an nn.MultiheadAttention, got Linear"):
        SplitMultiheadAttention.from_attention(linear)
    with pytest.raises(ValueError, match="add_bias_kv"):
        SplitMultiheadAttention.from_attention(torch.nn.MultiheadAttention(E, 2, add_bias_kv=True))

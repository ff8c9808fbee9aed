"""torch_bridge: DLPack aliasing, compact codes as tensors, the front doors on tensors (bit for
bit with hnlq_jax), 64-bit tensors, autograd, LUT products."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import experiment

import hnlq_jax as hq
import torch_bridge as tb

# CPU tensors: the JAX references run on the CPU too (conftest.jax_on_cpu)
pytestmark = pytest.mark.usefixtures("jax_on_cpu")

CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2)


def test_to_jax_zero_copy_and_aliasing():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = tb.to_jax(t)
    assert a.shape == (3, 4) and a.dtype == jnp.float32
    t[0, 0] = 100.0  # documented: a later torch write shows in the JAX view
    assert float(a[0, 0]) == 100.0
    # Tensors that require grad are detached; non-contiguous ones are copied to compact.
    w = torch.ones(4, 4, requires_grad=True)
    np.testing.assert_array_equal(tb.to_jax(w), np.ones((4, 4)))
    s = torch.arange(16.0).reshape(4, 4)[:, ::2]
    np.testing.assert_array_equal(tb.to_jax(s), s.numpy())
    np.testing.assert_array_equal(tb.to_jax(s.T), s.T.numpy())
    for dtype in (torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.uint16,
                  torch.uint32, torch.int32, torch.bool):
        x = torch.ones(3, dtype=dtype)
        assert tb.to_jax(x).dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    # 64-bit: the raw exchange leaves JAX's mode to the caller and says how (x64_for)
    wide = torch.ones(2, dtype=torch.float64)
    with pytest.raises(TypeError, match="x64_for"):
        tb.to_jax(wide)
    with tb.x64_for(wide):
        assert tb.to_jax(wide).dtype == jnp.float64
    assert not jax.config.jax_enable_x64  # the context restores the mode
    with pytest.raises(TypeError, match="unsupported dtype"):
        tb.to_jax(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        tb.to_jax(np.ones(2))


def test_layer_codes_are_viewed_again_after_an_in_place_write():
    """The matmul op keeps JAX views of a layer's code buffers while they are unchanged: an
    in-place write (load_state_dict, copy_) must reach the next product, and corrupted codes
    written in place must be refused again (the check-once cache is per buffer state)."""
    rng = np.random.default_rng(5)
    w1, w2 = rng.standard_normal((2, 6, 16)).astype(np.float32)
    layer = tb.QuantizedLinear.from_linear(_linear(w1), CFG, calibrate=False)
    other = tb.QuantizedLinear.from_linear(_linear(w2), CFG, calibrate=False)
    x = torch.from_numpy(rng.standard_normal((3, 16)).astype(np.float32))
    with torch.no_grad():
        first = layer(x)
        layer.load_state_dict(other.state_dict())
        np.testing.assert_array_equal(layer(x).numpy(), other(x).numpy())
        assert not np.array_equal(layer(x).numpy(), first.numpy())
        layer.scale.fill_(float("nan"))
        with pytest.raises(ValueError, match="NaN or Inf"):
            layer(x)


@pytest.mark.skipif(not hq.kernels.cpu.available(), reason="the native kernels are not built")
@pytest.mark.parametrize("rows", [1, 3, 10, 16, 20, 127, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_kernels_called_directly(rows, dtype):
    """On CPU tensors the matmul op calls the native kernels on the tensors' memory (no JAX
    dispatch): below ops.GEMM_ROWS rows (of the bucket: 2 x 16 rows below, 2 x 20 at it) the
    fused product, bit for bit the jitted hq.matmul; from there the decoded weight times x in
    torch's GEMM, bit for bit
    x @ hq.decode(codes).T in torch. The bias is added as y + bias in x's dtype, as the op
    adds it. Non-contiguous x and leading axes too;
    the layer's codes are read where they live (a copy_ into them reaches the next call)."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((2, 24, 36)).astype(np.float32)
    bias = rng.standard_normal(24).astype(np.float32)
    layer, other = (tb.QuantizedLinear.from_linear(_linear(v, bias), CFG, calibrate=False)
                    for v in w)
    b = torch.from_numpy(bias)
    x = torch.from_numpy(rng.standard_normal((rows, 2, 36)).astype(np.float32)).to(dtype)
    x = x.transpose(0, 1)  # [2, rows, 36], not contiguous
    jx = jnp.asarray(x.float().numpy()).astype(str(dtype).removeprefix("torch."))
    for _ in range(2):  # the second call reads the layer's codes after an in-place write
        codes = hq.Codes(*(jnp.asarray(t.numpy()) for t in (layer.index, layer.tfield)),
                         layer.codes_config, scale=jnp.asarray(layer.scale.numpy()), n=36)
        with torch.no_grad():
            got = layer(x)
        assert got.dtype == dtype and got.shape == (2, rows, 24)
        if hq.buckets.row_bucket(2 * rows) < tb.ops.GEMM_ROWS:
            want = jax.jit(lambda a, c: hq.matmul(a, c, implementation="native"))(jx, codes)
            want = torch.from_numpy(np.array(want, np.float32)).to(dtype) + b.to(dtype)
        else:
            wd = torch.from_numpy(np.array(hq.decode(codes)))
            if dtype == torch.bfloat16:
                wd = wd.bfloat16().float()
            x2 = x.float().reshape(-1, 36)
            want = ((x2 @ wd.T).to(dtype) + b.to(dtype)).reshape(2, rows, 24)
        np.testing.assert_array_equal(got.float().numpy(), want.float().numpy())
        with torch.no_grad():
            for name in ("index", "tfield", "scale"):
                getattr(layer, name).copy_(getattr(other, name))


@pytest.mark.parametrize("rows", [1, 64])
def test_inference_call_is_the_ops_bit_for_bit(rows):
    """The inference call (no dispatch) and the op (gradients on) add the bias alike: at a
    width where an addmm would round otherwise, from GEMM_ROWS rows too."""
    torch.manual_seed(rows)
    layer = tb.QuantizedLinear.from_linear(torch.nn.Linear(384, 1536), CFG)
    x = torch.randn(rows, 384)
    with torch.no_grad():
        fast = layer(x)
    assert torch.equal(fast, layer(x.requires_grad_()).detach())


@pytest.mark.parametrize("n", [384, 64, 1000])
def test_rotate_op_bit_for_bit_without_jax_dispatch(monkeypatch, n):
    """The rotate op gives Rotation.apply / inverse's bits in every dtype (leading axes,
    non-contiguous input); where apply takes the native kernel (384, 64) the op calls it on
    the tensor's memory, else (1000: a random mixer above MAX_MIXER) it runs the JAX path;
    autograd is the other direction."""
    from torch_bridge import ops as top
    calls = []
    direct = hq.kernels.cpu.rotate_host
    monkeypatch.setattr(hq.kernels.cpu, "rotate_host", lambda *a: calls.append(1) or direct(*a))
    rot = hq.incoherence.Rotation(n, 9)
    rng = np.random.default_rng(n)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.from_numpy(rng.standard_normal((n, 3, 2)).astype(np.float32)).to(dtype)
        x = x.permute(1, 2, 0)  # [3, 2, n], not contiguous
        jx = jnp.asarray(x.float().numpy()).astype(str(dtype).removeprefix("torch."))
        for inverse in (False, True):
            got = torch.ops.hnlq.rotate(x, n, 9, inverse)
            want = (rot.inverse if inverse else rot.apply)(jx)
            assert got.dtype == dtype and got.shape == x.shape
            np.testing.assert_array_equal(got.float().numpy(), np.asarray(want, np.float32))
    native = hq.incoherence.default_implementation(n, np.float32, "cpu") == "native"
    assert len(calls) == (6 if native else 0)
    x = torch.randn(4, n, requires_grad=True)
    top.rotate(x, n, 9, False).square().sum().backward()  # d/dx |x R|^2 = 2 x R R^T = 2 x
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.detach().numpy(), atol=1e-5)


@pytest.mark.skipif(not hq.kernels.cpu.available(), reason="the native kernels are not built")
@pytest.mark.parametrize("rotate", [False, True])
def test_inference_skips_the_op_dispatch_bit_for_bit(rotate):
    """An inference call of a layer runs the ops' bodies without dispatching the custom ops (no
    hnlq:: event in torch's profiler), with the ops' result bit for bit: the native kernels on
    CPU tensors, the compiled JAX product for another implementation (as on CUDA tensors);
    with autograd to record (x requires grad) the ops run and the gradient flows."""
    rng = np.random.default_rng(3)
    model = torch.nn.Sequential(_linear(rng.standard_normal((24, 36)).astype(np.float32)))
    tb.quantize_model(model, CFG, calibrate=False, rotate=rotate)
    layer = model[0]
    x = torch.from_numpy(rng.standard_normal((5, 36)).astype(np.float32))
    r = layer.rotation
    xr = x if r is None else torch.ops.hnlq.rotate(x, r.n, r.seed, False)
    want = torch.ops.hnlq.matmul(xr, layer.index, layer.tfield, layer.scale, 36, None,
                                 *layer._op_config)

    def hnlq_events(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn()
        return out, sorted({e.name for e in prof.events() if e.name.startswith("hnlq::")})

    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):  # x needs no grad
        with mode():
            got, events = hnlq_events(lambda: layer(x))
        assert events == [] and torch.equal(got, want)
    layer.implementation = "xla"  # the JAX path, and with a bias added after it
    with torch.no_grad():
        got, events = hnlq_events(lambda: layer(x))
        want_xla = torch.ops.hnlq.matmul(xr, layer.index, layer.tfield, layer.scale, 36, "xla",
                                         *layer._op_config)
        assert events == [] and torch.equal(got, want_xla)
        layer.bias = torch.nn.Parameter(torch.arange(24, dtype=torch.float32))
        got, events = hnlq_events(lambda: layer(x))
    assert events == [] and torch.equal(got, want_xla + layer.bias)
    layer.implementation, layer.bias = None, None
    xg = x.clone().requires_grad_(True)
    got, events = hnlq_events(lambda: layer(xg))
    assert "hnlq::matmul" in events and ("hnlq::rotate" in events) == rotate
    assert torch.equal(got.detach(), want)
    got.sum().backward()
    assert xg.grad is not None and xg.grad.shape == x.shape
    # what decides: compiling, autograd, tensor subclasses
    assert tb.ops.direct(x) and not tb.ops.direct(xg)
    with torch.no_grad():
        assert tb.ops.direct(xg, None)
    assert not tb.ops.direct(torch.nn.Parameter(x.clone(), requires_grad=False))


@pytest.mark.skipif(not hq.kernels.cpu.available(), reason="the native kernels are not built")
def test_large_batch_decodes_slabs_of_rows(monkeypatch):
    """A large batch's product decodes the weight a slab of rows at a time (a few MiB whole):
    slabs of 5 rows (with a ragged last one) give the product of the whole decoded weight."""
    from torch_bridge import ops as top
    rng = np.random.default_rng(11)
    layer = tb.QuantizedLinear.from_linear(
        _linear(rng.standard_normal((23, 36)).astype(np.float32)), CFG, calibrate=False)
    x = torch.from_numpy(rng.standard_normal((200, 36)).astype(np.float32))
    with torch.no_grad():
        whole = layer(x)
        monkeypatch.setattr(top, "_SLAB_WEIGHTS", 36 * 5)
        slabs = layer(x)
    wd = torch.from_numpy(np.array(hq.decode(layer.codes().to_jax())))
    np.testing.assert_array_equal(whole.numpy(), (x @ wd.T).numpy())
    np.testing.assert_allclose(slabs.numpy(), whole.numpy(), rtol=1e-6, atol=1e-5)


def _linear(w, bias=None):
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w))
        if bias is not None:
            linear.bias.copy_(torch.from_numpy(bias))
    return linear


def test_to_torch_aliasing_and_copy():
    a = jnp.arange(6.0)
    t = tb.to_torch(a)
    assert t.dtype == torch.float32 and t.shape == (6,)
    c = tb.to_torch(a, copy=True)
    c.add_(1)
    np.testing.assert_array_equal(a, np.arange(6.0))  # the copy owns its memory
    with pytest.raises(TypeError, match="expected a jax.Array"):
        tb.to_torch(np.ones(2))


def _same_codes(t: tb.Codes, j: hq.Codes):
    assert t.config == j.config and t.n == j.n
    assert t.index.dtype == getattr(torch, j.index.dtype.name)
    np.testing.assert_array_equal(t.index.numpy(), j.index)
    np.testing.assert_array_equal(t.tfield.numpy(), j.tfield)
    if j.scale is None:
        assert t.scale is None
    else:
        np.testing.assert_array_equal(t.scale.numpy(), j.scale)


def test_codec_bit_for_bit():
    x = np.random.default_rng(0).standard_normal((5, 30, 4)).astype(np.float32)
    codes = tb.encode(torch.from_numpy(x), CFG)
    ref = hq.encode(x, CFG)
    _same_codes(codes, ref)
    assert codes.index.dtype == torch.uint8 and codes.tfield.shape == (5, 15)  # 4-bit T field
    assert codes.shape == (5, 30, 4) and codes.nbytes == ref.nbytes
    np.testing.assert_array_equal(codes.T.numpy(), ref.T)
    np.testing.assert_array_equal(codes.labels.numpy(), ref.labels)
    np.testing.assert_array_equal(tb.decode(codes).numpy(), hq.decode(ref))
    np.testing.assert_array_equal(tb.decode(codes, levels=1).numpy(), hq.decode(ref, levels=1))
    assert tb.decode(codes, dtype=torch.bfloat16).dtype == torch.bfloat16
    q = tb.quantize(torch.from_numpy(x), CFG)
    np.testing.assert_array_equal(q.numpy(), hq.quantize(x, CFG))
    # Grad-requiring and non-contiguous inputs give the same codes.
    xt = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2))).transpose(0, 1)
    xt.requires_grad_(True)
    _same_codes(tb.encode(xt, CFG), ref)
    # Codes move between the two sides through DLPack.
    _same_codes(tb.Codes.from_jax(ref), ref)
    _same_codes(codes, codes.to_jax())


def test_rows_and_matmul_bit_for_bit():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 30)).astype(np.float32)
    x = rng.standard_normal((2, 5, 30)).astype(np.float32)
    codes = tb.encode_rows(torch.from_numpy(w), CFG)
    ref = hq.encode_rows(w, CFG)
    _same_codes(codes, ref)
    assert codes.shape == (24, 30) and codes.config.beta == 1.0
    np.testing.assert_array_equal(tb.decode(codes).numpy(), hq.decode(ref))
    for impl in (None, "xla", "pallas", "lut"):
        np.testing.assert_array_equal(
            tb.matmul(torch.from_numpy(x), codes, implementation=impl).numpy(),
            hq.matmul(x, ref, implementation=impl))
    # an explicit beta is the rows_codes of that beta
    _same_codes(tb.encode_rows(torch.from_numpy(w), CFG, beta=torch.tensor(0.3)),
                hq.rows.rows_codes(w, CFG, jnp.float32(0.3)))
    for bad in (float("nan"), 0.0, -0.3, torch.tensor(float("inf")), torch.tensor([0.3, 0.3])):
        with pytest.raises(ValueError, match="encode_rows: beta must be None, a positive number"):
            tb.encode_rows(torch.from_numpy(w), CFG, beta=bad)
    # E8 q=4: uint16 indices cross DLPack too
    e8 = hq.HNLQConfig("E8", 4, 2, beta=0.3)
    ce8 = tb.encode_rows(torch.from_numpy(w[:, :16]), e8)
    assert ce8.index.dtype == torch.uint16
    _same_codes(ce8, hq.encode_rows(w[:, :16], e8))


def test_cpu_tensors_on_a_gpu_machine(monkeypatch):
    """CPU tensors where JAX's default backend is a GPU: their DLPack imports live on the CPU,
    so every operation takes the CPU's path (on an H200 they reached a GPU kernel and failed)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 8, 4)).astype(np.float32)
    w = rng.standard_normal((16, 24)).astype(np.float32)
    a = rng.standard_normal((2, 24)).astype(np.float32)
    ref, ref_w = hq.encode(x, CFG), hq.encode_rows(w, CFG)
    want = (hq.decode(ref), hq.quantize(x, CFG), hq.matmul(a, ref_w))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with jax.default_device(None):  # where the tensors live decides, not jax_on_cpu
        codes = tb.encode(torch.from_numpy(x), CFG)
        _same_codes(codes, ref)
        np.testing.assert_array_equal(tb.decode(codes).numpy(), want[0])
        np.testing.assert_array_equal(tb.quantize(torch.from_numpy(x), CFG).numpy(), want[1])
        rows = tb.encode_rows(torch.from_numpy(w), CFG)
        _same_codes(rows, ref_w)
        np.testing.assert_array_equal(tb.matmul(torch.from_numpy(a), rows).numpy(), want[2])


def test_float64_and_int64():
    """64-bit tensors run under JAX's x64 mode: float64 in, float64 out, as hq under x64."""
    x = torch.randn(6, 4, dtype=torch.float64)
    codes = tb.encode(x, CFG)
    out = tb.decode(codes, dtype=torch.float64)
    q = tb.quantize(x, CFG)
    w = torch.randn(5, 8, dtype=torch.float64)
    rows = tb.encode_rows(w, CFG)
    a = torch.randn(3, 8, dtype=torch.float64)
    y = tb.matmul(a, rows)
    assert out.dtype == q.dtype == y.dtype == rows.scale.dtype == torch.float64
    with jax.enable_x64(True):
        ref = hq.encode(x.numpy(), CFG)
        _same_codes(codes, ref)
        np.testing.assert_array_equal(out.numpy(), hq.decode(ref, dtype=jnp.float64))
        np.testing.assert_array_equal(q.numpy(), hq.quantize(x.numpy(), CFG))
        rref = hq.encode_rows(w.numpy(), CFG)
        _same_codes(rows, rref)
        np.testing.assert_array_equal(y.numpy(), hq.matmul(a.numpy(), rref))
    # float32 codes decode to float64 on request
    assert tb.decode(tb.encode(x.float(), CFG), dtype=torch.float64).dtype == torch.float64
    with pytest.raises(TypeError, match="floating"):  # int64: the codec's own error
        tb.encode(torch.zeros(2, 4, dtype=torch.int64), CFG)
    assert not jax.config.jax_enable_x64


def test_quantize_straight_through_and_gradcheck():
    x = torch.randn(6, 4, dtype=torch.float32, requires_grad=True)
    y = tb.quantize(x, CFG)
    (y * torch.arange(24.0).reshape(6, 4)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.arange(24.0).reshape(6, 4))

    def f(a, b):
        return jnp.sin(a) * b + jnp.sum(a ** 2)

    g = tb.jax_function(f)  # float64 tensors: computed in float64 without any set-up
    a = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert g(a, b).dtype == torch.float64
    assert torch.autograd.gradcheck(g, (a, b))
    # An integer input gets no gradient; the floating one still does.
    h = tb.jax_function(lambda a, k: a * k.astype(a.dtype))
    k = torch.arange(15).reshape(3, 5)
    assert torch.autograd.gradcheck(lambda a: h(a, k), (a,))


def test_bad_input():
    with pytest.raises(ValueError, match="last axis"):
        tb.encode(torch.zeros(3, 5), CFG)
    with pytest.raises(ValueError, match="NaN or Inf"):
        tb.quantize(torch.tensor([[float("nan"), 0, 0, 0]]), CFG)
    with pytest.raises(ValueError, match="still overload"):
        tb.encode(torch.full((1, 4), 1e7), CFG)
    assert int(tb.encode(torch.full((1, 4), 1e7), CFG, failures="mark").T) == -1
    with pytest.raises(TypeError, match="floating"):
        tb.quantize(torch.zeros(2, 4, dtype=torch.int32), CFG)
    with pytest.raises(TypeError, match="HNLQConfig"):
        tb.encode(torch.zeros(2, 4), "D4")
    q3 = hq.HNLQConfig("D4", 3, 2, beta=0.2, max_T=6)  # q^d = 81: index 100 is corrupt
    good = tb.encode(torch.zeros(2, 4), q3)
    with pytest.raises(ValueError, match="codebook index out of range"):
        tb.decode(tb.Codes(torch.full_like(good.index, 100), good.tfield, q3))
    with pytest.raises(ValueError, match="T field holds values above max_T"):
        tb.decode(tb.Codes(good.index, torch.full_like(good.tfield, 0xFF), q3))
    with pytest.raises(ValueError, match="expected index uint8"):
        tb.decode(tb.Codes(good.index.to(torch.int64), good.tfield, q3))
    with pytest.raises(TypeError, match="Codes.from_jax"):
        tb.decode(good.to_jax())
    with pytest.raises(TypeError, match="torch.dtype"):
        tb.decode(good, dtype=np.float32)
    with pytest.raises(ValueError, match="row axis"):
        tb.encode_rows(torch.tensor(1.0), CFG)
    with pytest.raises(TypeError, match="HNLQConfig"):
        tb.encode_rows(torch.zeros(2, 4), "D4")
    with pytest.raises(ValueError, match="NaN or Inf"):
        tb.encode_rows(torch.tensor([[float("inf"), 1.0]]), CFG)
    spike = torch.randn(2, 4096)
    spike[0, 5] = 150.0  # ~60x its row's RMS: beyond max_T at the calibrated beta
    cfg = CFG.replace(beta=hq.gaussian_beta(CFG))
    with pytest.raises(ValueError, match=r"torch_bridge\.encode_rows: 1 block\(s\) still overload"):
        tb.encode_rows(spike, cfg)
    assert int((tb.encode_rows(spike, cfg, failures="mark").T < 0).sum()) == 1
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., k\]"):
        tb.matmul(torch.zeros(2, 7), tb.encode_rows(torch.randn(3, 8), CFG))
    with pytest.raises(TypeError, match="expected torch tensors"):
        tb.jax_function(lambda a: a)(np.ones(2))


def test_lut_products_bit_for_bit():
    rng = np.random.default_rng(2)
    A, B = (rng.standard_normal(s).astype(np.float32) for s in ((3, 5, 18), (7, 18)))
    cfg = CFG.replace(beta=0.05)  # a table for D4 q=4 M=2, any beta
    cA, cB = (hq.encode(hq.to_blocks(m, 4), cfg) for m in (A, B))
    tA, tB = (tb.encode(torch.from_numpy(np.array(hq.to_blocks(m, 4))), cfg) for m in (A, B))
    np.testing.assert_array_equal(tb.lut.matmul(tA, tB).numpy(), hq.lut.matmul(cA, cB))
    np.testing.assert_array_equal(tb.lut.dot(tA, tA).numpy(), hq.lut.dot(cA, cA))
    x = torch.from_numpy(A).requires_grad_(True)
    y = tb.lut.matmul_one_sided(tB, x)
    np.testing.assert_array_equal(y.detach().numpy(), hq.lut.matmul_one_sided(cB, A))
    np.testing.assert_array_equal(tb.lut.dot_one_sided(tA, x).detach().numpy(),
                                  hq.lut.dot_one_sided(cA, A))
    # row codes: the scales multiply the product
    rB = tb.encode_rows(torch.from_numpy(B), cfg)
    np.testing.assert_array_equal(tb.lut.matmul_one_sided(rB, x).detach().numpy(),
                                  hq.lut.matmul_one_sided(rB.to_jax(), A))
    # implementation= as in hnlq_jax.lut: each path's sums bit for bit
    native = ("native",) if hq.kernels.cpu.available() else ()
    for impl in ("xla",) + native:
        np.testing.assert_array_equal(
            tb.lut.matmul_one_sided(rB, x, implementation=impl).detach().numpy(),
            hq.lut.matmul_one_sided(rB.to_jax(), A, implementation=impl))
        np.testing.assert_array_equal(tb.lut.matmul(tA, tB, implementation=impl).numpy(),
                                      hq.lut.matmul(cA, cB, implementation=impl))
    for bad in ("pallas", ["xla"]):
        with pytest.raises(ValueError, match="lut.matmul_one_sided: implementation must be"):
            tb.lut.matmul_one_sided(rB, x, implementation=bad)
        with pytest.raises(ValueError, match="lut.matmul: implementation must be one of"):
            tb.lut.matmul(tA, tB, implementation=bad)
    # d/dx (x @ W_hat^T) = g @ W_hat
    g = torch.from_numpy(rng.standard_normal((3, 5, 7)).astype(np.float32))
    y.backward(g)
    W_hat = np.asarray(hq.decode(cB)).reshape(7, -1)[:, :18]
    np.testing.assert_allclose(x.grad.numpy(), g.numpy() @ W_hat, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="NaN or Inf"):
        tb.lut.matmul_one_sided(tB, torch.full((2, 18), float("inf")))
    with pytest.raises(ValueError, match="last axis"):
        tb.lut.matmul_one_sided(tB, torch.zeros(2, 30))
    with pytest.raises(ValueError, match="different configs"):
        tb.lut.dot(tA, tb.encode(torch.zeros(3, 5, 5, 4), cfg.replace(beta=0.1)))
    with pytest.raises(TypeError, match="torch_bridge.Codes"):
        tb.lut.matmul(cA, tB)


def test_gpu_check_times_the_bridge_and_profiles_it():
    """gpu_check's torch part at the smoke size (CPU tensors): both layers timed beside
    F.linear with the bridge's parts, and the first layer's host time profiled down to the
    bridge's own functions, all in the report (a lease is too short to find its bugs)."""
    gpu_check = experiment("gpu_check")
    rows = gpu_check.torch_path(True)
    assert [r["lattice"] for r in rows] == list(gpu_check.CONFIGS)
    keys = ("quantized_s", "F.linear_s", "to_jax_s", "jax_call_s", "jax_queued_s", "to_torch_s")
    assert all(0 < r[k] < 1 for r in rows for k in keys)
    profile = rows[0]["host_profile"]
    assert len(profile) == 12 and profile == sorted(profile, key=lambda p: -p["own_us"])
    assert any("codes_matmul" in p["function"] for p in profile)
    md = gpu_check.markdown({"environment": dict(device="cpu", backend="cpu", jax="0",
                                                 python="3"), "torch": rows})
    assert "| D4 256² |" in md and "| E8 256² |" in md and "host time goes (D4" in md


def test_jit_trace_records_the_op():
    """torch.jit.trace of quantized layers records the ops (the inference call's kernel writes
    into memory a tracer cannot see): the traced model computes as the eager one."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8)).eval()
    tb.quantize_model(model, CFG)
    model.append(tb.QLinear(8, 8, CFG).eval())
    x = torch.randn(4, 64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch >= 2.11 deprecates it
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the layers' shape checks
        traced = torch.jit.trace(model, x)  # check_trace: a second trace must agree
        assert torch.equal(traced(x), model(x))
        assert torch.equal(traced(2 * x), model(2 * x))


def test_layers_made_under_inference_mode_run():
    """Layers built or loaded under torch.inference_mode (inference tensors: no version
    counter) run there and outside (without autograd, as torch's own layers), bit for bit as
    the layers made outside; an in-place write there is read by the next call."""
    torch.manual_seed(6)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),  # noqa: E731
                                       torch.nn.Linear(32, 8))
    model = make()
    tb.quantize_model(model, CFG)
    other = make()
    tb.quantize_model(other, CFG)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        served = tb.load_quantized(make(), model.state_dict())
        assert torch.equal(served(x), model(x))
        served.load_state_dict(other.state_dict())  # in place, into inference tensors
        assert torch.equal(served(x), other(x))
        layer = tb.QLinear(64, 32, CFG).eval()
        y = layer(x)
    with torch.no_grad():
        assert torch.equal(served(x), other(x)) and torch.equal(layer(x), y)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap, once
def test_forward_mode_ad_is_refused_and_vmap_runs():
    """A forward-mode tangent is refused (torch would drop it silently), also before a
    rotation; torch.func.vmap takes the op and equals the batch."""
    import torch.autograd.forward_ad as fwad
    torch.manual_seed(7)
    plain = tb.QuantizedLinear.from_linear(torch.nn.Linear(64, 48), CFG)
    rotated = tb.QuantizedLinear.from_linear(torch.nn.Linear(64, 48), CFG,
                                             rotation=hq.incoherence.Rotation(64, 1))
    x = torch.randn(3, 5, 64)
    for layer in (plain, rotated):
        with fwad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
            layer(fwad.make_dual(x[0], torch.ones_like(x[0])))
        with torch.no_grad():
            mapped = torch.func.vmap(layer)(x)
        with torch.no_grad():
            assert torch.equal(mapped, layer(x))
    codes = tb.encode_rows(torch.randn(48, 64), CFG)
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        tb.matmul(fwad.make_dual(x[0], torch.ones_like(x[0])), codes)


@pytest.mark.parametrize("n, k", [(0, 16), (8, 0)])
def test_matmul_of_an_empty_weight_is_zeros(n, k):
    """As hq.matmul: an empty weight (or x) gives zeros of [..., n] at every batch (the
    bridge's kernels refused the codes, or torch.cat an empty list, from 33 rows on)."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2)
    codes = hq.encode_rows(np.zeros((n, k), np.float32), cfg)
    for lead in ((0,), (1,), (40,), (200,), (2, 50)):
        x = torch.ones(lead + (k,))
        y = tb.matmul(x, tb.Codes.from_jax(codes))
        assert y.shape == lead + (n,) and torch.equal(y, torch.zeros(lead + (n,)))
        np.testing.assert_array_equal(y.numpy(), hq.matmul(x.numpy(), codes))

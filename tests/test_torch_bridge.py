"""torch_bridge: DLPack aliasing, the codec on tensors (bit for bit with hnlq_jax), autograd."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hnlq_jax as hq
import torch_bridge as tb

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
    for dtype in (torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32,
                  torch.bool):
        x = torch.ones(3, dtype=dtype)
        assert tb.to_jax(x).dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    with pytest.raises(TypeError, match="64-bit mode"):
        tb.to_jax(torch.ones(2, dtype=torch.float64))
    with jax.enable_x64(True):
        assert tb.to_jax(torch.ones(2, dtype=torch.float64)).dtype == jnp.float64
    with pytest.raises(TypeError, match="unsupported dtype"):
        tb.to_jax(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        tb.to_jax(np.ones(2))


def test_to_torch_aliasing_and_copy():
    a = jnp.arange(6.0)
    t = tb.to_torch(a)
    assert t.dtype == torch.float32 and t.shape == (6,)
    c = tb.to_torch(a, copy=True)
    c.add_(1)
    np.testing.assert_array_equal(a, np.arange(6.0))  # the copy owns its memory
    with pytest.raises(TypeError, match="expected a jax.Array"):
        tb.to_torch(np.ones(2))


def test_codec_bit_for_bit():
    x = np.random.default_rng(0).standard_normal((5, 30, 4)).astype(np.float32)
    labels, T = tb.encode(torch.from_numpy(x), CFG)
    ref = hq.encode(x, CFG)
    assert labels.dtype == torch.uint8 and T.dtype == torch.int8
    np.testing.assert_array_equal(labels.numpy(), ref.labels)
    np.testing.assert_array_equal(T.numpy(), ref.T)
    out = tb.decode((labels, T), CFG)
    np.testing.assert_array_equal(out.numpy(), hq.decode(ref, CFG))
    assert tb.decode((labels, T), CFG, dtype=torch.bfloat16).dtype == torch.bfloat16
    q = tb.quantize(torch.from_numpy(x), CFG)
    np.testing.assert_array_equal(q.numpy(), hq.quantize(x, CFG))
    # Grad-requiring and non-contiguous inputs give the same codes.
    xt = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2))).transpose(0, 1)
    xt.requires_grad_(True)
    np.testing.assert_array_equal(tb.encode(xt, CFG)[0].numpy(), ref.labels)


def test_quantize_straight_through_and_gradcheck():
    x = torch.randn(6, 4, dtype=torch.float32, requires_grad=True)
    y = tb.quantize(x, CFG)
    (y * torch.arange(24.0).reshape(6, 4)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.arange(24.0).reshape(6, 4))
    with jax.enable_x64(True):
        def f(a, b):
            return jnp.sin(a) * b + jnp.sum(a ** 2)

        g = tb.jax_function(f)
        a = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        b = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
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
    with pytest.raises(TypeError, match="floating"):
        tb.quantize(torch.zeros(2, 4, dtype=torch.int32), CFG)
    with pytest.raises(TypeError, match="HNLQConfig"):
        tb.encode(torch.zeros(2, 4), "D4")
    with pytest.raises(ValueError, match="labels must be in 0..q-1"):
        tb.decode((torch.full((2, 2, 4), 7, dtype=torch.uint8), torch.zeros(2, dtype=torch.int8)),
                  CFG)
    with pytest.raises(TypeError, match="expected torch tensors"):
        tb.jax_function(lambda a: a)(np.ones(2))


def test_lut_products_bit_for_bit():
    rng = np.random.default_rng(2)
    A, B = (rng.standard_normal(s).astype(np.float32) for s in ((3, 5, 18), (7, 18)))
    cfg = CFG.replace(beta=0.05)  # a table for D4 q=4 M=2, any beta
    cA, cB = (hq.encode(hq.to_blocks(m, 4), cfg) for m in (A, B))
    tA, tB = (tb.encode(torch.from_numpy(np.array(hq.to_blocks(m, 4))), cfg) for m in (A, B))
    np.testing.assert_array_equal(tb.matmul(tA, tB, cfg).numpy(), hq.lut.matmul(cA, cB, cfg))
    np.testing.assert_array_equal(tb.dot(tA, tA, cfg).numpy(), hq.lut.dot(cA, cA, cfg))
    x = torch.from_numpy(A).requires_grad_(True)
    y = tb.matmul_one_sided(tB, x, cfg)
    np.testing.assert_array_equal(y.detach().numpy(), hq.lut.matmul_one_sided(cB, A, cfg))
    np.testing.assert_array_equal(tb.dot_one_sided(tA, x, cfg).detach().numpy(),
                                  hq.lut.dot_one_sided(cA, A, cfg))
    # d/dx (x @ W_hat^T) = g @ W_hat
    g = torch.from_numpy(rng.standard_normal((3, 5, 7)).astype(np.float32))
    y.backward(g)
    W_hat = np.asarray(hq.decode(cB, cfg)).reshape(7, -1)[:, :18]
    np.testing.assert_allclose(x.grad.numpy(), g.numpy() @ W_hat, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="NaN or Inf"):
        tb.matmul_one_sided(tB, torch.full((2, 18), float("inf")), cfg)
    with pytest.raises(ValueError, match="last axis"):
        tb.matmul_one_sided(tB, torch.zeros(2, 30), cfg)
    with pytest.raises(ValueError, match="labels must be in 0..q-1"):
        tb.dot((tA[0] + 4, tA[1]), tA, cfg)
    with pytest.raises(TypeError, match="pair of tensors"):
        tb.matmul(cA, tB, cfg)

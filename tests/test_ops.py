"""torch_bridge.ops: the HNLQ operations as torch.library custom ops, inside torch.compile."""

import numpy as np
import pytest
import torch

import hnlq_jax as hq
import torch_bridge as tb
from torch_bridge.ops import config_args

# CPU tensors: the JAX references run on the CPU too (conftest.jax_on_cpu)
pytestmark = pytest.mark.usefixtures("jax_on_cpu")

CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2016)
DITHERED = hq.HNLQConfig("D4", 4, 2, beta=0.2016, dither=(0.01, -0.02, 0.03, 0.0))
CHECKS = ("test_schema", "test_faketensor", "test_autograd_registration")


@pytest.mark.parametrize("cfg", [CFG, DITHERED])
def test_opcheck(cfg):
    """Schemas, fake (shape) implementations and autograd registration agree with the ops."""
    x = torch.randn(3, 5, 4, dtype=torch.float32, requires_grad=True)
    codes = tb.encode(x, cfg)
    rows = tb.encode_rows(torch.randn(6, 10), cfg)
    a = torch.randn(2, 10, requires_grad=True)
    scale = rows.scale.clone().requires_grad_(True)
    rcfg = config_args(rows.config)
    cases = [
        (torch.ops.hnlq.quantize.default, (x, None, *config_args(cfg))),
        (torch.ops.hnlq.encode.default, (x.detach(), "xla", "raise", *config_args(cfg))),
        (torch.ops.hnlq.decode.default,
         (*codes.op_args(), None, torch.bfloat16, None, *config_args(cfg))),
        (torch.ops.hnlq.decode.default, (*rows.op_args(), 1, torch.float32, None, *rcfg)),
        (torch.ops.hnlq.matmul.default,
         (a, rows.index, rows.tfield, scale, rows.n, None, *rcfg)),
        (torch.ops.hnlq.matmul.default,
         (torch.randn(2, 12), rows.index, rows.tfield, None, None, "lut", *rcfg)),
        (torch.ops.hnlq.matmul_backward.default,
         (torch.randn(2, 6), a.detach(), *rows.op_args(), None, *rcfg)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=CHECKS)


def test_compiled_graph_equals_eager_bit_for_bit():
    w = tb.encode_rows(torch.randn(5, 28), CFG)

    def f(x):
        codes = tb.encode(x, CFG)
        y = 2 * tb.quantize(x, CFG) + tb.decode(codes)
        return tb.matmul(y.reshape(6, 28), w)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fullgraph: no breaks
    x = torch.randn(6, 7, 4, requires_grad=True)
    got = compiled(x)
    np.testing.assert_array_equal(got.detach().numpy(), f(x).detach().numpy())
    xq = 3 * np.asarray(hq.quantize(x.detach().numpy(), CFG)).reshape(6, 28)
    np.testing.assert_array_equal(got.detach().numpy(),
                                  hq.matmul(xq, w.to_jax()))
    # straight-through through quantize (2x), decode and encode give no gradient; the matmul's
    # x-gradient is 1 @ W_hat
    got.sum().backward()
    w_hat = np.asarray(hq.decode(w.to_jax()))
    expect = 2 * np.broadcast_to(w_hat.sum(0), (6, 28)).reshape(6, 7, 4)
    np.testing.assert_allclose(x.grad.numpy(), expect, rtol=1e-5, atol=1e-5)


def test_compiled_batch_sizes():
    """A compiled graph with the matmul op over several batch sizes (recompiles when torch
    marks the batch dynamic: the fake implementation specializes it)."""
    w = tb.encode_rows(torch.randn(3, 8), CFG)
    compiled = torch.compile(lambda x: tb.matmul(x, w), backend="aot_eager", fullgraph=True)
    for batch in (2, 5, 9):
        x = torch.randn(batch, 8)
        np.testing.assert_array_equal(compiled(x).numpy(), hq.matmul(x.numpy(), w.to_jax()))


def test_matmul_gradients_equal_jax():
    """The matmul op's backward is the (jitted) jax.vjp of hq.matmul, in x and the row scale."""
    import jax

    w = tb.encode_rows(torch.randn(7, 12), CFG)
    x = torch.randn(3, 12, requires_grad=True)
    scale = w.scale.clone().requires_grad_(True)
    y = torch.ops.hnlq.matmul(x, w.index, w.tfield, scale, w.n, None, *config_args(w.config))
    g = torch.randn(3, 7)
    y.backward(g)
    jc = w.to_jax()

    def f(a, s):
        return hq.matmul(a, hq.Codes(jc.index, jc.tfield, jc.config, scale=s, n=jc.n))

    dx, ds = jax.jit(lambda a, s, g: jax.vjp(f, a, s)[1](g))(x.detach().numpy(), jc.scale,
                                                             g.numpy())
    np.testing.assert_array_equal(x.grad.numpy(), dx)
    np.testing.assert_array_equal(scale.grad.numpy(), ds)


def test_compiled_shape_errors():
    compiled = torch.compile(lambda x: tb.quantize(x, CFG), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="last axis is the lattice axis"):
        compiled(torch.zeros(3, 5))
    w = tb.encode_rows(torch.randn(3, 8), CFG)
    mm = torch.compile(lambda x: tb.matmul(x, w), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"x must be \[\.\.\., k\] with k = 8"):
        mm(torch.zeros(2, 12))
    with pytest.raises(TypeError, match="HNLQConfig"):
        config_args("D4")

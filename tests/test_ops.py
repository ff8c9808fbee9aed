"""torch_bridge.ops: the codec as torch.library custom ops, inside torch.compile."""

import numpy as np
import pytest
import torch

import hnlq_jax as hq
import torch_bridge as tb
from torch_bridge.ops import config_args

CFG = hq.HNLQConfig("D4", 4, 2, beta=0.2016)
DITHERED = hq.HNLQConfig("D4", 4, 2, beta=0.2016, dither=(0.01, -0.02, 0.03, 0.0))


@pytest.mark.parametrize("cfg", [CFG, DITHERED])
def test_opcheck(cfg):
    """Schemas, fake (shape) implementations and autograd registration agree with the ops."""
    x = torch.randn(3, 5, 4, dtype=torch.float32, requires_grad=True)
    labels, T = tb.encode(x, cfg)
    for op, args in ((torch.ops.hnlq.quantize.default, (x, *config_args(cfg))),
                     (torch.ops.hnlq.encode.default, (x.detach(), *config_args(cfg))),
                     (torch.ops.hnlq.decode.default,
                      (labels, T, torch.bfloat16, *config_args(cfg)))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                    "test_autograd_registration"))


def test_compiled_graph_equals_eager_bit_for_bit():
    def f(x):
        labels, T = tb.encode(x, CFG)
        return 2 * tb.quantize(x, CFG) + tb.decode((labels, T), CFG)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fullgraph: no breaks
    x = torch.randn(6, 7, 4, requires_grad=True)
    got = compiled(x)
    np.testing.assert_array_equal(got.detach().numpy(), f(x).detach().numpy())
    np.testing.assert_array_equal(got.detach().numpy(), 3 * np.asarray(hq.quantize(
        x.detach().numpy(), CFG)))
    got.sum().backward()  # straight-through through quantize; encode gives no gradient
    np.testing.assert_array_equal(x.grad.numpy(), np.full((6, 7, 4), 2.0, np.float32))


def test_compiled_shape_errors():
    compiled = torch.compile(lambda x: tb.quantize(x, CFG), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="last axis is the lattice axis"):
        compiled(torch.zeros(3, 5))
    with pytest.raises(TypeError, match="HNLQConfig"):
        config_args("D4")

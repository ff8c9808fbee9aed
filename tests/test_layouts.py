"""Kernels as [out, in] matrices (hnlq_jax.layouts): a layer's call written as a product with
its kernel's matrix is the layer's own output, for every Dense / DenseGeneral / Einsum form it
supports; the forms it does not support say why; layouts save and load."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hnlq_jax.layouts import KernelLayout, LayerCall, layer_call


def _calls(run) -> list:
    """:func:`layer_call` of every module call made by ``run()``."""
    seen = []

    def record(next_fun, args, kwargs, context):
        seen.append(layer_call(context.module, args, kwargs))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        run()
    return seen


def _product(call: LayerCall, x, kernel):
    """The layer's output without bias, through the kernel's matrix."""
    return call.outputs(call.inputs(x) @ call.layout.matrix(kernel).T)


@st.composite
def _layouts(draw):
    rank = draw(st.integers(2, 4))
    roles = draw(st.lists(st.sampled_from("io"), min_size=rank, max_size=rank).filter(
        lambda r: set(r) == {"i", "o"}))
    shape = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    return KernelLayout(tuple(shape), "".join(roles))


@given(_layouts(), st.integers(0, 2**31 - 1))
def test_matrix_and_kernel_are_inverse(layout, seed):
    kernel = np.random.default_rng(seed).standard_normal(layout.shape)
    w = layout.matrix(kernel)
    assert w.shape == (layout.n, layout.k)
    np.testing.assert_array_equal(layout.kernel(w), kernel)
    # Row j, column i: the kernel entry at output index j and input index i (C order each).
    out_shape = [layout.shape[a] for a in layout.out_axes]
    in_shape = [layout.shape[a] for a in layout.in_axes]
    j, i = np.random.default_rng(seed).integers(0, [layout.n, layout.k])
    index = [0] * len(layout.shape)
    for axes, sizes, flat in ((layout.out_axes, out_shape, j), (layout.in_axes, in_shape, i)):
        for a, v in zip(axes, np.unravel_index(flat, sizes)):
            index[a] = v
    assert w[j, i] == kernel[tuple(index)]
    assert KernelLayout.from_dict(layout.to_dict()) == layout


# (equation, input shape, kernel shape, kernel roles)
EINSUMS = [
    ("...d,dhk->...hk", (2, 3, 6), (6, 2, 4), "ioo"),   # a query projection
    ("bshk,hkd->bsd", (2, 3, 2, 4), (2, 4, 6), "iio"),  # an output projection
    ("bd,hd->bh", (3, 5), (4, 5), "oi"),                # a transposed 2-D kernel
    ("bsd,dh->hbs", (2, 3, 5), (5, 4), "io"),           # the output axes reordered
    ("abc,cbe->ea", (2, 3, 4), (4, 3, 5), "iio"),       # contracted axes out of order
]


@pytest.mark.parametrize("equation, x_shape, k_shape, roles", EINSUMS)
def test_einsum_calls_are_products_with_the_matrix(equation, x_shape, k_shape, roles):
    layer = nn.Einsum(k_shape, equation)
    x = jax.random.normal(jax.random.key(0), x_shape)
    variables = layer.init(jax.random.key(1), x)
    y = layer.apply(variables, x)
    call = _calls(lambda: layer.apply(variables, x))[0]
    assert call.layout == KernelLayout(k_shape, roles)
    p = variables["params"]
    want = y - jnp.reshape(p["bias"], call.bias_shape())
    np.testing.assert_allclose(np.asarray(_product(call, x, p["kernel"])), np.asarray(want),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer, x_shape, roles", [
    (nn.Dense(5), (2, 3, 4), "io"),
    (nn.DenseGeneral((2, 3)), (4, 6), "ioo"),
    (nn.DenseGeneral(5, axis=(1, -1)), (2, 3, 4, 6), "iio"),
    (nn.DenseGeneral((2, 3), axis=(-1, 1)), (2, 4, 3, 6), "iioo"),  # axes given unsorted
    (nn.DenseGeneral(5, axis=0, use_bias=False), (6, 2), "io"),
])
def test_dense_calls_are_products_with_the_matrix(layer, x_shape, roles):
    x = jax.random.normal(jax.random.key(0), x_shape)
    variables = layer.init(jax.random.key(1), x)
    variables = jax.tree.map(lambda v: v + 0.5, variables)  # a nonzero bias
    y = layer.apply(variables, x)
    call, p = _calls(lambda: layer.apply(variables, x))[0], variables["params"]
    assert call.layout == KernelLayout(p["kernel"].shape, roles)
    got = _product(call, x, p["kernel"])
    if "bias" in p:
        got = got + jnp.reshape(p["bias"], call.bias_shape())
    np.testing.assert_allclose(np.asarray(got), np.asarray(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer, x_shape, why", [
    (nn.DenseGeneral(3, batch_dims=(0,)), (2, 4), "batch_dims"),
    (nn.Einsum((2, 4, 3), "bd,bdk->bk"), (2, 4), "batched"),
    (nn.Einsum((4, 3), "bdd,dk->bk"), (2, 4, 4), "diagonal"),
    (nn.Einsum((4, 5, 3), "bd,dek->bk"), (2, 4), "sums index 'e'"),
    (nn.Einsum((4,), "bd,d->b", kernel_init=nn.initializers.ones), (2, 4), "no output axis"),
    (nn.Einsum((2, 3), "b,hk->bhk"), (2,), "no contracted axis"),
])
def test_other_calls_say_why(layer, x_shape, why):
    x = jnp.ones(x_shape)
    seen = _calls(lambda: layer.init(jax.random.key(0), x))
    assert isinstance(seen[0], str) and why in seen[0], seen[0]


def test_other_modules_are_not_layers_and_own_calls_say_why():
    class OwnDense(nn.Dense):  # its own call: not computed as a Dense
        def __call__(self, x):
            return super().__call__(x) * 2

    conv = _calls(lambda: nn.Conv(3, (2,)).init(jax.random.key(0), jnp.ones((1, 4, 2))))
    own = _calls(lambda: OwnDense(3).init(jax.random.key(0), jnp.ones((1, 4))))
    assert conv == [None] and "its own __call__ (OwnDense" in own[0]


@pytest.mark.parametrize("shape, roles", [((3, 4), "ii"), ((3, 4), "oo"), ((3, 4), "i"),
                                          ((3, 0), "io"), ((3, 4), "ix"), ((3.5, 4), "io")])
def test_bad_layouts_refused(shape, roles):
    with pytest.raises(ValueError, match="KernelLayout"):
        KernelLayout(shape, roles)


def test_saved_layouts_checked():
    state = KernelLayout((3, 4, 5), "iio").to_dict()
    assert state["shape"] == "3x4x5"
    for bad in ({**state, "version": 2}, {**state, "kind": "other"}, {**state, "shape": "3x-4"},
                {**state, "roles": "iii"}, {"shape": "3x4"}):
        with pytest.raises(ValueError, match="KernelLayout.from_dict"):
            KernelLayout.from_dict(bad)
    with pytest.raises(ValueError, match="expected a kernel of shape"):
        KernelLayout((3, 4), "io").matrix(jnp.ones((4, 3)))

"""Row buckets: sizes, and run_rows against the unpadded call (values, shapes, compiles)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hnlq_jax.buckets import row_bucket, run_rows


def test_row_bucket():
    sizes = [row_bucket(b) for b in range(0, 300)]
    assert sizes[:9] == list(range(9))
    assert all(b <= s <= 1.25 * b for b, s in zip(range(300), sizes) if b)
    assert len(set(sizes)) <= 9 + 4 * 6  # four sizes per octave above 8


@jax.jit
def _affine(rows, w, b):
    return rows @ w + b  # row-wise: padding rows cannot change the others


@given(lead=st.lists(st.integers(0, 12), min_size=1, max_size=3), data=st.data())
def test_run_rows_equals_the_direct_call(lead, data):
    # Small integers: every sum is exact, so the comparison does not hang on the order in which
    # XLA:CPU sums a dot of another row count (18 rows and their bucket's 20 sum differently)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = rng.integers(-8, 9, (*lead, 5)).astype(np.float32)
    w = rng.integers(-8, 9, (5, 3)).astype(np.float32)
    b = rng.integers(-8, 9, 3).astype(np.float32)
    for given_x in (x, jnp.asarray(x)):
        y = run_rows(_affine, given_x, w, b)
        assert y.shape == (*lead, 3) and isinstance(y, jax.Array)
        np.testing.assert_array_equal(y, _affine(x.reshape(-1, 5), w, b).reshape(*lead, 3))


@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_run_rows_compiles_once_per_bucket(kind, compiles):
    w, b = np.eye(4, 2, dtype=np.float32), np.zeros(2, np.float32)
    wrap = np.asarray if kind == "numpy" else jnp.asarray
    xs = [wrap(np.ones(shape, np.float32)) for shape in [(18, 4), (19, 4), (2, 9, 4), (5, 4, 4)]]
    run_rows(_affine, np.ones((17, 4), np.float32), w, b)  # bucket 20
    compiles.clear()
    for x in xs:
        assert run_rows(_affine, x, w, b).shape == x.shape[:-1] + (2,)
    assert compiles == []


def test_run_rows_output_owns_its_memory():
    """The result must not view the bucket's buffer (which the next call may reuse)."""
    x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    w, b = np.eye(4, dtype=np.float32), np.zeros(4, np.float32)
    first = run_rows(_affine, x[:, None, :], w, b)
    kept = np.array(first)
    for _ in range(3):
        run_rows(_affine, -x[:, None, :], w, b)
    np.testing.assert_array_equal(first, kept)


@pytest.mark.parametrize("shape", [(8, 4), (9, 4), (2, 3, 4)])
def test_run_rows_keeps_a_committed_inputs_device(shape):
    """Padded or reshaped, the result lands on the device x is committed to, as the unpadded
    call's does (not on the default device)."""
    dev = jax.devices()[1]
    x = jax.device_put(np.ones(shape, np.float32), dev)
    w, b = jax.device_put(np.eye(4, 2, dtype=np.float32), dev), np.zeros(2, np.float32)
    y = run_rows(_affine, x, w, b)
    assert y.devices() == {dev} and y.committed
    assert run_rows(_affine, np.ones(shape, np.float32), np.eye(4, 2, dtype=np.float32),
                    b).devices() == {jax.devices()[0]}


def test_run_rows_of_a_sharded_input_is_not_committed_to_one_device():
    """x sharded over several devices: the padded result is not committed to one of them (it
    combines with x, as the unpadded call's sharded result does)."""
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.make_mesh((2,), ("i",), devices=jax.devices()[:2])
    x = jax.device_put(np.ones((2, 5, 4), np.float32), NamedSharding(mesh, PartitionSpec("i")))
    y = run_rows(_affine, x, np.eye(4, dtype=np.float32), np.zeros(4, np.float32))
    assert not y.committed
    np.testing.assert_array_equal(y + x, 2 * np.ones((2, 5, 4)))

"""Compensated rounding (hnlq_jax.ptq) against round-to-nearest and a NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hnlq_jax as hq
from hnlq_jax import ptq, rows
from hnlq_jax.incoherence import Rotation

D4 = hq.HNLQConfig("D4", 4, 2)
E8 = hq.HNLQConfig("E8", 4, 2)
OUT, IN = 24, 70  # 70 = 17 * 4 + 2 = 8 * 8 + 6: a partial last block for both lattices
# about rows.calibrate_rows' beta for layer(): fixed, so that most tests skip the search's compile
BETA = {"D4": 0.19, "E8": 0.23}


def layer(out=OUT, n=IN, tokens=1000, seed=0, dead=(), dtype=np.float32):
    """A weight and the Hessian of correlated Gaussian inputs with uneven column energies."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((n, n)) / np.sqrt(n) + 0.5 * np.eye(n)
    X = rng.standard_normal((tokens, n)) @ mix * np.exp(rng.uniform(-1, 1, n))
    X[:, list(dead)] = 0
    w = rng.standard_normal((out, n)) * np.exp(rng.uniform(-1, 1, (out, 1))) * 0.1
    return w.astype(dtype), (X.T @ X).astype(dtype)


def reference(w, H, config, beta, damp=0.01, act_order=False):
    """The algorithm in float64 NumPy, one block column at a time, with the library's encoder.

    Returns ``(index [out, nb, M], T [out, nb], w_hat [out, in])`` in natural block order.
    """
    w, H = np.array(w, np.float64), np.array(H, np.float64)
    out, n = w.shape
    d, nb = config.d, -(-w.shape[1] // config.d)
    c = beta * np.asarray(rows.row_rms(jnp.asarray(w)))  # row scales of the original weight
    dead = np.diag(H) == 0
    H[dead, dead] = np.diag(H)[~dead].mean() if (~dead).any() else 1
    w[:, dead] = 0
    dg = np.diag(H).copy()
    H += damp * np.mean(dg) * np.eye(n)
    N = nb * d
    Hp, Wp = np.eye(N), np.zeros((out, N))
    Hp[:n, :n], Wp[:, :n] = H, w
    if act_order:
        sums = np.pad(dg, (0, N - n)).reshape(nb, d).sum(1)
        order = np.argsort(-sums, kind="stable")
    else:
        order = np.arange(nb)
    cols = (order[:, None] * d + np.arange(d)).reshape(-1)
    Hp, Wp = Hp[np.ix_(cols, cols)], Wp[:, cols]
    U = np.linalg.cholesky(np.linalg.inv(Hp)).T  # upper, U^T U = Hp^-1
    ucfg = rows.unit(config)
    index = np.zeros((out, nb, config.M), np.int64)
    T = np.zeros((out, nb), np.int64)
    w_hat = np.zeros((out, N))
    for j in range(nb):
        B, rest = slice(j * d, (j + 1) * d), slice((j + 1) * d, N)
        x = Wp[:, B]
        codes = hq.encode(x / c[:, None], ucfg)
        q = np.asarray(hq.decode(codes)) * c[:, None]
        Wp[:, rest] -= (x - q) @ np.linalg.solve(U[B, B], U[B, rest])
        index[:, order[j]], T[:, order[j]] = np.asarray(codes.index), np.asarray(codes.T)
        w_hat[:, order[j] * d:(order[j] + 1) * d] = q
    return index, T, w_hat[:, :n]


def round_to_nearest(w, config, beta):
    """Round-to-nearest in the row format, as rows.rows_codes does it (c = beta rms(row), the
    blocks of w / c coded at unit beta), through hq.encode: the encoder program the reference
    compiles too. Returns ``(index, T, w_hat)``."""
    c = beta * rows.row_rms(jnp.asarray(w))[:, None]
    codes = hq.encode(hq.to_blocks(jnp.asarray(w) / c, config.d), rows.unit(config))
    w_hat = hq.from_blocks(hq.decode(codes), w.shape[1]) * c
    return np.asarray(codes.index), np.asarray(codes.T), np.asarray(w_hat)


def rtn_loss(w, H, config, beta):
    return float(ptq.proxy_loss(w, round_to_nearest(w, config, beta)[2], H))


@pytest.mark.parametrize("config", [D4, E8], ids=["D4", "E8"])
def test_compensation_beats_round_to_nearest(x64, config):
    w, H = layer(dtype=np.float64)
    beta = BETA[config.lattice]
    rtn = rtn_loss(w, H, config, beta)
    fixed = ptq.gptq_rows(w, H, config, beta=beta)
    assert fixed.loss < 0.6 * rtn, (fixed.loss, rtn)
    assert fixed.clipped == 0 and int(np.max(np.asarray(fixed.codes.T))) > 0
    np.testing.assert_allclose(np.asarray(fixed.beta), beta, rtol=1e-6)
    # the reported loss is the proxy loss of the decoded codes
    assert fixed.loss == pytest.approx(float(ptq.proxy_loss(w, hq.decode(fixed.codes), H)),
                                       rel=1e-9)


@pytest.mark.parametrize("config, act_order, dead", [(D4, False, ()), (E8, True, (3, 66)),
                                                     (D4, True, (0,))],
                         ids=["D4", "E8-act_order-dead", "D4-act_order-dead"])
def test_equals_numpy_reference(x64, config, act_order, dead):
    w, H = layer(dead=dead, dtype=np.float64)
    beta = 0.9 * BETA[config.lattice]
    res = ptq.gptq_rows(w, H, config, beta=beta, act_order=act_order)
    index, T, w_hat = reference(w, H, config, beta, act_order=act_order)
    np.testing.assert_array_equal(np.asarray(res.codes.index), index)
    np.testing.assert_array_equal(np.asarray(res.codes.T), T)
    assert res.codes.scale.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(hq.decode(res.codes)), w_hat, rtol=1e-12, atol=1e-15)
    assert T.max() > 0  # the overload steps take part


def test_diagonal_hessian_is_round_to_nearest(x64):
    """Uncorrelated inputs: no error to feed forward, the codes are round-to-nearest's (those
    of rows.rows_codes) bit for bit."""
    w, _ = layer(dtype=np.float64)
    H = np.diag(np.linspace(0.5, 3.0, IN))
    beta = BETA["D4"]
    res = ptq.gptq_rows(w, H, D4, beta=beta, act_order=True)
    index, T, w_hat = round_to_nearest(w, D4, beta)
    np.testing.assert_array_equal(np.asarray(res.codes.index), index)
    np.testing.assert_array_equal(np.asarray(res.codes.T), T)
    assert res.loss == pytest.approx(float(ptq.proxy_loss(w, w_hat, H)), rel=1e-12)


def test_act_order_codes_are_in_natural_order(x64):
    w, H = layer(dtype=np.float64)
    # make the energies rise along the input axis, so the order is (nearly) reversed
    s = np.linspace(0.2, 3.0, IN)
    H = H * s[:, None] * s[None, :]
    beta = BETA["D4"]
    nat = ptq.gptq_rows(w, H, D4, beta=beta)
    act = ptq.gptq_rows(w, H, D4, beta=beta, act_order=True)
    assert act.codes.shape == (OUT, IN) and act.codes.blocks_shape == (OUT, 18)
    assert not np.array_equal(np.asarray(act.codes.index), np.asarray(nat.codes.index))
    # decoded in natural order: close to w block by block (a permuted layout would not be)
    w_hat = np.asarray(hq.decode(act.codes))
    err = np.sum((w_hat - w) ** 2) / np.sum(w**2)
    assert err < 0.05
    assert act.loss < 0.6 * rtn_loss(w, H, D4, beta)


def test_beta_search():
    w, H = layer()
    beta = float(rows.calibrate_rows(jnp.asarray(w), D4))
    fixed = ptq.gptq_rows(w, H, D4, grid=(1.0,) * 5)  # 5 candidates, like the default grid
    np.testing.assert_array_equal(np.asarray(fixed.beta), np.float32(beta))
    # the grid holds 1.0 and the search picks per row, so it can only do better
    searched = ptq.gptq_rows(w, H, D4)
    assert searched.loss <= fixed.loss * (1 + 1e-6)
    grid = np.float32(beta) * np.asarray(ptq.DEFAULT_GRID, np.float32)
    assert set(np.asarray(searched.beta).tolist()) <= set(grid.tolist())
    assert np.unique(np.asarray(searched.beta)).size > 1
    layer_wide = ptq.gptq_rows(w, H, D4, per_row=False)
    assert np.unique(np.asarray(layer_wide.beta)).size == 1
    assert searched.loss < layer_wide.loss
    # "f" charges the T entropy: the smallest beta (lowest loss, most overload) loses
    f = ptq.gptq_rows(w, H, D4, criterion="f", grid=(0.3, 0.6, 0.8, 1.0, 1.2))
    loss = ptq.gptq_rows(w, H, D4, per_row=False, grid=(0.3, 0.6, 0.8, 1.0, 1.2))
    assert np.unique(np.asarray(f.beta)).size == 1
    assert float(f.beta[0]) > float(loss.beta[0])


def test_t_budget():
    """The budget keeps the lowest-loss candidate whose T entropy fits, and reports it."""
    w, H = layer()
    grid = (0.6, 0.8, 1.0, 1.3, 1.7)
    free = ptq.gptq_rows(w, H, D4, per_row=False, grid=grid)
    # every candidate alone: its T entropy per weight and its loss
    each = [ptq.gptq_rows(w, H, D4, per_row=False, grid=(g,)) for g in grid]
    bits = np.array([r.t_bits for r in each])
    assert np.all(np.diff(bits) < 0)  # larger betas overload less
    assert free.t_bits == pytest.approx(bits[0], rel=1e-6) and free.loss == each[0].loss
    for k in (1, 3):
        # a budget just above candidate k's entropy: k is the best that fits
        got = ptq.gptq_rows(w, H, D4, grid=grid, t_budget=bits[k] * (1 + 1e-5))
        assert got.t_bits == pytest.approx(bits[k], rel=1e-6)
        np.testing.assert_array_equal(np.asarray(got.codes.index),
                                      np.asarray(each[k].codes.index))
        # unpacked T entropy of the result, computed independently
        T = np.asarray(got.codes.T).ravel()
        p = np.bincount(T) / T.size
        assert got.t_bits == pytest.approx(-(p[p > 0] * np.log2(p[p > 0])).sum() / 4, rel=1e-5)
    with pytest.raises(ValueError, match=r"no beta of the grid keeps T within t_budget"):
        ptq.gptq_rows(w, H, D4, grid=grid, t_budget=bits[-1] * 0.99)


def test_rotation_round_trip(x64):
    w, H = layer(seed=1, dtype=np.float64)
    rot = Rotation(IN, seed=7)
    beta = np.linspace(0.15, 0.25, OUT)  # an [out] beta
    res = ptq.gptq_rows(w, H, D4, beta=beta, rotation=rot)
    assert res.rotation == rot
    np.testing.assert_array_equal(np.asarray(res.beta), beta)
    x = np.random.default_rng(2).standard_normal((3, IN))
    w_hat = np.asarray(res.weight())
    np.testing.assert_allclose(np.asarray(res.matmul(x)), x @ w_hat.T, rtol=1e-6, atol=1e-6)
    # the proxy loss does not depend on the basis
    assert res.loss == pytest.approx(float(ptq.proxy_loss(w, w_hat, H)), rel=1e-9)
    assert res.loss < rtn_loss(w, H, D4, BETA["D4"])


def test_blocks_that_cannot_encode_are_shrunk(x64):
    """At a tiny beta many blocks lie beyond what max_T reaches: they are shrunk until they
    encode, and the error that leaves is compensated like any other."""
    w, H = layer(dtype=np.float64)
    res = ptq.gptq_rows(w, H, D4, beta=1e-3)
    T = np.asarray(res.codes.T)
    assert res.clipped > 0 and np.all(T >= 0) and np.any(T == D4.max_T)
    w_hat = np.asarray(hq.decode(res.codes))
    assert np.all(np.isfinite(w_hat)) and np.isfinite(res.loss)
    assert res.loss == pytest.approx(float(ptq.proxy_loss(w, w_hat, H)), rel=1e-9)


def test_hessian_streaming():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 50, 20)).astype(np.float32)
    H, count = None, 0
    for chunk in x:
        H, count = ptq.hessian_update(H, chunk, count)
    ref = np.einsum("bti,btj->ij", x.astype(np.float64), x.astype(np.float64))
    assert count == 150 and H.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(H), ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ptq.hessian(x)), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="in-features 20"):
        ptq.hessian_update(np.zeros((8, 8), np.float32), x[0], 0)
    with pytest.raises(TypeError, match="floating"):
        ptq.hessian(np.ones((4, 3), np.int32))


def test_proxy_loss_by_hand():
    rng = np.random.default_rng(0)
    w, w_hat = rng.standard_normal((2, 5, 6))
    X = rng.standard_normal((9, 6))
    want = np.sum((X @ (w_hat - w).T) ** 2)
    assert float(ptq.proxy_loss(w, w_hat, X.T @ X)) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="H \\[in, in\\]"):
        ptq.proxy_loss(w, w_hat, np.eye(5))


def _indefinite(n):
    H = np.ones((n, n), np.float32) * 0.9 + 0.1 * np.eye(n, dtype=np.float32)
    H[0, 1] = H[1, 0] = -5.0
    return H


_W, _H = layer(out=4, n=8, tokens=50)


@pytest.mark.parametrize("args, kwargs, err, match", [
    ((_W, _H[:, :7]), {}, ValueError, "square"),
    ((_W, np.eye(9, dtype=np.float32)), {}, ValueError, "in-features 8"),
    ((_W[0], _H), {}, ValueError, "2-D"),
    ((_W, np.where(np.eye(8) > 0, np.nan, _H).astype(np.float32)), {}, ValueError, "NaN"),
    ((np.full_like(_W, np.inf), _H), {}, ValueError, "w has 32 NaN or Inf"),
    ((_W, _H - 2 * np.diag(np.diag(_H))), {}, ValueError, "negative diagonal"),
    ((_W, _indefinite(8)), {}, ValueError, "Cholesky"),
    ((_W, _H + np.triu(np.ones((8, 8), np.float32), 1)), {}, ValueError, "not symmetric"),
    ((_W.astype(np.int32), _H), {}, TypeError, "w must be a floating"),
    ((_W, _H.astype(np.int32)), {}, TypeError, "H must be a floating"),
    ((_W, _H), {"damp": -1.0}, ValueError, "damp"),
    ((_W, _H), {"grid": ()}, ValueError, "grid"),
    ((_W, _H), {"beta": -0.1}, ValueError, "beta must be"),
    ((_W, _H), {"beta": np.ones(3)}, ValueError, "beta must be"),
    # finite in float64, not in the weight's float32: named, not blamed on H
    ((_W, _H), {"beta": 1e39}, ValueError, "beta is inf in float32 for row 0"),
    ((_W, _H), {"beta": 1e-46}, ValueError, "beta is 0 in float32 for row 0"),
    ((_W, _H), {"grid": (1.0, 1e39)}, ValueError,
     "grid times the calibrated beta is inf in float32"),
    ((_W * np.float32(1e30), _H), {"beta": 1e10}, ValueError, "must be normal float32"),
    ((_W, _H), {"criterion": "f", "per_row": True}, ValueError, "per_row=False"),
    ((_W, _H), {"criterion": "mse"}, ValueError, "criterion"),
    ((_W, _H), {"t_budget": 0.1, "per_row": True}, ValueError, "per_row=False"),
    ((_W, _H), {"t_budget": -0.1}, ValueError, "t_budget must be"),
    ((_W, _H), {"t_budget": float("nan")}, ValueError, "t_budget must be"),
    ((_W, _H), {"rotation": Rotation(16)}, ValueError, "rotation"),
], ids=["H-not-square", "H-size", "w-1d", "H-nan", "w-inf", "H-neg-diag", "H-indefinite",
        "H-asym", "w-int", "H-int", "damp", "grid", "beta-neg", "beta-shape", "beta-inf-f32",
        "beta-zero-f32", "grid-inf-f32", "scale-inf", "f-per-row",
        "criterion", "budget-per-row", "budget-neg", "budget-nan", "rotation-size"])
def test_errors(args, kwargs, err, match):
    with pytest.raises(err, match=match):
        ptq.gptq_rows(*args, D4, **kwargs)


def test_config_must_be_hnlq_config():
    with pytest.raises(TypeError, match="HNLQConfig"):
        ptq.gptq_rows(_W, _H, "D4")


def test_half_precision_input():
    w, H = layer()
    res = ptq.gptq_rows(jnp.asarray(w, jnp.bfloat16), jnp.asarray(H, jnp.bfloat16), D4)
    assert res.codes.scale.dtype == jnp.float32 and np.isfinite(res.loss)
    assert jax.numpy.all(res.codes.T >= 0)


@pytest.mark.parametrize("options", [
    {"damp": None}, {"grid": list(ptq.DEFAULT_GRID)}, {"grid": np.asarray(ptq.DEFAULT_GRID)},
    {"act_order": None}, {"t_budget": None}, {"criterion": None}, {"sequential": np.False_},
], ids=["damp", "grid-list", "grid-array", "act-order", "budget", "criterion",
        "sequential-numpy"])
def test_calibration_options_at_default_pass_without_calibration(options):
    ptq.check_calibration_options("f", None, **options)


@pytest.mark.parametrize("options, named", [
    ({"damp": ptq.DAMP}, "damp"), ({"grid": (0.9, 1.0)}, "grid"),
    ({"act_order": False}, "act_order"), ({"t_budget": 0.0}, "t_budget"),
    ({"criterion": "loss"}, "criterion"), ({"sequential": True, "damp": None}, "sequential applies"),
], ids=["damp", "grid", "act-order", "budget-zero", "criterion", "sequential"])
def test_calibration_options_changed_need_calibration(options, named):
    with pytest.raises(ValueError, match=f"f: {named}"):
        ptq.check_calibration_options("f", None, **options)
    ptq.check_calibration_options("f", object(), **options)  # with calibration: used


def test_recommended_fills_only_what_is_left_out_and_refuses_non_bool_flags():
    run = object()
    assert ptq.recommended("f", run, None, None, None, None) == tuple(
        ptq.RECOMMENDED[k] for k in ("rotate", "act_order", "damp", "criterion"))
    assert ptq.recommended("f", run, False, None, 0.2, "loss") == (
        False, ptq.RECOMMENDED["act_order"], 0.2, "loss")
    assert ptq.recommended("f", None, None, None, None, None) == (False, None, None, None)
    for bad in ({"rotate": "yes"}, {"act_order": 1}):
        args = {"rotate": None, "act_order": None, **bad}
        with pytest.raises(TypeError, match=f"f: {next(iter(bad))} must be a bool"):
            ptq.recommended("f", run, args["rotate"], args["act_order"], None, None)


@given(st.lists(st.text(alphabet="abcXYZ#[]1 ", min_size=1, max_size=6), min_size=1,
                max_size=30), st.integers(0, 20), st.integers(1, 5), st.integers(0, 99))
def test_vocabulary_sentences(vocab, n, words, seed):
    """Sentences of whole alphabetic words (>= 3 letters) of the vocabulary only, seeded, and
    every such word can be drawn."""
    pool = {w for w in vocab if w.isalpha() and len(w) > 2}
    if not pool:
        with pytest.raises(ValueError, match="no alphabetic entries"):
            ptq.vocabulary_sentences(vocab, n, words=words, seed=seed)
        return
    got = ptq.vocabulary_sentences(vocab, n, words=words, seed=seed)
    assert got == ptq.vocabulary_sentences(list(reversed(vocab)), n, words=words, seed=seed)
    assert len(got) == n
    for sentence in got:
        assert sentence.endswith(".")
        drawn = sentence[:-1].split(" ")
        assert len(drawn) == words and set(drawn) <= pool
    many = ptq.vocabulary_sentences(vocab, 200, words=5, seed=seed)
    assert {w for s in many for w in s[:-1].split(" ")} == pool


def test_vocabulary_sentences_take_numpy_integers():
    assert ptq.vocabulary_sentences(["alpha", "beta"], np.int64(3), words=np.int32(2)) == \
        ptq.vocabulary_sentences(["alpha", "beta"], 3, words=2)


@pytest.mark.parametrize("kwargs", [{"n": -1}, {"n": 2.0}, {"words": 0}, {"n": True}])
def test_vocabulary_sentences_bad_input(kwargs):
    with pytest.raises(ValueError, match="vocabulary_sentences"):
        ptq.vocabulary_sentences(["word"], **{"n": 2, **kwargs})


def test_all_zero_rows_decode_to_zero_with_a_dither():
    """gptq_rows stores the scale 0 for an all-zero row (as encode_rows): it decodes to 0."""
    cfg = hq.HNLQConfig("D4", 4, 2, beta=0.2016, dither=(0.1, -0.05, 0.02, 0.0))
    rng = np.random.default_rng(4)
    W = rng.standard_normal((3, 16)).astype(np.float32)
    W[1] = 0
    X = rng.standard_normal((64, 16)).astype(np.float32)
    result = ptq.gptq_rows(W, X.T @ X, cfg)
    decoded = np.asarray(hq.decode(result.codes))
    np.testing.assert_array_equal(decoded[1], 0)
    assert np.all(np.asarray(result.codes.scale)[[0, 2]] > 0)


def test_rows_near_the_smallest_normal_float_encode():
    """Rows whose beta * RMS is subnormal (RMS 2e-38) take the smallest normal scale
    (rows.row_scale) instead of failing with a "badly conditioned H" error; a normal row of
    the same layer keeps beta * RMS."""
    rng = np.random.default_rng(6)
    W = rng.standard_normal((3, 32)).astype(np.float32)
    W[:2] *= np.float32(2e-38)
    X = rng.standard_normal((128, 32)).astype(np.float32)
    result = ptq.gptq_rows(W, X.T @ X, D4)
    scale, tiny = np.asarray(result.codes.scale), np.finfo(np.float32).tiny
    np.testing.assert_array_equal(scale[:2], tiny)
    assert scale[2] > 10 * tiny and np.all(np.asarray(result.codes.T) >= 0)
    err = np.abs(np.asarray(hq.decode(result.codes), np.float64) - W)
    assert err[:2].max() < 2e-38 + 2 * tiny


@pytest.mark.parametrize("act_order", [False, True])
def test_dead_columns_leave_the_scale_of_h_free(act_order):
    """With input channels never active, H and H * 2^-14 (a mean instead of a sum) give the
    same codes: a dead column's H_ii is the live mean, not a fixed 1 (which made the damping
    and the block order depend on the scale)."""
    w, H = layer(dead=(1, 5, 6, 9))
    H = np.asarray(H, np.float32)
    a = ptq.gptq_rows(w, H, D4, act_order=act_order, beta=1.0)
    b = ptq.gptq_rows(w, H * 2.0**-14, D4, act_order=act_order, beta=1.0)
    np.testing.assert_array_equal(np.asarray(a.codes.index), np.asarray(b.codes.index))
    np.testing.assert_array_equal(np.asarray(a.codes.tfield), np.asarray(b.codes.tfield))


def test_numpy_scalars_as_options_and_zero_row_loss():
    """NumPy float32 and 0-d array options are numbers like Python's; with a dither the
    reported loss is that of the stored codes, all-zero rows (scale 0) included."""
    w, H = layer()
    base = ptq.gptq_rows(w, H, D4, damp=0.01, beta=1.0)
    for damp in (np.float32(0.01), jnp.asarray(0.01), np.asarray(0.01)):
        np.testing.assert_array_equal(
            np.asarray(ptq.gptq_rows(w, H, D4, damp=damp, beta=1.0).codes.index),
            np.asarray(base.codes.index))
    ptq.gptq_rows(w, H, D4, t_budget=np.float32(2.0), per_row=False)
    with pytest.raises(ValueError, match="damp must be a finite number"):
        ptq.gptq_rows(w, H, D4, damp=np.bool_(True))
    cfg = D4.replace(dither=(0.05, -0.02, 0.03, 0.01))
    w0 = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    w0[1] = 0
    res = ptq.gptq_rows(w0, np.eye(8, dtype=np.float32), cfg, beta=1.0)
    np.testing.assert_allclose(res.loss, float(ptq.proxy_loss(w0, res.weight(), np.eye(8))),
                               rtol=1e-5)

"""Inner products and matrix products of HNLQ codes through lookup tables.

The math is in ``docs/math.md`` ("Lookup tables and inner products"). Codes of a length-n vector
are its d-block codes along the last axis, blocks ``[..., nb]`` with ``nb = ceil(n / d)``
(zero-padded): ``encode(to_blocks(x, d), config)`` or the row codes of
:func:`hnlq_jax.encode_rows` (whose row scales multiply the result). The tables are indexed by
the codes' codebook indices directly.

Per block k, with the lattice point ``c_k = sum_m q^m r(b_m)`` and the scale
``s_k = beta 2^(alpha T_k)``, the decoder returns ``x_k = s_k (c_k - z)`` (``z`` the dither),
so

* two-sided: ``<x_k, y_k> = s^x_k s^y_k (<c^x, c^y> - <c^x, z> - <z, c^y> + <z, z>)`` with the
  exact integer ``<c^x, c^y> = sum_{i,j} q^(i+j) LUT[b_i^x, b_j^y]`` (``q^(2d)`` entries);
* one-sided: ``<x_k, y_k> = s^x_k (sum_m q^m t_k[b_m^x] - <z, y_k>)`` with the per-block table
  ``t_k[b] = <r(b), y_k>`` (``q^d`` entries) of a real vector ``y``.

The tables are built once per call (the two-sided one once per process) and placed on the device
that runs the product: under ``jit`` they are constants of the compiled program (64 KiB of int8
for D4 q=4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax import _numerics, kernels
from hnlq_jax.codec import (check_beta_fits, codebook, codebook_table, decode_blocks,
                            default_float, to_blocks)
from hnlq_jax.codes import Codes, check_codes, t_bits, unpack_t, valid_blocks
from hnlq_jax.config import HNLQConfig, check_config

__all__ = [
    "IMPLEMENTATIONS",
    "MAX_ONE_SIDED",
    "MAX_TWO_SIDED",
    "dot",
    "dot_one_sided",
    "matmul",
    "matmul_one_sided",
    "one_sided",
    "table_den",
    "two_sided",
]

MAX_TWO_SIDED = 2**22  # entries of the q^d x q^d table (4 MiB of int8)
MAX_ONE_SIDED = 2**16  # entries of one block's table
_GATHER_CHUNK = 2**18  # gathered elements per step of a matrix product (bounds the memory)
_HIGHEST = jax.lax.Precision.HIGHEST  # float32 contractions stay float32 on GPUs (no TF32)


def table_den(config: HNLQConfig) -> int:
    """The two-sided table holds ``table_den * <r(b), r(b')>``: 2 for A2 (half-integers), else 1."""
    return 2 if config.lat.kind == "A2" else 1


def _gram_P(lat):
    """``(K, den)``: integer K with ``<x, y> = P_x^T K P_y / den`` for P coordinates."""
    if lat.kind == "E8":  # doubled Cartesian coordinates
        return np.eye(8, dtype=np.int64), 4
    if lat.kind == "A2":  # basis coordinates, Gram [[1, 1/2], [1/2, 1]]
        return np.rint(2 * lat.G.T @ lat.G).astype(np.int64), 2
    return np.eye(lat.d, dtype=np.int64), 1


def _two_sided_np(config: HNLQConfig) -> np.ndarray:
    return _two_sided_table(config.lattice, config.q)


@functools.lru_cache(maxsize=None)
def _two_sided_table(name: str, q: int) -> np.ndarray:
    config = HNLQConfig(name, q, 1)
    P = codebook_table(name, q).astype(np.int64)
    K, den = _gram_P(config.lat)
    num, div = P @ K @ P.T, den // table_den(config)
    assert not np.any(num % div), "inner products of lattice points are multiples of 1/den"
    table = num // div
    lo, hi = int(table.min()), int(table.max())
    dtype = next(t for t in (np.int8, np.int16, np.int32)
                 if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max)
    return table.astype(dtype)


def _base(config, fn: str):
    """Validates the config; returns ``(q, M, d, Q = q^d)``."""
    check_config(config, fn)
    return config.q, config.M, config.d, config.q**config.d


def _check_two_sided(config, fn: str, sums: bool = True):
    """The two-sided table exists (``Q^2 <= MAX_TWO_SIDED``) and, with ``sums``, the products'
    int32 sums over the M levels cannot overflow."""
    q, M, d, Q = _base(config, fn)
    if Q * Q > MAX_TWO_SIDED:
        raise ValueError(
            f"{fn}: the two-sided table of {config.lattice} q={q} has q^(2d) = {Q * Q:,} entries, "
            f"more than MAX_TWO_SIDED = {MAX_TWO_SIDED:,}; use the one-sided tables "
            f"(dot_one_sided / matmul_one_sided, q^d = {Q:,} entries per block) or decode "
            "then dot"
        )
    if sums:  # (the products scale by beta; the table does not)
        check_beta_fits(config.beta, default_float(), fn)
    bound = int(np.abs(_two_sided_np(config)).max()) * ((q**M - 1) // (q - 1)) ** 2
    if sums and bound >= 2**31:
        raise ValueError(
            f"{fn}: q^M = {q**M} is too large for the two-sided table's int32 sums "
            f"(bound {bound:,}); use dot_one_sided / matmul_one_sided or decode then dot"
        )


def check_one_sided(config, fn: str):
    q, _, d, Q = _base(config, fn)
    check_beta_fits(config.beta, default_float(), fn)
    if Q > MAX_ONE_SIDED:
        raise ValueError(
            f"{fn}: a one-sided table of {config.lattice} q={q} has q^d = {Q:,} entries per "
            f"block, more than MAX_ONE_SIDED = {MAX_ONE_SIDED:,}; decode then dot instead"
        )


def two_sided(config: HNLQConfig) -> jax.Array:
    """The two-sided table ``LUT[b, b'] = <r(b), r(b')>`` (codebook order).

    Args:
      config: the quantizer (only lattice and q matter: :func:`dot` and :func:`matmul` refuse
        a q^M whose table sums could leave int32).

    Returns:
      ``[q^d, q^d]`` in the smallest integer dtype that holds it exactly (int8 for D4 q <= 6,
      Z2 q <= 15, A2 q <= 14, E8 q = 2). For A2 the entries are half-integers and the table holds
      ``2 * LUT`` (see :func:`table_den`).

    Raises:
      ValueError: when the table would have more than :data:`MAX_TWO_SIDED` entries (E8 q >= 3,
        D4 q >= 7, ...): use the one-sided tables or decode then dot.
    """
    _check_two_sided(config, "two_sided", sums=False)
    return jnp.asarray(_two_sided_np(config))


def _block_codes(codes, fn: str):
    """``(index [..., nb, M], u [..., nb], scale or None)`` of the codes of vectors."""
    check_codes(codes, fn)
    if len(codes.blocks_shape) < 1:
        raise ValueError(f"{fn}: expected the codes of vectors, blocks [..., nb]; encode "
                         "to_blocks(x, d) or use hnlq_jax.encode_rows to make them")
    nb = codes.blocks_shape[-1]
    return codes.index, unpack_t(codes.tfield, codes.config, nb), codes.scale


def _check_real(y, nb: int, config, fn: str, what: str, n: int | None = None):
    """Validates a real ``[..., k]`` array whose d-blocks pair with ``nb`` coded blocks (of row
    codes of length ``n``, when given: then ``k = n``). Its values are not checked: NaN and Inf
    make the results they touch non-finite, as in a float dot (NaN where a dot could give
    ±Inf: each level's table entry is a product of its own)."""
    y = jnp.asarray(y)
    d = config.d
    if not jnp.issubdtype(y.dtype, jnp.floating):
        raise TypeError(f"{fn}: {what} must be a floating-point array, got dtype {y.dtype}")
    if y.ndim == 0:
        raise ValueError(f"{fn}: expected {what} [..., k], got a scalar")
    if n is not None and y.shape[-1] != n:
        # Entries past n would meet the decoded padding of the last block, not zeros.
        raise ValueError(f"{fn}: {what} has shape {y.shape}; its last axis must be the codes' "
                         f"row length n = {n}")
    if -(-y.shape[-1] // d) != nb:
        raise ValueError(
            f"{fn}: {what} has shape {y.shape}; its last axis must split into the codes' "
            f"nb = {nb} blocks of d = {d}, i.e. have length {nb * d - d + 1}..{nb * d}"
        )
    return y


def _block_scale(index, u, config, dtype):
    """``beta 2^(alpha T)`` per block, NaN where the block is invalid (so the sum is NaN)."""
    s = config.beta * _numerics.overload_scale(u, config, _numerics.pow2(config, dtype))
    return jnp.where(valid_blocks(index, u, config), s, jnp.nan)


def _row_scale(out, scale):
    """``out[..., j] * scale[...]`` for one coded operand's row scale (None: unchanged)."""
    return out if scale is None else out * scale.astype(out.dtype)


def _z_terms(config, dtype):
    """``(t_z[Q], <z, z>)``: the one-sided table of the dither, or ``None`` without dither."""
    if config.dither is None:
        return None
    z = jnp.asarray(config.dither_array, dtype)
    return jnp.matmul(codebook(config, dtype), z, precision=_HIGHEST), jnp.dot(z, z)


def _padding(codes_a: Codes, codes_b: Codes, fn: str) -> int:
    """Coordinates of the last block beyond the logical length (row codes: ``nb d - n``).

    The tables multiply whole blocks, and the zero padding of a row does not decode to zero in
    general (a dither, or a lattice such as E8 whose nearest point to a block with zero
    coordinates may have nonzero ones), so two-sided products subtract those coordinates.
    """
    ns = {c.n for c in (codes_a, codes_b) if c.n is not None}
    if len(ns) > 1:
        raise ValueError(f"{fn}: the row codes have different row lengths n = {codes_a.n} and "
                         f"{codes_b.n}: their products need equal lengths")
    return codes_a.blocks_shape[-1] * codes_a.config.d - ns.pop() if ns else 0


def _tail(index, u, config, dtype, pad: int):
    """``[..., pad]``: the decoded padding coordinates of the last block (no row scale)."""
    last = decode_blocks(index[..., -1, :], u[..., -1], config, None, dtype, config.beta)
    return last[..., config.d - pad:]


@functools.partial(jax.jit, static_argnums=(4, 5))
def _dot(a, ua, b, ub, config, pad):
    dtype = default_float()
    Q, M = config.q**config.d, config.M
    a, b = a.astype(jnp.int32), b.astype(jnp.int32)  # [..., nb, M]
    lut = jnp.asarray(_two_sided_np(config)).reshape(-1)
    pairs = lut[a[..., :, None] * Q + b[..., None, :]].astype(jnp.int32)  # [..., nb, M, M]
    w = np.array([[config.q ** (i + j) for j in range(M)] for i in range(M)], np.int32)
    v = jnp.sum(pairs * w, axis=(-2, -1)).astype(dtype) / table_den(config)  # exact
    zt = _z_terms(config, dtype)
    if zt is not None:
        tz, zz = zt
        wl = _numerics.level_weights(config, dtype)
        v = v - (jnp.sum(tz[a] * wl, -1) + jnp.sum(tz[b] * wl, -1)) + zz  # symmetric in x, y
    s = _block_scale(a, ua, config, dtype) * _block_scale(b, ub, config, dtype)
    out = jnp.sum(s * v, axis=-1)
    if pad:
        out = out - jnp.sum(_tail(a, ua, config, dtype, pad) * _tail(b, ub, config, dtype, pad),
                            axis=-1)
    return out


def _same_config(ca: Codes, cb: Codes, fn: str) -> HNLQConfig:
    if ca.config != cb.config:
        raise ValueError(f"{fn}: the two codes were made with different configs: {ca.config} "
                         f"and {cb.config}")
    return ca.config


def dot(codes_x, codes_y):
    """``<x_hat, y_hat>`` of two coded vectors through the two-sided table.

    Args:
      codes_x, codes_y: codes of vectors (blocks ``[..., nb]``) of one config; the leading
        shapes broadcast, ``nb`` must agree. Row scales multiply the result.

    Returns:
      ``[...]`` inner products (float64 under x64, else float32). The per-block integer part is
      exact; the result equals ``<decode(x), decode(y)>`` up to float rounding. NaN where a
      block has ``T = -1``.

    Raises:
      ValueError: table too large, mismatched shapes or configs, corrupted codes.
    """
    a, ua, sa = _block_codes(codes_x, "dot")
    b, ub, sb = _block_codes(codes_y, "dot")
    config = _same_config(codes_x, codes_y, "dot")
    _check_two_sided(config, "dot")
    _same_blocks(ua.shape, ub.shape, "dot")
    out = _dot(a, ua, b, ub, config, _padding(codes_x, codes_y, "dot"))
    return _row_scale(_row_scale(out, sa), sb)


def _same_blocks(sa, sb, fn: str):
    try:
        jnp.broadcast_shapes(sa[:-1], sb[:-1])
    except ValueError:
        raise ValueError(f"{fn}: leading shapes {sa[:-1]} and {sb[:-1]} do not broadcast") from None
    if sa[-1] != sb[-1]:
        raise ValueError(f"{fn}: the codes have {sa[-1]} and {sb[-1]} blocks; they must agree")


@functools.partial(jax.jit, static_argnums=1)
def _one_sided(y, config):
    dtype = jnp.promote_types(y.dtype, jnp.float32)
    yb = to_blocks(y.astype(dtype), config.d)  # [..., nb, d]
    return jnp.matmul(yb, codebook(config, dtype).T, precision=_HIGHEST)


def one_sided(y, config: HNLQConfig):
    """Per-block tables ``t_k[b] = <r(b), y_k>`` of a real vector (or batch of vectors).

    Args:
      y: ``[..., n]`` floating array; its last axis is split into ``nb = ceil(n/d)`` d-blocks
        (zero-padded).
      config: the quantizer (only lattice and q matter).

    Returns:
      ``[..., nb, q^d]`` in y's dtype (at least float32), rows in codebook order: ``q^d / d``
      numbers per entry of y (64 for D4 q=4, 8192 for E8 q=4), so batch large products.

    Raises:
      ValueError: more than :data:`MAX_ONE_SIDED` entries per block.
    """
    check_one_sided(config, "one_sided")
    y = jnp.asarray(y)
    y = _check_real(y, -(-y.shape[-1] // config.d) if y.ndim else 0, config, "one_sided", "y")
    return _one_sided(y, config)


def dither_dot(yb, config):
    """``<z, y_k>`` per block ``[..., nb]``, or 0 without dither."""
    if config.dither is None:
        return 0
    return jnp.matmul(yb, jnp.asarray(config.dither_array, yb.dtype), precision=_HIGHEST)


@functools.partial(jax.jit, static_argnums=3)
def _dot_one_sided(index, u, y, config):
    t = _one_sided(y, config)  # [..., nb, Q]
    dtype = t.dtype
    a = index.astype(jnp.int32)  # [..., nb, M]
    lead = jnp.broadcast_shapes(t.shape[:-2], a.shape[:-2])
    t = jnp.broadcast_to(t, lead + t.shape[-2:])
    a = jnp.broadcast_to(a, lead + a.shape[-2:])
    v = jnp.sum(jnp.take_along_axis(t, a, axis=-1) * _numerics.level_weights(config, dtype), -1)
    v = v - dither_dot(to_blocks(y.astype(dtype), config.d), config)
    return jnp.sum(_block_scale(index, u, config, dtype) * v, axis=-1)


def dot_one_sided(codes_x, y):
    """``<x_hat, y>`` of a coded vector and a real one through ``y``'s one-sided tables.

    Args:
      codes_x: codes of vectors, blocks ``[..., nb]`` (a row scale multiplies the result).
      y: ``[..., n]`` real vectors with ``ceil(n/d) = nb``; leading shapes broadcast.

    Returns:
      ``[...]`` inner products in y's dtype (at least float32); equal to
      ``<decode(x), y>`` up to float rounding; NaN where a block has ``T = -1``.
    """
    index, u, scale = _block_codes(codes_x, "dot_one_sided")
    config = codes_x.config
    check_one_sided(config, "dot_one_sided")
    y = _check_real(y, u.shape[-1], config, "dot_one_sided", "y", codes_x.n)
    _same_blocks(u.shape, y.shape[:-1] + (u.shape[-1],), "dot_one_sided")
    return _row_scale(_dot_one_sided(index, u, y, config), scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _native_sums(U, E, idx, tfield, config):
    """:func:`_gather_matmul`'s sums by the native kernel (float32), which reads the codes' T
    field itself (XLA's unpacking took longer than the sums), differentiable in U and E as the
    XLA path (whose VJP its backward pass takes)."""
    M = config.M  # the steps by u: _block_scale of every u value (index 0 is always in range)
    steps = _block_scale(jnp.zeros((256, M), jnp.int32), jnp.arange(256), config, U.dtype)
    return kernels.cpu.lut_matmul(U, E, idx, tfield, steps, config.q, t_bits(config))


def _native_sums_fwd(U, E, idx, tfield, config):
    return _native_sums(U, E, idx, tfield, config), (U, E, idx, tfield)


def _native_sums_bwd(config, res, g):
    U, E, idx, tfield = res
    u = unpack_t(tfield, config, idx.shape[1])
    _, vjp = jax.vjp(lambda U, E: _gather_matmul(U, E, idx, u, config), U, E)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), (idx, tfield))
    return vjp(g) + zeros


_native_sums.defvjp(_native_sums_fwd, _native_sums_bwd)


def _gather_matmul(U, E, idx, u, config, tfield=None):
    """``out[m, n] = sum_k s[n, k] (sum_j q^j U[m, k, idx[n, k, j]] - E[m, k])``.

    Args:
      U: ``[m, nb, Q]`` per-block tables of the m rows.
      E: ``[m, nb]`` per-block offsets, or ``None``.
      idx: ``[n, nb, M]`` codebook indices of the n coded columns.
      u: ``[n, nb]`` their T field values: ``s`` is their block scales (NaN where invalid).
      tfield: their packed T field, where the native kernel sums (``kernels.cpu.lut_matmul``;
        float32; ``u`` is then unused), else ``None``: XLA's gathers.
    """
    m, nb, Q = U.shape
    n, M = idx.shape[0], config.M
    if m == 0 or n == 0 or nb == 0:
        return jnp.zeros((m, n), U.dtype)
    if tfield is not None:
        return _native_sums(U, E, idx, tfield, config)
    s = _block_scale(idx, u, config, U.dtype)
    # Gathering along the table axis of each block (not from one flattened table) is ~1.7x
    # faster on XLA:CPU; columns go in chunks so the gathered [m, nb, chunk, M] stays small.
    chunk = min(n, max(1, _GATHER_CHUNK // (m * nb * M)))
    pad = (-n) % chunk
    idx = jnp.pad(idx.astype(jnp.int32), [(0, pad), (0, 0), (0, 0)]).reshape(-1, chunk, nb, M)
    s = jnp.pad(s, [(0, pad), (0, 0)]).reshape(-1, chunk, nb)
    w = _numerics.level_weights(config, U.dtype)

    def columns_of(args):
        ik, sk = args  # [chunk, nb, M], [chunk, nb]
        ik = jnp.transpose(ik, (1, 0, 2)).reshape(1, nb, chunk * M)
        g = jnp.take_along_axis(U, jnp.broadcast_to(ik, (m, nb, chunk * M)), axis=2)
        g = jnp.matmul(g.reshape(m, nb, chunk, M), w, precision=_HIGHEST)  # [m, nb, chunk]
        return jnp.einsum("mkc,ck->mc", g, sk, precision=_HIGHEST)

    out = jax.lax.map(columns_of, (idx, s))  # [n / chunk, m, chunk]
    out = jnp.transpose(out, (1, 0, 2)).reshape(m, -1)[:, :n]
    if E is not None:
        out = out - jnp.matmul(E, s.reshape(-1, nb)[:n].T, precision=_HIGHEST)
    return out


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _matmul(a, ua, b, tb, config, pad, native):
    dtype = default_float()
    ub = unpack_t(tb, config, b.shape[1])  # inside jit: unused (not computed) when native
    lead = ua.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64))  # not -1: a reshape cannot infer it when nb = 0
    a = a.reshape((m,) + a.shape[-2:]).astype(jnp.int32)  # [m, nb, M]
    ua = ua.reshape((m, ua.shape[-1]))
    lut = jnp.asarray(_two_sided_np(config))
    U = sum(lut[a[..., i]].astype(jnp.int32) * config.q**i for i in range(config.M))
    U = U.astype(dtype) / table_den(config)  # [m, nb, Q]: <c_a, r(b)>, exact
    sA = _block_scale(a, ua, config, dtype)
    E = None
    zt = _z_terms(config, dtype)
    if zt is not None:  # rows become <c_a - z, r(b)>; E = <c_a - z, z>
        tz, zz = zt
        U = U - tz
        E = sA * (jnp.sum(tz[a] * _numerics.level_weights(config, dtype), -1) - zz)
    out = _gather_matmul(sA[..., None] * U, E, b, ub, config, tb if native else None)
    if pad:
        out = out - jnp.matmul(_tail(a, ua, config, dtype, pad),
                               _tail(b, ub, config, dtype, pad).T, precision=_HIGHEST)
    return out.reshape(lead + out.shape[-1:])


def _matrix_codes(codes, fn: str, what: str):
    """``(index [n, nb, M], T field [n, tb], scale or None)`` of a coded matrix (its T field
    unpacked inside the products' jit: a native product reads it itself)."""
    check_codes(codes, fn)
    if len(codes.blocks_shape) != 2:
        raise ValueError(f"{fn}: {what} must be coded as n rows of length k: blocks [n, nb], "
                         f"got blocks {list(codes.blocks_shape)}")
    return codes.index, codes.tfield, codes.scale


IMPLEMENTATIONS = ("xla", "native")


def _check_implementation(implementation, fn: str):
    if implementation not in (None,) + IMPLEMENTATIONS:
        raise ValueError(f"{fn}: implementation must be one of {IMPLEMENTATIONS} or None, got "
                         f"{implementation!r}")


def _native(implementation, fn: str, dtype, *arrays) -> bool:
    """Whether a matrix product's sums run natively: ``implementation`` checked (``None``: the
    native kernel where it is built, the inputs live on a CPU and the tables' ``dtype`` is
    float32)."""
    _check_implementation(implementation, fn)
    wide = dtype != jnp.float32
    if implementation == "native":
        why = kernels.cpu.why_unavailable()
        if why or wide:
            raise ValueError(f"{fn}: no native lookup-table product here: "
                             f"{why or f'it sums float32, the tables are {jnp.dtype(dtype)}'};"
                             " use implementation='xla'")
        return True
    return (implementation is None and kernels.cpu.available() and not wide
            and kernels.platform(*arrays) == "cpu")


def matmul(codes_A, codes_B, *, implementation=None):
    """``A_hat @ B_hat`` of two coded matrices through the two-sided table.

    ``A`` is given by its rows and ``B`` by its columns, both coded along the contraction
    axis k (``B``'s codes are those of ``B^T``), so the result is ``A_hat @ B_hat`` with
    ``B_hat = decode(codes_B)^T``.

    Args:
      codes_A: blocks ``[..., nb]`` (rows of length k, any leading shape).
      codes_B: blocks ``[n, nb]`` (the n columns of B), of the same config. Row scales of
        either multiply the result.
      implementation: the sums over the table rows of A's blocks: ``"native"`` (the native
        CPU kernel, ``kernels.cpu.lut_matmul``), ``"xla"`` (XLA's gathers) or ``None``
        (native where it is built, the codes live on a CPU and the product is float32).

    Returns:
      ``[..., n]`` (float64 under x64, else float32), equal to decode-then-matmul up to float
      rounding; NaN in entries that touch a block with ``T = -1``.
    """
    a, ua, sa = _block_codes(codes_A, "matmul")
    b, tb, sb = _matrix_codes(codes_B, "matmul", "B")
    config = _same_config(codes_A, codes_B, "matmul")
    _check_two_sided(config, "matmul")
    if ua.shape[-1] != b.shape[1]:
        raise ValueError(f"matmul: A has {ua.shape[-1]} blocks per row, B {b.shape[1]} per column")
    native = _native(implementation, "matmul", default_float(), a, b)
    out = _matmul(a, ua, b, tb, config, _padding(codes_A, codes_B, "matmul"), native)
    if sa is not None:
        out = out * sa.astype(out.dtype)[..., None]
    return _row_scale(out, sb)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _matmul_one_sided(index, tfield, x, config, native):
    lead = x.shape[:-1]
    u = unpack_t(tfield, config, index.shape[1])  # inside jit: unused (not computed) if native
    t = _one_sided(x.reshape((-1, x.shape[-1])), config)  # [m, nb, Q]
    E = None
    if config.dither is not None:
        E = dither_dot(to_blocks(x.reshape((-1, x.shape[-1])).astype(t.dtype), config.d), config)
    out = _gather_matmul(t, E, index, u, config, tfield if native else None)
    return out.reshape(lead + out.shape[-1:])


def matmul_one_sided(codes_W, x, *, implementation=None):
    """``x @ W_hat^T``: real activations times coded weights (weight-only quantization).

    Args:
      codes_W: blocks ``[n, nb]``: the n output rows of W, each coded along its length-k input
        axis (row scales are applied).
      x: ``[..., k]`` real activations, ``ceil(k/d) = nb``.
      implementation: the sums over x's tables: ``"native"``, ``"xla"`` or ``None``, as
        :func:`matmul`'s.

    Returns:
      ``[..., n]`` in x's dtype (at least float32), equal to ``x @ decode(W)^T`` up to float
      rounding.

    Raises:
      ValueError: an unknown implementation, or ``"native"`` where it cannot run.
    """
    index, tfield, scale = _matrix_codes(codes_W, "matmul_one_sided", "W")
    config = codes_W.config
    n, nb = codes_W.blocks_shape
    check_one_sided(config, "matmul_one_sided")
    x = _check_real(x, nb, config, "matmul_one_sided", "x", codes_W.n)
    _check_implementation(implementation, "matmul_one_sided")
    dtype = jnp.promote_types(x.dtype, jnp.float32)  # the tables'
    if x.size == 0 or n == 0:
        return jnp.zeros(x.shape[:-1] + (n,), dtype)
    native = _native(implementation, "matmul_one_sided", dtype, index, x)
    return _row_scale(_matmul_one_sided(index, tfield, x, config, native), scale)

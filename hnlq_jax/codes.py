"""``Codes``: the compact, self-describing form of HNLQ codes that every operation takes.

Layout (``docs/format.md`` has the full description):

* ``index``: ``[..., M]`` unsigned, one codebook index per block and level,
  ``k_m = sum_i b_{m,i} q^(d-1-i)`` (coordinate 0 most significant, the codebook order), in the
  smallest of uint8 / uint16 / uint32 that holds ``q^d``.
* ``tfield``: the overload steps as ``u = T + 1`` (``u = 0``: a failed block), in
  :func:`t_bits` bits. With 4 bits two neighbouring blocks of the *last* leading axis share a
  byte (block ``2j`` in the low nibble, ``2j + 1`` in the high one): ``uint8 [..., ceil(L/2)]``.
  With 8 bits it is ``uint8 [...]``.
* ``scale``: optional real per-row scale ``[...rows]`` (row codes only, see below).
* static (pytree aux data): the :class:`~hnlq_jax.config.HNLQConfig` and, for *row codes*, the
  logical row length ``n``.

Two kinds of codes share the class:

* *block codes* (``n is None``): the codes of ``x[..., d]``; ``decode`` gives ``[..., d]``.
* *row codes* (``n`` set): the codes of ``w[..., n]`` split into ``nb = ceil(n/d)`` zero-padded
  blocks, so ``index`` is ``[..., nb, M]``; ``decode`` gives ``[..., n]``, times ``scale``.

Codes are a pytree: they pass through ``jit``, ``vmap`` (over any leading axis but the last,
along which the 4-bit T field pairs blocks), ``scan``, ``shard_map`` and checkpoints, and carry
no gradient (their arrays are integers; ``scale`` is the one real leaf).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from hnlq_jax.config import HNLQConfig, check_config, saved_int

__all__ = ["Codes", "FORMAT_VERSION", "index_dtype", "t_bits", "logical_shape", "saved_header",
           "check_saved_header"]

# Bumped whenever the meaning of a stored field changes; serialized forms record it.
FORMAT_VERSION = 1
_KEEP = object()  # Codes.with_rows: an argument left out


@functools.lru_cache(maxsize=None)
def index_dtype(config: HNLQConfig) -> np.dtype:
    """Smallest unsigned dtype that holds the ``q^d`` codebook indices of ``config``."""
    size = config.q**config.d
    for dt in (np.uint8, np.uint16, np.uint32):
        if size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise AssertionError("HNLQConfig validation keeps q^d <= 2^32")  # pragma: no cover


def t_bits(config: HNLQConfig) -> int:
    """Bits of one block's T field: 4 when ``max_T <= 14`` (``u = T + 1 <= 15``), else 8."""
    return 4 if config.max_T <= 14 else 8


def saved_header(config: HNLQConfig) -> dict:
    """What a serialized artifact records beside its arrays: format version and config."""
    # A list, not a tuple: msgpack (flax.serialization) refuses tuples; reading takes either.
    fields = dataclasses.asdict(config)
    if fields["dither"] is not None:
        fields["dither"] = list(fields["dither"])
    return {"format_version": FORMAT_VERSION, "config": fields}


def checksum(*arrays) -> int:
    """CRC-32 of the bytes of ``arrays`` in order (each as NumPy holds it: C order, the
    machine's byte order), what saved codes record beside their arrays (``"crc32"``).

    Args:
      *arrays: NumPy arrays (a JAX array is copied to the host; ``None`` is skipped).
    """
    crc = 0
    for a in arrays:
        if a is not None:
            a = np.ascontiguousarray(np.asarray(a))
            crc = zlib.crc32(a.reshape(-1).view(np.uint8), crc)
    return crc


def header_checksum(header: dict) -> int:
    """CRC-32 of what describes a saved artifact's arrays (its :func:`saved_header` and row
    length, in_features, rotation...), as canonical JSON of their parsed values: recorded as
    ``"header_crc32"`` beside :func:`checksum`'s ``"crc32"`` of the arrays, so that a flipped
    bit in the saved config (alpha, max_T) cannot load as another valid config."""
    return zlib.crc32(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())


def check_header_checksum(state, header: dict, where: str) -> None:
    """Compares the ``"header_crc32"`` a saved artifact records with :func:`header_checksum`
    of ``header``, its fields as loaded (saved before it was recorded: nothing to compare).

    Raises:
      ValueError: the header is not the one that was saved (corrupted or edited).
    """
    saved = state.get("header_crc32") if isinstance(state, dict) else None
    if saved is None:
        return
    if saved_int(saved) is None:
        raise ValueError(f"{where}: the saved header checksum {saved!r} is not an int; save the "
                         "codes again")
    if header_checksum(header) != saved_int(saved):
        raise ValueError(f"{where}: the saved header (format version, config, row length) does "
                         "not match its saved CRC-32 (corrupted or edited since it was saved); load "
                         "an intact copy, or quantize the float model again")


def check_checksum(state, arrays, where: str) -> None:
    """Compares the ``"crc32"`` a saved artifact records with :func:`checksum` of its arrays
    (saved before checksums were recorded, it has none: nothing to compare; one that records
    a ``"header_crc32"``, written since, must have it).

    Raises:
      ValueError: the arrays are not those that were saved (corrupted or edited).
    """
    saved = state.get("crc32") if isinstance(state, dict) else None
    if saved is None:
        if isinstance(state, dict) and "header_crc32" in state:  # written with both, always
            raise ValueError(f"{where}: the saved codes carry a header checksum but no checksum "
                             "of their arrays (corrupted or edited since they were saved); "
                             "load an intact copy, or quantize the float model again")
        return
    if saved_int(saved) is None:
        raise ValueError(f"{where}: the saved checksum {saved!r} is not an int; save the codes "
                         "again")
    if checksum(*arrays) != saved_int(saved):
        raise ValueError(f"{where}: the code arrays do not match their saved CRC-32 (corrupted "
                         "or edited since they were saved); load an intact copy, or quantize "
                         "the float model again")


def read_saved_header(state, where: str) -> HNLQConfig:
    """The config of a saved artifact whose header is of this format version.

    Args:
      state: the saved mapping; must hold ``format_version`` and ``config`` (a dict of
        :class:`HNLQConfig` fields), as :func:`saved_header` writes them.
      where: the loader's name, for messages.

    Raises:
      ValueError: a missing header, another format version or an invalid saved config.
    """
    if not (isinstance(state, dict) and {"format_version", "config"} <= set(state)):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{where}: expected saved HNLQ codes with a format_version and a config, "
                         f"got {got}")
    version = state["format_version"]
    if saved_int(version) != FORMAT_VERSION:
        raise ValueError(f"{where}: the codes were saved in format version {version!r}; this "
                         f"version of hnlq_jax reads format version {FORMAT_VERSION}: quantize "
                         "again with this version")
    # Every field, as saved_header writes them: a missing one would silently take its default.
    fields = [f.name for f in dataclasses.fields(HNLQConfig)]
    missing = [k for k in fields if k not in state["config"]] if isinstance(
        state["config"], dict) else []
    if missing:
        raise ValueError(f"{where}: the saved config {state['config']!r} lacks the field(s) "
                         f"{missing} (truncated or edited by hand?); save the codes again")
    try:
        saved = HNLQConfig(**state["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: the saved config {state['config']!r} is not valid: {e}") \
            from None
    return saved


def check_saved_header(state, config: HNLQConfig, where: str, remedy: str) -> HNLQConfig:
    """:func:`read_saved_header`, the config checked against ``config``.

    Args:
      state: the saved mapping (:func:`saved_header`).
      config: the config the loader expects.
      where: the loader's name, for messages.
      remedy: what to do on a config mismatch (e.g. "build the layer with the saved config").

    Raises:
      ValueError: as :func:`read_saved_header`, or a config other than ``config`` (the
        message names both).
    """
    saved = read_saved_header(state, where)
    if saved != config:
        raise ValueError(f"{where}: the codes were saved with {saved}, but {config} is expected "
                         f"(beta aside: it lives in the row scales); {remedy}")
    return saved


def logical_shape(blocks_shape: tuple, config: HNLQConfig, n: int | None) -> tuple:
    """Shape of the decoded array of codes with blocks ``blocks_shape``: ``blocks + (d,)`` for
    block codes (``n`` None), ``blocks[:-1] + (n,)`` for row codes."""
    blocks_shape = tuple(blocks_shape)
    return blocks_shape + (config.d,) if n is None else blocks_shape[:-1] + (n,)


def as_array(v):
    """``jnp.asarray(v)``, skipped for a JAX array or tracer (where it is a no-op that costs
    ~25 us: the checks of an eager call would spend more than the call's kernel). A NumPy array
    takes ``jax.device_put`` (a copy, canonical dtype): ``jnp.asarray`` compiles a small staging
    program for every new shape (jax 0.10)."""
    if isinstance(v, jax.Array):
        return v
    return jax.device_put(v) if isinstance(v, np.ndarray) else jnp.asarray(v)


def is_concrete(x) -> bool:
    """True for a value known now (an array), False for a tracer."""
    return not isinstance(x, jax.core.Tracer)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _all(x, predicate, args):
    return jnp.all(predicate(x, *args))


def concrete_all(x, predicate, *args) -> bool:
    """``all(predicate(x, *args))`` for a concrete array (or pytree of arrays), evaluated now
    even while tracing (as for a constant closed over by a jitted function); True for a tracer
    (such values are checked or marked at run time instead).

    One compiled program per shape: ``predicate`` and ``args`` are static, so ``predicate`` must
    be a module-level function (a new lambda per call would compile on every call).
    """
    if not all(is_concrete(a) for a in jax.tree.leaves(x)):
        return True
    with jax.ensure_compile_time_eval():
        return bool(_all(x, predicate, args))


# ------------------------------------------------------------------ field conversions (jnp)
# Jitted with their static arguments, so that an eager call (a new shape of Codes.from_labels,
# .labels or .T) compiles one small program instead of one per jnp operation; under an outer
# trace they inline.


@functools.partial(jax.jit, static_argnums=(1, 2))
def index_from_labels(labels, q: int, dtype):
    """``[..., M]`` codebook indices of ``labels[..., M, d]`` (any integer dtype, in 0..q-1)."""
    b = labels.astype(jnp.uint32)
    k = b[..., 0]
    for i in range(1, labels.shape[-1]):
        k = k * jnp.uint32(q) + b[..., i]
    return k.astype(dtype)


def digits_of_index(k, q: int, d: int) -> list:
    """The ``d`` label columns (int32) of codebook indices ``k``, coordinate 0 first."""
    k = k.astype(jnp.uint32)
    out = []
    for i in range(d - 1, -1, -1):
        if q & (q - 1) == 0:  # a power of two: shifts and masks
            out.append(((k >> jnp.uint32(i * (q.bit_length() - 1))) & jnp.uint32(q - 1)))
        else:
            out.append((k // jnp.uint32(q**i)) % jnp.uint32(q))
    return [c.astype(jnp.int32) for c in out]


@functools.partial(jax.jit, static_argnums=1)
def labels_of_index(index, config: HNLQConfig):
    """``[..., M, d]`` uint8 labels of ``index[..., M]``."""
    return jnp.stack(digits_of_index(index, config.q, config.d), axis=-1).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnums=1)
def pack_t(T, config: HNLQConfig):
    """The T field of ``T[...]`` (int, -1 = failed); see the module docstring."""
    u = (T.astype(jnp.int32) + 1).astype(jnp.uint8)
    if t_bits(config) == 8 or u.ndim == 0:
        return u
    L = u.shape[-1]
    if L % 2:
        u = jnp.concatenate([u, jnp.zeros(u.shape[:-1] + (1,), jnp.uint8)], axis=-1)
    u = u.reshape(u.shape[:-1] + (u.shape[-1] // 2, 2))
    return u[..., 0] | (u[..., 1] << jnp.uint8(4))


@functools.partial(jax.jit, static_argnums=(1, 2))
def unpack_t(tfield, config: HNLQConfig, L: int | None):
    """``u = T + 1`` (int32) of ``L`` blocks along the last leading axis from a T field."""
    if t_bits(config) == 8 or L is None:
        return tfield.astype(jnp.int32)
    f = tfield.astype(jnp.int32)
    u = jnp.stack([f & 15, f >> 4], axis=-1).reshape(f.shape[:-1] + (2 * f.shape[-1],))
    return u[..., :L]


@functools.partial(jax.jit, static_argnums=2)
def _fields_of_digit_view(labels, T, config: HNLQConfig):
    """``(index, T field)`` of a digit view ``(labels[..., M, d], T[...])``."""
    return index_from_labels(labels, config.q, index_dtype(config)), pack_t(T, config)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _t_of_field(tfield, config: HNLQConfig, L: int | None):
    """``T`` (int8, -1 = failed) of ``L`` blocks along the last leading axis from a T field."""
    return (unpack_t(tfield, config, L) - 1).astype(jnp.int8)


def tfield_shape(lead: tuple, config: HNLQConfig) -> tuple:
    """Shape of the T field for blocks of leading shape ``lead``."""
    if t_bits(config) == 8 or len(lead) == 0:
        return tuple(lead)
    return tuple(lead[:-1]) + (-(-lead[-1] // 2),)


# ------------------------------------------------------------------------------ the class


@jax.tree_util.register_pytree_node_class
class Codes:
    """HNLQ codes of a batch of blocks or of the rows of a matrix (a pytree).

    Build them with :func:`hnlq_jax.encode`, :func:`hnlq_jax.encode_rows` or
    :meth:`Codes.from_labels`; read them back with :func:`hnlq_jax.decode`, which needs no
    config: it travels with the codes.

    Attributes:
      index: ``[..., M]`` codebook indices (uint8 / uint16 / uint32, see :func:`index_dtype`).
      tfield: packed ``T + 1``, see the module docstring and :func:`t_bits`.
      scale: ``None``, or ``[...rows]`` real per-row scales of row codes.
      config: the quantizer that made the codes (static).
      n: the logical row length of row codes, ``None`` for block codes (static).
    """

    __slots__ = ("index", "tfield", "scale", "config", "n")

    def __init__(self, index, tfield, config: HNLQConfig, *, scale=None, n: int | None = None):
        self.index = index
        self.tfield = tfield
        self.scale = scale
        self.config = config
        self.n = n

    # -- pytree
    def tree_flatten(self):
        return (self.index, self.tfield, self.scale), (self.config, self.n)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.index, obj.tfield, obj.scale = children
        obj.config, obj.n = aux
        return obj

    # -- views
    @property
    def blocks_shape(self) -> tuple:
        """Leading shape of the blocks: ``index.shape[:-1]``."""
        return tuple(self.index.shape[:-1])

    @property
    def shape(self) -> tuple:
        """Shape of the decoded array: ``[..., d]`` (block codes) or ``[..., n]`` (row codes)."""
        return logical_shape(self.blocks_shape, self.config, self.n)

    @property
    def labels(self) -> jax.Array:
        """``[..., M, d]`` uint8 digit view ``b_m`` (derived on demand; level 0 the finest)."""
        return labels_of_index(self.index, self.config)

    @property
    def T(self) -> jax.Array:
        """``[...]`` int8 overload steps, ``-1`` for a block that could not be encoded."""
        lead = self.blocks_shape
        return _t_of_field(self.tfield, self.config, lead[-1] if lead else None)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held: index, T field and scale."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self))

    def bits_per_value(self) -> float:
        """Bits held per coded value (``nbytes * 8`` over the number of decoded entries)."""
        size = int(np.prod(self.shape, dtype=np.int64))
        return 8 * self.nbytes / size if size else float("nan")

    # -- construction
    @classmethod
    def from_labels(cls, labels, T, config: HNLQConfig, *, scale=None, n: int | None = None):
        """Codes from a digit view (e.g. made by a reference implementation).

        Args:
          labels: ``[..., M, d]`` integers in ``0..q-1``.
          T: ``[...]`` integers in ``-1..max_T``.
          config: the quantizer that made them.
          scale: optional per-row scale ``[...rows]`` (row codes).
          n: logical row length for row codes (``ceil(n/d)`` = the last leading axis).

        Raises:
          TypeError, ValueError: shapes, dtypes or values that do not fit ``config``.
        """
        labels, T = check_labels(labels, T, config, "Codes.from_labels")
        codes = cls(*_fields_of_digit_view(labels, T, config), config)
        return codes.with_rows(scale=scale, n=n) if (n is not None or scale is not None) \
            else codes

    def with_rows(self, *, scale=_KEEP, n=_KEEP) -> Codes:
        """These codes read as row codes of logical length ``n`` with optional ``scale``.

        Args:
          scale: ``[...rows]`` per-row scales, or ``None`` for none; left out, the codes' own
            (``None`` for block codes), so that ``row_codes.with_rows(n=...)`` keeps the scale.
          n: the row length (``None``: every block's ``d`` entries); left out, the codes' own.

        Raises:
          ValueError: ``n`` does not split into the last leading axis, or ``scale`` has the
            wrong shape.
        """
        scale = self.scale if scale is _KEEP else scale
        n = self.n if n is _KEEP else n
        n, scale = check_rows(self.blocks_shape, self.config, scale, n, "Codes.with_rows")
        return Codes(self.index, self.tfield, self.config, scale=scale, n=n)

    def __repr__(self) -> str:
        c = self.config
        if not all(hasattr(a, "shape") for a in (self.index, self.tfield)):
            # e.g. after jax.tree.map turned the leaves into something else
            return f"Codes({c!r}, n={self.n}, leaves {self.index!r}, {self.tfield!r}, {self.scale!r})"
        kind = "blocks" if self.n is None else f"rows n={self.n}"
        scale = "" if self.scale is None else f", scale {self.scale.dtype}{list(self.scale.shape)}"
        return (f"Codes({c.lattice} q={c.q} M={c.M}, {kind}, shape {list(self.shape)}: index "
                f"{self.index.dtype}{list(self.index.shape)}, T {t_bits(c)}-bit "
                f"{list(self.tfield.shape)}{scale})")


# ------------------------------------------------------------------------------ validation


def check_rows(lead: tuple, config: HNLQConfig, scale, n, fn: str):
    """``(n, scale)`` of row codes with blocks ``lead``, checked (``n`` None: every block's
    ``d`` entries; ``scale`` None or a real array ``lead[:-1]``).

    Raises:
      ValueError: no block axis, ``n`` that does not split into the blocks, or a bad scale.
    """
    if not lead:
        raise ValueError(f"{fn}: row codes need a block axis [..., nb, M]")
    nb, d = lead[-1], config.d
    if n is not None and saved_int(n) is None:  # int(10.7) would truncate
        raise ValueError(f"{fn}: the row length n must be an int or None, got {n!r}")
    n = nb * d if n is None else saved_int(n)
    if not (nb * d - d < n <= nb * d or (n == 0 and nb == 0)):
        raise ValueError(f"{fn}: n={n} does not split into {nb} blocks of d={d}")
    if scale is not None:
        scale = as_array(scale)
        if scale.shape != lead[:-1] or not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(f"{fn}: scale must be a real array of shape {lead[:-1]}, got "
                             f"{scale.dtype}{list(scale.shape)}")
    return n, scale


def check_labels(labels, T, config: HNLQConfig, fn: str):
    """Validates a digit view ``(labels[..., M, d], T[...])`` against ``config``."""
    check_config(config, fn)
    # Host values are range-checked as given: JAX (without x64) would wrap int64 into int32,
    # and T = 2^32 + 3 would pass as 3.
    host = [None if isinstance(v, jax.Array) else np.asarray(v) for v in (labels, T)]
    labels, T = jnp.asarray(labels), jnp.asarray(T)
    M, d = config.M, config.d
    if labels.shape[-2:] != (M, d) or labels.shape[:-2] != T.shape:
        raise ValueError(
            f"{fn}: expected labels [..., M={M}, d={d}] and T [...] with the same leading shape, "
            f"got labels {labels.shape} and T {T.shape}")
    if not (jnp.issubdtype(labels.dtype, jnp.integer) and jnp.issubdtype(T.dtype, jnp.integer)):
        raise TypeError(f"{fn}: labels and T must be integer arrays, got {labels.dtype}, {T.dtype}")
    # JAX arrays: one compiled reduction (True for tracers, checked or marked at run time).
    if host[0] is None and host[1] is None and concrete_all((labels, T), _digit_view_ok, config):
        return labels, T
    b, t = (h if h is not None else np.asarray(v) if is_concrete(v) else np.zeros(0, np.int64)
            for h, v in zip(host, (labels, T)))
    labels_ok = not b.size or (0 <= b.min() and b.max() < config.q)
    if labels_ok and (not t.size or (-1 <= t.min() and t.max() <= config.max_T)):
        return labels, T
    if not labels_ok:
        raise ValueError(f"{fn}: labels must be in 0..q-1 = 0..{config.q - 1}, got values in "
                         f"{b.min()}..{b.max()}")
    raise ValueError(f"{fn}: T must be in -1..max_T = -1..{config.max_T}, got values in "
                     f"{t.min()}..{t.max()}")


def _digit_view_ok(view, config: HNLQConfig):
    """Labels in ``0..q-1`` and T in ``-1..max_T`` (compared in int32)."""
    labels, T = (a.astype(jnp.int32) for a in view)
    return (jnp.all((labels >= 0) & (labels < config.q))
            & jnp.all((T >= -1) & (T <= config.max_T)))


def check_codes(codes, fn: str, config: HNLQConfig | None = None) -> Codes:
    """Validates a :class:`Codes` value: types, shapes, and (when concrete) the index and T
    ranges. ``config``, when given, must equal the codes' own.

    Raises:
      TypeError: not a ``Codes`` (e.g. a tuple of the old ``(labels, T)`` form).
      ValueError: a config mismatch, inconsistent shapes, an index ``>= q^d``, a T field
        value above ``max_T + 1`` or a non-finite row scale (corrupted codes).
    """
    if not isinstance(codes, Codes):
        root = type(codes).__module__.split(".")[0]
        kind = type(codes).__name__ if root == "builtins" else f"{root}.{type(codes).__name__}"
        how = ("unpack packed data first: hnlq_jax.unpack(packed)" if kind == "hnlq_jax.Packed"
               else "convert them with codes.to_jax()" if kind == "torch_bridge.Codes"
               else "build codes with hnlq_jax.encode or "
               "hnlq_jax.Codes.from_labels(labels, T, config)")
        raise TypeError(f"{fn}: expected hnlq_jax.Codes, got {kind}; {how}")
    cfg = codes.config
    if not isinstance(cfg, HNLQConfig):
        raise TypeError(f"{fn}: codes carry no HNLQConfig (got {type(cfg).__name__})")
    if config is not None and config != cfg:
        raise ValueError(f"{fn}: the codes were made with {cfg}, not {config}")
    if _verified(codes):
        return codes
    index, tfield = as_array(codes.index), as_array(codes.tfield)
    idt = index_dtype(cfg)
    if index.dtype != idt or index.ndim < 1 or index.shape[-1] != cfg.M:
        raise ValueError(f"{fn}: expected index {idt}[..., M={cfg.M}] for {cfg.lattice} "
                         f"q={cfg.q}, got {index.dtype}{list(index.shape)}")
    lead = tuple(index.shape[:-1])
    if tfield.dtype != jnp.uint8 or tuple(tfield.shape) != tfield_shape(lead, cfg):
        raise ValueError(f"{fn}: expected a uint8 T field of shape "
                         f"{list(tfield_shape(lead, cfg))} for blocks {list(lead)}, got "
                         f"{tfield.dtype}{list(tfield.shape)}")
    if not concrete_all((index, tfield), _codes_ok, cfg):
        size = cfg.q**cfg.d
        if np.max(np.asarray(index), initial=0) >= size:
            raise ValueError(f"{fn}: codebook index out of range: values up to "
                             f"{int(np.max(np.asarray(index)))} >= q^d = {size} (corrupted codes?)")
        raise ValueError(f"{fn}: T field holds values above max_T = {cfg.max_T} (corrupted "
                         "codes, or codes of a config with a larger max_T?)")
    if codes.n is not None:
        check_rows(lead, cfg, codes.scale, codes.n, fn)
    elif codes.scale is not None:
        # Block codes would decode without the scale and pack would make row codes of them.
        raise ValueError(f"{fn}: the codes have a row scale but no row length n; make row "
                         "codes with Codes.with_rows(scale=..., n=...) or encode_rows")
    if codes.scale is not None and not concrete_all(as_array(codes.scale), jnp.isfinite):
        raise ValueError(f"{fn}: the row scales hold NaN or Inf (corrupted codes?)")
    _remember_verified(codes)
    return codes


# Arrays whose ranges check_codes has verified, by identity: JAX arrays are immutable, so a
# layer calling matmul on the same codes does not scan them again (a full pass over the
# weight). The weak references drop an entry when its arrays go.
_VERIFIED: dict = {}


def _verified(codes: Codes) -> bool:
    """Whether ``check_codes`` passed these very arrays with this config and n."""
    arrays = tuple(a for a in (codes.index, codes.tfield, codes.scale) if a is not None)
    entry = _VERIFIED.get(tuple(map(id, arrays)))
    return (entry is not None and entry[0] == (codes.config, codes.n)
            and len(entry[1]) == len(arrays) and all(r() is a for r, a in zip(entry[1], arrays)))


def _remember_verified(codes: Codes):
    arrays = tuple(a for a in (codes.index, codes.tfield, codes.scale) if a is not None)
    if not all(isinstance(a, jax.Array) and is_concrete(a) for a in arrays):
        return  # tracers are checked at run time; NumPy arrays are mutable
    key = tuple(map(id, arrays))
    refs = tuple(weakref.ref(a, lambda _, key=key: _VERIFIED.pop(key, None)) for a in arrays)
    _VERIFIED[key] = ((codes.config, codes.n), refs)


def _codes_ok(arrays, cfg: HNLQConfig):
    """Every index below ``q^d`` and every T field entry at most ``max_T + 1`` (the padding
    nibble of an odd last axis is not an entry: reading ignores it)."""
    index, tfield = arrays
    lead = index.shape[:-1]
    u = unpack_t(tfield, cfg, lead[-1] if lead else None)
    return jnp.all(_index_ok(index, cfg)) & jnp.all(u <= cfg.max_T + 1)


def valid_blocks(index, u, config: HNLQConfig):
    """``[...]`` bool: the block decodes (``1 <= u <= max_T + 1`` and every index ``< q^d``).

    ``index`` is ``[..., M]``, or a list of the M per-level columns (as the kernels hold them).
    """
    ok = (u >= 1) & (u <= config.max_T + 1)
    for k in (index if isinstance(index, list) else [index[..., m] for m in range(config.M)]):
        ok = ok & _index_ok(k, config)
    return ok


def _index_ok(k, config: HNLQConfig):
    """``k < q^d`` elementwise; ``True`` when the index dtype holds no larger value."""
    size = config.q**config.d
    if size - 1 >= np.iinfo(index_dtype(config)).max:
        return True
    return k.astype(jnp.uint32) < jnp.uint32(size)


def row_length(codes: Codes) -> int:
    """``k``: the logical row length (``n`` of row codes, ``nb d`` of block codes)."""
    return codes.n if codes.n is not None else codes.blocks_shape[-1] * codes.config.d


def check_weight_codes(codes, fn: str) -> Codes:
    """Validated codes of a weight ``W[n, k]``: blocks ``[n, nb]``."""
    check_codes(codes, fn)
    if len(codes.blocks_shape) != 2:
        raise ValueError(f"{fn}: the weight must be coded as n rows of length k: codes with "
                         f"blocks [n, nb], got blocks {list(codes.blocks_shape)}; see "
                         "hnlq_jax.encode_rows")
    return codes


def check_activations(x, codes: Codes, fn: str):
    """Validated real activations ``x[..., k]`` for weight codes of row length ``k``."""
    x = x if isinstance(x, np.ndarray) else as_array(x)  # NumPy stays on the host (no copy)
    k = row_length(codes)
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(f"{fn}: x must be [..., k] with k = {k} (the codes' row length), got "
                         f"shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: x must be floating, got {x.dtype}")
    return x

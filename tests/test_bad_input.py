"""Bad inputs to the public API: one table, each row a clear error (issue 15).

``CASES`` lists every bad input found so far, as ``pytest.param(call, error, match, id=...)``:
``call()`` must raise ``error`` with a message matching the regex ``match`` (``re.search``),
which checks that the message says what was wrong and, where there is one, what to do. The
table covers configs, arrays (shape, dtype, NaN/Inf, values beyond ``max_T``), codes (ranges,
dtypes, another config), packed bytes (truncated, corrupted, another config or format
version), the wire format, the Flax and PyTorch layers' saved state, the PyTorch front doors
and the command line.

A new bad input goes in the table, as one more row; the list only grows. A bad input that
today gives silent garbage or an unclear error is listed too, marked
``xfail(strict=True, reason=...)``: when it is fixed the row passes, the strict mark fails,
and the mark is removed.

Everything is tiny and built lazily (``functools.cache``), so the table runs in seconds and a
row only pays for what it uses.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import struct
import tempfile
import zlib

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hnlq_jax as hq
import hnlq_jax.flax as hf
import torch_bridge as tb
from hnlq_jax import Codes, HNLQConfig, Packed, dist, kernels, lut, modq, ops, wire
from hnlq_jax.__main__ import main as cli_main
from hnlq_jax.rows import calibrate_rows, unit

# The configs every row shares (compiled once).
C = HNLQConfig("D4", 4, 2, beta=0.5)
C8 = C.replace(q=8)  # index uint16: codes of C read as C8 have the wrong dtype
# q^d = 9 < 256 and max_T + 1 = 6 < 15: out-of-range indices and T fields can be written.
CS = HNLQConfig("Z2", 3, 2, beta=0.5, max_T=5)
X = 4 * np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)  # some T > 0
VALID_T = jnp.full((2,), 0x11, jnp.uint8)  # T = 0 for 3 blocks of CS (two 4-bit fields a byte)
# The codes of a weight [4, 16] (blocks [4, 4]) with every index 0 and T = 0.
WEIGHT_CODES = Codes(jnp.zeros((4, 4, 2), jnp.uint8), jnp.full((4, 2), 0x11, jnp.uint8), C)

# The phrase of every "saved with another config" error (codes.check_saved_header).
OTHER_CONFIG = r"saved with HNLQConfig\(lattice='D4', q=4.*but HNLQConfig\(lattice='{}', q={}"


# ----------------------------------------------------------------------------- shared inputs


@functools.cache
def _codes() -> Codes:
    return hq.encode(X, C)


def _rows(n: int) -> Codes:
    """Row codes of 3 rows of length ``n`` (3 blocks for n = 10 or 11)."""
    return hq.encode_rows(np.random.default_rng(n).standard_normal((3, n)).astype(np.float32), C)


@functools.cache
def _packed() -> Packed:
    return hq.pack(_codes())


@functools.cache
def _bytes() -> bytes:
    return _packed().to_bytes()


def _packed_with(**fields) -> Packed:
    """``_packed()`` with some arrays or static fields replaced (in-memory corruption)."""
    p = _packed()
    kw = dict(labels=p.labels, tcode=p.tcode, rice=p.rice, config=p.config,
              blocks_shape=p.blocks_shape, version=p.version)
    kw.update(fields)
    return Packed(kw.pop("labels"), kw.pop("tcode"), kw.pop("rice"), kw.pop("config"),
                  kw.pop("blocks_shape"), **kw)


def _packed_cs(labels=(0,) * 13, tcode=(), rice=()) -> Packed:
    """16 blocks of ``CS`` packed by hand: 13 label bytes (three full chunks of 17 base-3 digits
    in 27 bits, then 13 digits in 21 bits), a T stream and its Rice parameters."""
    def u8(v):
        return jnp.asarray(np.array(v, np.uint8))

    return Packed(u8(labels), u8(tcode), u8(rice), CS, (16,))


@functools.cache
def _row_bytes() -> bytes:
    """The bytes of the packed row codes of a weight [4, 16] (scales float32 [4])."""
    return hq.pack(hq.encode_rows(X.reshape(4, 16), C)).to_bytes()


def _renested(depth: int = 100_000) -> bytes:
    """``_bytes()`` with a header of ``depth`` nested JSON lists and a valid CRC-32."""
    b = _bytes()
    (hlen,) = struct.unpack("<I", b[8:12])
    head = b"[" * depth + b"]" * depth
    out = b[:8] + struct.pack("<I", len(head)) + head + b[12 + hlen:-4]
    return out + struct.pack("<I", zlib.crc32(out))


def _resigned(change, b: bytes | None = None) -> bytes:
    """``b`` (default ``_bytes()``) with its JSON header changed by ``change(header)`` and a
    valid CRC-32 (what another writer could produce, as opposed to corruption, which the CRC
    catches)."""
    b = _bytes() if b is None else b
    (hlen,) = struct.unpack("<I", b[8:12])
    header = json.loads(b[12:12 + hlen])
    change(header)
    head = json.dumps(header, sort_keys=True).encode()
    out = b[:8] + struct.pack("<I", len(head)) + head + b[12 + hlen:-4]
    return out + struct.pack("<I", zlib.crc32(out))


def _flipped(at: int) -> bytes:
    b = bytearray(_bytes())
    b[at] ^= 0x40
    return bytes(b)


@functools.cache
def _flax():
    """``(model, training variables, saved inference state dict)`` of a QDense 8 -> 4."""
    model = hf.QDense(4, config=C, calibrate=False)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.ones((2, 8)))  # one compile
    inference, _ = hf.export_params(variables, C)
    return model, variables, flax.serialization.to_state_dict(inference)


def _saved_codes(**changes) -> dict:
    """The saved inference state dict with fields of its codes' record changed."""
    saved = _flax()[2]
    record = dict(saved["hnlq"]["codes"])
    config = changes.pop("config", {})
    record.update(changes, config={**record["config"], **config})
    return {**saved, "hnlq": {"codes": record}}


def _saved_tfield(dtype) -> np.ndarray:
    return np.asarray(_flax()[2]["hnlq"]["codes"]["tfield"], dtype)


def _restore_into_q8():
    """flax.serialization.from_state_dict (msgpack, orbax) into a model of another config."""
    target = {"params": {"bias": jnp.zeros(4)},
              "hnlq": {"codes": Codes(jnp.zeros((4, 2, 2), jnp.uint16),
                                      jnp.zeros((4, 1), jnp.uint8), unit(C8),
                                      scale=jnp.ones(4), n=8)}}
    return flax.serialization.from_state_dict(target, _flax()[2])


@functools.cache
def _qlinear_state() -> dict:
    return tb.QLinear(8, 4, C, calibrate=False).state_dict()


def _qlinear_state_with(*, version=None, config=None, **tensors) -> dict:
    """The saved QLinear state dict with its format version, config fields or tensors changed
    (its header's checksum made anew: the state a layer of that config would have saved)."""
    state = {**_qlinear_state(), **tensors}
    extra = dict(state["_extra_state"])
    if version is not None:
        extra["format_version"] = version
    extra["config"] = {**extra["config"], **(config or {})}
    extra["header_crc32"] = hq.codes.header_checksum(
        {k: extra[k] for k in ("format_version", "config", "in_features")})
    return {**state, "_extra_state": extra}


def _qlinear_state_without(field: str) -> dict:
    """The saved QLinear state dict with one config field dropped (it would take its default)."""
    state = _qlinear_state_with()
    state["_extra_state"]["config"].pop(field)
    return state


def _unversioned_state() -> dict:
    """A state dict of the earlier format: ``labels`` and ``T`` buffers, no format version."""
    state = {k: v for k, v in _qlinear_state().items()
             if k not in ("index", "tfield", "_extra_state")}
    return {**state, "labels": torch.zeros(4, 2, 2, 4, dtype=torch.uint8),
            "T": torch.zeros(4, 2, dtype=torch.int8)}


def _empty_qlinear(in_features: int = 8, config: HNLQConfig = C) -> tb.QLinear:
    """A QLinear that has not quantized anything yet (cheap: no encode)."""
    return tb.QLinear(in_features, 4, config, calibrate=False, quantize_weights=False)


def _load_corrupted_qlinear():
    """A state dict whose T field holds 7 (T = 6) for a layer with max_T = 5."""
    state = _qlinear_state_with(config={"max_T": 5},
                                tfield=torch.full_like(_qlinear_state()["tfield"], 0x77))
    return _empty_qlinear(config=C.replace(max_T=5)).load_state_dict(state)


def _cli(*argv: str):
    """``python -m hnlq_jax ARGV``; argparse's exit becomes ``SystemExit("exit CODE: STDERR")``
    so that the table can match the message. ``{tmp}`` in an argument is a fresh folder that
    holds ``exists.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/exists.json", "w") as f:
            f.write("{}")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                return cli_main([a.format(tmp=tmp) for a in argv])
            except SystemExit as e:
                raise SystemExit(f"exit {e.code}: {err.getvalue()}") from None


def _nan_linear() -> torch.nn.Linear:
    """An ``nn.Linear`` 8 -> 4 whose ``weight[2, 5]`` is NaN."""
    linear = torch.nn.Linear(8, 4)
    with torch.no_grad():
        linear.weight[2, 5] = float("nan")
    return linear


def _nan_kernel_variables() -> dict:
    """Float Flax variables of one Dense 8 -> 4 whose ``kernel[5, 2]`` is NaN."""
    kernel = jnp.ones((8, 4)).at[5, 2].set(jnp.nan)
    return {"params": {"Dense_0": {"kernel": kernel, "bias": jnp.zeros(4)}}}


def _nan_qdense_variables() -> dict:
    """The QDense training variables of :func:`_flax` with ``kernel[3, 1]`` NaN."""
    variables = _flax()[1]
    kernel = variables["params"]["kernel"].at[3, 1].set(jnp.nan)
    return {**variables, "params": {**variables["params"], "kernel": kernel}}


def _drifted_qdense_variables() -> dict:
    """The QDense training variables of :func:`_flax` with its stored beta 10^-4 of the
    calibrated one (a kernel grown far beyond it): no block fits at max_T."""
    variables = _flax()[1]
    hnlq = {**variables["hnlq"], "beta": 1e-4 * variables["hnlq"]["beta"]}
    return {**variables, "hnlq": hnlq}


def _xfail(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


# ------------------------------------------------------------------------------------ table

CASES = [
    # -- HNLQConfig
    pytest.param(lambda: HNLQConfig("X9"), ValueError,
                 r"unknown lattice 'X9': expected 'Z2', 'A2', 'D4', 'E8'", id="config-lattice"),
    pytest.param(lambda: HNLQConfig("D4", q=1), ValueError,
                 r"HNLQConfig\.q must be in 2\.\.256 \(uint8 labels\), got 1",
                 id="config-q-below-2"),
    pytest.param(lambda: HNLQConfig("D4", q=4.0), TypeError, r"HNLQConfig\.q must be an int, "
                 r"got 4\.0", id="config-q-float"),
    pytest.param(lambda: HNLQConfig("D4", M=0), ValueError, r"HNLQConfig\.M must be >= 1, got 0",
                 id="config-M-0"),
    pytest.param(lambda: HNLQConfig("D4", alpha=0.0), ValueError,
                 r"HNLQConfig\.alpha must be finite and > 0, got 0", id="config-alpha-0"),
    pytest.param(lambda: HNLQConfig("D4", max_T=-1), ValueError,
                 r"HNLQConfig\.max_T must be in 0\.\.127, got -1", id="config-maxT-negative"),
    pytest.param(lambda: HNLQConfig("E8", q=256, M=1), ValueError,
                 r"q\*\*d = 256\*\*8 codebook entries exceed 2\*\*32.*use a smaller q",
                 id="config-q^d-too-large"),
    pytest.param(lambda: HNLQConfig("D4", q=4, M=11), ValueError,
                 r"q\*\*M = 4\*\*11 exceeds 2\*\*20", id="config-q^M-too-large"),
    pytest.param(lambda: HNLQConfig("D4", dither=(0.9, 0.9, 0.0, 0.0)), ValueError,
                 r"dither \[0\.9, 0\.9, 0\.0, 0\.0\] is outside the Voronoi cell of 0 of D4",
                 id="config-dither-outside-cell"),
    pytest.param(lambda: HNLQConfig("D4", beta=0.2).replace(beta=torch.tensor(0.3)), TypeError,
                 r"beta must be a real number, got tensor", id="config-beta-torch-tensor"),

    # -- arrays into encode / quantize and friends
    pytest.param(lambda: hq.encode(np.zeros((3, 5), np.float32), C), ValueError,
                 r"encode: the last axis .* must have size d=4 for D4, got shape \(3, 5\); use "
                 r"to_blocks\(x, 4\)", id="encode-last-axis-not-d"),
    pytest.param(lambda: hq.encode(np.zeros((3, 4), np.int32), C), TypeError,
                 r"encode: expected a floating-point array, got dtype int32", id="encode-int"),
    pytest.param(lambda: hq.encode_rows(np.zeros((2, 8), np.int64), C), TypeError,
                 r"encode_rows: expected a floating-point array, got dtype int64",
                 id="encode_rows-int64"),
    pytest.param(lambda: hq.encode(np.array([[np.nan, 0, 0, 0], [np.inf, 0, 0, 0], [0] * 4],
                                            np.float32), C), ValueError,
                 r"encode: input has NaN or Inf in 2 block\(s\) \(the first at block \[0\]\); "
                 r"expected finite values",
                 id="encode-nan-inf"),
    pytest.param(lambda: hq.encode_rows(np.full((2, 8), 1e300), C), ValueError,
                 r"encode_rows: input has NaN or Inf in 4 block\(s\) .*\. The float64 input "
                 r"became float32 \(JAX without jax_enable_x64\): entries beyond its range, "
                 r"if it had any, became Inf there", id="encode_rows-float64-beyond-float32",
                 marks=pytest.mark.filterwarnings("ignore:overflow encountered in cast")),
    pytest.param(lambda: hq.encode(1e7 * X, C), ValueError,
                 r"encode: 16 block\(s\) still overload at max_T = 14 \(the largest has norm "
                 r"[0-9.]+e\+0[78]; every block beyond about [0-9.]+ = beta 2\^\(alpha max_T\) "
                 r"times the overload radius .* does, some nearer ones too\)\. Raise beta .* or "
                 r"max_T .*failures='mark'",
                 id="encode-beyond-max_T"),
    pytest.param(lambda: hq.quantize(1e7 * X, C), ValueError,
                 r"quantize: .*overload at max_T = 14.*largest.*Raise beta",
                 id="quantize-beyond-max_T"),
    pytest.param(lambda: hq.encode(X, C.replace(beta=1e39)), ValueError,
                 r"encode: beta = 1e\+39 is beyond the range of float32 \(largest 3\.403e\+38\)"
                 r", the dtype the values are computed in: every block would code as T = 0 and "
                 r"decode to NaN\. Use a beta within it", id="encode-beta-beyond-float32"),
    pytest.param(lambda: hq.quantize(X.astype(np.float16), C.replace(beta=1e39)), ValueError,
                 r"quantize: beta = 1e\+39 is beyond the range of float32",
                 id="quantize-beta-beyond-float32"),
    pytest.param(lambda: hq.decode(Codes(WEIGHT_CODES.index, WEIGHT_CODES.tfield,
                                         C.replace(beta=1e39))), ValueError,
                 r"decode: beta = 1e\+39 is beyond the range of float32",
                 id="decode-beta-beyond-float32"),
    pytest.param(lambda: hq.encode_rows(X, C.replace(beta=1e39)), ValueError,
                 r"encode_rows: beta = 1e\+39 is beyond the range of float32",
                 id="encode_rows-beta-beyond-float32"),
    pytest.param(lambda: modq.sum_with_fallback(Codes(_codes().index, _codes().tfield,
                                                      C.replace(beta=1e39))), ValueError,
                 r"sum_with_fallback: beta = 1e\+39 is beyond the range of float32",
                 id="modq-beta-beyond-float32"),
    pytest.param(lambda: lut.dot(*[Codes(_codes().index, _codes().tfield,
                                         C.replace(beta=1e39))] * 2), ValueError,
                 r"dot: beta = 1e\+39 is beyond the range of float32", id="lut-beta-beyond-float32"),
    pytest.param(lambda: hq.matmul(np.ones((2, 16), np.float32), Codes(
        WEIGHT_CODES.index, WEIGHT_CODES.tfield, C.replace(beta=1e39))), ValueError,
                 r"matmul: beta = 1e\+39 is beyond the range of float32",
                 id="matmul-beta-beyond-float32"),
    pytest.param(lambda: wire.layout(64, C.replace(beta=1e39)), ValueError,
                 r"wire: beta = 1e\+39 is beyond the range of float32",
                 id="wire-beta-beyond-float32"),
    pytest.param(lambda: tb.encode_rows(torch.ones(2, 8), C, beta=1e39), ValueError,
                 r"torch_bridge\.encode_rows: beta = 1e\+39 is beyond the range of float32",
                 id="torch-encode_rows-beta-beyond-float32"),
    pytest.param(lambda: tb.quantize(torch.randn(3, 4) * 1e7, C), ValueError,
                 r"quantize: .*overload at max_T = 14", id="torch-quantize-beyond-max_T"),
    pytest.param(lambda: hq.encode(X, {"lattice": "D4"}), TypeError,
                 r"encode: config must be an HNLQConfig, got dict", id="encode-config-dict"),
    pytest.param(lambda: hq.quantize(C, X), TypeError,
                 r"^quantize: config must be an HNLQConfig, got ndarray", id="quantize-swapped"),
    pytest.param(lambda: hq.encode_rows(C, X), TypeError,
                 r"^encode_rows: config must be an HNLQConfig, got ndarray",
                 id="encode_rows-swapped"),
    pytest.param(lambda: hq.encode(X, C, failures="ignore"), ValueError,
                 r"encode: failures must be one of \('raise', 'mark'\), got 'ignore'",
                 id="encode-failures"),
    pytest.param(lambda: hq.encode(X, C, implementation="cuda"), ValueError,
                 r"encode: implementation must be one of \('xla', 'pallas'\) or None, got 'cuda'",
                 id="encode-implementation"),
    pytest.param(lambda: hq.encode(np.zeros((2, 3), np.float32), HNLQConfig("Z3"),
                                   implementation="pallas"), ValueError,
                 r"no Pallas kernel for Z3: d = 3 is not a power of two.*use "
                 r"implementation='xla'", id="encode-pallas-unsupported-lattice"),
    pytest.param(lambda: ops.default_implementation("bogus", C), ValueError,
                 r"default_implementation: op must be one of \('encode', 'decode', 'quantize', "
                 r"'matmul'\), got 'bogus'", id="default-implementation-op"),
    pytest.param(lambda: kernels.encode(X, C, gpu_backend="cuda"), ValueError,
                 r"gpu_backend must be one of \('triton', 'mosaic_gpu'\), got 'cuda'",
                 id="kernels-gpu-backend"),
    pytest.param(lambda: hq.to_blocks(X, 0), ValueError,
                 r"to_blocks: d must be a positive int \(the lattice dimension\), got 0",
                 id="to_blocks-d-0"),
    pytest.param(lambda: hq.from_blocks(np.zeros((2, 3, 4)), 20), ValueError,
                 r"from_blocks: n=20 does not match 3 blocks of 4", id="from_blocks-n"),
    pytest.param(lambda: hq.codebook(HNLQConfig("E8", 8, 1)), ValueError,
                 r"codebook: q\^d = 8\^8 = 16777216 entries exceeds .*decode labels directly",
                 id="codebook-too-large"),
    pytest.param(lambda: hq.calibrate_beta(X, C, criterion="psnr"), ValueError,
                 r"calibrate_beta: criterion must be 'f' or 'mse', got 'psnr'",
                 id="calibrate-criterion"),
    pytest.param(lambda: hq.gaussian_beta("D4"), TypeError,
                 r"gaussian_beta: config must be an HNLQConfig, got str", id="gaussian_beta-str"),
    pytest.param(lambda: hq.gaussian_beta(HNLQConfig("D4", 4, 1, max_T=0)), ValueError,
                 r"gaussian_beta: no beta of the paper's grid encodes all 4000 Gaussian samples "
                 r"with D4 q=4 M=1 within max_T = 0; raise max_T", id="gaussian_beta-max_T-0"),
    pytest.param(lambda: hq.gaussian_beta({"lattice": "D4"}), TypeError,
                 r"gaussian_beta: config must be an HNLQConfig, got dict",
                 id="gaussian_beta-dict"),

    pytest.param(lambda: calibrate_rows(np.asarray(_nan_linear().weight.detach()), C),
                 ValueError, r"calibrate_rows: the weight has 1 NaN or Inf entries \(the first at "
                 r"\[2, 5\]\); expected finite values", id="calibrate_rows-nan"),
    pytest.param(lambda: hq.rows.rows_codes(np.ones((4, 8), np.float32), C, np.ones(3)),
                 ValueError, r"rows_codes: beta must be a scalar \(one beta per layer\), got "
                 r"shape \(3,\)", id="rows_codes-beta-array"),
    # -- empty layers: nothing to calibrate on (an XLA gather error, a ZeroDivisionError)
    pytest.param(lambda: calibrate_rows(np.ones((3, 0), np.float32), C), ValueError,
                 r"calibrate_rows: the weight is empty \(shape \(3, 0\)\)",
                 id="calibrate_rows-empty"),
    pytest.param(lambda: tb.QLinear(0, 6, C), ValueError,
                 r"QLinear: in_features and out_features must be >= 1, got 0 and 6",
                 id="qlinear-empty"),
    pytest.param(lambda: hf.QDense(0, C).init(jax.random.key(0), np.ones((2, 8))), ValueError,
                 r"QDense \(root\): expected features >= 1 and inputs \[\.\.\., in >= 1\], got "
                 r"features=0", id="qdense-no-features"),
    pytest.param(lambda: hf.QDense(4, C).init(jax.random.key(0), np.ones((2, 0))), ValueError,
                 r"inputs of shape \(2, 0\)", id="qdense-no-inputs"),
    pytest.param(lambda: hq.calibrate_beta(X, C, scale=-1.0), ValueError,
                 r"calibrate_beta: scale must be 'rms' or a positive finite number, got -1\.0",
                 id="calibrate_beta-scale"),

    # -- codes: ranges, dtypes, another config
    pytest.param(lambda: Codes.from_labels(np.zeros((3, 2, 4), np.int32),
                                           np.full(3, 300, np.int16), C), ValueError,
                 r"from_labels: T must be in -1\.\.max_T = -1\.\.14, got values in 300\.\.300",
                 id="from_labels-T-int16-300"),
    # a row length that is not an int: refused, not truncated (int(15.7) = 15 fits the blocks)
    pytest.param(lambda: WEIGHT_CODES.with_rows(n=15.7), ValueError,
                 r"with_rows: the row length n must be an int or None, got 15\.7",
                 id="with_rows-n-float"),
    # int64 beyond int32: checked as given, not after JAX's wrap to int32 (2^32 + 3 -> 3)
    pytest.param(lambda: Codes.from_labels(np.zeros((2, 2, 4), np.int64),
                                           np.array([2**32 + 3, 0]), C), ValueError,
                 r"from_labels: T must be in -1\.\.max_T = -1\.\.14, got values in "
                 r"0\.\.4294967299", id="from_labels-T-int64-wraps"),
    pytest.param(lambda: Codes.from_labels(np.full((2, 2, 4), 2**32 + 1, np.int64),
                                           np.zeros(2, np.int64), C), ValueError,
                 r"from_labels: labels must be in 0\.\.q-1 = 0\.\.3, got values in "
                 r"4294967297\.\.4294967297", id="from_labels-label-int64-wraps"),
    pytest.param(lambda: Codes.from_labels(np.zeros((3, 2, 4), np.int32),
                                           np.full(3, 0.7, np.float32), C), TypeError,
                 r"from_labels: labels and T must be integer arrays, got int32, float32",
                 id="from_labels-T-float"),
    pytest.param(lambda: Codes.from_labels(np.full((3, 2, 4), 4, np.int32), np.zeros(3, np.int32),
                                           C), ValueError,
                 r"from_labels: labels must be in 0\.\.q-1 = 0\.\.3, got values in 4\.\.4",
                 id="from_labels-label-q"),
    pytest.param(lambda: hq.decode((np.zeros((3, 2, 4), np.int32), np.zeros(3, np.int32))),
                 TypeError, r"decode: expected hnlq_jax\.Codes, got tuple; build codes with "
                 r"hnlq_jax\.encode or hnlq_jax\.Codes\.from_labels", id="decode-labels-tuple"),
    pytest.param(lambda: hq.decode(Codes(jnp.full((3, 2), 9, jnp.uint8), VALID_T, CS)),
                 ValueError, r"decode: codebook index out of range: values up to 9 >= q\^d = 9 "
                 r"\(corrupted codes\?\)", id="decode-index-out-of-range"),
    pytest.param(lambda: hq.decode(Codes(jnp.zeros((3, 2), jnp.uint8),
                                         jnp.full((2,), 0x77, jnp.uint8), CS)), ValueError,
                 r"decode: T field holds values above max_T = 5 \(corrupted codes, or codes of a "
                 r"config with a larger max_T\?\)", id="decode-tfield-above-max_T"),
    pytest.param(lambda: hq.decode(Codes(jnp.zeros((3, 2), jnp.uint8), VALID_T, C8)), ValueError,
                 r"decode: expected index uint16\[\.\.\., M=2\] for D4 q=8, got uint8\[3, 2\]",
                 id="decode-codes-of-another-config"),
    pytest.param(lambda: hq.decode(Codes(jnp.zeros((3, 2), jnp.uint8), VALID_T, CS,
                                         scale=jnp.ones(()))), ValueError,
                 r"decode: the codes have a row scale but no row length n; make row codes with "
                 r"Codes\.with_rows", id="decode-scale-without-n"),
    pytest.param(lambda: hq.pack(Codes(jnp.zeros((3, 2), jnp.uint8), VALID_T, CS,
                                       scale=jnp.ones(()))), ValueError,
                 r"pack: the codes have a row scale but no row length n", id="pack-scale-without-n"),
    pytest.param(lambda: hq.decode(_codes(), levels=3), ValueError,
                 r"decode: levels must be an int in 1\.\.M=2, got 3", id="decode-levels"),
    pytest.param(lambda: hq.decode(_codes(), levels=True), ValueError,
                 r"decode: levels must be an int in 1\.\.M=2, got True", id="decode-levels-bool"),
    pytest.param(lambda: hq.matmul(np.zeros((2, 9), np.float32), WEIGHT_CODES),
                 ValueError, r"matmul: x must be \[\.\.\., k\] with k = 16 \(the codes' row "
                 r"length\), got shape \(2, 9\)", id="matmul-x-width"),
    pytest.param(lambda: hq.matmul(np.zeros((2, 4), np.float32), _codes()), ValueError,
                 r"matmul: the weight must be coded as n rows of length k.*got blocks \[16\]; "
                 r"see hnlq_jax\.encode_rows", id="matmul-block-codes"),
    pytest.param(lambda: lut.matmul_one_sided(_rows(10), np.ones((1, 12), np.float32)),
                 ValueError, r"matmul_one_sided: x has shape \(1, 12\); its last axis must be the "
                 r"codes' row length n = 10", id="lut-matmul-one-sided-row-length"),
    pytest.param(lambda: lut.dot_one_sided(_rows(10), np.ones((3, 12), np.float32)),
                 ValueError, r"dot_one_sided: y has shape \(3, 12\); .* n = 10",
                 id="lut-dot-one-sided-row-length"),
    pytest.param(lambda: lut.dot(_rows(10), _rows(11)), ValueError,
                 r"dot: the row codes have different row lengths n = 10 and 11",
                 id="lut-dot-row-lengths"),
    pytest.param(lambda: lut.one_sided(np.float32(1.0), C), ValueError,
                 r"one_sided: expected y \[\.\.\., k\], got a scalar", id="lut-one-sided-scalar"),
    pytest.param(lambda: lut.dot(_codes(), Codes(_codes().index, _codes().tfield,
                                                C.replace(beta=0.7))), ValueError,
                 r"dot: the two codes were made with different configs: HNLQConfig\(.*beta=0\.5"
                 r".* and HNLQConfig\(.*beta=0\.7", id="lut-dot-configs"),
    pytest.param(lambda: modq.accumulate(Codes(_codes().index, _codes().tfield,
                                               C.replace(dither=(0.1, 0.0, 0.0, 0.0))), axis=0),
                 ValueError, r"accumulate: mod-q sums need a config without dither",
                 id="modq-dither"),
    pytest.param(lambda: modq.accumulate(_codes(), True), ValueError,
                 r"accumulate: axis must be an int indexing the leading \(block\) axes of shape "
                 r"\(16,\), got True", id="modq-axis-bool"),
    pytest.param(lambda: modq.validate(_codes(), np.int64(1)), ValueError,
                 r"validate: axis must be an int indexing the leading \(block\) axes of shape "
                 r"\(16,\), got np\.int64\(1\)", id="modq-axis-numpy-out-of-range"),
    pytest.param(lambda: kernels.modq_sum(Codes(jnp.zeros((0, 3, 2), jnp.uint8),
                                                jnp.zeros((0, 2), jnp.uint8), C)), ValueError,
                 r"modq_sum: the summed axis 0 of the codes \(blocks \(0, 3\)\) is empty; a "
                 r"mod-q sum needs at least one summand", id="modq_sum-empty-axis"),

    # -- packed data: bytes and in-memory Packed
    pytest.param(lambda: jax.jit(hq.pack)(_codes()), TypeError,
                 r"pack: sizes its output from the data, so it runs outside jit; .*use "
                 r"hnlq_jax\.wire", id="pack-under-jit"),
    pytest.param(lambda: hq.decode(_packed()), TypeError,
                 r"decode: expected hnlq_jax\.Codes, got hnlq_jax\.Packed; unpack packed data first: "
                 r"hnlq_jax\.unpack\(packed\)", id="packed-decoded-without-unpack"),
    pytest.param(lambda: hq.unpack(_bytes()), TypeError,
                 r"unpack: expected hnlq_jax\.Packed, got bytes; read bytes with "
                 r"hnlq_jax\.Packed\.from_bytes\(buf\) first", id="packed-bytes-unpacked"),
    pytest.param(lambda: Packed.from_bytes(b"PK\x03\x04" + _bytes()[4:]), ValueError,
                 r"from_bytes: not HNLQ packed data \(bad magic bytes\)", id="bytes-magic"),
    pytest.param(lambda: Packed.from_bytes(_bytes()[:-7]), ValueError,
                 r"from_bytes: corrupted or truncated data \(CRC-32 mismatch\)",
                 id="bytes-cut"),
    pytest.param(lambda: Packed.from_bytes(_bytes()[:10]), ValueError,
                 r"from_bytes: truncated data \(10 bytes", id="bytes-cut-in-header"),
    pytest.param(lambda: Packed.from_bytes(_bytes()[:5]), ValueError,
                 r"from_bytes: truncated data \(5 bytes", id="bytes-cut-in-magic"),
    pytest.param(lambda: Packed.from_bytes(b""), ValueError,
                 r"from_bytes: truncated data \(0 bytes", id="bytes-empty"),
    pytest.param(lambda: Packed.from_bytes(_flipped(-9)), ValueError,
                 r"from_bytes: corrupted or truncated data \(CRC-32 mismatch\)",
                 id="bytes-flipped"),
    pytest.param(lambda: Packed.from_bytes(_bytes(), C8), ValueError,
                 r"from_bytes: the data was made with HNLQConfig\(lattice='D4', q=4.*, not "
                 r"HNLQConfig\(lattice='D4', q=8", id="bytes-another-config"),
    pytest.param(lambda: Packed.from_bytes(_resigned(lambda h: h.update(version=99))), ValueError,
                 r"from_bytes: the data is in format version 99, this hnlq_jax reads version 1; "
                 r"decode it with the version that wrote it", id="bytes-another-version"),
    pytest.param(lambda: Packed.from_bytes(_resigned(lambda h: h.pop("sizes"))), ValueError,
                 r"from_bytes: .*header", id="bytes-header-without-sizes"),
    pytest.param(lambda: Packed.from_bytes(_resigned(lambda h: h.update(scale=["<i4", [4]]),
                                                     _row_bytes())), ValueError,
                 r"from_bytes: .*'scale' dtype must be a floating NumPy dtype string \(e\.g\. "
                 r"'<f4'\) or 'bfloat16', got '<i4'", id="bytes-scale-int"),
    pytest.param(lambda: Packed.from_bytes(_resigned(lambda h: h.update(scale=["int8", [4]]),
                                                     _row_bytes())), ValueError,
                 r"'scale' dtype must be .* got 'int8'", id="bytes-scale-int-by-name"),
    pytest.param(lambda: Packed.from_bytes(_resigned(lambda h: h.update(scale=["|V4", [4]]),
                                                     _row_bytes())), ValueError,
                 r"'scale' dtype must be .* got '\|V4'", id="bytes-scale-void"),
    pytest.param(lambda: hq.unpack(Packed.from_bytes(_resigned(
        lambda h: h.update(scale=["<f4", [2, 2]]), _row_bytes()))), ValueError,
                 r"^unpack: scale must be a real array of shape \(4,\), got float32\[2, 2\]",
                 id="unpack-scale-shape"),
    pytest.param(lambda: Packed.from_bytes("codes.bin"), TypeError,
                 r"from_bytes: .*bytes.*got str", id="bytes-given-a-path"),
    # a shape whose size overflows int64, or disagrees with the label bytes, fails in from_bytes
    # (it used to reach unpack: OverflowError, a reshape TypeError, a negative block count)
    pytest.param(lambda: Packed.from_bytes(_resigned(lambda h: h.update(blocks_shape=[2**64]))),
                 ValueError, r"from_bytes: .*header: blocks_shape \[18446744073709551616\] does "
                 r"not match its 32 bytes of labels for D4 q=4 M=2", id="bytes-shape-overflow"),
    pytest.param(lambda: Packed.from_bytes(_resigned(lambda h: h.update(blocks_shape=[17]))),
                 ValueError, r"from_bytes: .*header: blocks_shape \[17\] does not match",
                 id="bytes-shape-one-block-more"),
    pytest.param(lambda: Packed.from_bytes(_renested()), ValueError,
                 r"from_bytes: not a valid hnlq_jax packed header: not JSON \(RecursionError\)",
                 id="bytes-header-nested-too-deep"),
    pytest.param(lambda: Packed.from_bytes(_bytes(), {"lattice": "D4"}), TypeError,
                 r"Packed\.from_bytes: config must be an HNLQConfig, got dict",
                 id="bytes-config-dict"),
    pytest.param(lambda: hq.unpack(_packed_with(version=0)), ValueError,
                 r"unpack: the data is in format version 0, this hnlq_jax reads version 1",
                 id="unpack-another-version"),
    pytest.param(lambda: hq.unpack(_packed_with(config=C8)), ValueError,
                 r"unpack: expected labels uint8\[48\] for 16 blocks of D4 q=8 M=2, got "
                 r"uint8\[32\] \(truncated or another config\?\)", id="unpack-another-config"),
    pytest.param(lambda: hq.unpack(_packed_cs(tcode=[0], rice=[0])), ValueError,
                 r"unpack: corrupted T stream \(its runs do not end at the last block",
                 id="unpack-T-stream-corrupted"),
    # zero padding decoded "successfully" and the decoder allocated per bit (2 GB for 16 MiB)
    pytest.param(lambda: hq.unpack(_packed_with(tcode=jnp.zeros(1 << 20, jnp.uint8))),
                 ValueError, r"unpack: a T stream of 1048576 bytes is longer than any of 16 "
                 r"blocks in \d+ planes \(at most \d+\): corrupted or padded data",
                 id="unpack-T-stream-padded"),
    pytest.param(lambda: hq.unpack(_packed_cs(labels=[0xFF] * 13)), ValueError,
                 r"unpack: corrupted label bitstream: 16 block\(s\) hold a chunk above the "
                 r"largest value for q=3", id="unpack-label-chunk-corrupted"),
    pytest.param(lambda: hq.unpack(_packed_cs(labels=[0] * 11 + [0xFF] * 2)), ValueError,
                 r"unpack: corrupted label bitstream: .*for q=3",
                 id="unpack-last-label-chunk-corrupted"),
    pytest.param(lambda: hq.unpack(_packed_with(rice=jnp.zeros(20, jnp.uint8))), ValueError,
                 r"unpack: 20 T planes for max_T = 14 \(at most 15\): corrupted data or another "
                 r"config", id="unpack-too-many-planes"),
    pytest.param(lambda: hq.unpack(_codes()), TypeError,
                 r"unpack: expected hnlq_jax\.Packed, got Codes", id="unpack-codes"),

    # -- the wire format and the collectives
    pytest.param(lambda: wire.layout(64, C, chunk=12), ValueError,
                 r"wire: chunk must be a positive multiple of 8 blocks, got 12", id="wire-chunk"),
    pytest.param(lambda: wire.layout(64, C, parts=0), ValueError,
                 r"wire: parts must be an int >= 1, got 0", id="wire-parts"),
    pytest.param(lambda: wire.layout(-5, C), ValueError, r"wire: size must be .*got -5",
                 id="wire-negative-size"),
    pytest.param(lambda: wire.encode(jnp.zeros(100, jnp.float32), wire.layout(64, C)), ValueError,
                 r"wire.*64 values.*got .*100", id="wire-encode-size"),
    pytest.param(lambda: wire.encode(jnp.arange(64), wire.layout(64, C)), TypeError,
                 r"wire\.encode: expected floating-point values, got dtype int32",
                 id="wire-encode-int"),
    pytest.param(lambda: wire.decode(jnp.zeros((1, 46), jnp.uint8), (1, 2, 3)), TypeError,
                 r"wire\.decode: expected a wire\.Layout \(from wire\.layout\(size, config, "
                 r"parts\)\), got tuple", id="wire-decode-not-a-layout"),
    pytest.param(lambda: wire.layout(64, C, t_capacity=float("inf")), ValueError,
                 r"wire: t_capacity must be a positive number of bits per block, got inf",
                 id="wire-layout-infinite-t-capacity"),
    pytest.param(lambda: wire.decode(jnp.zeros((1, 46), jnp.uint8), wire.layout(64, C8)),
                 ValueError, r"wire.*payload.*\[1, 54\].*got .*\[1, 46\]",
                 id="wire-decode-payload-of-another-layout"),
    pytest.param(lambda: dist.compressed_mean(jnp.arange(8), "i", C), TypeError,
                 r"compressed_mean: x must be floating, got int32", id="compressed_mean-int"),
    pytest.param(lambda: dist.wire_bytes(np.zeros(10), C, 2, method="ring"), ValueError,
                 r"wire_bytes: method must be one of \('all_gather', 'reduce_scatter'\), got "
                 r"'ring'", id="wire_bytes-method"),

    # -- Flax: QDense and its saved inference form
    pytest.param(lambda: hf.quantize_params(_nan_kernel_variables(), C), ValueError,
                 r"quantize_params: layer 'Dense_0': the kernel has 1 NaN or Inf "
                 r"entries \(the first at \[5, 2\]\)", id="flax-quantize-nan-kernel"),
    pytest.param(lambda: hf.quantize_params(_nan_kernel_variables()["params"], C), ValueError,
                 r"quantize_params: expected the float model's variables \{'params': \.\.\.\}, got "
                 r"a dict without 'params' \(keys \['Dense_0'\]; pass the whole variables of "
                 r"model\.init, not variables\['params'\]\)", id="flax-quantize-params-only"),
    pytest.param(lambda: hf.quantize_params([], C), ValueError,
                 r"quantize_params: expected the float model's variables \{'params': \.\.\.\}, got "
                 r"list", id="flax-quantize-list"),
    pytest.param(lambda: hf.quantize_params(_nan_kernel_variables(), C, act_order=True,
                                            t_budget=0.1), ValueError,
                 r"quantize_params: act_order, t_budget apply only to compensated rounding, and "
                 r"no calibration was given: pass calibration=run", id="flax-quantize-rtn-options"),
    pytest.param(lambda: hf.import_params(_flax()[2], HNLQConfig("Z4", 4, 2)), ValueError,
                 r"import_params: layer \(root\): the codes were " + OTHER_CONFIG.format("Z4", 4)
                 + r".*load them into a model of their config", id="flax-import-another-config"),
    pytest.param(lambda: hf.import_params(_saved_codes(format_version=0), C), ValueError,
                 r"import_params: .*saved in format version 0; this version of hnlq_jax reads "
                 r"format version 1: quantize again", id="flax-import-another-version"),
    pytest.param(lambda: hf.import_params(_saved_codes(tfield=_saved_tfield(np.float32)), C),
                 ValueError, r"import_params: .*expected a uint8 T field of shape \[4, 1\].*got "
                 r"float32\[4, 1\]", id="flax-import-T-float"),
    pytest.param(lambda: hf.import_params(_saved_codes(config={"q": 1}), C), ValueError,
                 r"import_params: .*the saved config .* is not valid: HNLQConfig\.q must be in",
                 id="flax-import-invalid-saved-config"),
    pytest.param(lambda: hf.import_params({"params": {}}, C), ValueError,
                 r"import_params: expected variables with a 'hnlq' collection \(from QDense\.init "
                 r"or export_params\)", id="flax-import-no-codes"),
    pytest.param(_restore_into_q8, ValueError,
                 r"restoring \./hnlq/codes: the codes were " + OTHER_CONFIG.format("D4", 8),
                 id="flax-restore-another-config"),
    pytest.param(lambda: hf.QDense(4, config=C8, calibrate=False).apply(_flax()[1],
                                                                        jnp.ones((2, 8))),
                 ValueError, r"the layer's codes were made with HNLQConfig\(lattice='D4', q=4.*"
                 r"configured with HNLQConfig\(lattice='D4', q=8.*re-export the model",
                 id="flax-apply-another-config"),
    pytest.param(lambda: hf.QDense(4, config=C8, calibrate=False).apply(_flax()[1],
                                                                        jnp.ones((2, 8))),
                 ValueError, r"^QDense \(root\): the layer's codes", id="flax-apply-root-name"),
    pytest.param(lambda: hf.export_params(_flax()[1], C8), ValueError,
                 r"^export_params: layer \(root\): the layer's codes were made with",
                 id="flax-export-another-config"),
    pytest.param(lambda: hf.export_params(_nan_qdense_variables(), C), ValueError,
                 r"^export_params: layer \(root\): the kernel \[in, out\] has 1 NaN or Inf "
                 r"entries \(the first at \[3, 1\]\)", id="flax-export-nan-kernel"),
    # eager, as encode_rows: its codes decoded to NaN outputs without an error
    pytest.param(lambda: hf.export_params(_drifted_qdense_variables(), C), ValueError,
                 r"^export_params: layer \(root\): \d+ block\(s\) still overload at max_T = 14 "
                 r"\(the first at block \[0, 0\]\)", id="flax-export-kernel-beyond-beta"),
    pytest.param(lambda: hf.refresh_codes(_nan_qdense_variables(), C), ValueError,
                 r"^refresh_codes: layer \(root\): the kernel \[in, out\] has 1 NaN",
                 id="flax-refresh-nan-kernel"),
    pytest.param(lambda: _flax()[0].apply({"params": _flax()[1]["params"]}, jnp.ones((2, 8)),
                                          deterministic=True), ValueError,
                 r"QDense \(root\): params/kernel but no hnlq/beta and codes \(a float Dense "
                 r"checkpoint\?\): quantize it with one training call, model\.apply\(variables, "
                 r"x, mutable=\['hnlq'\]\)", id="flax-dense-checkpoint-without-codes"),
    pytest.param(lambda: _flax()[0].apply(hf.import_params(_flax()[2], C), jnp.ones((2, 12))),
                 ValueError, r"QDense \S+: expected inputs \[\.\.\., 8\] \(the layer's codes hold a "
                 r"\[4, 8\] kernel\^T\), got shape \(2, 12\)", id="flax-inference-input-width"),
    pytest.param(lambda: hf.QDense(4, config=C, ste="sign").init(jax.random.PRNGKey(0),
                                                                 jnp.ones((1, 8))),
                 ValueError, r"QDense: ste must be one of \('identity', 'clipped'\), got 'sign'",
                 id="flax-ste"),

    # -- PyTorch: front doors and layers
    pytest.param(lambda: tb.QLinear.from_linear(_nan_linear(), C), ValueError,
                 r"QLinear\.from_linear: the weight has 1 NaN or Inf entries \(the first at "
                 r"\[2, 5\]\); expected finite values", id="qlinear-from-nan-weight"),
    pytest.param(lambda: tb.quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 8),
                                                               _nan_linear()), C), ValueError,
                 r"quantize_model: layer '1': QuantizedLinear\.from_linear: the weight has 1 NaN "
                 r"or Inf entries \(the first at \[2, 5\]\)", id="quantize_model-nan-weight"),
    pytest.param(lambda: tb.quantize_model(
        torch.nn.Sequential(torch.nn.Linear(8, 4)), C,
        calibration=lambda m: m(torch.full((3, 8), float("nan")))), ValueError,
                 r"quantize_model: layer '0': gptq_rows: H has 64 NaN or Inf entries: the layer's "
                 r"calibration inputs have NaN or Inf", id="quantize_model-nan-calibration"),
    pytest.param(lambda: tb.quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 4)), C,
                                           criterion="f"), ValueError,
                 r"quantize_model: criterion applies only to compensated rounding, and no "
                 r"calibration was given: pass calibration=run, or leave it at the default",
                 id="quantize_model-rtn-options"),
    pytest.param(lambda: tb.encode(np.zeros((3, 4), np.float32), C), TypeError,
                 r"torch_bridge\.encode: expected a torch\.Tensor, got ndarray \(for NumPy or JAX "
                 r"arrays use the hnlq_jax function of the same name\)", id="torch-encode-numpy"),
    pytest.param(lambda: tb.HNLQHookState("D4"), TypeError,
                 r"HNLQHookState: config must be an HNLQConfig, got str", id="torch-hook-config"),
    pytest.param(lambda: tb.encode(torch.zeros(3, 4, dtype=torch.int64), C), TypeError,
                 r"encode: expected a floating-point array, got dtype int64",
                 id="torch-encode-int64"),
    pytest.param(lambda: tb.encode(torch.zeros(3, 5), C), ValueError,
                 r"encode: the last axis .* must have size d=4 for D4, got shape \(3, 5\)",
                 id="torch-encode-last-axis"),
    pytest.param(lambda: tb.encode(torch.zeros(3, 4, dtype=torch.complex64), C), TypeError,
                 r"to_jax: unsupported dtype torch\.complex64; supported: torch\.float64",
                 id="torch-encode-complex"),
    pytest.param(lambda: tb.decode(_codes()), TypeError,
                 r"torch_bridge\.decode: expected torch_bridge\.Codes, got Codes \(convert with "
                 r"torch_bridge\.Codes\.from_jax\)", id="torch-decode-jax-codes"),
    pytest.param(lambda: hq.decode(tb.encode(torch.zeros(3, 4), C)), TypeError,
                 r"^decode: expected hnlq_jax\.Codes, got torch_bridge\.Codes; convert them with "
                 r"codes\.to_jax\(\)", id="jax-decode-torch-codes"),
    pytest.param(lambda: tb.QLinear(8, 4, C, implementation="lut"), ValueError,
                 r"QLinear: implementation must be None or one of \('xla', 'pallas'\) \(the "
                 r"layer encodes, decodes and multiplies with it\), got 'lut'",
                 id="qlinear-lut-implementation"),
    pytest.param(lambda: tb.to_jax(torch.zeros(2, dtype=torch.float64)), TypeError,
                 r"to_jax: a torch\.float64 tensor becomes a 64-bit JAX array only in JAX's x64 "
                 r"mode.*torch_bridge\.x64_for", id="torch-to_jax-float64"),
    pytest.param(lambda: tb.encode_rows(np.zeros((2, 8), np.float32), C), TypeError,
                 r"torch_bridge\.encode_rows: expected a torch\.Tensor, got ndarray",
                 id="torch-encode_rows-numpy"),
    pytest.param(lambda: _empty_qlinear(config=C8).load_state_dict(_qlinear_state()), ValueError,
                 r"QLinear \(root\): the codes were " + OTHER_CONFIG.format("D4", 8)
                 + r".*build the layer with the saved config", id="qlinear-load-q4-into-q8"),
    pytest.param(lambda: _empty_qlinear().load_state_dict(_qlinear_state_with(version=0)),
                 ValueError, r"QLinear \(root\): the codes were saved in format version 0; "
                 r"this version of hnlq_jax reads format version 1",
                 id="qlinear-load-another-version"),
    pytest.param(lambda: _empty_qlinear().load_state_dict(_qlinear_state_with(version="1")),
                 ValueError, r"QLinear \(root\): the codes were saved in format version '1'; ",
                 id="qlinear-load-version-string"),
    pytest.param(lambda: _empty_qlinear().load_state_dict(_qlinear_state_with(version=1.0)),
                 ValueError, r"QLinear \(root\): the codes were saved in format version 1\.0; ",
                 id="qlinear-load-version-float"),
    pytest.param(lambda: _empty_qlinear().load_state_dict(_qlinear_state_without("max_T")),
                 ValueError, r"QLinear \(root\): the saved config .* lacks the field\(s\) "
                 r"\['max_T'\] \(truncated or edited by hand\?\)",
                 id="qlinear-load-config-field-missing"),
    pytest.param(lambda: _empty_qlinear().load_state_dict(_unversioned_state(), strict=False),
                 ValueError, r"QLinear \(root\): the state dict holds codes in the earlier "
                 r"unversioned format \(labels, T\).*quantize the float model again",
                 id="qlinear-load-unversioned"),
    pytest.param(_load_corrupted_qlinear, ValueError,
                 r"T field holds values above max_T = 5 \(corrupted codes",
                 id="qlinear-load-corrupted-tfield"),
    pytest.param(lambda: _empty_qlinear(in_features=12).load_state_dict(_qlinear_state()),
                 ValueError, r"QLinear \(root\): the codes were saved from a weight with "
                 r"in_features = 8, the layer has in_features = 12; build the layer with the "
                 r"saved shape", id="qlinear-load-another-shape"),
    pytest.param(lambda: _empty_qlinear()(torch.zeros(2, 7)), ValueError,
                 r"QLinear: expected input \[\.\.\., 8\], got \(2, 7\)", id="qlinear-input-width"),
    pytest.param(lambda: _empty_qlinear().set_codes(tb.Codes(
        torch.zeros(4, 2, 2, dtype=torch.uint16), torch.zeros(4, 1, dtype=torch.uint8),
        unit(C8), torch.ones(4), 8)), ValueError,
                 r"QLinear\.set_codes: the codes were made with HNLQConfig\(lattice='D4', q=8.*"
                 r"the layer holds codes of HNLQConfig\(lattice='D4', q=4",
                 id="qlinear-set-codes-another-config"),
    pytest.param(lambda: tb.QLinear(8, 4, C, ste="sign", quantize_weights=False), ValueError,
                 r"QLinear: ste must be one of \('identity', 'clipped'\), got 'sign'",
                 id="qlinear-ste"),
    pytest.param(lambda: tb.HNLQHookState(C, method="ring"), ValueError,
                 r"HNLQHookState: method must be one of \('all_gather', 'reduce_scatter'\), got "
                 r"'ring'", id="ddp-hook-method"),

    # -- the command line (argparse exits with status 2 and the message on stderr)
    pytest.param(lambda: _cli("--lattice", "X9", "--n", "10"), SystemExit,
                 r"^exit 2: .*error: unknown lattice 'X9': expected 'Z2'", id="cli-lattice"),
    pytest.param(lambda: _cli("--n", "0"), SystemExit,
                 r"^exit 2: .*error: argument --n: expected a whole number >= 1, got '0'",
                 id="cli-n-0"),
    pytest.param(lambda: _cli("rd", "--json", "{tmp}/nodir/x.json", "--lattices", "X9"),
                 SystemExit, r"^exit 2: .*error: argument --json: folder '.*/nodir' does not "
                 r"exist", id="cli-json-folder-missing"),
    pytest.param(lambda: _cli("rd", "--json", "{tmp}/exists.json", "--lattices", "X9"),
                 SystemExit, r"^exit 2: .*error: argument --json: '.*/exists\.json' exists; pass "
                 r"--force to overwrite it", id="cli-json-exists"),
    pytest.param(lambda: _cli("bogus", "--n", "10"), SystemExit,
                 r"^exit 2: usage: python -m hnlq_jax \[-h\] \{demo,rd,info\}.*error: unknown "
                 r"command 'bogus': choose from demo, rd, info", id="cli-unknown-command"),
    pytest.param(lambda: _cli("rd", "--plot", "{tmp}/f.txt", "--lattices", "X9"), SystemExit,
                 r"^exit 2: .*error: argument --plot: '.*/f\.txt': expected a file name ending "
                 r"in \.png or \.pdf or \.svg", id="cli-plot-format"),
]

# The table only grows: a row that no longer applies is changed, not dropped.
MIN_CASES = 90


@pytest.mark.parametrize("call, error, match", CASES)
def test_bad_input_raises_a_clear_error(call, error, match):
    with pytest.raises(error, match=re.compile(match, re.S)):
        call()


def test_table_only_grows():
    ids = [p.id for p in CASES]
    assert len(ids) == len(set(ids)), "duplicate ids in CASES"
    assert len(CASES) >= MIN_CASES, "rows were removed from CASES; change a row, don't drop it"


def test_every_case_has_a_specific_message():
    """Each row checks its message, not only the exception type."""
    for p in CASES:
        call, error, match = p.values
        assert callable(call) and issubclass(error, BaseException) and len(match) >= 20, p.id

"""Command line: ``python -m hnlq_jax [demo|rd|info] ...``.

* ``demo`` (the default): quantizes iid Gaussian data at a calibrated beta and prints rate,
  MSE, distance to the Gaussian bound, overload rate and throughput.
* ``rd``: the paper's rate-distortion table (beta grid search, f in dB above D(R)) for chosen
  lattices, q and M; ``--plot`` saves f versus R, ``--json`` the table.
* ``info``: versions, backend, devices and the lattices.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import hnlq_jax as hq
from hnlq_jax import rd
from hnlq_jax.lattices import LATTICE_NAMES
from hnlq_jax.timing import best_time


def demo(args) -> dict:
    """Runs the demo and returns its figures (also printed)."""
    cfg = hq.HNLQConfig(args.lattice, args.q, args.M)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    beta, table = hq.calibrate_beta(rng.standard_normal((4000, cfg.d)), cfg)
    cfg = cfg.replace(beta=beta)
    t_cal = time.perf_counter() - t0
    x = jnp.asarray(rng.standard_normal((args.n, cfg.d)), jnp.float32)
    enc = jax.jit(hq.encode, static_argnums=1)
    dec = jax.jit(hq.decode)
    codes = enc(x, cfg)
    xhat = dec(codes)
    stats = hq.rate_stats(codes)
    mse = float(jnp.mean((x - xhat) ** 2))
    rate = float(stats.rate)
    t_enc = best_time(enc, x, cfg)
    t_dec = best_time(dec, codes)
    packed = hq.pack(codes)
    out = {
        "config": f"{cfg.lattice} q={cfg.q} M={cfg.M} alpha={cfg.alpha:.4g} max_T={cfg.max_T}",
        "beta": beta,
        "n_vectors": args.n,
        "rate_nominal": cfg.rate,
        "H_T": float(stats.entropy_T),
        "rate": rate,
        "mse_per_dim": mse,
        "dB_above_D(R)": 10 * math.log10(mse * 2 ** (2 * rate)),
        "overload_rate": float(stats.overload_rate),
        "failure_rate": float(stats.failure_rate),
        "encode_vec_per_s": args.n / t_enc,
        "decode_vec_per_s": args.n / t_dec,
        "codes_bytes": codes.nbytes,
        "packed_bytes": packed.nbytes,
        "float32_bytes": int(x.nbytes),
        "calibration_s": t_cal,
    }
    print(f"HNLQ demo: {out['config']}, {args.n:,} iid N(0,1) vectors of dim {cfg.d} "
          f"on {jax.default_backend()}")
    print(f"  beta (grid search, 4000 samples, {t_cal:.1f} s): {beta:.4f}")
    print(f"  rate: {rate:.3f} bits/dim = {cfg.rate:g} (labels) + H(T)/d = "
          f"{float(stats.entropy_T):.3f}/{cfg.d}")
    print(f"  MSE/dim: {mse:.4e}   {out['dB_above_D(R)']:.2f} dB above D(R) = 2^-2R")
    print(f"  overload: {100 * out['overload_rate']:.2f} % of blocks rescaled (T > 0), "
          f"{100 * out['failure_rate']:.2f} % failed")
    print(f"  throughput: encode {out['encode_vec_per_s']:.3g} vec/s, decode "
          f"{out['decode_vec_per_s']:.3g} vec/s")
    n_val = args.n * cfg.d
    print(f"  size: {out['codes_bytes']:,} bytes as Codes ({8 * out['codes_bytes'] / n_val:.2f} "
          f"bits/value), {out['packed_bytes']:,} packed ({8 * out['packed_bytes'] / n_val:.2f}); "
          f"float32 {out['float32_bytes']:,}, bf16 {out['float32_bytes'] // 2:,}")
    return out


def rate_distortion(args) -> list:
    """Runs and prints the rate-distortion table; saves the plot and JSON when asked."""
    shown = []

    def row(p):  # the header with the first row: an invalid option is refused before either
        if not shown:
            print(f"beta grid search on {args.n} iid N(0,1) vectors (seed {args.seed}), "
                  "float64; each row prints when its config is done (the first ones compile)")
            print(rd.format_table([]))
            shown.append(True)
        print(rd.format_table([p]).split("\n")[1], flush=True)

    points = rd.rate_distortion(args.lattices, args.q, args.M, n=args.n, seed=args.seed,
                                voronoi=not args.no_voronoi, callback=row)
    if args.json:
        _write_atomic(args.json, lambda t: t.write_text(json.dumps([p._asdict() for p in points],
                                                                  indent=1)))
        print(f"table written to {args.json}")
    if args.plot:
        _write_atomic(args.plot, lambda t: rd.plot(points, str(t)))
        print(f"plot written to {args.plot}")
    return points


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info(args) -> None:
    print(f"hnlq_jax {hq.__version__}")
    print(f"python {platform.python_version()} ({sys.platform})")
    for pkg in ("jax", "jaxlib", "numpy", "flax", "optax", "torch"):
        print(f"{pkg:8s} {_version(pkg)}")
    print(f"backend  {jax.default_backend()}")
    print(f"devices  {', '.join(str(d) for d in jax.devices())}")
    print(f"x64      {bool(jax.config.jax_enable_x64)}")
    native = hq.kernels.cpu
    print("paths (implementation=): xla (always); pallas (GPU; interpret mode on a CPU); lut; "
          "native: " + (f"built ({native.isa()})" if native.available()
                        else native.why_unavailable()))
    mosaic = hq.kernels.mosaic_gpu
    print("GPU kernels of pallas: Triton; Mosaic GPU gemv and decode_matmul: " + (
        "available (taken where the tuning table names it)" if mosaic.available()
        else mosaic.unsupported(hq.HNLQConfig("D4", 4, 2))))
    d4 = hq.HNLQConfig("D4", 4, 2)
    print("implementation=None on this backend (D4 q=4 M=2): matmul "
          f"{hq.ops.default_implementation('matmul', d4)}, decode "
          f"{hq.ops.default_implementation('decode', d4)}; rotation (n=384) "
          f"{hq.incoherence.default_implementation(384, np.float32, jax.default_backend())}")
    print("lattices (also Z{n}, D{n} for n >= 2):")
    print(f"  {'name':5s} {'d':>2s} {'r_cov':>7s} {'sigma^2':>9s} {'G(L)':>9s}")
    for name in LATTICE_NAMES:
        lat = hq.lattice(name)
        vol = abs(np.linalg.det(lat.G))
        nsm = lat.second_moment / vol ** (2 / lat.d)
        print(f"  {name:5s} {lat.d:2d} {lat.covering_radius:7.4f} {lat.second_moment:9.6f} "
              f"{nsm:9.6f}")


# Counts index int32 arrays (and 2^31 vectors would not fit a CPU's memory anyway).
MAX_COUNT = 2**31 - 1


def _count(text: str) -> int:
    """A positive count written as an int or in float notation (``1e6``)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 1000 or 1e6, got {text!r}")
    if not (math.isfinite(v) and v >= 1 and v == int(v)):
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    if v > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_COUNT:.3g} (2^31 - 1), got "
                                         f"{text!r}")
    return int(v)


def _output(force: bool, suffixes: tuple = ()):
    """An argparse type for an output file: its folder must exist, its suffix be one of
    ``suffixes`` (any when empty); an existing file needs ``--force`` (checked before any
    work)."""
    def check(text: str) -> pathlib.Path:
        path = pathlib.Path(text)
        if suffixes and path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a file name ending in {' or '.join(suffixes)}")
        if not path.parent.is_dir():
            raise argparse.ArgumentTypeError(f"folder {str(path.parent)!r} does not exist")
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file")
        if path.exists() and not force:
            raise argparse.ArgumentTypeError(f"{text!r} exists; pass --force to overwrite it")
        return path
    return check


def _write_atomic(path: pathlib.Path, write) -> None:
    """``write(tmp_path)`` then an atomic rename onto ``path`` (no half-written file)."""
    tmp = path.with_name(f".tmp-{path.name}")  # keeps the suffix (matplotlib reads it)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # (gone after the rename; a failed write leaves none)


COMMANDS = ("demo", "rd", "info")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    unknown = argv[0] if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS \
        else None
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["demo"] + argv  # demo is the default command, options included
    force = "--force" in argv
    parser = argparse.ArgumentParser(prog="python -m hnlq_jax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    commands = {}
    p = commands["demo"] = sub.add_parser("demo", help="quantize Gaussian data and report "
                                                       "(default)")
    p.add_argument("--lattice", default="D4", help="Z2, A2, D4, E8, Z{n} or D{n} (default D4)")
    p.add_argument("--q", type=int, default=4, help="nesting ratio (default 4)")
    p.add_argument("--M", type=int, default=2, help="levels (default 2)")
    p.add_argument("--n", type=_count, default=1_000_000, help="vectors to quantize (default 1e6)")
    p.add_argument("--seed", type=int, default=0, help="the Gaussian data's seed (default 0)")
    p = commands["rd"] = sub.add_parser("rd", help="the paper's rate-distortion table")
    p.add_argument("--lattices", nargs="+", default=["Z2", "A2", "D4", "E8"],
                   help="lattices of the table (default Z2 A2 D4 E8)")
    p.add_argument("--q", nargs="+", type=int, default=[3, 4, 8],
                   help="nesting ratios (default 3 4 8)")
    p.add_argument("--M", nargs="+", type=int, default=[1, 2, 3], help="levels (default 1 2 3)")
    p.add_argument("--n", type=_count, default=4000, help="sample size (default 4000)")
    p.add_argument("--seed", type=int, default=0, help="the Gaussian sample's seed (default 0)")
    p.add_argument("--no-voronoi", action="store_true", help="skip the q^2 Voronoi codes")
    p.add_argument("--plot", type=_output(force, (".png", ".pdf", ".svg")),
                   help="save f versus R to this image (.png, .pdf or .svg)")
    p.add_argument("--json", type=_output(force), help="save the table to this JSON file")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    sub.add_parser("info", help="versions, backend, devices, lattices")
    if unknown is not None:
        parser.error(f"unknown command {unknown!r}: choose from {', '.join(COMMANDS)} "
                     "(demo, the default, when the first argument is an option)")
    args = parser.parse_args(argv)
    if args.command == "info":
        info(args)
        return 0
    try:  # a bad config or size is reported as a usage error of its command
        (demo if args.command == "demo" else rate_distortion)(args)
    except (ValueError, TypeError) as e:
        commands[args.command].error(str(e))
    except MemoryError:
        commands[args.command].error(f"not enough memory for --n {args.n}: try a smaller --n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The kernels on a real GPU, timed on the device: a tile sweep, the product table, the tests.

One run of this script is what a GPU lease is spent on (``--budget`` seconds; every part
checks the clock and the results are written after each, so a run cut off keeps what it
measured):

1. **ceilings**: a device-to-device copy (bytes read + written) and a bfloat16 GEMV at
   8192^2, against the device's HBM peak: the GEMV row must read 70-90 % before any ratio
   against it means anything.
2. **tests_mosaic**: ``tests/test_kernels_mosaic_gpu.py`` (those of ``--tests``) natively,
   in a process of their own, at most ``TESTS_LIMIT`` seconds (``--quick``:
   ``QUICK_TESTS_LIMIT``): the Mosaic GPU kernels against XLA on the GPU. Before the sweep,
   so that a kernel that faults (an illegal address breaks the whole process's CUDA context)
   or hangs is found there: the sweep then leaves the Mosaic GPU kernels out
   (:func:`device_fault`).
3. **sweep**: the launch parameters (rows and blocks per program, warps, stages, split-K
   waves) of ``kernels.gemv`` (Triton) and ``kernels.mosaic_gpu.gemv`` (Mosaic GPU, the
   codebooks it holds: D4) at batch 1 and 8 (``--quick``: 1) and of ``kernels.decode_matmul``
   and ``kernels.mosaic_gpu.decode_matmul`` (tensor cores) at batch 16 and 64
   (``--quick``: 16), the latter also at 1 and 8 against both gemvs (``--quick``: 8, whose
   time stands for 1) and the former at 8, for D4 q=4 M=2 and E8 q=4 M=2 at 8192^2; the
   fastest kernel becomes the batch class's ``"backend"`` (:func:`pick_backends`); the
   winners go into
   ``hnlq_jax/kernels/gpu_tiles.py`` (``--write-tiles`` after the run) and into this run's
   table.
4. **matmul**: ``hq.matmul(x, codes, implementation="pallas")`` (``gemv`` up to 8 rows,
   ``decode_matmul`` beyond) against a bfloat16 ``jnp.dot`` of the dense weight, XLA's int4
   weight-only product with group-128 bfloat16 scales (int4 -> convert -> scale -> dot, fused
   by XLA: what a JAX user would pick instead) and decode-then-dot (``"xla"``), bfloat16
   activations, 4096^2, 8192^2 and 28672 x 8192 (an LLM MLP's up-projection), batch 1, 4, 16,
   64; and of each fused call, the main kernel's time and the rest's (x's planes, the
   split-K sums).
5. **codec**: encode and decode of N D4 vectors, bytes in + out over device time (the front
   doors, and the kernels at 1024 and 4096 blocks per program); and an encode of N/64 (two
   passes) in wall clock a call with 20 calls queued, beside its device time (a host sync in
   the call would show as the difference).
6. **torch**: ``QuantizedLinear`` on CUDA tensors beside ``F.linear`` in bfloat16, and the
   bridge's cost per call at batch 1 (wall clock), split into its parts (the JAX call synced
   and with 20 queued: dispatch apart from the wait), and the layer's host time by function
   under cProfile (:func:`host_profile`: what the parts leave out).

7. **tests**: the other tests of ``--tests`` (default ``tests/test_kernels.py``: Triton's
   kernels against XLA, encode and decode bit-exact) natively, in the time left.

and, between 3 and 4, **ncu**: Nsight Compute's sections for one ``gemv`` launch into
``results/gpu_ncu.txt`` (what bounds the kernel). Each test run's whole output goes to
``results/gpu_check_<part>.txt`` (``-v``: a hang's log ends at the test it left running).

A first run on a device is when kernels break, so the run protects what it has measured: a
sweep candidate whose error shows a broken CUDA context ends the run's work on the device
(recorded as ``fault``; rerun with ``--no-mosaic`` if it was a Mosaic GPU kernel), and a
:class:`Watchdog` writes the results and ends the process when a candidate runs past
``CANDIDATE_LIMIT`` seconds or a part past the budget by a minute (recorded as ``hung``).

Every time is device time (:func:`hnlq_jax.timing.device_time`: CUPTI, the weight rotating
through copies that together are at least 3x the L2), so neither side runs from cache.

Writes ``results/gpu_check.json`` (after every part, and every row of the sweep, the
product table and the codec), ``results/gpu_check.md``, ``results/gpu_check.png``
(``--out``: another folder, e.g. a lent machine's ``$OUT``); ``--report`` puts the Markdown
into ``docs/gpu.md`` and ``--write-tiles`` the sweep's winners into the tuning table, both
from the saved JSON. Without a GPU it stops with exit status 2 unless ``--allow-cpu`` (a
smoke run at tiny sizes).

Exit status (:func:`exit_status`): 0 every part ran; 1 a part, a case or a test failed, or
the device context broke; 2 no GPU; 3 the watchdog stopped the run; 4 nothing failed, but
parts were skipped or a test run stopped at its limit (the budget), or the bfloat16 GEMV read
outside ``BASELINE_PCT`` of the HBM peak (its ratios flagged).

Usage: ``python experiments/gpu_check.py [--budget 420] [--quick] [--allow-cpu] [--skip-tests]
[--no-mosaic] [--out DIR]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import pprint
import signal
import subprocess
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).parent.parent
# The working tree's package, not an installed copy (a lent GPU machine has the repository,
# not an install of it), and the scripts next to this file
sys.path[:0] = [str(ROOT), str(pathlib.Path(__file__).parent)]
import bench_kernels  # noqa: E402  (the environment row)
import report  # noqa: E402

import hnlq_jax as hq  # noqa: E402
from hnlq_jax import kernels  # noqa: E402
from hnlq_jax.kernels import gpu_tiles  # noqa: E402
from hnlq_jax.timing import cache_copies, device_time, fresh_copies  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
# HBM peak by device kind (vendor figures, bytes/s); unknown devices report no roofline.
# Matched in order, by substring of the device kind (the longer names first: "GH200" holds
# "H200", "H100 NVL" "H100"); GH200 comes with HBM3 or HBM3e: no one figure
HBM_PEAK = {"GH200": None, "H100 NVL": 3.9e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12,
            "H200": 4.8e12, "H100": 3.35e12}
CONFIGS = {"D4": hq.HNLQConfig("D4", 4, 2), "E8": hq.HNLQConfig("E8", 4, 2)}
SHAPES = [(4096, 4096), (8192, 8192), (28672, 8192)]  # (n, k): y[b, n] = x[b, k] W[n, k]^T
BATCHES = (1, 4, 16, 64)
# Seconds the native tests may take (in processes of their own: the Mosaic GPU kernels' first,
# the others last; --quick: QUICK_TESTS_LIMIT) and one sweep candidate (compile + 10 timed
# runs: ~5-20 s) before the run counts it as hung
TESTS_LIMIT = 240
QUICK_TESTS_LIMIT = 90
CANDIDATE_LIMIT = 120


def peak_bandwidth(kind: str):
    for name, bw in HBM_PEAK.items():
        if name in kind:
            return bw
    return None


class Clock:
    """The run's budget: parts and loops ask :meth:`left` before starting more work."""

    def __init__(self, budget: float):
        self.end = time.monotonic() + budget

    def left(self) -> float:
        return self.end - time.monotonic()


# What a kernel's failure on the device looks like when it takes the process's CUDA context
# with it (everything after it in the process fails too) or crashes a pytest worker
FATAL = ("illegal memory access", "ILLEGAL_ADDRESS", "misaligned address", "illegal instruction",
         "unspecified launch failure", "LAUNCH_FAILED", "Fatal Python error", "node down",
         "crashed")


def device_fault(text: str) -> str | None:
    """The first sign in ``text`` (an error or a test run's output) of a kernel that broke
    the device context or its process; ``None`` where there is none. Indented lines are left
    out: in a test run's output they are the failing tests' source and locals (a test of this
    script spells the signs out), while pytest's own lines, its summary of each failure and a
    crash's report start at the margin."""
    lines = [ln for ln in text.splitlines() if not ln[:1].isspace()]
    return next((m for m in FATAL if any(m in ln for ln in lines)), None)


class Watchdog:
    """Ends the run, its results written, when the step it guards runs past its limit: a
    kernel that never returns (a barrier no thread arrives at) would otherwise hold the lease
    to its end with nothing written. ``on_expiry(label)`` is called once, from a thread."""

    def __init__(self, on_expiry):
        self.on_expiry = on_expiry
        self.label, self.deadline = None, float("inf")
        threading.Thread(target=self._watch, daemon=True).start()

    @contextlib.contextmanager
    def guard(self, label: str, seconds: float):
        """Within the block, ``label`` must finish in ``seconds`` (and by any outer limit)."""
        outer = self.label, self.deadline
        self.label = label
        self.deadline = min(self.deadline, time.monotonic() + seconds)
        try:
            yield
        finally:
            self.label, self.deadline = outer

    def _watch(self):
        while time.monotonic() <= self.deadline:
            time.sleep(0.2)
        self.on_expiry(self.label)


def pytest_command(*targets: str, workers: int = 4) -> list:
    """The pytest command line run from the repository root (several workers share the GPU:
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` is set by :func:`run_tests`): every test's result
    on its own line (the log names the last one a hang left running), the failures' reasons
    at the end, up to 10 failures (a first native run finds several at once), and a stack dump
    of a test still running after 60 s."""
    return [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-rfE", "--tb=short",
            "--maxfail=10", "-o", "faulthandler_timeout=60", "-n", str(workers),
            "--dist", "worksteal", *(targets or ("tests/test_kernels.py",))]


def _summary(text: str) -> list:
    """What a test run's JSON keeps of its output: the failures and errors, and the last
    line (the full output is in the log file)."""
    lines = text.strip().splitlines()
    bad = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:20]
    return bad + lines[-1:]


def split_tests(targets) -> dict:
    """``targets`` (files, node ids, folders) as the two test runs: ``tests_mosaic`` (the
    Mosaic GPU kernels' file, run first) and ``tests`` (the rest, last). A folder is its
    ``test_*.py`` files, so that one holding the Mosaic GPU tests splits too."""
    files = []
    for t in targets:
        path = ROOT / t
        files += ([str(f.relative_to(ROOT)) for f in sorted(path.glob("test_*.py"))]
                  if path.is_dir() else [t])
    mosaic = [t for t in files if "test_kernels_mosaic_gpu" in t]
    return {"tests_mosaic": mosaic, "tests": [t for t in files if t not in mosaic]}


def run_tests(targets, clock, limit: float = TESTS_LIMIT, log: pathlib.Path | None = None):
    """The kernel tests natively, in a process of their own (a kernel that faults or hangs
    there costs at most ``limit`` seconds). ``fault``: the sign of a kernel that broke its
    process (:func:`device_fault`), or that the tests ran past ``limit`` with one stuck (the
    stack dump of a test past 60 s: a run that is only slow, its first native compiles on a
    cold cache, leaves its kernels in the sweep, whose own watchdog guards each candidate).
    ``log``: where the whole output goes."""
    # the programs users run: JAX's default compilation, not the tests' fast settings
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "HNLQ_TEST_FAST_COMPILE": "0"}
    # a session of its own: on a timeout its whole process group goes (the xdist workers,
    # which may hold the GPU, with the main process)
    proc = subprocess.Popen(pytest_command(*targets), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(min(clock.left() - 5, limit), 1))
        text, code = out + err, proc.returncode
        fault = device_fault(text)
        stop = []
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        text = out + err
        budget = clock.left() < 10
        stuck = not budget and "Timeout (" in text  # faulthandler's dump (pytest_command)
        code, fault = None, f"a test hung: the run passed {limit:.0f} s" if stuck else None
        stop = ["(stopped at the time budget)" if budget else
                f"(stopped after {limit:.0f} s" + ("" if stuck else ", no test stuck: slow, "
                                                   "not a fault") + ")"]
    if log is not None:
        log.write_text("\n".join([text.rstrip("\n")] + stop) + "\n")
    return {"targets": list(targets), "returncode": code, "fault": fault,
            "summary": _summary(text) + stop, **({"log": log.name} if log else {})}


def _copies(a, nbytes):
    """``a`` (an array or a pytree of them) and fresh copies of it, enough to defeat the L2
    (two in a smoke run on the CPU, which times nothing that matters)."""
    return fresh_copies(a, cache_copies(nbytes) if jax.default_backend() == "gpu" else 2)


def _nbytes(tree) -> int:
    """Bytes the arrays of ``tree`` hold in device memory: int4 packs two values a byte (its
    ``nbytes`` counts one a byte)."""
    return sum(v.size * jax.dtypes.itemsize_bits(v.dtype) // 8 for v in jax.tree.leaves(tree))


def _weight(n, k, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, k), jnp.float32) / np.sqrt(k)


def _x(b, k, seed=1):
    return jax.random.normal(jax.random.key(seed), (b, k), jnp.float32).astype(jnp.bfloat16)


def _timed(fn, x, ws, peak, nbytes, ref=None, iterations=10):
    """Device time of ``fn(x, w)`` over the copies ``ws``; with ``ref``, also the relative
    difference of the first call's result from it (the timed program's own output)."""
    t, how, y, kernels = device_time(fn, x, ws, iterations=iterations)
    row = {"seconds": t, "method": how, "GBps": nbytes / t / 1e9}
    if kernels:  # on the device: what each kernel of a call takes (the glue around the main one)
        row["kernels"] = kernels
    if peak:
        row["pct_peak"] = 100 * nbytes / t / peak
    if ref is not None:
        row["rel_diff"] = float(jnp.linalg.norm(y.astype(jnp.float32) - ref)
                                / jnp.linalg.norm(ref))
    return row


def dense_bf16(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def int4_weight_only(x, q):
    """XLA's int4 weight-only product: int4 [n, k] and bfloat16 scales [n, k/128]."""
    w, s = q
    n, k = w.shape
    deq = (w.astype(jnp.bfloat16).reshape(n, k // 128, 128) * s[:, :, None]).reshape(n, k)
    return dense_bf16(x, deq)


def quantize_int4(W):
    n, k = W.shape
    g = W.reshape(n, k // 128, 128)
    s = jnp.max(jnp.abs(g), axis=2) / 7
    q = jnp.clip(jnp.round(g / s[:, :, None]), -8, 7).astype(jnp.int4).reshape(n, k)
    return q, s.astype(jnp.bfloat16)


def ceilings(peak, small):
    """A copy's bandwidth and the bfloat16 GEMV's (the baseline every ratio is taken against)."""
    size = 2**20 if small else 2**29  # bfloat16 elements: 1 GiB on a GPU
    a = jnp.ones((size,), jnp.bfloat16)
    copy = _timed(lambda s, v: v * s, jnp.bfloat16(2), [a], peak, 2 * a.nbytes)
    n = 256 if small else 8192
    W = _weight(n, n).astype(jnp.bfloat16)
    gemv = _timed(dense_bf16, _x(1, n), _copies(W, W.nbytes), peak, W.nbytes)
    return {"copy": {"bytes": 2 * a.nbytes, **copy}, "bf16_gemv": {"n": n, **gemv}}


def sweep_candidates(op: str, lattice: str, batch: int, quick: bool = False,
                     generation: str = "sm90"):
    """Phase A: rows and blocks per program (4 warps, 1 stage); phase B varies the rest around
    A's winner (the keys it names replace the winner's). ``quick``: ``gemv``'s tuning-table
    entry with its codes read as words and block by block, and tiles of words."""
    if op == "gemv_mosaic":  # kernels.mosaic_gpu.gemv: rows a program, words a step, stages
        if quick:  # taller tiles (x's loads amortized), longer steps, and 4 work items a
            # multiprocessor (each item fills its own pipeline)
            entry = kernels.pallas.tuning_entry(op, CONFIGS[lattice], batch, generation)
            return [entry, dict(entry, block_n=128, resident=1), dict(entry, block_w=64),
                    dict(entry, waves=4)], []
        a = [dict(block_n=bn, block_w=bw, stages=4, waves=4)
             for bn in (64, 128) for bw in ((16, 32, 64) if batch == 1 else (16, 32))]
        return a, [dict(stages=2), dict(stages=8), dict(waves=2), dict(waves=8),
                   dict(resident=1), dict(resident=3)]  # (shared memory holds at most 3)
    if op == "decode_matmul_mosaic":  # kernels.mosaic_gpu.decode_matmul (wgmma)
        entry = kernels.pallas.tuning_entry(op, CONFIGS[lattice], batch, generation)
        if quick:  # the planes through shared memory, taller tiles (one program a
            # multiprocessor), longer steps, and one program of 4 stages and 2 work items
            return [entry, dict(entry, a_registers=not entry["a_registers"]),
                    dict(entry, block_n=2 * entry["block_n"], resident=1, stages=4),
                    dict(entry, block_w=2 * entry["block_w"]),
                    dict(entry, stages=4, resident=1, waves=2)], []
        # (with A in registers, block_w must hold x's padded rows: invalid ones fail at once)
        a = [dict(entry, block_n=bn, block_w=bw, a_registers=r)
             for bn in (64, 128) for bw in (16, 32, 64) for r in (True, False)]
        return a, [dict(stages=3), dict(stages=4), dict(waves=1), dict(waves=4),
                   dict(resident=2)]
    if quick:  # the entry's launch parameters (its backend is what the sweep decides)
        entry = {k: v for k, v in kernels.pallas.tuning_entry(
            op, CONFIGS[lattice], batch, generation).items() if k != "backend"}
        if op == "decode_matmul":  # the codes as words (the default) and block by block, and
            # float16 operands
            return [entry, dict(entry, words=False), dict(entry, f16=True)], []
        a = [dict(entry, words=True), dict(entry, words=False)]
        if batch == 1:  # (128 blocks a step: 64 registers a thread, 256: 140)
            a += [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=1, waves=4, words=True)
                  for bn in (8, 16, 32) for bk in (128, 256)]
        return a, []
    if op == "decode_matmul":  # its dot wants tiles >= 16; batch 16 fills one row tile
        a = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=1, waves=2)
             for bn in (32, 64, 128) for bk in (32, 64, 128)]
        return a, [dict(num_warps=8), dict(num_stages=2), dict(waves=1), dict(waves=4),
                   dict(f16=True)]
    a = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=1, waves=4)
         for bn in (8, 16, 32) for bk in ((64, 128, 256) if batch == 1 else (64, 128))]
    if lattice == "D4":  # x's one-sided tables: tall tiles share a block's table over rows
        a += [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=1, waves=4,
                   lut_tables=True)
              for bn in (64, 128, 256) for bk in (16, 32)]
    b = [dict(num_warps=2), dict(num_warps=8), dict(num_stages=2), dict(waves=1),
         dict(waves=8)] if batch == 1 else []
    return a, b + [dict(words=False)]  # the codes block by block, not as words


# (op, batch): what the sweep times; the batch names the tuning table's class ("batch<=B").
# "gemv_mosaic" and "decode_matmul_mosaic" (kernels.mosaic_gpu's, for the codebooks they hold)
# compete with Triton's "gemv" and "decode_matmul": where one wins, the table's entry of the
# Triton op names it ("backend", pick_backends) and hq.matmul takes it.
# The tensor-core kernels also compete with both gemvs at 8 rows (Mosaic GPU's also at 1 in
# the full run), Triton's with Triton's gemv at 4 too (its time at 16 rows: it pads to 16).
# The Mosaic GPU kernels, never yet timed on a device, come first: a short budget cuts the end.
# (--quick leaves out Mosaic's gemv at 8 rows, which cannot win: 255 registers, 22.6
# instructions a weight compiled for sm_90a, against 5.3 of its tensor-core kernel; and that
# kernel at 1 row, whose time at 8 stands for it: x is padded to 16 rows either way)
QUICK_SWEEP = (("gemv_mosaic", 1), ("decode_matmul_mosaic", 8),
               ("decode_matmul_mosaic", 16), ("gemv", 1), ("gemv", 4), ("gemv", 8),
               ("decode_matmul", 8), ("decode_matmul", 16))
SWEEP = QUICK_SWEEP + (("gemv_mosaic", 8), ("decode_matmul_mosaic", 1),
                       ("decode_matmul", 64), ("decode_matmul_mosaic", 64))
_MOSAIC = {"gemv_mosaic": "gemv", "decode_matmul_mosaic": "decode_matmul"}


def sweep(clock, small, quick=False, skip_mosaic=None, guard=None, out=None, reserve=0.0,
          on_row=None):
    """The kernels' launch parameters per op, lattice and batch class, timed; returns every
    row and the winners ({op: {lattice: {"batch<=B": entry}}}). No candidate (nor a
    lattice's set-up) starts with less than ``reserve`` seconds (the parts after the sweep)
    and 20 more left; ``on_row()`` is called after each row (the run saves its results).

    ``skip_mosaic``: why the Mosaic GPU kernels are not timed (``None``: they are).
    ``guard(label, seconds)``: a context each candidate runs in (:meth:`Watchdog.guard`). A
    candidate whose error shows a broken device context (:func:`device_fault`) ends the
    sweep (``"fault"``): nothing after it in this process can run. ``out``: the dict to
    fill as the rows come (a run stopped by the watchdog keeps them), returned."""
    n = 256 if small else 8192
    generation = kernels.pallas.gpu_generation(jax.devices()[0]) or "sm90"
    guard = guard or (lambda *_: contextlib.nullcontext())
    limit = float("inf") if small else CANDIDATE_LIMIT  # (interpret mode takes its time)
    rows, best = [], {}
    out = {} if out is None else out
    out.update(n=n, rows=rows, best=best)
    if skip_mosaic:
        out["mosaic_skipped"] = skip_mosaic

    def one_round(rnd, lattice, cfg, codes, ws, ref_w):
        """One round over one lattice's ops and batch classes: ``"first"`` each one's first
        candidate, ``"rest"`` the others, ``"all"`` every one (a device fault ends it:
        ``out["fault"]``)."""
        for op, batch in (QUICK_SWEEP if quick else SWEEP):
            if op in _MOSAIC and (skip_mosaic
                                  or kernels.mosaic_gpu.unsupported(cfg, _MOSAIC[op])):
                continue
            x = _x(batch, n)
            ref = jnp.dot(x.astype(jnp.float32), ref_w.T, precision="highest")
            phase_a, phase_b = sweep_candidates(op, lattice, batch, quick, generation)
            key = (op, lattice, batch)
            phases = {"first": (phase_a[:1],), "rest": (phase_a[1:], phase_b),
                      "all": (phase_a, phase_b)}[rnd]
            for phase in phases:
                winner = winners_of(rows).get(key)
                base = dict(winner["entry"]) if winner and phase is phase_b else {}
                for cand in phase:
                    if clock.left() < 20 + reserve:
                        break
                    entry = {**base, **cand}
                    if op in _MOSAIC:
                        t = kernels.mosaic_gpu.launch_params(_MOSAIC[op], cfg, n, n // cfg.d,
                                                             batch, entry)
                    else:
                        t = kernels.pallas.launch_params(op, cfg, n, n // cfg.d, batch, entry)
                    if cand.get("words") and not kernels.pallas.reads_words(cfg, n // cfg.d,
                                                                            t):
                        continue  # words asked for, which the tiles do not allow: a repeat
                    if any((r["op"], r["lattice"], r["batch"]) == key and r.get("launch") == t
                           for r in rows):
                        continue  # another entry that launches as one timed already
                    if op in _MOSAIC:
                        fn = functools.partial(getattr(kernels.mosaic_gpu, _MOSAIC[op]),
                                               out_dtype=jnp.bfloat16, **t)
                    elif op == "gemv":
                        fn = functools.partial(kernels.gemv, out_dtype=jnp.bfloat16, **t)
                    else:
                        fn = functools.partial(kernels.decode_matmul,
                                               compute_dtype=jnp.bfloat16,
                                               out_dtype=jnp.bfloat16, **t)
                    row = {"op": op, "lattice": lattice, "batch": batch, "entry": entry,
                           "splits": t["splits"], "launch": t}
                    try:
                        with guard(f"sweep {op} {lattice} batch {batch} {entry}", limit):
                            row.update(_timed(lambda x, c: fn(x, c), x, ws, None,
                                              _nbytes(codes), ref))
                    except Exception as e:  # noqa: BLE001  (a candidate that fails to compile)
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    if on_row:
                        on_row()
                    if device_fault(row.get("error", "")):
                        out["fault"] = row["error"]
                        return
            winner = winners_of(rows).get(key)
            if winner:
                best.setdefault(op, {}).setdefault(lattice, {})[f"batch<={batch}"] = \
                    winner["entry"]

    setups = {}  # lattice -> (codes, their copies, decoded weight): made once
    # --quick times the first candidate of every lattice, op and batch class before any
    # other, so that a run the budget cuts short still compares every kernel everywhere
    for rnd in (("first", "rest") if quick else ("all",)):
        for lattice, cfg in CONFIGS.items():
            if clock.left() < 20 + reserve:
                break
            if lattice not in setups:
                codes = hq.encode_rows(_weight(n, n), cfg)
                setups[lattice] = (codes, _copies(codes, _nbytes(codes)),
                                   hq.decode(codes, implementation="xla"))
            one_round(rnd, lattice, cfg, *setups[lattice])
            if "fault" in out:
                pick_backends(best, winners_of(rows), attempted_of(rows))
                return out
    pick_backends(best, winners_of(rows), attempted_of(rows))
    return out


def winners_of(rows: list) -> dict:
    """``{(op, lattice, batch): row}``: the fastest of the sweep's rows that ran and match the
    float32 product (to 1 %: bfloat16 outputs)."""
    winners = {}
    for r in rows:
        key = (r["op"], r["lattice"], r["batch"])
        if "seconds" in r and r.get("rel_diff", 0) < 1e-2 and (
                key not in winners or r["seconds"] < winners[key]["seconds"]):
            winners[key] = r
    return winners


def attempted_of(rows: list) -> set:
    """The ``(op, lattice, batch)`` the sweep's rows timed or tried (an error too)."""
    return {(r["op"], r["lattice"], r["batch"]) for r in rows}


# The sweep's op that times each backend a tuning entry can name, by the entry's own op.
BACKEND_OPS = {"gemv": {"mosaic_gpu": "gemv_mosaic", "mosaic_gpu_mma": "decode_matmul_mosaic",
                        "triton_mma": "decode_matmul"},
               "decode_matmul": {"mosaic_gpu": "decode_matmul_mosaic"}}


def _stands_for(op, batch):
    """The batches whose time stands for ``batch``: itself, and for the tensor-core kernels
    (Triton's decode_matmul and Mosaic GPU's both pad x to 16 rows) the classes above it up
    to 16, the nearest first (the tile entry that runs at the batch is the nearest class's)."""
    padded = op in ("decode_matmul", "decode_matmul_mosaic")
    return [batch] + ([b for b in (8, 16) if b > batch] if padded else [])


def class_winner(winners: dict, op, lattice, batch):
    """The sweep's fastest row of ``op`` that stands for ``batch`` (:func:`_stands_for`), or
    None."""
    return next((winners[(op, lattice, b)] for b in _stands_for(op, batch)
                 if (op, lattice, b) in winners), None)


def pick_backends(best: dict, winners: dict, attempted=None):
    """Names in ``best`` the backend of each lattice and batch class where another kernel's
    winner beat what ``hq.matmul`` would run instead (or that had none, every candidate of it
    failing; where ``attempted``, the ``(op, lattice, batch)`` of the sweep's rows, shows it
    never timed, a sweep cut short, nothing is named): up to ``GEMV_ROWS``
    rows the ``gemv`` entry says ``"mosaic_gpu"`` (Mosaic GPU's gemv beat Triton's),
    ``"mosaic_gpu_mma"`` (Mosaic GPU's tensor-core kernel beat both gemvs) or ``"triton_mma"``
    (Triton's ``decode_matmul``, which pads x to 16 rows: timed at the batch, else its time
    at the nearest class above, 8 or 16 rows); beyond, the ``decode_matmul`` entry says
    ``"mosaic_gpu"`` (it beat Triton's decode_matmul). ``winners``:
    ``{(op, lattice, batch): row}`` (:func:`winners_of`), the rows' ``seconds``."""
    def seconds(op, lattice, batch):
        row = class_winner(winners, op, lattice, batch)
        return row["seconds"] if row else float("inf")

    def timed(op, lattice, batch):
        return attempted is None or any((op, lattice, b) in attempted
                                        for b in _stands_for(op, batch))

    for lattice, batch in sorted({(lat, b) for _, lat, b in winners}):
        entry = "gemv" if batch <= kernels.GEMV_ROWS else "decode_matmul"
        # (beyond gemv's rows the tensor-core kernel is the entry's own Mosaic GPU one)
        others = {backend: seconds(op, lattice, batch)
                  for backend, op in BACKEND_OPS[entry].items()}
        fastest = min(others, key=others.get)
        if timed(entry, lattice, batch) and others[fastest] < seconds(entry, lattice, batch):
            by_class = best.setdefault(entry, {}).setdefault(lattice, {})
            cls = f"batch<={batch}"
            by_class[cls] = {**by_class.get(cls, {}), "backend": fastest}


def _cell(f, *args, **kwargs) -> dict:
    """``f``'s row, or ``{"error": ...}`` where it raised, so that one case that fails (a
    compile, a launch) loses nothing else of its part; an error that broke the device
    context is raised on (nothing after it can run)."""
    try:
        return f(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (recorded in the row)
        error = f"{type(e).__name__}: {e}"[:300]
        if device_fault(error):
            raise
        return {"error": error}


def matmul_table(clock, peak, small, batches, shapes=SHAPES, rows=None, on_row=None):
    """Fused codes kernels against the dense bfloat16 dot, XLA's int4 and decode-then-dot;
    each row appended to ``rows`` (returned) as it is measured, then ``on_row()``."""
    shapes = [(256, 256)] if small else shapes
    fused = functools.partial(hq.matmul, implementation="pallas")
    unfused = functools.partial(hq.matmul, implementation="xla")
    rows = [] if rows is None else rows
    for n, k in shapes:
        W = _weight(n, k)
        Wb = W.astype(jnp.bfloat16)
        q4 = quantize_int4(W)
        dense_ws, int4_ws = _copies(Wb, Wb.nbytes), _copies(q4, _nbytes(q4))
        codes = {lat: hq.encode_rows(W, cfg) for lat, cfg in CONFIGS.items()}
        code_ws = {lat: _copies(c, _nbytes(c)) for lat, c in codes.items()}
        for b in batches:
            if clock.left() < 30:
                return rows
            x = _x(b, k)
            row = {"n": n, "k": k, "batch": b, "bf16_bytes": Wb.nbytes,
                   "bf16": _cell(_timed, dense_bf16, x, dense_ws, peak, Wb.nbytes),
                   "int4": _cell(_timed, int4_weight_only, x, int4_ws, peak, _nbytes(q4)),
                   "int4_bits": 8 * _nbytes(q4) / (n * k)}
            for lat, c in codes.items():
                ref = jnp.dot(x.astype(jnp.float32),
                              hq.decode(c, implementation="xla").T, precision="highest")
                row[lat] = {"fused": _cell(_timed, fused, x, code_ws[lat], peak, _nbytes(c),
                                           ref),
                            "decode_then_dot": _cell(_timed, unfused, x, code_ws[lat], peak,
                                                     _nbytes(c)),
                            "bits": 8 * _nbytes(c) / (n * k)}
            rows.append(row)
            if on_row:
                on_row()
    return rows


def codec_bandwidth(peak, small, rows=None, on_row=None):
    """encode and decode of N D4 vectors through the front doors: bytes in + out per second;
    each row appended to ``rows`` (returned) as it is measured (one that fails holds its
    error; where the set-up of a group of rows fails, one row holds it), then ``on_row()``."""
    cfg = CONFIGS["D4"].replace(beta=hq.gaussian_beta(CONFIGS["D4"]))
    n = 4096 if small else 10**8
    x = jax.random.normal(jax.random.key(0), (n, cfg.d), jnp.float32)
    rows = [] if rows is None else rows

    def add(row):
        rows.append(row)
        if on_row:
            on_row()

    def group(op, f):
        failed = _cell(lambda: f() or {})
        if failed:
            add({"op": op, "implementation": "pallas", "N": n, **failed})

    def d4():
        codes = hq.encode(x, cfg, implementation="pallas")
        nbytes = x.nbytes + _nbytes(codes)
        # (XLA's encode, ~100x slower on a GPU, is left out: it would take the run's budget);
        # then the kernels at more blocks per program (the front doors take 256)
        cases = [("encode", "pallas", lambda _, v: hq.encode(v, cfg, implementation="pallas"),
                  x),
                 ("decode", "pallas", lambda _, c: hq.decode(c, implementation="pallas"), codes),
                 ("decode", "xla", lambda _, c: hq.decode(c, implementation="xla"), codes)]
        for b in (1024, 4096):
            cases += [(f"encode (block={b})", "pallas",
                       lambda _, v, b=b: kernels.encode(v, cfg, block=b), x),
                      (f"decode (block={b})", "pallas",
                       lambda _, c, b=b: kernels.decode(c, None, jnp.float32, block=b), codes)]
        for op, impl, f, arg in cases:
            add({"op": op, "implementation": impl, "N": n,
                 **_cell(_timed, f, jnp.zeros(()), [arg], peak, nbytes, iterations=3)})

    def e8():  # E8's decode with its codebook packed (512 KiB, gathered) or from the digits
        e8 = CONFIGS["E8"]
        ce = hq.encode(x.reshape(-1, e8.d), e8, implementation="pallas")
        for use_table in (True, False):
            add({"op": f"decode E8 (use_table={use_table})", "implementation": "pallas",
                 "N": n // 2, **_cell(
                     _timed, lambda _, c, t=use_table: kernels.decode(c, None, jnp.float32,
                                                                      use_table=t),
                     jnp.zeros(()), [ce], peak, x.nbytes + _nbytes(ce), iterations=3)})

    def queued():
        # A mid-sized encode (two passes) beside its wall clock a call with calls queued: a
        # host sync inside a call (an XLA conditional copies its branch index to the host)
        # would serialize them, and the wall clock would exceed the device time by a dispatch.
        # Its 25 MB fit the L2: no share of the HBM peak is claimed for it.
        xs = x[:n // 64]
        f = jax.jit(lambda v: hq.encode(v, cfg, implementation="pallas"))
        small_bytes = xs.nbytes + _nbytes(f(xs))
        add({"op": f"encode {xs.shape[0]:.0e} (device)", "implementation": "pallas",
             "N": xs.shape[0], **_cell(_timed, lambda _, v: f(v), jnp.zeros(()), [xs], None,
                                       small_bytes, iterations=3)})
        wall = _queued_wall(lambda: f(xs))
        add({"op": f"encode {xs.shape[0]:.0e} (wall clock a call, 20 queued)",
             "implementation": "pallas", "N": xs.shape[0], "seconds": wall,
             "GBps": small_bytes / wall / 1e9})

    group("encode, decode (set-up)", d4)
    group("decode E8 (set-up)", e8)
    group("encode (queued, set-up)", queued)
    return rows


def _queued_wall(f, calls: int = 20) -> float:
    """Wall clock a call of ``f`` (a jitted JAX call) with ``calls`` dispatched before one
    wait: the device time where nothing in a call waits on the host."""
    jax.block_until_ready(f())
    t = time.perf_counter()
    out = [f() for _ in range(calls)]
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / calls


def torch_path(small):
    """``QuantizedLinear`` on CUDA tensors beside ``F.linear`` (bfloat16), batch 1, wall clock
    per call (dispatch included: what a torch user sees), and where the bridge's time goes: a
    DLPack import of x, the jitted JAX product on JAX arrays, a DLPack export of y. Beside the
    DLPack import, on CUDA, the other zero-copy import JAX has: ``jnp.asarray`` of the tensor's
    ``__cuda_array_interface__`` (of an int16 view: the interface has no bfloat16), which a
    cheaper import would have the bridge take."""
    import torch
    from torch.nn import functional as F

    from torch_bridge import QuantizedLinear, to_jax, to_torch
    n = 256 if small else 8192
    device = "cpu" if small else "cuda"  # the smoke run checks the code on the CPU
    lin = torch.nn.Linear(n, n, bias=False, device=device, dtype=torch.bfloat16)
    rows = []
    x = torch.randn(1, n, device=device, dtype=torch.bfloat16)
    for lattice, cfg in CONFIGS.items():
        q = QuantizedLinear.from_linear(lin, cfg)
        codes = hq.Codes(to_jax(q.index), to_jax(q.tfield), q.codes_config,
                         scale=to_jax(q.scale), n=n)
        xj = to_jax(x)
        jitted = jax.jit(hq.matmul)
        y = jitted(xj, codes)
        cases = {"quantized_s": lambda: _torch_wall(lambda: q(x)),
                 "F.linear_s": lambda: _torch_wall(lambda: F.linear(x, lin.weight)),
                 "to_jax_s": lambda: _torch_wall(lambda: to_jax(x)),
                 "cai_s": lambda: _torch_wall(lambda: jnp.asarray(x.view(torch.int16))),
                 "jax_call_s": lambda: _torch_wall(
                     lambda: jitted(xj, codes).block_until_ready()),
                 "jax_queued_s": lambda: _queued_wall(lambda: jitted(xj, codes)),
                 "to_torch_s": lambda: _torch_wall(lambda: to_torch(y)),
                 "host_profile": lambda: host_profile(lambda: q(x))}
        if device != "cuda":  # (no CUDA array interface on the CPU)
            del cases["cai_s"]
        row = {"lattice": lattice, "n": n}
        with torch.no_grad():
            for key, f in cases.items():  # each on its own: one that fails loses no other
                got = _cell(lambda: {"value": f()})
                if "error" in got:
                    row.setdefault("errors", {})[key] = got["error"]
                else:
                    row[key] = got["value"]
        rows.append(row)
    return rows


def host_profile(f, calls: int = 50, top: int = 12) -> list[dict]:
    """Where ``f``'s host time goes: the ``top`` functions by their own time under cProfile
    over ``calls`` calls (builtins too: a DLPack import or a stream handshake shows by name),
    each with its calls, own and cumulative microseconds a call of ``f``. cProfile inflates
    Python-heavy functions; the order, not the sum, is the finding."""
    import cProfile
    import pstats
    f()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        f()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, own, cum, _)}
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{pathlib.Path(file).name}:{line}({name})" if line else name,
             "calls": n / calls, "own_us": own / calls * 1e6, "cumulative_us": cum / calls * 1e6}
            for (file, line, name), (_, n, own, cum, _) in ranked]


def profile_target():
    """What ``ncu`` profiles (``--profile-target``): a few batch-1 products of an 8192^2 D4
    weight through ``kernels.gemv``, nothing else on the GPU."""
    codes = hq.encode_rows(_weight(8192, 8192), CONFIGS["D4"])
    x = _x(1, 8192)
    f = jax.jit(lambda x, c: kernels.gemv(x, c, jnp.bfloat16))
    for _ in range(4):
        f(x, codes).block_until_ready()


def ncu_profile(clock, results: pathlib.Path):
    """Nsight Compute's view of one ``gemv`` launch (speed of light, memory, warp stalls,
    occupancy), as text: what bounds the kernel. ``--clock-control none`` leaves the clocks as
    they are."""
    sections = ["SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "SchedulerStats",
                "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis"]
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", "regex:gemv", "--launch-skip",
           "2", "--launch-count", "1", *[a for s in sections for a in ("--section", s)],
           sys.executable, str(pathlib.Path(__file__)), "--profile-target"]
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=max(min(clock.left() - 5, 150), 1))
    text = r.stdout + r.stderr
    (results / "gpu_ncu.txt").write_text(text)
    return {"returncode": r.returncode, "lines": len(text.splitlines())}


def _torch_wall(f, reps=50):
    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    f()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    sync()
    return (time.perf_counter() - t) / reps


# The share of the HBM peak a bfloat16 GEMV reads where the timing is believed (a cuBLAS-class
# GEMV's): outside it the ratios against the baseline are flagged, and the run exits 4.
BASELINE_PCT = (70, 90)


def baseline_ok(out) -> bool:
    """Whether the bfloat16 GEMV of the ceilings read ``BASELINE_PCT`` of the HBM peak (False
    where it was not timed or the peak is unknown)."""
    pct = ((out.get("ceilings") or {}).get("bf16_gemv") or {}).get("pct_peak")
    return pct is not None and BASELINE_PCT[0] <= pct <= BASELINE_PCT[1]


def _cells(r) -> list:
    """``(name, cell)`` of a product-table row's timed cells (:func:`matmul_table`)."""
    return [("bf16", r["bf16"]), ("int4", r["int4"])] + [
        (f"{lat} {kind}", r[lat][kind]) for lat in CONFIGS
        for kind in ("fused", "decode_then_dot")]


def _us(r):
    return f"{r['seconds'] * 1e6:.1f} µs" if r and "seconds" in r else "n/a"


def _pct(r):
    return f"{r['pct_peak']:.0f} %" if r and "pct_peak" in r else "n/a"


def markdown(out) -> str:
    env = out["environment"]
    timing = out.get("timing", "n/a")
    timing = "device time (CUPTI: kernel durations)" if timing == "CUPTI" else timing
    rotation = ("each weight rotating through copies at least 3x the L2"
                if env["backend"] == "gpu" else "2 copies of each weight (a smoke run off a "
                "GPU: its times say nothing)")
    lines = [f"Device: {env['device']} ({env['backend']}), jax {env['jax']}, Python "
             f"{env['python']}; times are {timing}, {rotation}.", ""]
    for name, err in out.get("errors", {}).items():
        lines += [f"**{name} failed**: `{err.splitlines()[0][:300]}`", ""]
    if out.get("hung"):
        lines += [f"**Stopped: `{out['hung']}` ran past its limit** (the results before it "
                  "are below).", ""]
    if out.get("fault"):
        lines += [f"**The device context broke** (nothing after it ran): "
                  f"`{out['fault'].splitlines()[0][:300]}`", ""]
    if (out.get("sweep") or {}).get("mosaic_skipped"):
        lines += [f"Mosaic GPU kernels not timed: {out['sweep']['mosaic_skipped']}.", ""]
    if out.get("skipped"):
        lines += [f"Parts not run (time budget or a broken context): "
                  f"{', '.join(out['skipped'])}.", ""]
    c = out.get("ceilings")
    if c:
        lines += ["| ceiling | time | GB/s | % of HBM peak |", "|---|---|---|---|",
                  f"| copy {c['copy']['bytes'] / 1e9:.1f} GB (read + write) | "
                  f"{_us(c['copy'])} | {c['copy']['GBps']:.0f} | {_pct(c['copy'])} |",
                  f"| bf16 GEMV {c['bf16_gemv']['n']}² batch 1 | {_us(c['bf16_gemv'])} | "
                  f"{c['bf16_gemv']['GBps']:.0f} | {_pct(c['bf16_gemv'])} |", ""]
    if env["backend"] == "gpu" and not baseline_ok(out):
        lines += ["**The bfloat16 GEMV baseline reads "
                  f"{_pct((c or {}).get('bf16_gemv'))} of the HBM peak, outside "
                  f"{BASELINE_PCT[0]}-{BASELINE_PCT[1]} %: the ratios against it below are "
                  "not to be believed.**", ""]
    mm = out.get("matmul") or []
    if mm:
        int4_bits = mm[0].get("int4_bits", float("nan"))
        lines += ["Speed-up: the bf16 dot's time over the fused kernel's (above 1: faster).", "",
                  f"| weight (n x k) | batch | bf16 dot | int4 XLA ({int4_bits:.3f} bits) | "
                  "D4 fused | D4 speed-up | E8 fused | E8 speed-up | D4 decode+dot | "
                  "E8 decode+dot |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in mm:
            def ratio(lat):
                if "seconds" not in r["bf16"] or "seconds" not in r[lat]["fused"]:
                    return "n/a"
                return f"{r['bf16']['seconds'] / r[lat]['fused']['seconds']:.2f}x"
            lines.append(
                f"| {r['n']} x {r['k']} | {r['batch']} | {_us(r['bf16'])} ({_pct(r['bf16'])}) "
                f"| {_us(r['int4'])} | {_us(r['D4']['fused'])} | {ratio('D4')} | "
                f"{_us(r['E8']['fused'])} | {ratio('E8')} | {_us(r['D4']['decode_then_dot'])} | "
                f"{_us(r['E8']['decode_then_dot'])} |")
        bits = {lat: mm[0][lat]["bits"] for lat in CONFIGS}
        worst = max((r[lat]["fused"]["rel_diff"] for r in mm for lat in CONFIGS
                     if "rel_diff" in r[lat]["fused"]), default=float("nan"))
        lines += ["", f"Bits per weight in memory: D4 {bits['D4']:.2f}, E8 {bits['E8']:.2f} "
                  f"(codes, T field and row scales), int4 {int4_bits:.3f}, bf16 16. Largest "
                  "relative "
                  "difference of a fused product from the float32 product of the decoded "
                  f"weights: {worst:.1e}.",
                  ""]
        cells = [(f"{r['n']} x {r['k']} batch {r['batch']} {name}", cell["error"])
                 for r in mm for name, cell in _cells(r) if "error" in cell]
        lines += [f"{where} failed: `{err.splitlines()[0][:200]}`" for where, err in cells]
        lines += [""] if cells else []
        split = [(r, lat) for r in mm for lat in CONFIGS if r[lat]["fused"].get("kernels")]
        if split:  # the glue: what runs on the device besides the product's main kernel
            lines += ["Where a fused call's device time goes (CUPTI, per call):", "",
                      "| weight | batch | lattice | kernels | longest | the others |",
                      "|---|---|---|---|---|---|"]
            for r, lat in split:
                ks = r[lat]["fused"]["kernels"]
                name, top = max(ks.items(), key=lambda kv: kv[1])
                lines.append(f"| {r['n']} x {r['k']} | {r['batch']} | {lat} | {len(ks)} | "
                             f"`{name[:40]}` {top * 1e6:.1f} µs | "
                             f"{(sum(ks.values()) - top) * 1e6:.1f} µs |")
            lines.append("")
    sw = out.get("sweep")
    if sw:
        best = sw["best"]
        if best and "gemv" not in best and "decode_matmul" not in best:
            best = {"gemv": best}  # a run before decode_matmul was swept
        winners = winners_of(sw["rows"])
        lines += [f"Tile sweep at {sw['n']}² (winners, into the tuning table; where an entry "
                  "names a backend, its time is that backend's, then that of the entry's "
                  "tiles in the op's own kernel):", "",
                  "| kernel | lattice | batch class | entry | time |", "|---|---|---|---|---|"]
        for op, by_lat in best.items():
            for lat, by in by_lat.items():
                for cls, entry in by.items():
                    tiles = {k: v for k, v in entry.items() if k != "backend"}
                    times = [r["seconds"] for r in sw["rows"]
                             if r.get("op", "gemv") == op and r["lattice"] == lat
                             and f"batch<={r['batch']}" == cls and r["entry"] == tiles
                             and "seconds" in r]
                    t = f"{min(times) * 1e6:.1f} µs" if times else "n/a"  # backend only
                    if "backend" in entry:  # what runs: the named backend's winner
                        batch = int(cls.removeprefix("batch<="))
                        named = BACKEND_OPS.get(op, {}).get(entry["backend"])
                        row = named and class_winner(winners, named, lat, batch)
                        ran = (f"{row['seconds'] * 1e6:.1f} µs (at {row['batch']} rows)"
                               if row else "n/a")
                        t = f"{ran}; `{op}`'s tiles {t}"
                    lines.append(f"| `{op}` | {lat} | {cls} | `{entry}` | {t} |")
        failed = [r for r in sw["rows"] if "error" in r]
        lines += ["", f"{len(sw['rows'])} candidates timed, {len(failed)} failed to run.", ""]
    if out.get("codec"):
        lines += ["| op | implementation | N | time | GB/s | % of HBM peak |",
                  "|---|---|---|---|---|---|"]
        for r in out["codec"]:
            if "error" in r:
                lines.append(f"| {r['op']} | {r['implementation']} | {r['N']:.0e} | failed: "
                             f"`{r['error'].splitlines()[0][:120]}` | | |")
                continue
            lines.append(f"| {r['op']} | {r['implementation']} | {r['N']:.0e} | "
                         f"{r['seconds'] * 1e3:.3f} ms | {r['GBps']:.0f} | {_pct(r)} |")
        lines.append("")
    if out.get("torch"):
        lines += ["| torch, batch 1 (wall clock per call) | QuantizedLinear | F.linear bf16 | "
                  "to_jax(x) | x by CUDA array interface | jitted hq.matmul | "
                  "the same, 20 queued | to_torch(y) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in out["torch"]:
            parts = " | ".join(f"{r[k] * 1e6:.0f} µs" if k in r else "n/a"
                               for k in ("quantized_s", "F.linear_s", "to_jax_s", "cai_s",
                                         "jax_call_s", "jax_queued_s", "to_torch_s"))
            lines.append(f"| {r['lattice']} {r['n']}² | {parts} |")
        lines.append("")
        lines += [f"`{r['lattice']}` {key} failed: `{err.splitlines()[0][:200]}`"
                  for r in out["torch"] for key, err in r.get("errors", {}).items()]
        first = out["torch"][0]
        if first.get("host_profile"):
            lines += [f"Where `QuantizedLinear`'s host time goes ({first['lattice']}, cProfile "
                      "over 50 calls, µs a call):", "",
                      "| function | calls | own | cumulative |", "|---|---|---|---|"]
            lines += [f"| `{p['function']}` | {p['calls']:g} | {p['own_us']:.1f} | "
                      f"{p['cumulative_us']:.1f} |" for p in first["host_profile"]]
            lines.append("")
    for name in ("tests_mosaic", "tests"):
        tests = out.get(name)
        if tests:
            log = f" (the whole output: `{tests['log']}`)" if tests.get("log") else ""
            lines += [f"`pytest {' '.join(tests['targets'])}` natively: "
                      f"{tests['summary'][-1] if tests['summary'] else 'no output'}{log}"]
            lines += [f"* `{ln[:300]}`" for ln in tests["summary"][:-1]
                      if ln.startswith(("FAILED", "ERROR"))] + [""]
    return "\n".join(lines)


def plot(out, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mm = out.get("matmul") or []
    if not mm:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['n']}x{r['k']}\nb{r['batch']}" for r in mm]
    pos = np.arange(len(mm))
    def speed(r, cell):  # NaN (no bar) where a cell holds an error
        return r["bf16"].get("seconds", np.nan) / cell.get("seconds", np.nan)

    for i, (name, get) in enumerate([("int4 XLA", lambda r: r["int4"]),
                                     ("D4 fused", lambda r: r["D4"]["fused"]),
                                     ("E8 fused", lambda r: r["E8"]["fused"])]):
        ax.bar(pos + 0.27 * (i - 1), [speed(r, get(r)) for r in mm], 0.27, label=name)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(pos, labels, fontsize=7)
    ax.set_ylabel("speed vs bf16 dot (device time)")
    ax.legend()
    ax.set_title(out["environment"]["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merged_tiles(table: dict, best: dict) -> dict:
    """A generation's tuning table (``{op: {lattice: {class: entry}}}``) with the sweep's
    winners ``best`` in place of its entries; the batch classes, lattices and ops the sweep
    did not time keep theirs (a ``--quick`` run times fewer classes than a full one)."""
    out = {op: {lat: dict(by) for lat, by in lats.items()} for op, lats in table.items()}
    for op, lats in best.items():
        for lat, by in lats.items():
            out.setdefault(op, {}).setdefault(lat, {}).update(by)
    return out


def write_tiles(best: dict, generation: str, path: pathlib.Path):
    """Puts the sweep's winners (``{op: {lattice: {class: entry}}}``) into the tuning table's
    entry for ``generation`` (:func:`merged_tiles`)."""
    tiles = dict(gpu_tiles.TILES)
    tiles[generation] = merged_tiles(tiles.get(generation, {}), best)
    src = path.read_text()
    head = src.split("TILES: dict = ")[0]
    path.write_text(head + "TILES: dict = " + pprint.pformat(tiles, width=96) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=420, help="seconds for the whole run")
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without a GPU")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="a second look in a short lease: gemv's sweep around the tuning table "
                        "(words or not; Triton's and Mosaic GPU's), decode_matmul's at batch "
                        "16 (both), the product table at 8192² batch 1, 4 and 16, the "
                        "tests, the codec's bandwidth by block size, the torch path; into "
                        "results/gpu_check_quick.*")
    p.add_argument("--tests", nargs="+",
                   default=["tests/test_kernels.py", "tests/test_kernels_mosaic_gpu.py"],
                   help="test files (or node ids) to run natively: those of "
                        "tests/test_kernels_mosaic_gpu.py before the sweep, the others last")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS,
                   help="the folder the results go to (on a lent machine: $OUT, whose files "
                        "come back; default: experiments/results)")
    p.add_argument("--no-mosaic", action="store_true",
                   help="leave the Mosaic GPU kernels out of the sweep (a rerun after one "
                        "faulted or hung: the report names it)")
    p.add_argument("--profile-target", action="store_true",
                   help="only run the products ncu profiles (the profile part runs this)")
    report.add_report_flag(p)
    p.add_argument("--write-tiles", action="store_true",
                   help="only write the saved sweep's winners into hnlq_jax/kernels/gpu_tiles.py")
    args = p.parse_args(argv)
    if args.profile_target:
        profile_target()
        return 0
    if args.report or args.write_tiles:
        if args.quick and args.report:
            p.error("--report writes the full run's table into docs/gpu.md; a quick run's is "
                    "results/gpu_check_quick.md")
        out = report.load_results("gpu_check_quick" if args.quick else "gpu_check")
        if out.get("sweep"):  # the backends as this version picks them from the run's times
            rows = out["sweep"]["rows"]
            pick_backends(out["sweep"]["best"], winners_of(rows), attempted_of(rows))
        if args.write_tiles:
            if not (out.get("sweep") or {}).get("best"):
                p.error("the saved run has no sweep winners to write")
            write_tiles(out["sweep"]["best"], out["environment"]["generation"],
                        ROOT / "hnlq_jax" / "kernels" / "gpu_tiles.py")
        if args.report:
            (RESULTS / "gpu_check.md").write_text(markdown(out) + "\n")
            report.write_between_markers(report.DOCS / "gpu.md", "gpu_check",
                                         markdown(out))
        return 0
    small = jax.default_backend() != "gpu"
    if small and not args.allow_cpu:
        print(f"gpu_check: no GPU (backend {jax.default_backend()!r}); run it on a GPU "
              "machine, or pass --allow-cpu for a smoke run", file=sys.stderr)
        return 2
    clock = Clock(args.budget)
    env = bench_kernels.environment()
    dev = jax.devices()[0]
    env.update(generation=kernels.pallas.gpu_generation(dev) or "cpu",
               multiprocessors=getattr(dev, "core_count", None))
    peak = peak_bandwidth(env["device"])
    out = {"environment": {**env, "hbm_peak_Bps": peak}}
    suffix = ("_cpu_smoke" if small else "") + ("_quick" if args.quick else "")
    results = args.out
    results.mkdir(parents=True, exist_ok=True)

    # the watchdog's thread writes the results too: one writer at a time (a save cut off
    # midway by os._exit would leave half a JSON)
    writing = threading.RLock()

    def save():
        with writing:
            for attempt in range(3):  # the watchdog's save may meet the main thread adding a
                try:  # row ("dictionary changed size"): try again, the file as it was
                    text = json.dumps(out, indent=1)
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
            (results / f"gpu_check{suffix}.json").write_text(text)

    def finish():
        with writing:
            out["timing"] = timing_of(out)
            save()
            md = markdown(out)
            (results / f"gpu_check{suffix}.md").write_text(md + "\n")
            try:
                plot(out, results / f"gpu_check{suffix}.png")
            except Exception:  # noqa: BLE001  (a missing matplotlib must not lose the numbers)
                traceback.print_exc()
            print(md, flush=True)

    def hung(label):
        out["hung"] = label
        print(f"gpu_check: {label} ran past its limit; results written, stopping", flush=True)
        try:
            finish()
        finally:
            os._exit(3)  # the main thread waits on the device: only the process can end

    watchdog = Watchdog(hung)

    def section(name, f, *f_args, need=10):
        """One part into ``out[name]``; a part that raises is recorded (and the run goes on:
        a lease is short, and a first run on a device is when parts break). After a fault
        (the device context broken) nothing more runs in this process."""
        if clock.left() < need or out.get("fault"):
            out.setdefault("skipped", []).append(name)
            return
        t = time.monotonic()
        try:  # a part may overrun the budget by a minute (its last candidate, its report)
            with watchdog.guard(name, clock.left() + 60):
                out[name] = f(*f_args)
        except Exception as e:  # noqa: BLE001  (reported, not handled)
            traceback.print_exc()
            out.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            if device_fault(out["errors"][name]):
                out["fault"] = out["errors"][name]
        out.setdefault("part_seconds", {})[name] = round(time.monotonic() - t, 1)
        print(f"gpu_check: {name} done in {time.monotonic() - t:.0f} s, "
              f"{clock.left():.0f} s left", flush=True)
        save()

    section("ceilings", ceilings, peak, small)
    # The Mosaic GPU kernels' tests first, in a process of their own: a kernel that faults or
    # hangs on the device is found there, and the sweep then leaves them out (Triton's
    # kernels have run on an H100 before; the Mosaic GPU ones had not). The other tests run
    # last, in the time left.
    tests = split_tests(args.tests)
    limit = QUICK_TESTS_LIMIT if args.quick else TESTS_LIMIT

    def tests_part(name):
        if not args.skip_tests and tests[name]:
            section(name, run_tests, tests[name], clock, limit,
                    results / f"gpu_check{suffix}_{name}.txt", need=30)

    tests_part("tests_mosaic")
    fault = (out.get("tests_mosaic") or {}).get("fault")
    skip_mosaic = ("--no-mosaic" if args.no_mosaic else
                   f"the native tests faulted or hung ({fault})" if fault else None)
    out["sweep"] = {}  # filled row by row: a run the watchdog stops keeps what was timed
    # the time the parts after the sweep took on the H100 (product table, codec, torch: 190 s
    # in all, about 80 s of them at --quick's sizes) stays theirs, and the other tests' (at
    # most a minute at --quick)
    section("sweep", sweep, clock, small, args.quick, skip_mosaic, watchdog.guard,
            out["sweep"], 150 if args.quick else 190, save, need=60)
    if out.get("sweep"):  # this run's products use the winners, as the table will
        if out["sweep"].get("fault"):
            out["fault"] = out["sweep"]["fault"]
        gpu_tiles.TILES[env["generation"]] = merged_tiles(
            gpu_tiles.TILES.get(env["generation"], {}), out["sweep"]["best"])
    if not small and not args.quick:  # what bounds gemv: where the next kernel change starts
        section("ncu", ncu_profile, clock, results, need=60)
    out["matmul"], out["codec"] = [], []  # filled row by row, saved after each
    batches = (1, 16) if small else (1, 4, 16) if args.quick else BATCHES
    shapes = [(8192, 8192)] if args.quick else SHAPES
    section("matmul", matmul_table, clock, peak, small, batches, shapes, out["matmul"], save,
            need=60)
    planned = len(batches) * (1 if small else len(shapes))  # (small: 256² alone)
    if "matmul" not in out.get("skipped", []) and len(out["matmul"]) < planned:
        out.setdefault("skipped", []).append("matmul (cut short)")  # by the clock
    section("codec", codec_bandwidth, peak, small, out["codec"], save)
    section("torch", torch_path, small)
    tests_part("tests")
    finish()
    return exit_status(out)


def exit_status(out) -> int:
    """The run's exit status (the module docstring's): 1 where a part, a case of the product
    table or the codec, or a test failed, a test was stuck, or the device context broke; 4
    where nothing failed but parts were skipped or cut short, a test run was stopped at its
    time limit, or, on a GPU, the GEMV baseline is not to be believed; else 0."""
    runs = [out[t] for t in ("tests_mosaic", "tests") if out.get(t)]
    cells = [c for r in out.get("matmul") or [] for _, c in _cells(r) if "error" in c]
    if (out.get("errors") or out.get("fault") or cells
            or any("error" in r for r in out.get("codec") or [])
            or any(r["returncode"] not in (0, None) or r.get("fault") for r in runs)):
        return 1
    partial = (out.get("skipped") or any(r["returncode"] is None for r in runs)
               or (out["environment"]["backend"] == "gpu" and not baseline_ok(out)))
    return 4 if partial else 0


def timing_of(out) -> str:
    """How the run's rows were timed, from their ``method``s (:func:`_timed`)."""
    methods = set()

    def walk(v):
        if isinstance(v, dict):
            if isinstance(v.get("method"), str):
                methods.add(v["method"])
            for w in v.values():
                walk(w)
        elif isinstance(v, list):
            for w in v:
                walk(w)
    walk(out)
    if not methods:
        return "n/a (nothing timed)"
    if methods == {"cupti"}:
        return "CUPTI"
    return "wall clock" + (" (some rows; the others CUPTI)" if "cupti" in methods else "")


if __name__ == "__main__":
    sys.exit(main())

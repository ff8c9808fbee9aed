"""Timing of jitted calls (wall clock; device time on a GPU), shared by the command line and
the benchmarks."""

from __future__ import annotations

import math
import time

import jax
import numpy as np


def best_time(fn, *args, repeat: int = 3) -> float:
    """Best wall-clock seconds of ``fn(*args)`` over ``repeat`` runs, after one warm-up call
    (which compiles). Waits for the results, so asynchronous dispatch is included."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def cache_copies(nbytes: int, cache_bytes: int = 50 * 2**20, least: int = 4) -> int:
    """How many copies of an operand of ``nbytes`` to rotate so that together they are at least
    three times ``cache_bytes`` (an H100's L2 is 50 MB): each call then reads its copy from
    memory, as a model's layers read their own weights."""
    return max(least, -(-3 * cache_bytes // max(int(nbytes), 1)))


def device_time(fn, x, operands, *, iterations: int = 10):
    """Device seconds per call of ``fn(x, w)``, ``w`` rotating through ``operands``.

    One jitted program calls ``fn(x, w)`` for each ``w`` in ``operands`` (copies of one weight
    at their own addresses, :func:`cache_copies` of them, so no call finds its weight in
    cache). On a GPU, CUPTI (``jax.experimental.mosaic.gpu.profiler``) sums the durations of
    the kernels the program launched, everything ``fn`` runs included (activation re-layouts,
    split-K sums) and the gaps between launches excluded; the median over ``iterations`` runs,
    over ``len(operands)``. Elsewhere (no CUPTI): the best wall-clock time of the program,
    dispatch and gaps included.

    Returns:
      ``(seconds per call, "cupti" or "wall", fn(x, operands[0]), kernels)``: ``kernels``
      the seconds per call of each kernel by name (:func:`per_kernel`; ``None`` without
      CUPTI).
    """
    prog = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    if jax.default_backend() == "gpu":
        # Compiled and run once first: a kernel's own error (a failed compile, a fault on
        # launch: JaxRuntimeError, a RuntimeError too) is raised here, not taken for CUPTI's
        jax.block_until_ready(prog(x, operands))
        try:
            from jax.experimental.mosaic.gpu import profiler
            out, runs = profiler.measure(prog, aggregate=False, iterations=iterations)(
                x, operands)
        except (ImportError, RuntimeError):  # no CUPTI: the wall clock below
            runs = None
        if runs:
            runs = [runs] if iterations == 1 else runs  # one run: its list itself
            t, kernels = per_kernel(runs, len(operands))
            return t, "cupti", out[0], kernels
    t = best_time(prog, x, operands, repeat=iterations) / len(operands)
    return t, "wall", prog(x, operands)[0], None


def per_kernel(runs: list, calls: int) -> tuple:
    """``(seconds per call, {kernel name: seconds per call})`` from CUPTI's kernel timings of
    each run (``[[(name, milliseconds), ...], ...]``, a run making ``calls`` calls): the median
    run's total, and each name's median over the runs of its summed durations."""
    totals = [sum(ms for _, ms in run) for run in runs]
    names = dict.fromkeys(name for run in runs for name, _ in run)  # first-launch order
    kernels = {name: float(np.median([sum(ms for n, ms in run if n == name) for run in runs]))
               / 1e3 / calls for name in names}
    return float(np.median(totals)) / 1e3 / calls, kernels

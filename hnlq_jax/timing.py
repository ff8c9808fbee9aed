"""Timing of jitted calls (wall clock; device time on a GPU), shared by the command line and
the benchmarks."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
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


# MiB of copies a CPU benchmark cycles each weight through (beyond any L3 here).
ROTATE_MB = 320


def sample_times(fn, copies, repeat: int, stream: bool = True, warm_all: bool = False) -> list:
    """Wall-clock seconds of each call ``fn(copy)``, the calls cycling through ``copies``.

    Args:
      fn: the call to time (its result is waited for).
      copies: its operand and copies of it at their own addresses (:func:`fresh_copies`,
        :func:`n_copies` of them).
      repeat: calls to time.
      stream: at least one call a copy, so that a copy is back in use only after all the
        others went through the caches (else ``repeat`` calls, for compute-bound calls).
      warm_all: warm up on every copy (a layer checks its codes on its first call), not the
        first alone.

    Returns:
      The seconds of each timed call, in order.
    """
    for c in copies if warm_all else copies[:1]:
        jax.block_until_ready(fn(c))
    times = []
    for i in range(max(repeat, len(copies)) if stream else repeat):
        c = copies[i % len(copies)]
        t = time.perf_counter()
        jax.block_until_ready(fn(c))
        times.append(time.perf_counter() - t)
    return times


def median_time(fn, copies, repeat: int, **kw) -> float:
    """The median seconds of :func:`sample_times` (same arguments)."""
    return float(np.median(sample_times(fn, copies, repeat, **kw)))


def interleaved(candidates: dict, repeat: int, rounds: int) -> dict:
    """Medians of several calls timed in turn, so that a slow spell of a shared machine falls
    on all of them alike.

    Args:
      candidates: ``{name: (fn, copies, kw)}``, as :func:`sample_times` takes them.
      repeat: calls a round (:func:`sample_times`).
      rounds: rounds, each timing every candidate once in order.

    Returns:
      ``{name: median seconds}`` over all rounds.
    """
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, (fn, copies, kw) in candidates.items():
            samples[name] += sample_times(fn, copies, repeat, **kw)
    return {name: float(np.median(v)) for name, v in samples.items()}


def n_copies(nbytes: int, rotate_mb: float = ROTATE_MB) -> int:
    """How many copies of an operand of ``nbytes`` to cycle through on a CPU so that together
    they are at least ``rotate_mb`` MiB (at least 2): a copy is back in use only after the
    others went through the caches, as a model's layers read their own weights."""
    return max(2, math.ceil(rotate_mb * 2**20 / nbytes))


def fresh_copies(a, n: int) -> list:
    """``a`` (an array or a pytree of them, such as :class:`~hnlq_jax.Codes`) and ``n - 1``
    copies of it, each at its own addresses (``n`` in all)."""
    return [a] + [jax.tree.map(lambda v: jnp.array(v, copy=True), a)
                  for _ in range(n - 1)]


def cache_copies(nbytes: int, cache_bytes: int = 50 * 2**20, least: int = 4) -> int:
    """How many copies of an operand of ``nbytes`` to rotate so that together they are at least
    three times ``cache_bytes`` (an H100's L2 is 50 MB): each call then reads its copy from
    memory, as a model's layers read their own weights."""
    return max(least, -(-3 * cache_bytes // max(int(nbytes), 1)))


def device_time(fn, x, operands, *, iterations: int = 10):
    """Device seconds per call of ``fn(x, w)``, ``w`` rotating through ``operands``.

    One jitted program calls ``fn(x, w)`` for each ``w`` in ``operands`` (copies of one weight
    at their own addresses, :func:`cache_copies` of them, so no call finds its weight in
    cache), each call taking the one before's output (:func:`chained`: XLA would otherwise
    compute the work on ``x`` alone once for all calls, and fuse their epilogues into one
    kernel, which charged a call a fraction of its own). On a GPU, CUPTI
    (``jax.experimental.mosaic.gpu.profiler``) sums the durations of the kernels the program
    launched, everything ``fn`` runs included (activation re-layouts, split-K sums) and the
    gaps between launches excluded; the median over ``iterations`` runs, over
    ``len(operands)``. Elsewhere (no CUPTI): the best wall-clock time of the program,
    dispatch and gaps included.

    Returns:
      ``(seconds per call, "cupti" or "wall", fn(x, operands[0]), kernels)``: ``kernels``
      the seconds per call of each kernel by name (:func:`per_kernel`; ``None`` without
      CUPTI).
    """
    prog = jax.jit(lambda x, ws: chained(fn, x, ws))
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


def chained(fn, x, operands) -> list:
    """Calls of ``fn`` on each operand (traced), each call's input the one before's output,
    as a model's next layer takes it: so no two calls share a computation on x (XLA computed
    it once for all of them) or a kernel (sibling epilogues fused into one), and each is
    charged its own.

    Args:
      fn: ``fn(x, w)``.
      x: the first call's input ``[..., k]``.
      operands: the ``w`` of each call, in order.

    Returns:
      ``[fn(x_0, w_0), fn(x_1, w_1), ...]`` with ``x_0 = x`` and ``x_{i+1}`` the first ``k``
      columns of ``fn(x_i, w_i)`` in x's dtype (for a square weight its output itself); where
      an output cannot be an input (a decode's, other leading axes, fewer columns), ``x``
      throughout.
    """
    out = []
    for w in operands:
        out.append(fn(x, w))
        y = out[-1]
        if (isinstance(y, jax.Array) and y.ndim == x.ndim >= 1 and y.shape[:-1] == x.shape[:-1]
                and y.shape[-1] >= x.shape[-1]
                and jnp.issubdtype(y.dtype, jnp.floating)):
            x = y[..., :x.shape[-1]].astype(x.dtype)
    return out


def per_kernel(runs: list, calls: int) -> tuple:
    """``(seconds per call, {kernel name: seconds per call})`` from CUPTI's kernel timings of
    each run (``[[(name, milliseconds), ...], ...]``, a run making ``calls`` calls): the median
    run's total, and each name's median over the runs of its summed durations."""
    totals = [sum(ms for _, ms in run) for run in runs]
    names = dict.fromkeys(name for run in runs for name, _ in run)  # first-launch order
    kernels = {name: float(np.median([sum(ms for n, ms in run if n == name) for run in runs]))
               / 1e3 / calls for name in names}
    return float(np.median(totals)) / 1e3 / calls, kernels

"""Wall-clock timing of jitted calls, shared by the command line and the benchmarks."""

from __future__ import annotations

import math
import time

import jax


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

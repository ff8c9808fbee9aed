"""Shared test set-up: 8 fake CPU devices (before any JAX op), a persistent compilation cache,
bounded memory maps, golden files, hypothesis, compile counting."""

import importlib
import importlib.util
import os
import pathlib
import re
import socket
import sys

# One persistent XLA compilation cache for a test run: its xdist workers and the subprocesses
# the tests start (inheriting these variables) compile the same encoders and kernels again and
# again, and XLA compiles are most of the suite's time. Set JAX_COMPILATION_CACHE_DIR to move it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).parent.parent / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# The tests compile thousands of programs and run each on little data, so compiling is most
# of their time: without LLVM's optimizations and with XLA:CPU's older elemental emitters
# (half the time of its MLIR fusion emitters for a small program) a cold run takes about
# half as long. XLA's HLO passes still run, without fast math either way. CI's second stage
# runs JAX's defaults (HNLQ_TEST_FAST_COMPILE=0), so the programs users run are tested too.
# jaxlib 0.11.2 and 0.12 do not know the emitters' flag (an unknown XLA flag aborts the
# process: every test worker on the GPU machine).
if os.environ.get("HNLQ_TEST_FAST_COMPILE", "1") == "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    from jaxlib import version as _jaxlib  # a string only: XLA is not loaded yet

    jaxlib_version = tuple(int(v) for v in _jaxlib.__version__.split(".")[:2])
    if (jaxlib_version < (0, 11)
            and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_cpu_use_fusion_emitters=false").strip()

import jax  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"
GOLDEN = sorted(p.name for p in DATA.glob("*.npz"))

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


def experiment(name):
    """The module of the script ``experiments/<name>.py`` (the scripts import each other by
    their names, so their folder is on the path while it loads)."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "experiments"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def load_golden(name):
    """Arrays of one golden file (a dict of numpy arrays)."""
    with np.load(DATA / name) as z:
        return {k: z[k] for k in z.files}


def golden_config(g, **changes):
    from hnlq_jax import HNLQConfig

    kw = dict(
        lattice=str(g["lattice"]),
        q=int(g["q"]),
        M=int(g["M"]),
        beta=float(g["beta"]),
        alpha=float(g["alpha"]),
        max_T=int(g["max_scaling_iterations"]),
        dither=tuple(g["dither"]) if bool(g["with_dither"]) else None,
    )
    kw.update(changes)
    return HNLQConfig(**kw)


# CI's second venv has the newest jax on Python 3.12 and no torch (README, "Tests"): there
# the test files that name torch are not collected, and the run's header says how many.
_NO_TORCH = importlib.util.find_spec("torch") is None
# A file needs torch where it imports torch or torch_bridge, or says so in a comment line:
# one that only names torch in a docstring (test_kernels_cpu) is collected.
_NEEDS_TORCH = re.compile(r"^\s*(import|from)\s+torch(_bridge)?\b|^# needs torch", re.M)
_TORCH_FILES = sorted(p.name for p in pathlib.Path(__file__).parent.glob("test_*.py")
                      if _NO_TORCH and _NEEDS_TORCH.search(p.read_text()))  # read where needed


def sum_of_squares_in_numpy(x):
    """``hnlq_jax._numerics.sum_of_squares`` of a 1-D ``x`` by its definition, in NumPy's IEEE
    arithmetic: entries below the threshold zeroed, split at half the significant bits (round
    to nearest even on the bits), the three sums of exact products halved in a fixed order."""
    info = np.finfo(x.dtype)
    x = np.where(np.abs(x) < 2.0 ** (info.minexp // 2 + info.nmant), 0, x).astype(x.dtype)
    bits = x.view(np.uint32 if x.dtype == np.float32 else np.uint64)
    shift = bits.dtype.type(info.nmant - (info.nmant - 1) // 2)
    one = bits.dtype.type(1)
    rounded = bits + ((one << (shift - one)) - one) + ((bits >> shift) & one)
    h = (rounded & ~((one << shift) - one)).view(x.dtype)
    l = x - h  # noqa: E741

    def halving(v):
        v = np.concatenate([v, np.zeros((1 << max(len(v) - 1, 0).bit_length()) - len(v),
                                        v.dtype)])
        while len(v) > 1:
            v = v[:len(v) // 2] + v[len(v) // 2:]
        return v[0]

    return halving(h * h) + (halving(2 * h * l) + halving(l * l))


def pytest_ignore_collect(collection_path, config):
    if _NO_TORCH and collection_path.name in _TORCH_FILES:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """The quick loop (``pytest -m "not slow"``) runs each test function once: on its first
    parameter set, the others are marked slow (as are the multi-process tests). XLA compiles
    are most of the suite's time, and the further sets mostly compile the same code for other
    configs; CI runs them all."""
    seen = set()
    for item in items:
        fn = (item.path, getattr(item, "originalname", item.name))
        if hasattr(item, "callspec") and fn in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(fn)


def pytest_report_header(config):
    if _NO_TORCH:
        return f"torch is not installed: {len(_TORCH_FILES)} test files that need it are not run"
    return None


def _memory_maps():
    """How many memory mappings this process holds (Linux; 0 where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _max_memory_maps():
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530  # Linux's default


_MAP_BUDGET = _max_memory_maps() // 2


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    """Drops the process' compiled programs when it holds half the kernel's memory maps.

    XLA:CPU keeps every kernel of a live executable in mappings of its own (code, constants,
    data: ~30 per encoder, ~130 when a new beta is folded in), and one xdist worker compiles
    thousands of programs: past vm.max_map_count (65530 by default) mmap fails inside a compile
    and the worker dies with SIGSEGV in the unwinder. Recompiles after the drop read the
    persistent cache."""
    yield
    if _memory_maps() > _MAP_BUDGET:
        jax.clear_caches()


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def jax_on_cpu():
    """JAX computes on the CPU (``jax.default_device``). The torch tests hold CPU tensors, so
    their JAX references must run there too: on a GPU machine a reference computed on the GPU
    sums floats (row scales, products) in another order than the CPU, and differs in last bits."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def free_port():
    """A free TCP port on the loopback interface (for multi-process tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def compiles():
    """A list that gains one entry per XLA compile while the test runs, the compiled function's
    name (``"jit(encode_flat)"``). The persistent cache is off meanwhile, so that a program the
    process lacks is compiled, never read from it."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(kwargs.get("fun_name", "?"))

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # is_cache_used() memoizes the setting
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()

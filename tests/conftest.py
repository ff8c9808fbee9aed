"""Shared test set-up: 8 fake CPU devices (before any JAX op), golden files, hypothesis."""

import pathlib
import socket

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"
GOLDEN = sorted(p.name for p in DATA.glob("*.npz"))

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


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
    """A list that gains one entry per XLA compile while the test runs."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)

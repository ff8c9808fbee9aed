"""A DDP communication hook that exchanges HNLQ codes instead of float gradients.

Usage, in the style of PyTorch's PowerSGD hook::

    state = HNLQHookState(config, warmup_steps=10)
    ddp_model.register_comm_hook(state, hnlq_hook)

Each gradient bucket is flattened, error feedback is added, and the JAX encoder of
:mod:`hnlq_jax.dist` turns it into one payload: the packed label bitstream, int8 T and one int8
power-of-two exponent per chunk of 256 d-blocks. The payloads are all-gathered (each rank sends
``(world - 1) * P`` bytes), every rank decodes all of them and averages in rank order, so all
ranks get the same gradient bit for bit. Small buckets and the warm-up steps take the exact
all-reduce.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import functools

import jax
import jax.numpy as jnp
import torch
import torch.distributed as dist

from hnlq_jax.config import HNLQConfig
from hnlq_jax.dist import CHUNK, Payload, _check, _decode, _encode, _layout, _ordered_mean
from hnlq_jax.packing import bits_per_block
from torch_bridge.interop import to_jax, to_torch

__all__ = ["HNLQHookState", "hnlq_hook"]


def _sizes(numel: int, config: HNLQConfig, chunk: int) -> tuple[int, int, tuple[int, int, int]]:
    """``(chunk, chunks, byte sizes of (data, T, exponent))`` of one payload."""
    chunk, n_chunks = _layout(numel, config, chunk, 1)
    data = n_chunks * chunk * bits_per_block(config) // 8
    return chunk, n_chunks, (data, n_chunks * chunk, n_chunks)


@functools.partial(jax.jit, static_argnames=("config", "chunk", "implementation"))
def _compress(v, r, *, config, chunk, implementation):
    """``(payload bytes [P] uint8, v + r - sent, blocks with T > 0)`` of a flat float32 ``v``."""
    v = v + r
    chunk, n_chunks, _ = _sizes(v.shape[0], config, chunk)
    p = _encode(v, config, chunk, n_chunks, implementation)
    wire = jnp.concatenate([p.data.reshape(-1), jax.lax.bitcast_convert_type(p.T, jnp.uint8)
                            .reshape(-1), jax.lax.bitcast_convert_type(p.exponent, jnp.uint8)])
    sent = _decode(p, config, implementation)[: v.shape[0]]
    return wire, v - sent, jnp.sum(p.T > 0)


@functools.partial(jax.jit, static_argnames=("numel", "config", "chunk", "implementation"))
def _mean(wires, *, numel, config, chunk, implementation):
    """Mean ``[numel]`` float32 of the ranks' payloads ``wires [world, P]``, in rank order."""
    chunk, n_chunks, (nd, nt, _) = _sizes(numel, config, chunk)
    as_int8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int8)

    def one(w):
        p = Payload(w[:nd].reshape(n_chunks, -1), as_int8(w[nd:nd + nt]).reshape(n_chunks, chunk),
                    as_int8(w[nd + nt:]))
        return _decode(p, config, implementation)[:numel]

    return _ordered_mean(jax.vmap(one)(wires))


class HNLQHookState:
    """State of :func:`hnlq_hook`: the quantizer, the knobs, residuals and statistics.

    Args:
      config: the quantizer; ``beta`` for unit-RMS data (chunks are scaled to RMS ~ 1 by a
        power of two; :func:`hnlq_jax.gaussian_beta`). Every rank must pass the same config:
        the first call compares them across ranks and raises ``ValueError`` if they differ.
      process_group: the group to average over (default: the default group).
      error_feedback: add what quantization left out of a bucket to its next gradient.
      warmup_steps: iterations that use the exact all-reduce first.
      min_size: buckets with fewer elements use the exact all-reduce.
      chunk: d-blocks per power-of-two scale (a multiple of 8).
      implementation: encode/decode implementation (:mod:`hnlq_jax.kernels`).

    Attributes:
      iter: completed iterations (counted at each iteration's last bucket).
      residuals: bucket index -> float32 JAX array of the error-feedback residual.
      stats: the last completed iteration: ``bytes_sent`` (by this rank), ``float32_bytes``
        (what a ring all-reduce of float32 sends: ``2 (world - 1) / world`` per value),
        ``ratio`` and ``overload_rate`` (fraction of coded blocks with T > 0).
      total_bytes_sent, total_float32_bytes: sums over all iterations.
    """

    def __init__(self, config: HNLQConfig, process_group=None, error_feedback: bool = True,
                 warmup_steps: int = 0, min_size: int = 1024, chunk: int = CHUNK,
                 implementation=None):
        _check(config, "all_gather", chunk, "HNLQHookState")
        for name, v in (("warmup_steps", warmup_steps), ("min_size", min_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"HNLQHookState: {name} must be an int >= 0, got {v!r}")
        self.config = config
        self.process_group = process_group
        self.error_feedback = bool(error_feedback)
        self.warmup_steps = warmup_steps
        self.min_size = min_size
        self.chunk = chunk
        self.implementation = implementation
        self.iter = 0
        self.residuals: dict[int, jax.Array] = {}
        self.stats = {"bytes_sent": 0.0, "float32_bytes": 0.0, "ratio": 1.0,
                      "overload_rate": 0.0}
        self.total_bytes_sent = 0.0
        self.total_float32_bytes = 0.0
        self._step = [0.0, 0.0, 0, 0]  # bytes sent, float32 bytes, overloaded, coded blocks
        self._agreed = False

    def _check_agreement(self, group, world: int):
        """All ranks must decode each other's payloads with the same quantizer."""
        mine = (repr(self.config), self.chunk)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        if any(other != mine for other in everyone):
            lines = "\n".join(f"  rank {i}: config={c}, chunk={k}"
                              for i, (c, k) in enumerate(everyone))
            raise ValueError("hnlq_hook: ranks disagree on the quantizer; every rank must "
                             f"build HNLQHookState with the same config and chunk:\n{lines}")
        self._agreed = True

    def _account(self, bucket, sent: float, f32: float, over: int = 0, blocks: int = 0):
        s = self._step
        s[0] += sent
        s[1] += f32
        s[2] += over
        s[3] += blocks
        if bucket.is_last():
            self.stats = {"bytes_sent": s[0], "float32_bytes": s[1],
                          "ratio": s[1] / s[0] if s[0] else 1.0,
                          "overload_rate": s[2] / s[3] if s[3] else 0.0}
            self.total_bytes_sent += s[0]
            self.total_float32_bytes += s[1]
            self._step = [0.0, 0.0, 0, 0]
            self.iter += 1

    def __getstate__(self):
        # Like PowerSGDState: the process group cannot be pickled.
        return {k: v for k, v in self.__dict__.items() if k != "process_group"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.process_group = None


def hnlq_hook(state: HNLQHookState,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over the ranks, sent as HNLQ codes.

    Register with ``ddp_model.register_comm_hook(state, hnlq_hook)``. Buckets with fewer than
    ``state.min_size`` elements, and every bucket during the first ``state.warmup_steps``
    iterations, are all-reduced exactly (as DDP's default). Other buckets are encoded (with
    the error-feedback residual added), all-gathered as bytes, decoded and averaged in rank
    order; the result is identical on every rank. Non-float32 buckets are coded in float32
    and returned in their own dtype.

    Args:
      state: an :class:`HNLQHookState`.
      bucket: the ``GradBucket`` DDP passes.

    Returns:
      A future of the averaged flat bucket tensor.
    """
    if not isinstance(state, HNLQHookState):
        raise TypeError(f"hnlq_hook: state must be an HNLQHookState, got {type(state).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("hnlq_hook: torch.distributed is not initialized")
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if not state._agreed:
        state._check_agreement(group, world)
    buffer = bucket.buffer()
    n = buffer.numel()
    f32 = 2 * (world - 1) / world * 4 * n
    if state.iter < state.warmup_steps or n < state.min_size or world == 1:
        state._account(bucket, 2 * (world - 1) / world * buffer.element_size() * n, f32)
        buffer.div_(world)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    index = bucket.index()
    r = state.residuals.get(index)
    if r is None or r.shape[0] != n:  # first use, or DDP rebuilt its buckets
        r = jnp.zeros((n,), jnp.float32)
    kw = {"config": state.config, "chunk": state.chunk, "implementation": state.implementation}
    wire, r, over = _compress(to_jax(buffer.float()), r, **kw)
    if state.error_feedback:
        state.residuals[index] = r
    mine = to_torch(wire)
    state._account(bucket, (world - 1) * mine.numel(), f32, int(over), -(-n // state.config.d))
    out = torch.empty(world * mine.numel(), dtype=torch.uint8, device=buffer.device)
    work = dist.all_gather_single(out, mine, group=group, async_op=True)

    def finish(fut):
        # On gloo the future's value is not the gathered tensor: read ``out``.
        fut.wait()
        mean = _mean(to_jax(out).reshape(world, -1), numel=n, **kw)
        return buffer.copy_(to_torch(mean))

    return work.get_future().then(finish)

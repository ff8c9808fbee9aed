"""A DDP communication hook that exchanges HNLQ codes instead of float gradients.

Usage, in the style of PyTorch's PowerSGD hook::

    state = HNLQHookState(config, warmup_steps=10)
    ddp_model.register_comm_hook(state, hnlq_hook)

Each gradient bucket is flattened, error feedback is added, and :func:`hnlq_jax.wire.encode`
turns it into the payload of the wire format (labels at ``M log2 q`` bits per block, T as flag
bits and unary codes in a fixed capacity per chunk, one int8 power-of-two exponent per chunk). With
``method="all_gather"`` the payloads are all-gathered (each rank sends ``(world - 1) P`` bytes)
and every rank decodes all of them; with ``"reduce_scatter"`` an all-to-all sends part i of
every payload to rank i, which averages and re-encodes it, and an all-gather of those parts
completes the mean (``2 (world - 1) / world P`` bytes, like a ring all-reduce). Either way every
rank averages in rank order and gets the same gradient bit for bit. Small buckets and the
warm-up iterations take the exact all-reduce.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import functools

import jax
import jax.numpy as jnp
import torch
import torch.distributed as dist

from hnlq_jax import dist as hq_dist
from hnlq_jax import ops, wire
from hnlq_jax.codes import FORMAT_VERSION
from hnlq_jax.config import HNLQConfig, check_config
from torch_bridge.interop import to_jax, to_torch

__all__ = ["METHODS", "HNLQHookState", "hnlq_hook"]

METHODS = ("all_gather", "reduce_scatter")


def _all_gather(out, inp, **kw):
    """One flat all-gather into a preallocated tensor: all_gather_single where torch has it
    (2.13 deprecates all_gather_into_tensor in its favour), all_gather_into_tensor before
    (torch 2.11); looked up at each call, so that a wrapper installed on torch.distributed
    (a byte counter, a profiler) sees it."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp,
                                                                                     **kw)


def _placed(coder):
    """``coder`` (jitted) run with JAX's default device that of its first argument, a bucket's
    (or its parts') array: inside the jit the coders see tracers, and the codec resolves its
    default implementation and the Pallas kernels' interpret mode from the default device
    (:func:`hnlq_jax.kernels.platform`). Without it a CPU bucket on a GPU machine took the
    GPU's kernels, compiled for the GPU, and failed."""
    @functools.wraps(coder, updated=())  # (not the jitted function's private attributes)
    def run(a, *args, **kw):
        with jax.default_device(next(iter(a.devices()))):
            return coder(a, *args, **kw)
    return run


@_placed
@functools.partial(jax.jit, static_argnames=("lay", "implementation"))
def _compress(v, r, *, lay, implementation):
    """``(payload [parts, part_bytes] uint8, the next residual, wire.Info)`` of a flat float32
    v with the residual r (:func:`hnlq_jax.dist.feedback_residual`)."""
    v = v + r
    payload, info = wire.encode(v, lay, implementation)
    return payload, hq_dist.feedback_residual(v, wire.decode(payload, lay, implementation), r), info


@_placed
@functools.partial(jax.jit, static_argnames=("lay", "implementation"))
def _mean(parts, *, lay, implementation):
    """Rank-order mean ``[lay.part_values]`` float32 of parts ``[world, part_bytes]``
    (:func:`hnlq_jax.dist.mean_of_parts`)."""
    return hq_dist.mean_of_parts(parts, lay, implementation)


@_placed
@functools.partial(jax.jit, static_argnames=("lay", "implementation"))
def _decode_parts(parts, *, lay, implementation):
    """Values ``[world * lay.part_values]`` float32 of parts ``[world, part_bytes]``, in order."""
    return hq_dist.decode_parts(parts, lay, implementation).reshape(-1)


@_placed
@functools.partial(jax.jit, static_argnames=("lay", "implementation"))
def _requantize(avg, residual, *, lay, implementation):
    """:func:`hnlq_jax.dist.requantize` of this rank's averaged part."""
    return hq_dist.requantize(avg, lay, residual, implementation)


@functools.partial(jax.jit, static_argnames=("n", "dtype"))
def _saturated(values, *, n, dtype):
    """The first ``n`` float32 values as ``dtype`` (:func:`hnlq_jax.dist.saturate`: a mean
    near float16's maximum stays finite)."""
    return hq_dist.saturate(values[:n], dtype)


def _into(buffer: torch.Tensor, values) -> torch.Tensor:
    """The bucket's mean, its first ``buffer.numel()`` float32 ``values``, into its buffer
    (a float64 one widens the float32 values)."""
    dtype = jnp.dtype(str(buffer.dtype).removeprefix("torch."))
    dtype = dtype if dtype.itemsize <= 4 else jnp.dtype(jnp.float32)
    return buffer.copy_(to_torch(_saturated(values, n=buffer.numel(), dtype=dtype)))


def _signature(bucket) -> tuple:
    """What identifies a bucket's layout: its parameters' storage and shapes, in order."""
    return tuple((p.data_ptr(), tuple(p.shape)) for p in bucket.parameters())


class HNLQHookState:
    """State of :func:`hnlq_hook`: the quantizer, the knobs, residuals and statistics.

    Args:
      config: the quantizer; beta for unit-RMS data (chunks are scaled to RMS ~ 1 by a power
        of two; :func:`hnlq_jax.gaussian_beta`, which is used when beta is the default 1.0).
        Every rank must pass the same config: the first call compares them (and the format
        version, method, chunk, t_capacity, warmup_steps and min_size, which decide each
        bucket's collectives) across ranks and raises ``ValueError`` if they differ.
      process_group: the group to average over (default: the default group).
      error_feedback: add what quantization left out of a bucket to its next gradient (with
        ``"reduce_scatter"`` also what the re-encoding of this rank's part of the mean left
        out, to that part's next mean). Turned off later, the residuals are dropped.
      warmup_steps: iterations that use the exact all-reduce first (as PowerSGD's
        ``start_powerSGD_iter``).
      min_size: buckets with fewer elements use the exact all-reduce.
      method: ``"all_gather"`` or ``"reduce_scatter"`` (see the module docstring).
      chunk: d-blocks per power-of-two scale (a multiple of 8).
      t_capacity: T stream bits per block of a chunk (:func:`hnlq_jax.wire.layout`).
      implementation: encode/decode implementation (as for :func:`hnlq_jax.encode`).

    Attributes:
      iter: completed iterations (counted at each iteration's last bucket).
      residuals: bucket index -> ``(signature, residual)``: the float32 JAX error-feedback
        residual and the layout it belongs to (the bucket's parameters and shapes). A bucket
        whose layout changed -- DDP rebuilds its buckets after the first iteration -- starts
        again from a zero residual.
      part_residuals: the same for this rank's part of each bucket's mean
        (``"reduce_scatter"``).
      stats: the last completed iteration: ``bytes_sent`` (by this rank), ``float32_bytes``
        (what a ring all-reduce of float32 sends: ``2 (world - 1) / world`` per value),
        ``ratio_to_float32`` (``bytes_sent / float32_bytes``), ``overload_rate`` (fraction of
        coded blocks with T > 0) and
        ``rescaled_chunks`` (chunks the wire's rate control coded at a larger scale).
      total_bytes_sent, total_float32_bytes: sums over all iterations.

    The state pickles (without the process group, like ``PowerSGDState``); the residuals come
    along, but a restored state resets each on first use, as the storage it was keyed by is new.
    """

    def __init__(self, config: HNLQConfig, process_group=None, error_feedback: bool = True,
                 warmup_steps: int = 0, min_size: int = 1024, method: str = "all_gather",
                 chunk: int = wire.CHUNK, t_capacity=None, implementation=None):
        if method not in METHODS:
            raise ValueError(f"HNLQHookState: method must be one of {METHODS}, got {method!r}")
        check_config(config, "HNLQHookState")
        wire.layout(1, config, chunk=chunk, t_capacity=t_capacity)  # validates
        if implementation is not None:  # now, not at the first coded bucket after the warm-up
            try:
                ops.resolve(implementation, config, "encode")
            except ValueError as e:
                raise ValueError(f"HNLQHookState: {e} (the wire encodes and decodes with "
                                 "it)") from None
        for name, v in (("warmup_steps", warmup_steps), ("min_size", min_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"HNLQHookState: {name} must be an int >= 0, got {v!r}")
        self.config = config
        self.process_group = process_group
        self.error_feedback = bool(error_feedback)
        self.warmup_steps = warmup_steps
        self.min_size = min_size
        self.method = method
        self.chunk = chunk
        self.t_capacity = t_capacity
        self.implementation = implementation
        self.iter = 0
        self.residuals: dict[int, tuple] = {}
        self.part_residuals: dict[int, tuple] = {}
        self.stats = {"bytes_sent": 0.0, "float32_bytes": 0.0, "ratio_to_float32": 1.0,
                      "overload_rate": 0.0, "rescaled_chunks": 0}
        self.total_bytes_sent = 0.0
        self.total_float32_bytes = 0.0
        self._step = [0.0, 0.0, 0, 0, 0]  # bytes sent, float32 bytes, overloaded, blocks, rescaled
        self._agreed = False

    def layout(self, numel: int, world: int) -> wire.Layout:
        """The wire layout of a bucket of ``numel`` values among ``world`` ranks."""
        parts = world if self.method == "reduce_scatter" else 1
        return wire.layout(numel, self.config, parts, chunk=self.chunk, t_capacity=self.t_capacity)

    def _check_agreement(self, group, world: int):
        """All ranks must decode each other's payloads with the same quantizer and format."""
        # (warmup_steps, the warm-up iterations done -- a state restored from a checkpoint
        # carries its own -- and min_size decide which collective a bucket takes: ranks that
        # disagreed would wait on different ones until the group's timeout)
        mine = (f"{FORMAT_VERSION}/{wire.WIRE_VERSION}", repr(self.config), self.method,
                self.chunk, self.t_capacity, self.warmup_steps,
                min(self.iter, self.warmup_steps), self.min_size)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        if any(other != mine for other in everyone):
            lines = "\n".join(f"  rank {i}: format/wire version {v}, config={c}, method={m}, "
                              f"chunk={k}, t_capacity={t}, warmup_steps={w} ({d} done), "
                              f"min_size={z}"
                              for i, (v, c, m, k, t, w, d, z) in enumerate(everyone))
            raise ValueError("hnlq_hook: ranks disagree on the quantizer; every rank must "
                             "run the same hnlq_jax and build HNLQHookState with the same "
                             "config, method, chunk, t_capacity, warmup_steps and min_size "
                             f"(and restore states of the same iteration):\n{lines}")
        self._agreed = True

    def _residual(self, bucket, like, store=None):
        """The bucket's residual (in ``store``: :attr:`residuals`, or :attr:`part_residuals`),
        or zeros when it is new or its layout changed, shaped and placed as ``like`` (the
        bucket, or this rank's part of its mean, as a JAX array): a fresh residual placed like
        a carried one keeps the compiled step the same for both (an uncommitted one compiled
        it again)."""
        n = like.shape[0]
        entry = (self.residuals if store is None else store).get(bucket.index())
        if entry is None or entry[0] != _signature(bucket) or entry[1].shape[0] != n:
            return jax.device_put(jnp.zeros((n,), jnp.float32), next(iter(like.devices())))
        return entry[1]

    def _account(self, bucket, sent: float, f32: float, over: int = 0, blocks: int = 0,
                 rescaled: int = 0):
        s = self._step
        for i, v in enumerate((sent, f32, over, blocks, rescaled)):
            s[i] += v
        if bucket.is_last():
            self.stats = {"bytes_sent": s[0], "float32_bytes": s[1],
                          "ratio_to_float32": s[0] / s[1] if s[1] else 1.0,
                          "overload_rate": s[2] / s[3] if s[3] else 0.0,
                          "rescaled_chunks": s[4]}
            self.total_bytes_sent += s[0]
            self.total_float32_bytes += s[1]
            self._step = [0.0, 0.0, 0, 0, 0]
            self.iter += 1

    def __getstate__(self):
        # Like PowerSGDState: the process group cannot be pickled.
        return {k: v for k, v in self.__dict__.items() if k != "process_group"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("part_residuals", {})  # (pickled before it was kept)
        self.process_group = None
        self._agreed = False  # a new group (perhaps other versions on other nodes): ask again


def hnlq_hook(state: HNLQHookState,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over the ranks, sent as HNLQ codes.

    Register with ``ddp_model.register_comm_hook(state, hnlq_hook)``. Buckets with fewer than
    ``state.min_size`` elements, and every bucket during the first ``state.warmup_steps``
    iterations, are all-reduced exactly (as DDP's default). Other buckets are encoded (with
    the error-feedback residual added), exchanged as bytes (``state.method``), decoded and
    averaged in rank order; the result is identical on every rank. Non-float32 buckets are
    coded in float32 and returned in their own dtype.

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

    lay = state.layout(n, world)
    kw = {"lay": lay, "implementation": state.implementation}
    v = to_jax(buffer.float())
    if not state.error_feedback:  # (turned off since: its last residual is not added again)
        state.residuals.pop(bucket.index(), None)
        state.part_residuals.pop(bucket.index(), None)
    payload, r, info = _compress(v, state._residual(bucket, v), **kw)
    if state.error_feedback:
        state.residuals[bucket.index()] = (_signature(bucket), r)
    mine = to_torch(payload)  # [parts, part_bytes]
    P = mine.numel()
    sent = (world - 1) * P if lay.parts == 1 else 2 * (world - 1) * P // world
    state._account(bucket, sent, f32, int(info.overloaded), -(-n // lay.config.d),
                   int(info.rescaled))

    def gather(part: torch.Tensor):
        """``[world, part_bytes]``: every rank's part (all-gather of bytes)."""
        out = torch.empty(world * part.numel(), dtype=torch.uint8, device=buffer.device)
        return _all_gather(out, part.reshape(-1), group=group, async_op=True), out

    if lay.parts == 1:
        work, out = gather(mine)

        def finish(fut):
            # On gloo the future's value is not the gathered tensor: read ``out``.
            fut.wait()
            return _into(buffer, _mean(to_jax(out).reshape(world, -1), **kw))

        return work.get_future().then(finish)

    parts = torch.empty_like(mine)
    work = dist.all_to_all_single(parts, mine, group=group, async_op=True)

    def reduce_then_gather(fut):
        fut.wait()
        avg = _mean(to_jax(parts), **kw)  # this rank's part of the mean
        part_r = (state._residual(bucket, avg, state.part_residuals) if state.error_feedback
                  else None)
        mine_part, part_r = _requantize(avg, part_r, **kw)
        if state.error_feedback:  # its re-encoding's error too (hnlq_jax.dist.requantize)
            state.part_residuals[bucket.index()] = (_signature(bucket), part_r)
        work2, out = gather(to_torch(mine_part))
        work2.wait()
        return _into(buffer, _decode_parts(to_jax(out).reshape(world, -1), **kw))

    return work.get_future().then(reduce_then_gather)

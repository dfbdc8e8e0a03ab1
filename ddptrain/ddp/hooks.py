"""Hand-written collectives and communication hooks for the DDP wrapper.

    ring_all_reduce(t)                                      # in-place SUM, isend/irecv only
    model = ddptrain.DDP(net, comm_hook=RingHook())         # the ring inside the wrapper
    model = ddptrain.DDP(net, comm_hook=make_hook("bf16"))  # bf16 buckets, default transport
    model = ddptrain.DDP(net, comm_hook=allreduce_hook)     # force the backend's all_reduce
    model = ddptrain.DDP(net, comm_hook=local_hook)         # a world of one: nothing to send

Every hook follows the wrapper's contract: `hook(bucket, group)` gets a flat 1-D bucket already
scaled by 1/world_size and returns something whose `wait()` leaves the SUM over ranks in it.
A hook may also offer `allocate(numel, dtype, device)`; the wrapper then builds its buckets
with it (SharedMemoryHook: rows of a shared file; CastHook: buckets in the wire dtype);
`call_on_wait(bucket, group)`, used for a backward's last bucket, whose wait follows at once;
and `start_broadcast(tensors, src)`, which carries the wrapper's buffers (None: it cannot).
Hooks that keep state (a process group, a thread, buffers) are constructed on every rank, in
the same order, because constructing and allocating run collectives.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddptrain.cpu.ring import ring_reduce, scratch_for
from ddptrain.cpu.shm import SharedMemoryHook, shared_memory_usable
from ddptrain.cpu.tcp import HOST_ENV, SocketHook
from ddptrain.ddp.runner import Done
from ddptrain.dist import close_at_shutdown, global_rank, release_group


class Waitable(Protocol):
    """What a communication hook returns: `wait()` leaves the reduced values in the bucket."""

    def wait(self) -> Any: ...


CommHook = Callable[[torch.Tensor, Any], Waitable]


HOOK_NAMES = (
    "allreduce",
    "shm",
    "tcp",
    "ring",
    "bf16",
    "fp16",
    "allreduce-bf16",
    "allreduce-fp16",
    "ring-bf16",
    "ring-fp16",
)


def ring_all_reduce(
    tensor: torch.Tensor, group: Any = None, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """In-place SUM all_reduce of a contiguous tensor: ring reduce-scatter, then ring all-gather.

    Each rank sends and receives 2 * (world_size - 1) / world_size of the tensor, whatever the
    world size. At world size 2 the result is bitwise equal to `dist.all_reduce`; at larger
    sizes the summation order differs, so results agree to rounding. `scratch` (same dtype, at
    least numel / world_size elements, rounded up) is reused for receiving instead of a new
    buffer per call.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1 or tensor.numel() == 0:
        return tensor
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor (it reduces views in place)")
    rank = dist.get_rank(group)
    right = global_rank(group, (rank + 1) % world_size)
    left = global_rank(group, (rank - 1) % world_size)
    flat = tensor.view(-1)
    scratch = scratch_for(flat, world_size, scratch)
    ring_reduce(flat, rank, world_size, scratch, lambda s, r: _exchange(s, r, right, left, group))
    return tensor


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group: Any) -> None:
    # Sizes are the same on every rank, so a rank skips an empty piece exactly when its peer does.
    works = []
    if send.numel():
        works.append(dist.isend(send, dst=right, group=group))
    if recv.numel():
        works.append(dist.irecv(recv, src=left, group=group))
    for work in works:
        work.wait()


def allreduce_hook(bucket: torch.Tensor, group: Any) -> Any:
    """The backend's in-place asynchronous SUM all_reduce (the bucket is pre-scaled)."""
    return dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=group, async_op=True)


def local_hook(bucket: torch.Tensor, group: Any) -> Done:
    """A world of one: the bucket already holds the sum, so nothing is sent (the default there)."""
    return Done()


class _FutureWork:
    """Adapts a concurrent.futures.Future to the Waitable protocol (re-raises worker errors)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> Any:
        return self._future.result()


class RingHook:
    """Comm hook: `ring_all_reduce` on a dedicated group, run by one background thread.

    Hooks fire on the autograd thread while backward runs. The ring's point-to-point messages
    must not interleave with other collectives on the same group in a rank-dependent order, so
    it gets its own group (built here: every rank must construct the hook), and one worker
    thread runs buckets strictly in submission order, which is the same on every rank.
    """

    def __init__(self, process_group: Any = None) -> None:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        self.group = dist.new_group(ranks=ranks)
        self.world_size = dist.get_world_size(self.group)
        # One receive buffer, grown to the largest bucket: no allocation per bucket and step.
        self._scratch = torch.empty(0)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-ring")
        close_at_shutdown(self.close)

    def __call__(self, bucket: torch.Tensor, group: Any) -> _FutureWork | Done:
        if self.world_size == 1:
            return Done()
        return _FutureWork(self._executor.submit(self._reduce, bucket))

    def _reduce(self, bucket: torch.Tensor) -> torch.Tensor:
        self._scratch = scratch_for(bucket, self.world_size, self._scratch)
        return ring_all_reduce(bucket, self.group, self._scratch)

    def close(self) -> None:
        """Stop the worker thread (buckets not yet started are cancelled) and destroy the hook's
        group; ddptrain.shutdown() calls it."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        release_group(self.group)
        self.group = None


class _CastBuffers:
    """One reusable low-precision buffer per bucket, so casting allocates nothing per step."""

    def __init__(self, dtype: torch.dtype, allocate: Any = None) -> None:
        self.dtype = dtype
        self._allocate = allocate
        self._buffers: dict[int, tuple[Any, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def to_wire(self, bucket: torch.Tensor) -> torch.Tensor:
        with self._lock:
            ref, wire = self._buffers.get(bucket.data_ptr(), (None, None))
            if ref is None or ref() is not bucket or wire.numel() != bucket.numel():
                if self._allocate is not None:
                    wire = self._allocate(bucket.numel(), self.dtype, bucket.device)
                else:
                    wire = torch.empty(bucket.numel(), dtype=self.dtype, device=bucket.device)
                self._buffers[bucket.data_ptr()] = (weakref.ref(bucket), wire)
        return wire.copy_(bucket)


class _CastBack:
    """Waits for the low-precision reduction, then widens the result into the bucket."""

    def __init__(self, work: Any, wire: torch.Tensor, bucket: torch.Tensor) -> None:
        self._work, self._wire, self._bucket = work, wire, bucket

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._bucket.copy_(self._wire)


class CastHook:
    """Comm hook: gradients travel as `dtype` (bf16/fp16): cast, reduce with `inner`, cast back.

    `allocate` gives the wrapper buckets in `dtype` (placed by `inner.allocate` when it has
    one, e.g. shared memory), so the casts ride on the copies the wrapper makes anyway:
    gradients are rounded on the way into the bucket and widened on the way back into
    `.grad`. A bucket in another dtype is cast into a reused buffer and back. `inner` defaults
    to the backend's all_reduce. The used-parameter flags (0/1) survive the casts exactly.
    The wrapper divides by world_size before narrowing, so fp16 overflows only where an
    averaged gradient exceeds 65504. Construct on every rank (allocation is collective).
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, inner: Any = None) -> None:
        self.dtype = dtype
        self.inner = inner
        self._cast = _CastBuffers(dtype, getattr(inner, "allocate", None))

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed bucket in the wire dtype (when `dtype` is floating point)."""
        wire_dtype = self.dtype if dtype.is_floating_point else dtype
        inner_allocate = getattr(self.inner, "allocate", None)
        if inner_allocate is not None:
            return inner_allocate(numel, wire_dtype, device)
        return torch.zeros(numel, dtype=wire_dtype, device=device)

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> bool:
        """Buffers travel as they are, through `inner`'s broadcast where it has one (shared
        memory); False (the wrapper then uses the backend) otherwise."""
        inner = getattr(self.inner, "broadcast", None)
        return inner is not None and inner(tensors, src)

    def start_broadcast(self, tensors: list[torch.Tensor], src: int) -> Any:
        """`broadcast`, asynchronous: `inner`'s where it has one, else None."""
        inner = getattr(self.inner, "start_broadcast", None)
        return None if inner is None else inner(tensors, src)

    def __call__(self, bucket: torch.Tensor, group: Any) -> Any:
        return self._launch(bucket, group, self.inner)

    def call_on_wait(self, bucket: torch.Tensor, group: Any) -> Any:
        """The same for a bucket waited on at once: passed to `inner`'s call_on_wait if any."""
        return self._launch(bucket, group, getattr(self.inner, "call_on_wait", self.inner))

    def _launch(self, bucket: torch.Tensor, group: Any, inner: Any) -> Any:
        if bucket.dtype == self.dtype:
            return self._reduce(bucket, group, inner)
        wire = self._cast.to_wire(bucket)
        return _CastBack(self._reduce(wire, group, inner), wire, bucket)

    @staticmethod
    def _reduce(tensor: torch.Tensor, group: Any, inner: Any) -> Any:
        if inner is None:
            return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return inner(tensor, group)


def make_hook(name: str, process_group: Any = None) -> Any:
    """Build a comm hook by its CLI name (one of HOOK_NAMES); collective: call on every rank.

    "allreduce" is the backend's all_reduce; "shm" and "tcp" force a transport (and raise
    where it cannot serve); "bf16"/"fp16" cast around the default transport
    (`default_transport`); "allreduce-bf16" forces the backend.
    """
    if name == "allreduce":
        return allreduce_hook
    if name == "shm":
        return SharedMemoryHook(process_group)
    if name == "tcp":
        return SocketHook(process_group)
    if name == "ring":
        return RingHook(process_group)
    if name in ("bf16", "fp16"):
        inner = default_transport(process_group)
        return CastHook(torch.bfloat16 if name == "bf16" else torch.float16, inner)
    if name in ("allreduce-bf16", "allreduce-fp16"):
        return CastHook(torch.bfloat16 if name == "allreduce-bf16" else torch.float16)
    if name in ("ring-bf16", "ring-fp16"):
        dtype = torch.bfloat16 if name == "ring-bf16" else torch.float16
        return CastHook(dtype, RingHook(process_group))
    raise ValueError(f"unknown comm hook {name!r}; choose one of {', '.join(HOOK_NAMES)}")


def default_transport(process_group: Any = None, on_cpu: bool = True) -> Any:
    """Collective: how CPU buckets are reduced by default: shared memory when every rank is on
    one host, else direct TCP connections under gloo; None (the backend's all_reduce) where
    neither serves (GPU buckets, NCCL, ranks that cannot connect to each other)."""
    if shared_memory_usable(process_group, on_cpu):
        return SharedMemoryHook(process_group)
    if not on_cpu or dist.get_backend(process_group) != "gloo":
        return None
    hook = SocketHook.connect(process_group)
    if hook is None and dist.get_rank(process_group) == 0:
        warnings.warn(
            "ddptrain: the ranks could not open TCP connections to each other; gradients go "
            f"through the backend's all_reduce (set {HOST_ENV} to this host's address)",
            stacklevel=2,
        )
    return hook


# The name TrainerConfig.resolve_comm_hook calls.
get_hook = make_hook

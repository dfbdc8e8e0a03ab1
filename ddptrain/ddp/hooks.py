"""torch's communication-hook protocol, and the transports ddptrain reduces buckets with.

    model.register_comm_hook(None, allreduce_hook)           # torch's hooks run unchanged
    model.register_comm_hook(state, powerSGD_hook)           # PowerSGD, its state included
    ddptrain.DDP(net, comm_hook="bf16")                      # a transport, by name (NAMES)
    ddptrain.DDP(net, comm_hook=Transport subclass instance) # or built by hand

The protocol is torch's: `hook(state, bucket) -> torch.futures.Future[Tensor]`, called once per
bucket with a `GradBucket` (the interface of torch's `dist.GradBucket`) holding the SUM of the
local gradients; the future's value is the bucket's averaged gradients. torch's hooks divide by
the group size themselves.

A `Transport` is a hook state that carries buckets itself: what ddptrain's defaults are. The
wrapper gives it three things a plain hook cannot have: buckets allocated where it reads them
best (`allocate`: rows of a shared file), gradients copied in already divided by world_size
(one pass over every gradient, as torch's built-in reducer does, so `reduce` only sums), and
the model's buffers to send (`broadcast`). Its hook is `transport_hook`.

`default_transport` is the one place a transport is chosen: nothing to send alone; for CPU
processes under gloo the CPU transports (ddptrain.cpu: shared memory on one host, TCP across
hosts); else the backend's all_reduce. Transports that keep state (a group, a thread, shared
memory) are built on every rank in the same order: building one is collective.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.ddp.groups import close_at_shutdown, new_group_like, release_group, resolve

# torch's contract: hook(state, bucket) -> Future holding the bucket's averaged gradients.
CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]

# Transports by name (TrainerConfig.comm_hook, the recipe's --comm-hook): "allreduce" is the
# backend's all_reduce; "shm", "tcp" and "ring" force a CPU transport; "bf16"/"fp16" cast
# around the default transport; "allreduce-bf16", "ring-fp16", ... around a named one.
NAMES = (
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


class GradBucket:
    """One bucket as a hook sees it: the methods of torch's `dist.GradBucket`."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: list[torch.Tensor],
        parameters: list[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index, self._buffer = index, buffer
        self._gradients, self._parameters, self._is_last = gradients, parameters, is_last

    def index(self) -> int:
        """The bucket's position in launch order (0 is reduced first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat tensor holding every gradient of the bucket."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: views into buffer(), with the parameter's shape."""
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the order of gradients()."""
        return self._parameters

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward (reduced by the waiting thread)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the bucket's contents with `buffer` (same size), as torch's does."""
        if buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer got {buffer.numel()} elements for a bucket of {self._buffer.numel()}"
            )
        self._buffer.copy_(buffer.view(-1))


class Transport(ABC):
    """A hook state that carries buckets itself (see the module docstring).

    `reduce` receives a bucket whose buffer holds gradients already divided by the number of
    ranks contributing (and, in the last bucket, flags to sum) and leaves the SUM over ranks in
    it before returning. It runs one bucket at a time, in bucket order, on every rank.
    """

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed bucket of `numel` elements (collective where the transport shares memory)."""
        return torch.zeros(numel, dtype=dtype, device=device)

    @abstractmethod
    def reduce(self, bucket: GradBucket) -> None:
        """Sum `bucket.buffer()` over ranks, in place."""

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> bool:
        """Collective: copy rank `src`'s tensors into every rank's; False, having done
        nothing, where this transport cannot (the wrapper then uses the backend)."""
        return False

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release threads, groups and memory; ddptrain.shutdown() calls it."""


def transport_hook(state: Transport, bucket: GradBucket) -> torch.futures.Future:
    """The hook of every Transport: reduce in place, return a completed future."""
    state.reduce(bucket)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class Local(Transport):
    """A world of one: the bucket already holds the sum, so nothing is sent."""

    def reduce(self, bucket: GradBucket) -> None:
        return None


class AllReduce(Transport):
    """The backend's all_reduce (SUM), on a group of its own: the model may run collectives
    of its own on the wrapper's group (SyncBatchNorm's backward) while buckets are reduced."""

    def __init__(self, process_group: Any = None) -> None:
        self.group = new_group_like(process_group)
        close_at_shutdown(self.close)

    def reduce(self, bucket: GradBucket) -> None:
        dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=self.group)

    def close(self) -> None:
        # Dropped, not only destroyed: a group object still held keeps gloo's threads alive.
        release_group(self.group)
        self.group = None


class Cast(Transport):
    """Gradients travel as `dtype` (bf16/fp16) through `inner`, which defaults to AllReduce.

    Buckets are allocated in `dtype` (where `inner` places them), so the casts ride on the
    copies the wrapper makes anyway: gradients are rounded on the way into the bucket and
    widened on the way back into `.grad`. A bucket in another dtype is cast into a reused
    buffer and back. The used-parameter flags (0/1) survive the casts exactly. The wrapper
    divides by world_size before narrowing, so fp16 overflows only where an averaged gradient
    exceeds 65504.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, inner: Transport | None = None):
        self.dtype = dtype
        self.inner = inner if inner is not None else AllReduce()
        self._wire: dict[int, tuple[Any, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed bucket in the wire dtype (when `dtype` is floating point)."""
        return self.inner.allocate(numel, self.dtype if dtype.is_floating_point else dtype, device)

    def reduce(self, bucket: GradBucket) -> None:
        buffer = bucket.buffer()
        if buffer.dtype == self.dtype:
            self.inner.reduce(bucket)
            return
        wire = self._wire_for(buffer)
        wire.copy_(buffer)
        self.inner.reduce(GradBucket(bucket.index(), wire, [], [], bucket.is_last()))
        buffer.copy_(wire)

    def _wire_for(self, buffer: torch.Tensor) -> torch.Tensor:
        # One reusable buffer per bucket, so casting allocates nothing per step.
        with self._lock:
            ref, wire = self._wire.get(buffer.data_ptr(), (None, None))
            if ref is None or ref() is not buffer or wire.numel() != buffer.numel():
                wire = self.inner.allocate(buffer.numel(), self.dtype, buffer.device)
                self._wire[buffer.data_ptr()] = (weakref.ref(buffer), wire)
        return wire

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> bool:
        """Buffers travel as they are, through `inner`."""
        return self.inner.broadcast(tensors, src)

    def close(self) -> None:
        self.inner.close()


def make_transport(name: str, process_group: Any = None) -> Transport:
    """Collective: the transport called `name` (one of NAMES), built on every rank."""
    if name not in NAMES:
        raise ValueError(
            f"unknown comm hook {name!r}; choose one of default, {', '.join(NAMES)}, powersgd"
        )
    if name in ("bf16", "fp16"):
        base, wire = "default", name
    elif name.endswith(("-bf16", "-fp16")):
        base, wire = name.split("-")
    else:
        base, wire = name, ""
    if base == "default":
        inner = default_transport(process_group, on_cpu=True)
    elif base == "allreduce":
        inner = AllReduce(process_group)
    else:
        from ddptrain import cpu  # the CPU transports, by name

        inner = cpu.transport(base, process_group)
    if not wire:
        return inner
    return Cast(torch.bfloat16 if wire == "bf16" else torch.float16, inner)


def named_hook(
    name: str, process_group: Any = None, on_cpu: bool = True
) -> tuple[object, CommHook]:
    """Collective: the (state, hook) pair `name` stands for: "default", a transport of NAMES, or
    "powersgd" (ddptrain.compress: rank 4 from step 100)."""
    if name == "powersgd":
        # The one link from the core to the compressing hooks.
        from ddptrain.compress import powersgd

        state = powersgd.PowerSGDState(
            process_group,
            matrix_rank=powersgd.NAMED_RANK,
            start_step=powersgd.NAMED_START_STEP,
            on_cpu=on_cpu,
        )
        return state, powersgd.powersgd_hook
    if name == "default":
        return default_transport(process_group, on_cpu), transport_hook
    return make_transport(name, process_group), transport_hook


def default_transport(process_group: Any = None, on_cpu: bool = True) -> Transport:
    """Collective: how buckets are reduced when no hook is named (module docstring)."""
    if dist.get_world_size(process_group) == 1:
        return Local()
    if on_cpu and dist.get_backend(process_group) == "gloo":
        # The one link from the core to the CPU transports.
        from ddptrain import cpu

        chosen = cpu.default_transport(process_group)
        if chosen is not None:
            return chosen
    return AllReduce(process_group)


def refuse_shared_group(module: nn.Module, state: object) -> None:
    """Refuse a torch hook whose state names the group a submodule (SyncBatchNorm) runs
    collectives on in backward: the hook's run on the communication thread, the module's on
    autograd's, so on one group they would pair wrongly across ranks."""
    if state is None or isinstance(state, dist.ProcessGroup):
        group = resolve(state)
    elif hasattr(state, "process_group"):  # torch's PowerSGDState, for one
        group = resolve(state.process_group)
    else:
        return  # a state of the hook's own: its business
    for name, m in module.named_modules():
        if hasattr(m, "process_group") and resolve(m.process_group) == group:
            raise ValueError(
                f"the comm hook reduces on the process group that '{name}' "
                f"({type(m).__name__}) runs collectives on in backward; give one of them a "
                "group of its own: convert_sync_batchnorm(model, dist.new_group()) or "
                "register_comm_hook(dist.new_group(), hook)"
            )


def module_on_cpu(module: nn.Module) -> bool:
    """Whether every parameter of `module` is on the CPU."""
    return all(p.device.type == "cpu" for p in module.parameters())

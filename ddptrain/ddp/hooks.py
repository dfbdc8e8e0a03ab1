"""torch's communication-hook protocol, the transports it reaches, and how hooks are run.

    model.register_comm_hook(None, allreduce_hook)           # torch's hooks run unchanged
    model.register_comm_hook(state, powerSGD_hook)           # PowerSGD, its state included
    ddptrain.DDP(net, comm_hook=(transport, transport_hook)) # a Transport, built by hand
    ddptrain.DDP(net, comm_hook=ddptrain.named_hook("bf16")) # or by name (ddptrain/comm.py)

The protocol is torch's: `hook(state, bucket) -> torch.futures.Future[Tensor]`, called once per
bucket with a `GradBucket` (the interface of torch's `dist.GradBucket`) holding the SUM of the
local gradients; the future's value is their average (torch's hooks divide by the group size).

A `Transport` is a hook state that carries buckets itself: what ddptrain's defaults are. The
wrapper gives it three things a plain hook cannot have: buckets allocated where it reads them
best (`allocate`: rows of a shared file), gradients copied in already divided by world_size
(one pass over every gradient, as torch's built-in reducer does, so `reduce` only sums), and
the model's buffers to send (`broadcast`). Its hook is `transport_hook`.

`default_transport` is where the wrapper's default is chosen: nothing to send alone; what the
CPU package registered (`register_cpu_defaults`: ddptrain.cpu chooses shared memory or TCP for
CPU ranks under gloo, and registers itself when `ddptrain` is imported); else the backend's
all_reduce. The core imports no transport. Transports that keep state (a group, a thread,
shared memory) are built on every rank in the same order: building one is collective.

`OrderedRunner` runs the hooks: one bucket at a time, in bucket order, on a thread of its own
while backward goes on. The transports share the process-group helpers at the end.
"""

from __future__ import annotations

import collections
import datetime
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch's contract: hook(state, bucket) -> Future holding the bucket's averaged gradients.
CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]
# (param) -> (its bucket slot, the factor to scale its gradient by there), or None.
Claim = Callable[[torch.Tensor], "tuple[torch.Tensor, float] | None"]
Finish = Callable[[int, torch.Tensor, int], "list[tuple[int, torch.Tensor]]"]


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
        """Make `buffer` (same size, any dtype) the bucket's buffer(), as torch's does: torch's
        compress wrappers reduce a narrower copy this way. The wrapper copies what the hook's
        future returns back into its own bucket, whatever tensor that is."""
        if buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer got {buffer.numel()} elements for a bucket of {self._buffer.numel()}"
            )
        old, new = self._buffer, buffer.view(-1)
        # gradients() are slices of the buffer they belong to, as torch's are.
        self._gradients = [
            new[g.storage_offset() - old.storage_offset() :][: g.numel()].view(g.shape)
            for g in self._gradients
        ]
        self._buffer = new


class Transport(ABC):
    """A hook state that carries buckets itself (see the module docstring).

    `reduce` receives a bucket whose buffer holds gradients already divided by the number of
    ranks contributing (and, in the last bucket, flags to sum) and leaves the SUM over ranks in
    it before returning. It runs one bucket at a time, in bucket order, on every rank.
    `sums_exactly`: an int64 bucket's sum is exact (the deterministic mode's need); a transport
    that casts the bucket says False.
    """

    sums_exactly = True

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

    def reduce_finished(self, bucket: GradBucket, finish: Finish, value: int) -> bool:
        """Collective: sum the bucket, each part of the sum going to one rank's
        `finish(start of the part, part, value summed over ranks)`, whose (byte offset, bytes)
        are written into every rank's bucket: the result. False, having done nothing, where
        the transport cannot (the caller reduces, then finishes all of it itself)."""
        return False

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release threads, groups and memory; ddptrain.shutdown() calls it."""


def transport_hook(state: Transport, bucket: GradBucket) -> torch.futures.Future:
    """The hook of every Transport: reduce in place, return a completed future."""
    state.reduce(bucket)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class SingleRank(Transport):
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


# What a CPU package offers the core (ddptrain.cpu registers itself when ddptrain is imported):
# the transport for CPU ranks under gloo ((group) -> Transport, or None for the backend's), and
# a mode synchronized forwards of a CPU module run in ((module, claim) -> context, or None).
ChooseTransport = Callable[[Any], "Transport | None"]
ForwardMode = Callable[[nn.Module, Claim], "AbstractContextManager | None"]
_cpu_transport: ChooseTransport | None = None
_cpu_forward_mode: ForwardMode | None = None


def register_cpu_defaults(choose: ChooseTransport, forward_mode: ForwardMode) -> None:
    """Have `default_transport` ask `choose(process_group)` for CPU ranks under gloo, and the
    wrapper run synchronized forwards of CPU modules in `forward_mode(module, claim)`, where
    `claim` is Reducer.claim_slot (ddptrain.cpu: large Linear gradients into their slots)."""
    global _cpu_transport, _cpu_forward_mode
    _cpu_transport, _cpu_forward_mode = choose, forward_mode


def default_transport(process_group: Any = None, on_cpu: bool = True) -> Transport:
    """Collective: how buckets are reduced when no hook is given (module docstring)."""
    if dist.get_world_size(process_group) == 1:
        return SingleRank()
    if on_cpu and dist.get_backend(process_group) == "gloo" and _cpu_transport is not None:
        chosen = _cpu_transport(process_group)
        if chosen is not None:
            return chosen
    return AllReduce(process_group)


def cpu_forward_mode(module: nn.Module, claim: Claim) -> AbstractContextManager | None:
    """The registered mode for a CPU module's synchronized forwards, or None."""
    if _cpu_forward_mode is None or not module_on_cpu(module):
        return None
    return _cpu_forward_mode(module, claim)


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


# ----------------------------------------------------------------------------- running hooks
class Job:
    """One submitted function: `wait()` returns its result or re-raises its error."""

    def __init__(self, runner: OrderedRunner, fn: Callable, args: tuple, on_wait: bool) -> None:
        self._runner, self.fn, self.args = runner, fn, args
        self.on_wait = on_wait
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    def wait(self) -> Any:
        self._runner.wait_for(self)
        if self.error is not None:
            raise self.error
        return self.result


class OrderedRunner:
    """Runs jobs one at a time in submission order: on a worker thread, or on a thread that
    waits for a job (it runs any not yet started ahead of it, then its own).

        job = runner.submit(fn, a, b)            # the worker runs fn(a, b) while the caller goes on
        now = runner.submit(fn, a, wake=False)   # left to the caller, who waits at once:
        now.wait()                               # it runs here, with no thread wake-up
        runner.close()                           # jobs not started yet are cancelled

    The worker never starts a job submitted with wake=False, nor is it woken for one: its
    waiter, who waits at once, runs it without the two thread wake-ups (and GIL hand-offs)
    that cost ~0.1 ms each on a busy machine."""

    def __init__(self, name: str = "ddptrain-runner") -> None:
        lock = threading.Lock()
        self._work_ready = threading.Condition(lock)  # the worker sleeps here
        self._job_done = threading.Condition(lock)  # waiters sleep here
        self._queue: collections.deque[Job] = collections.deque()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args: Any, wake: bool = True) -> Job:
        """Queue fn(*args); wake=False: for the thread that will wait for it at once."""
        job = Job(self, fn, args, on_wait=not wake)
        with self._work_ready:
            if self._closed:
                raise RuntimeError(
                    "closed: an earlier reduction failed (see its error), or shutdown() ran"
                )
            self._queue.append(job)
            if wake:
                self._work_ready.notify()
        return job

    def wait_for(self, job: Job) -> None:
        with self._job_done:
            while not job.done:
                if not self._busy and self._queue:
                    self._run_next()
                else:
                    self._job_done.wait()

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel the jobs not yet started (their wait() raises) and stop the worker, waiting
        up to timeout_s for a job it is running. After an error a queued job may be a
        collective the other ranks never join, so none is started here."""
        with self._work_ready:
            self._closed = True
            while self._queue:
                job = self._queue.popleft()
                job.error = RuntimeError("cancelled: the runner was closed before it started")
                job.done = True
            self._job_done.notify_all()
            self._work_ready.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _worker_may_start(self) -> bool:
        head = self._queue[0] if self._queue else None
        return not self._busy and head is not None and not head.on_wait

    def _work(self) -> None:
        with self._work_ready:
            while not self._closed:
                if self._worker_may_start():
                    self._run_next()
                else:
                    self._work_ready.wait()

    def _run_next(self) -> None:
        # Called holding the lock; runs the job without it.
        job = self._queue.popleft()
        self._busy = True
        self._work_ready.release()
        try:
            job.result = job.fn(*job.args)
        except BaseException as e:  # noqa: BLE001 - re-raised by the waiter
            job.error = e
        finally:
            self._work_ready.acquire()
            self._busy = False
            job.done = True
            self._job_done.notify_all()
            if self._worker_may_start():
                self._work_ready.notify()


# ----------------------------------------------------------------------------- process groups
# What ddptrain.shutdown() closes before it destroys the groups: transports' worker threads and
# their own groups. A group left alive until the interpreter exits may still have a gloo thread
# releasing a finished collective's tensors, which takes the GIL that an exiting interpreter no
# longer gives: a C++ abort ("terminate called without an active exception") instead of exit 0.
_closers: list[weakref.WeakMethod] = []
# init_distributed's timeout_s, which transports that wait outside the backend use too.
_timeout_s = 300.0


def timeout_s() -> float:
    """Seconds a rank waits for its peers before a collective fails (init_distributed's)."""
    return _timeout_s


def set_timeout_s(seconds: float) -> None:
    """Set what timeout_s() returns (ddptrain.init_distributed does)."""
    global _timeout_s
    _timeout_s = float(seconds)


def close_at_shutdown(method: Callable[[], None]) -> None:
    """Have shutdown() call `method` first (a bound method; its object is held weakly)."""
    _closers.append(weakref.WeakMethod(method))


def run_closers() -> None:
    """Call every method registered with close_at_shutdown, newest first, once."""
    closers = [ref() for ref in reversed(_closers)]
    _closers.clear()
    for close in closers:
        if close is not None:
            close()


def resolve(group: Any) -> Any:
    """The process group object `group` names (None: the default group)."""
    return dist.group.WORLD if group is None else group


def global_rank(group: Any, group_rank: int) -> int:
    """The default group's rank of `group`'s rank `group_rank` (None: the default group)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def new_group_like(group: Any, backend: str | None = None) -> Any:
    """Collective on the default group: a new group of `group`'s ranks (None: every rank),
    whose collectives fail after timeout_s() as the default group's do."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    # torch gives a new group its backend's default (30 minutes for gloo), not the default
    # group's: a collective only some ranks reach would hang for that long.
    timeout = datetime.timedelta(seconds=timeout_s())
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


def release_group(group: Any) -> None:
    """Destroy a group made with new_group(), unless shutdown() destroyed it already."""
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # no longer registered: destroyed with the default group
        pass

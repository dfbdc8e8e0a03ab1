"""Uneven inputs: a rank that runs out of batches keeps answering the others' collectives.

    model = ddptrain.DDP(net)
    with model.join():                            # loaders may differ in length across ranks
        for x, y in loader:
            loss_fn(model(x), y).backward()       # sum over ranks still training / world_size
            optimizer.step()
            optimizer.zero_grad()
    # every rank gets here; parameters (and buffers) are those of the last rank to finish

    with model.join(divide_by_initial_world_size=False):   # divide by the ranks still training
    with model.join(throw_on_early_termination=True):      # every rank raises EarlyTerminationError

How it works (the semantics of torch's `DistributedDataParallel.join`, written for this
wrapper): while the context is active, every forward starts with one small all_reduce of a
vector with one entry per rank, nonzero for a rank still training, with flags saying whether
its backward will reduce gradients. A rank that runs out leaves its loop and, in `__exit__`,
answers the same all_reduce with zeros, then shadows what the entries say the others do: the
buffer broadcast, and, when they reduce gradients, every bucket's reduction with zero
gradients through the wrapper's comm hook (so shared-memory barriers, ring messages and casts
match) and the one-time bucket rebuild. Under `no_sync()` the others reduce nothing, so
neither does it. When the vector is all zeros every rank is done; the model is broadcast
from the highest rank among the last to finish, since ranks that joined early skipped steps.

Gradient accumulation with a short last round: a rank whose data ends mid-round reaches its
synchronizing backward while others are still under `no_sync()`. Reducing alone would pair
collectives wrongly, so a backward reduces only when no rank still training accumulates; the
rank that asked to reduce early is deferred (`join.deferred` becomes True; skip its optimizer
step and stop) and, once joined, contributes its accumulated gradients to the others' next
reduction instead of zeros.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ddptrain.cpu.shm import SharedMemoryHook
from ddptrain.cpu.tcp import SocketHook
from ddptrain.ddp.hooks import CastHook, RingHook
from ddptrain.ddp.replicas import broadcast_coalesced, coalesce
from ddptrain.ddp.step import StepState
from ddptrain.nn import sync_batchnorm

if TYPE_CHECKING:
    from ddptrain.ddp.wrapper import DistributedDataParallel

# Flags in a rank's entry of the per-forward vector; 0 means the rank has joined (run out).
_ACTIVE = 1
_REDUCES_GRADIENTS = 2  # grad enabled and not under no_sync(): its backward launches buckets
_BACKWARD = 4  # grad enabled: a backward follows (SyncBatchNorm reduces in it, even in no_sync)
_TRAINING = 8  # the module is in training mode: SyncBatchNorm gathers statistics in forward
_PENDING = 16  # joined, holding gradients deferred from a round the others have not finished


class EarlyTerminationError(RuntimeError):
    """Raised on every rank by `join(throw_on_early_termination=True)` when one runs out."""


class Join:
    """What `DistributedDataParallel.join()` returns; see the module docstring.

    Invariants:
    - While active, every rank runs the same sequence of collectives: a rank still training
      runs them in forward and backward, a joined rank runs the same ones from `__exit__`.
    - Each forward inside the context is followed by at most one backward, and by exactly one
      when grad is enabled outside `no_sync()` (a joined rank shadows that backward).
    - Gradients reduced while some ranks have joined are the sum over ranks still training,
      divided by the initial world size (default) or by the number still training.
    - After `__exit__` every rank holds the same parameters (and buffers, when the wrapper
      broadcasts buffers): those of the highest-ranked rank among the last to finish. Optimizer
      state is not synchronized: a joined rank's optimizer skipped the steps it missed.
    """

    def __init__(
        self,
        ddp: DistributedDataParallel,
        *,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.enable = enable
        self.throw_on_early_termination = throw_on_early_termination
        self.group = ddp.process_group
        self.world_size = ddp.world_size
        self.rank = dist.get_rank(self.group)
        first = next(iter(ddp.module.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        # Shadowed in registration order forward, reverse in backward: the order they run in
        # for a network that calls each once, in the order it defines them.
        self._sync_bns = [
            m for m in ddp.module.modules() if isinstance(m, sync_batchnorm.SyncBatchNorm)
        ]
        # Every rank takes part in every exchange, so all see the same sequence of vectors.
        self._last_states: list[int] | None = None
        self.authoritative_rank: int | None = None
        # This rank's reduction was put off to the others' next one (module docstring).
        self.deferred = False
        self._sync_before_deferral = True

    def __enter__(self) -> Join:
        if self.enable:
            if self.ddp._join is not None:
                raise RuntimeError("model.join() contexts cannot be nested")
            _check_sync_bn_groups(self.ddp, self._sync_bns)
            self.ddp._join = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enable:
            return
        self.ddp._join = None
        if self.deferred:
            self.ddp._sync = self._sync_before_deferral
        if exc_type is not None:
            return
        self._shadow_until_all_done()
        self._sync_final_model()

    def on_forward(self) -> tuple[int, int]:
        """Called by the wrapper as a forward starts: (buffer source rank, gradient divisor)."""
        ddp = self.ddp
        if self.deferred:
            raise RuntimeError(
                "a forward after this rank's reduction was deferred under model.join(): it "
                "ended its gradient accumulation while other ranks were still accumulating "
                "under no_sync(), which is only allowed for a rank whose data has run out. "
                "Every rank must synchronize after the same number of micro-batches until "
                "its data ends"
            )
        flags = _ACTIVE
        if torch.is_grad_enabled():
            flags |= _BACKWARD | (_REDUCES_GRADIENTS if ddp._sync else 0)
        if ddp.module.training:
            flags |= _TRAINING
        states = self._exchange(flags)
        self._maybe_throw(states)
        if flags & _REDUCES_GRADIENTS and not _reduces(states):
            self.deferred, self._sync_before_deferral = True, ddp._sync
            ddp._sync = False
        # Rank 0 may have joined with stale buffers: take them from a rank still training.
        return _active(states)[-1], self._divisor(states)

    def _divisor(self, states: list[int]) -> int:
        """Ranks whose gradients a reduction now sums: still training, or deferred."""
        if self.divide_by_initial_world_size:
            return self.world_size
        return sum(1 for s in states if s)

    def _exchange(self, flags: int) -> list[int]:
        states = torch.zeros(self.world_size, dtype=torch.int64, device=self._device)
        states[self.rank] = flags
        dist.all_reduce(states, group=self.group)
        result = states.tolist()
        if _active(result):
            self._last_states = result
        return result

    def _maybe_throw(self, states: list[int]) -> None:
        if not self.throw_on_early_termination or all(states):
            return
        done = [r for r, s in enumerate(states) if not s]
        raise EarlyTerminationError(
            f"rank(s) {done} ran out of inputs while others still had batches; "
            "join(throw_on_early_termination=True) stops every rank at the same step"
        )

    def _shadow_until_all_done(self) -> None:
        ddp = self.ddp
        pending = self.deferred
        if not pending:
            # Whatever this rank accumulated under no_sync() is dropped: it adds zeros.
            ddp._step = StepState(len(ddp._params), ddp._bucket_lens, self.world_size)
        while True:
            states = self._exchange(_PENDING if pending else 0)
            active = _active(states)
            # No rank still training: nothing more will reduce (a deferred rank's gradients
            # only wait for a rank that is still accumulating, which always ends reducing).
            if not active:
                return
            self._maybe_throw(states)
            if ddp.broadcast_buffers and self.world_size > 1 and ddp._model_buffers:
                ddp._model_buffers.sync(active[-1])
            if self._sync_bns and any(s & _TRAINING for s in states):
                for layer in self._sync_bns:
                    sync_batchnorm.shadow_forward(layer)
                if any(s & _BACKWARD for s in states):
                    for layer in reversed(self._sync_bns):
                        sync_batchnorm.shadow_backward(layer)
            if not _reduces(states):
                continue
            if pending:
                # The deferred round's accumulated gradients, in place of zeros.
                ddp._step.divisor = self._divisor(states)
                ddp._finalize_buckets()
                pending = False
            else:
                _shadow_backward(ddp)

    def _sync_final_model(self) -> None:
        last = self._last_states
        # No forward ran anywhere: every rank finished "last", as torch breaks ties (highest).
        src = self.world_size - 1 if last is None else _active(last)[-1]
        self.authoritative_rank = src
        ddp = self.ddp
        tensors = [p.detach() for _, p in ddp._named_params]
        if ddp.broadcast_buffers:
            tensors += ddp._model_buffers.tensors
        with torch.no_grad():
            broadcast_coalesced(coalesce(tensors), self.group, src)


def _active(states: list[int]) -> list[int]:
    """The ranks still training in an exchanged vector."""
    return [r for r, s in enumerate(states) if s & _ACTIVE]


def _reduces(states: list[int]) -> bool:
    """Whether this forward's backward reduces gradients: some rank asks to, and no rank still
    training accumulates under no_sync() (that one reduces later, with the deferred ones)."""
    asks = any(s & _REDUCES_GRADIENTS for s in states)
    accumulates = any(s & _BACKWARD and not s & _REDUCES_GRADIENTS for s in states)
    return asks and not accumulates


def _check_sync_bn_groups(ddp: DistributedDataParallel, layers: list) -> None:
    """Refuse SyncBatchNorm on the group the comm hook reduces buckets on.

    There, a rank still training interleaves bucket reductions with SyncBatchNorm's backward
    reductions in the order autograd happens to produce, which a joined rank cannot know; on
    separate groups each sequence is matched on its own.
    """
    if not layers or not _reduces_on_group(ddp.comm_hook):
        return
    world = dist.group.WORLD
    mine = ddp.process_group or world
    if any((layer.process_group or world) == mine for layer in layers):
        raise ValueError(
            "model.join() with SyncBatchNorm on the process group the comm hook reduces on "
            "would pair their collectives wrongly; give SyncBatchNorm its own group: "
            "convert_sync_batchnorm(model, process_group=torch.distributed.new_group())"
        )


def _reduces_on_group(hook: object) -> bool:
    """Whether a hook reduces buckets with collectives on the wrapper's process group."""
    if isinstance(hook, (SharedMemoryHook, RingHook, SocketHook)):
        return False  # shared-memory barriers, a group of its own, or sockets
    if isinstance(hook, CastHook):
        return hook.inner is None or _reduces_on_group(hook.inner)
    return True


def _shadow_backward(ddp: DistributedDataParallel) -> None:
    """Run one synchronized backward's collectives with zero gradients and no parameter used."""
    with torch.no_grad():
        for bucket in ddp._buckets:
            bucket.zero_()
        # Launched in bucket order, as every rank still training launches them.
        works = [ddp.comm_hook(bucket, ddp.process_group) for bucket in ddp._buckets]
        for work in works:
            work.wait()
    if ddp._ready_order is not None:
        ddp._rebuild_in_ready_order()

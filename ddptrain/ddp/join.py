"""Uneven inputs: the wrapper in torch's Join protocol (torch.distributed.algorithms.join).

    with Join([model, optimizer]):                # torch's context manager, the model first
        for x, y in loader:                       # loaders may differ in length across ranks
            loss_fn(model(x), y).backward()       # sum over ranks still training / world_size
            optimizer.step()
            optimizer.zero_grad()
    # every rank gets here; parameters (and buffers) are those of the last rank to finish

    with model.join():                            # the shortcut: Join([model], ...)
    with model.join(divide_by_initial_world_size=False):   # divide by the ranks still training
    with model.join(throw_on_early_termination=True):      # every rank raises when one runs out

How it works (the semantics of torch's DDP join, on the wrapper's public methods): every
forward inside the context first notifies torch's Join (one all_reduce of ones, which counts
the ranks still training), then joins one small all_reduce of a vector with one entry per rank,
nonzero for a rank still training, with flags saying whether its backward will reduce
gradients. A rank that runs out leaves its loop; torch's Join then calls `main_hook` once per
iteration of the others: it answers the same all_reduce with zeros, then shadows what the
entries say the others do: the buffer broadcast, SyncBatchNorm's collectives (any module that
is a `JoinShadow`), and, when they reduce gradients, one reduction through the wrapper's hook
with zero gradients (`reduce_gradients`), which leaves the averaged gradients in its `.grad`:
so a joined ZeroRedundancyOptimizer after the model in Join([...]) steps its shard correctly.
Under `no_sync()` the others reduce nothing, so neither does it. Once every rank has joined,
`post_hook` broadcasts the model from the highest rank among the last to join.

Gradient accumulation with a short last round: a rank whose data ends mid-round reaches its
synchronizing backward while others are still under `no_sync()`. Reducing alone would pair
collectives wrongly, so a backward reduces only when no rank still training accumulates; the
rank that asked to reduce early is deferred (`hook.deferred` becomes True; skip its optimizer
step and stop) and, once joined, contributes its accumulated gradients to the others' next
reduction instead of zeros.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

if TYPE_CHECKING:
    from ddptrain.ddp.wrapper import DistributedDataParallel

# Flags in a rank's entry of the per-forward vector; 0 means the rank has joined (run out).
_ACTIVE = 1
_REDUCES_GRADIENTS = 2  # grad enabled and not under no_sync(): its backward launches buckets
_BACKWARD = 4  # grad enabled: a backward follows (SyncBatchNorm reduces in it, even in no_sync)
_TRAINING = 8  # the module is in training mode: SyncBatchNorm gathers statistics in forward
_PENDING = 16  # joined, holding gradients deferred from a round the others have not finished


@runtime_checkable
class JoinShadow(Protocol):
    """A module with collectives of its own in forward and backward (SyncBatchNorm): what a
    joined rank runs in their place, with nothing to contribute."""

    def shadow_forward(self) -> None:
        """Answer one training forward's collectives."""

    def shadow_backward(self) -> None:
        """Answer one backward's collectives."""


class WrapperJoinHook(JoinHook):
    """The wrapper's part in torch's Join; see the module docstring.

    Invariants:
    - While active, every rank runs the same sequence of collectives: a rank still training
      runs them in forward and backward, a joined rank runs the same ones from `main_hook`.
    - Each forward inside the context is followed by at most one backward, and by exactly one
      when grad is enabled outside `no_sync()` (a joined rank shadows that backward).
    - Gradients reduced while some ranks have joined are the sum over ranks still training,
      divided by the initial world size (default) or by the number still training (ddptrain's
      transports; a torch hook divides by the group size itself, as in torch).
    - After the context every rank holds the same parameters (and buffers, when the wrapper
      broadcasts buffers): those of the highest-ranked rank among the last to finish.
      Optimizer state is not synchronized: a joined rank's optimizer skipped the steps it
      missed (a ZeroRedundancyOptimizer in the same Join keeps stepping its shard).
    """

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        # Shadowed in registration order forward, reverse in backward: the order they run in
        # for a network that calls each once, in the order it defines them.
        self._shadows = [m for m in ddp.module.modules() if isinstance(m, JoinShadow)]
        self.authoritative_rank: int | None = None
        # This rank's reduction was put off to the others' next one (module docstring).
        self.deferred = False
        self._sync_before_deferral = True
        self._pending = False
        self._closed = False

    def on_forward(self) -> int:
        """Called by the wrapper as a forward starts inside the context: returns the rank to
        take buffers from (rank 0 may have joined with stale ones)."""
        ddp = self.ddp
        if self.deferred:
            raise RuntimeError(
                "a forward after this rank's reduction was deferred under join: it ended its "
                "gradient accumulation while other ranks were still accumulating under "
                "no_sync(), which is only allowed for a rank whose data has run out. Every "
                "rank must synchronize after the same number of micro-batches until its data "
                "ends"
            )
        Join.notify_join_context(ddp)
        flags = _ACTIVE
        if torch.is_grad_enabled():
            flags |= _BACKWARD | (_REDUCES_GRADIENTS if ddp.require_backward_grad_sync else 0)
        if ddp.module.training:
            flags |= _TRAINING
        states = self._exchange(flags)
        if flags & _REDUCES_GRADIENTS and not _reduces(states):
            self.deferred, self._sync_before_deferral = True, ddp.require_backward_grad_sync
            self._pending = True
            ddp.require_backward_grad_sync = False
        ddp.set_gradient_divisor(self._divisor(states))
        return _active(states)[-1]

    def main_hook(self) -> None:
        """One iteration of the ranks still training, shadowed by a rank that has joined."""
        ddp = self.ddp
        states = self._exchange(_PENDING if self._pending else 0)
        active = _active(states)
        if not active:
            return
        if ddp.broadcast_buffers and self.world_size > 1:
            ddp.sync_buffers(active[-1])
        if self._shadows and any(s & _TRAINING for s in states):
            for module in self._shadows:
                module.shadow_forward()
            if any(s & _BACKWARD for s in states):
                for module in reversed(self._shadows):
                    module.shadow_backward()
        if not _reduces(states):
            return
        if self._pending:
            self._pending = False  # the deferred round's gradients, in place of zeros
        else:
            for p in ddp.parameters():
                p.grad = None
        ddp.reduce_gradients(self._divisor(states))

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: the model of the highest rank among the last to join."""
        candidate = torch.tensor([self.rank if is_last_joiner else -1], device=self._device())
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self.group)
        self.authoritative_rank = int(candidate.item())
        self.ddp.sync_from(self.authoritative_rank)
        self.close()

    def close(self) -> None:
        """Give the wrapper back its own settings (on any exit from the context; once)."""
        if self._closed:
            return
        self._closed = True
        if self.deferred:
            self.ddp.require_backward_grad_sync = self._sync_before_deferral
        self.ddp.end_join(self)

    def _divisor(self, states: list[int]) -> int:
        """Ranks whose gradients a reduction now sums: still training, or deferred."""
        if self.divide_by_initial_world_size:
            return self.world_size
        return sum(1 for s in states if s)

    def _exchange(self, flags: int) -> list[int]:
        states = torch.zeros(self.world_size, dtype=torch.int64, device=self._device())
        states[self.rank] = flags
        dist.all_reduce(states, group=self.group)
        return states.tolist()

    def _device(self) -> torch.device:
        return self.ddp.join_device


def _active(states: list[int]) -> list[int]:
    """The ranks still training in an exchanged vector."""
    return [r for r, s in enumerate(states) if s & _ACTIVE]


def _reduces(states: list[int]) -> bool:
    """Whether this forward's backward reduces gradients: some rank asks to, and no rank still
    training accumulates under no_sync() (that one reduces later, with the deferred ones)."""
    asks = any(s & _REDUCES_GRADIENTS for s in states)
    accumulates = any(s & _BACKWARD and not s & _REDUCES_GRADIENTS for s in states)
    return asks and not accumulates


class JoinContext:
    """What `model.join()` returns: torch's Join([model]), and the wrapper's own settings
    back on any exit (torch's Join skips its post hooks when the block raised)."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        divide_by_initial_world_size: bool,
        enable: bool,
        throw_on_early_termination: bool,
    ) -> None:
        self._join = Join(
            [ddp],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )
        # The wrapper's join hook: `deferred`, `authoritative_rank`.
        self.hook: WrapperJoinHook = ddp.join_hook_in_use

    @property
    def deferred(self) -> bool:
        """Whether this rank's last reduction was put off to the others' next (module doc)."""
        return self.hook.deferred

    @property
    def authoritative_rank(self) -> int | None:
        """The rank whose model every rank holds after the context."""
        return self.hook.authoritative_rank

    def __enter__(self) -> JoinContext:
        self._join.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._join.__exit__(exc_type, exc, tb)
        finally:
            self.hook.close()

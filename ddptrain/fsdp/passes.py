"""What one forward of the fully sharded wrapper and its backward track, and the checks that
turn a broken contract (units run in different orders, a gradient arriving late) into an error
naming the fix."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddptrain.fsdp.unit import Unit


class Pass:
    """What one forward and its backward track (a plain object: writes to nn.Module attributes
    cost ~10 us each, and the hooks make several per unit)."""

    __slots__ = (
        "callback_queued",
        "done",
        "freed_after_forward",
        "gather_order",
        "gather_position",
        "gathers_issued",
        "ran",
        "ready",
        "reduce_order",
        "reduced",
        "reducing",
        "sync",
    )

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.done = False
        self.ran: list[Unit] = []  # units in the order their forwards started
        self.freed_after_forward: list[Unit] = []  # in the order their forwards ended
        self.reduce_order: list[Unit] = []
        self.gather_order: list[Unit] = []
        self.gather_position: dict[int, int] = {}
        self.gathers_issued = 0
        self.reduced = 0
        self.ready: set[int] = set()
        self.reducing: list[Unit] = []
        self.callback_queued = False

    def enter(self, unit: Unit) -> None:
        """A unit's forward starts in this pass (grad enabled): record it, refusing a second
        run and a forward outside the wrapper's (the pass is over or never began)."""
        if self.done:
            raise RuntimeError(
                "a unit's forward ran with gradients outside the wrapper's forward (the wrapped "
                "module called directly?): call the FullyShardedDataParallel wrapper, or run "
                "under torch.no_grad() inside summon_full_params()"
            )
        if unit in self.ran:
            raise RuntimeError(
                f"unit {describe(unit)} ran twice in one forward; a unit runs once per forward "
                "(its gradients are reduced when its backward ends): make the module that is "
                "called twice part of a larger unit (units=[...])"
            )
        self.ran.append(unit)

    def check_current(self, current: Pass) -> None:
        """Refuse a backward hook of a pass that is over (a second backward, or one after
        another forward)."""
        if self is not current or self.done:
            raise RuntimeError(
                "backward of a forward that is over: backward was called twice on one forward, "
                "or after another forward, under FullyShardedDataParallel. Run each forward's "
                "backward before the next forward, once"
            )


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the gradients of those inputs are
    computed: the unit's own backward is over. Autograd runs ready nodes latest-created first
    and a parameter's AccumulateGrad before any, and this node was created before every op of
    the unit, so the unit's gradients are accumulated by then."""

    @staticmethod
    def forward(ctx: Any, on_backward: Any, *inputs: torch.Tensor) -> Any:
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.on_backward()
        return (None, *grads)


def describe(unit: Unit) -> str:
    return f"{type(unit.module).__name__} (parameters {', '.join(unit.names[:3])}, ...)"


def check_no_late_gradients(units: list[Unit]) -> None:
    """Raise if a gradient reached a whole parameter after its unit's gradients were reduced:
    it would be lost (never averaged), and added to the next step's."""
    for unit in units:
        for name, full in zip(unit.names, unit.full, strict=True):
            if full.grad is not None:
                full.grad = None
                raise RuntimeError(
                    f"the gradient of {name!r} arrived after its unit's gradients were reduced: "
                    "its unit's backward was taken to be over when the gradients of the unit's "
                    "inputs were computed. Use the parameter only inside its unit's forward, or "
                    "make the unit larger (units=[...])"
                )


def check_same_order(ran: list[Unit], units: list[Unit], group: Any) -> None:
    """Raise on every rank if ranks ran different units, or in different orders."""
    if dist.get_world_size(group) == 1:
        return
    index = {id(u): i for i, u in enumerate(units)}
    mine = [index[id(u)] for u in ran]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise RuntimeError(
                f"ranks ran different units in their first forward (rank 0: {everyone[0]}, rank "
                f"{rank}: {theirs}, by unit index): every rank must run the same units in the "
                "same order, or their gathers pair up wrongly. Make a branch that only some "
                "ranks take part of a larger unit"
            )

"""What one forward of the fully sharded wrapper and its backward track, the order every rank
gathers its units in, and the checks that turn a broken contract (a unit run twice, a gradient
arriving late) into an error naming the fix."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddptrain.ddp.hooks import global_rank
from ddptrain.fsdp.unit import Unit


class Pass:
    """What one forward and its backward track (a plain object: writes to nn.Module attributes
    cost ~10 us each, and the hooks make several per unit)."""

    __slots__ = (
        "callback_queued",
        "done",
        "gather_order",
        "gather_position",
        "gathers_issued",
        "ran",
        "ready",
        "reduce_order",
        "reduced",
        "reducing",
        "skipped",
        "skipped_checked",
        "sync",
    )

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.done = False
        self.ran: list[Unit] = []  # units in the order their forwards started
        self.skipped: set[int] = set()  # ids of the units this rank's forward did not run
        self.reduce_order: list[Unit] = []
        self.gather_order: list[Unit] = []
        self.gather_position: dict[int, int] = {}
        self.gathers_issued = 0
        self.skipped_checked = 0  # gather_order's units free_skipped has looked at
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

    def plan_backward(self, order: list[Unit], root: Unit | None, reshard: bool) -> None:
        """After a training forward, this pass's backward orders from the units' shared
        `order`, the same on every rank whichever units ran here; `root`: the unit of the whole
        module, if any (never freed after a training forward: its backward comes first)."""
        ran = {id(u) for u in self.ran}
        self.skipped = {id(u) for u in order if id(u) not in ran}
        # Reductions in reverse forward order (units whose backward ends first); a unit this
        # rank skipped has no backward to wait for: its gradients (none, or no_sync()'s) are
        # complete now.
        self.reduce_order = order[::-1]
        self.ready.update(self.skipped)
        if reshard:
            # Every unit but the root is gathered again, here too if this rank skipped it: it
            # pairs with the gathers of the ranks that ran it.
            self.gather_order = [u for u in reversed(order) if u is not root]
            self.gather_position = {id(u): i for i, u in enumerate(self.gather_order)}

    def issue_gathers(self, count: int) -> None:
        """Start the gathers of the first `count` units of gather_order not yet started."""
        while self.gathers_issued < min(count, len(self.gather_order)):
            self.gather_order[self.gathers_issued].gather()
            self.gathers_issued += 1

    def free_skipped(self, position: int) -> None:
        """Free the units before `position` in gather_order that this rank's forward skipped:
        gathered only to pair with the other ranks', and no backward of theirs runs here."""
        while self.skipped_checked < position:
            unit = self.gather_order[self.skipped_checked]
            self.skipped_checked += 1
            if id(unit) in self.skipped:
                unit.free()

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


class Schedule:
    """The order of a forward's gathers: every unit, in the same order on every rank, whichever
    units this rank's forward runs, so that each gather pairs with the same unit's on the other
    ranks (a branch some micro-batches take can be a unit of its own).

        schedule.begin()                # a forward of the wrapper starts
        schedule.issue_through(unit)    # before unit's forward: its gather and the next one's
        schedule.end()                  # the gathers of the units this forward did not reach
    """

    __slots__ = ("issued", "position", "units")

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.position = {id(u): i for i, u in enumerate(units)}
        self.issued: int | None = None  # gathers started in this forward; None: outside one

    def begin(self) -> None:
        self.issued = 0

    def issue_through(self, unit: Unit) -> None:
        """Start the gathers up to `unit`'s and the next unit's (a prefetch: it travels while
        `unit` computes); nothing outside a forward of the wrapper."""
        if self.issued is None:
            return
        stop = min(self.position[id(unit)] + 2, len(self.units))
        while self.issued < stop:
            self.units[self.issued].gather()
            self.issued += 1

    def end(self) -> None:
        """The forward is over: start the gathers it did not reach (the units it skipped)."""
        if self.issued is None:
            return
        for unit in self.units[self.issued :]:
            unit.gather()
        self.issued = None


def forward_order(ran: list[int], count: int) -> list[int]:
    """Unit indices 0..count-1 in the order of a forward that ran `ran`, each unit it did not
    run placed just after the unit before it in module order (unit 0 first)."""
    order = list(ran)
    for k in range(count):
        if k not in order:
            order.insert(order.index(k - 1) + 1 if k else 0, k)
    return order


def learn_order(ran: list[Unit], units: list[Unit], group: Any) -> list[Unit]:
    """Collective: the units in the order of rank 0's forward (`ran` there), the same list on
    every rank: the schedule of later forwards' gathers."""
    index = {id(u): i for i, u in enumerate(units)}
    mine = [[index[id(u)] for u in ran]]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(mine, src=global_rank(group, 0), group=group)
    return [units[i] for i in forward_order(mine[0], len(units))]

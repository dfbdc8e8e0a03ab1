"""The profile's marks: when each parameter's gradient was ready, when each unit's forward ran,
when each bucket reached the comm hook, and what one forward saves for backward.

    marks = Marks(meter, model, params, units, param_hooks=True)   # hooks on the model
    timer = HookTimer(meter); build(setup, device, timer.wrap)       # the comm hook, timed
    total, per_unit = activation_bytes(model, work, x, y, params, marks, device)

Every mark is a stamp of the profile's meter (meter.py): CPU seconds of the thread, or a CUDA
event on the stream the work runs on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddptrain.fsdp.layout import group_parameters
from ddptrain.plan.meter import Meter


class Marks:
    """When each parameter's gradient was ready, and when each unit's forward ran."""

    def __init__(
        self,
        meter: Meter,
        root: nn.Module,
        params: list[torch.Tensor],
        units: list[nn.Module],
        param_hooks: bool,
    ) -> None:
        self.meter = meter
        self.ready: dict[int, Any] = {}
        self.spans: dict[int, list[Any]] = {}
        self.units = units
        self.n = len(params)
        index = {id(p): i for i, p in enumerate(params)}
        groups = group_parameters(root, units) if units else []
        self.members = [[index[id(r.param)] for r in refs] for refs in groups]
        for k, unit in enumerate(units):
            unit.register_forward_pre_hook(self._enter(k))
            unit.register_forward_hook(self._leave(k))
        for i, p in enumerate(params):
            if p.requires_grad and param_hooks:
                p.register_post_accumulate_grad_hook(self._ready(i))

    def _ready(self, i: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            self.ready[i] = self.meter.stamp()

        return hook

    def _enter(self, k: int) -> Any:
        def hook(*_: Any) -> None:
            if torch.is_grad_enabled():
                self.spans[k] = [self.meter.stamp()]

        return hook

    def _leave(self, k: int) -> Any:
        def hook(*_: Any) -> None:
            if torch.is_grad_enabled() and k in self.spans:
                self.spans[k].append(self.meter.stamp())

        return hook

    def clear(self) -> None:
        self.ready.clear()
        self.spans.clear()

    def ready_offsets(self, t: float) -> list[float]:
        """Seconds after `t` (from the step's start) each parameter's gradient was ready."""
        at = {i: self.meter.seconds(s) for i, s in self.ready.items()}
        return [at.get(i, t) - t for i in range(self.n)]

    def forward_spans(self, t: float) -> list[list[float]]:
        """Each unit's forward start and end, seconds after `t`."""
        spans = {k: [self.meter.seconds(s) for s in v] for k, v in self.spans.items()}
        return [[s - t for s in spans.get(k, [t, t])] for k in range(len(self.units))]

    def unit_members(self) -> list[list[int]]:
        return self.members

    def unit_of_now(self) -> int | None:
        """The innermost unit whose forward is running (units come root first, pre-order)."""
        open_units = [k for k, s in self.spans.items() if len(s) == 1]
        return max(open_units, default=None)


class HookTimer:
    """Per bucket: the step's clock when the comm hook got it (the bucket's ready time), and
    the hook's own seconds (CPU: of the thread that runs it)."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.at_start: list[Any] = []
        self.spans: list[tuple[Any, Any]] = []

    def clear(self) -> None:
        self.at_start, self.spans = [], []

    def wrap(self, hook: Any) -> Any:
        def timed(state: Any, bucket: Any) -> Any:
            self.at_start.append(self.meter.stamp())
            start = self.meter.own_stamp()
            out = hook(state, bucket)
            self.spans.append((start, self.meter.own_stamp()))
            return out

        return timed

    def ready_seconds(self) -> list[float]:
        """Seconds from the step's start to each bucket's hook (after the step's finish)."""
        return [self.meter.seconds(s) for s in self.at_start]

    def own_seconds(self) -> list[float]:
        """The hook's own seconds on each bucket."""
        if self.meter.device == "cpu":
            return [b - a for a, b in self.spans]
        return [self.meter.seconds(b) - self.meter.seconds(a) for a, b in self.spans]


def activation_bytes(
    model: nn.Module,
    work: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    params: list[torch.Tensor],
    marks: Marks,
    device: torch.device,
) -> tuple[int, list[int]]:
    """Bytes of the distinct storages on `device` one forward saves for backward, not
    parameters': in all, and per unit (by the innermost unit running when saved; sharded
    strategies only)."""
    seen: dict[int, tuple[int, int | None]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        skip = {p.untyped_storage().data_ptr() for p in params}
        on_device = storage.device.type == device.type
        if on_device and ptr not in skip and ptr not in seen and storage.nbytes() > 0:
            seen[ptr] = (storage.nbytes(), marks.unit_of_now())
        return t

    marks.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = work.loss(model(x), y)
    loss.backward()
    total = sum(n for n, _ in seen.values())
    per_unit = [0] * len(marks.units)
    for n, k in seen.values():
        if k is not None:
            per_unit[k] += n
    return total, per_unit

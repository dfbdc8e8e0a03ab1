"""The sharded wrapper with deterministic=True: the same bits at any world size, and the same
bits as the DDP wrapper's exact mode (ddp/deterministic.py).

    exact = ExactGradients(module, group)          # collective: rank 0's seed, a group
    exact.backward_started()                       # each backward, once
    exact.accumulate(unit)                         # a unit's backward is done: round its grads
    exact.reduce(unit); exact.finish(unit)         # synchronized: reduce-scatter int64, mean
    exact.end_step()                               # BatchNorm statistics, the next step

Each unit keeps, for the step, one int64 accumulator laid out as its reduce-scatter sends:
every rank's part, then a tail (used flags, micro-batch count, overflows). A micro-batch's
whole gradients are rounded into it on the grid of each parameter (agreed from rank 0's first
micro-batch, one broadcast per unit per step) and freed, so a step holds the accumulators
(8 bytes an element) where accumulation under no_sync() holds the float gradients. The
synchronized backward reduce-scatters the integers, and each rank turns its part into the
mean, element by element as the DDP wrapper does: the same bits at every stage.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.ddp.exact import COUNT_BITS, add_fixed, fixed_point_shift, mean_from_fixed
from ddptrain.ddp.hooks import global_rank, new_group_like, release_group
from ddptrain.ddp.micro_batches import MicroBatchForwards
from ddptrain.fsdp.unit import Unit, in_memory_order, reduce_scatter_single

_TAIL = 2  # after the used flags: the micro-batch count, the overflows


class ExactGradients:
    """A unit's exact sums over a step's micro-batches and ranks (module docstring)."""

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.forwards = MicroBatchForwards(module, group)
        self.world_size = dist.get_world_size(group)
        # Rank 0's magnitudes travel on a group of their own, between the gathers' and the
        # reduce-scatters' collectives on theirs.
        self._group = new_group_like(group)
        self.micro_batches = 0
        self.count = 0
        # Whether the last step's sums overflowed (its gradients are then inf).
        self.overflowed = False
        self._shifts: dict[int, list[int]] = {}
        self._acc: dict[int, torch.Tensor] = {}
        self._used: dict[int, list[bool]] = {}
        self._overflows: dict[int, torch.Tensor | int] = {}
        self._received: dict[int, tuple[Any, torch.Tensor]] = {}

    @property
    def step(self) -> int:
        """Synchronized backwards so far (keys micro-batches' random numbers)."""
        return self.forwards.step

    @step.setter
    def step(self, value: int) -> None:
        self.forwards.step = value

    def backward_started(self) -> None:
        """One more micro-batch: a backward begins (under no_sync() or not)."""
        if self.micro_batches == 0:
            self.overflowed = False
        self.micro_batches += 1

    def accumulate(self, unit: Unit) -> None:
        """After the unit's backward: its whole gradients into the accumulator, then freed."""
        key = id(unit)
        if key not in self._shifts:
            self._shifts[key] = self._agree(unit)
        ws, shard, n = unit.world_size, unit.layout.shard_numel, len(unit.full)
        if key not in self._acc:
            width = shard + n + _TAIL
            self._acc[key] = torch.zeros(ws, width, dtype=torch.int64, device=unit.device)
            self._used[key], self._overflows[key] = [False] * n, 0
        parts, shifts, used = self._acc[key], self._shifts[key], self._used[key]
        for j, full in enumerate(unit.full):
            if full.grad is None:
                continue
            used[j] = True
            flat = in_memory_order(full.grad, unit.strides[j])
            for rank in range(ws):
                _, a, b, at = unit.all_pieces[rank][j]
                overflow = add_fixed(parts[rank, at : at + b - a], flat[a:b], shifts[j])
                self._overflows[key] = overflow + self._overflows[key]
            full.grad = None

    def _agree(self, unit: Unit) -> list[int]:
        """Collective: each parameter's grid from rank 0's first micro-batch of the step."""
        peaks = torch.zeros(len(unit.full), dtype=torch.float64, device=unit.device)
        if self.forwards.rank == 0:
            for j, full in enumerate(unit.full):
                if full.grad is not None and full.grad.numel():
                    peaks[j] = full.grad.detach().abs().amax().double()
        if self.world_size > 1:
            dist.broadcast(peaks, global_rank(self._group, 0), group=self._group)
        return [fixed_point_shift(v) for v in peaks.tolist()]

    def reduce(self, unit: Unit) -> None:
        """Collective on the reduce group: start reduce-scattering the unit's integers."""
        key = id(unit)
        parts = self._acc.pop(key)
        n = len(unit.full)
        tail = [*map(int, self._used.pop(key)), self.micro_batches, int(self._overflows.pop(key))]
        parts[:, -n - _TAIL :] = torch.tensor(tail, dtype=torch.int64)
        receive = torch.empty(parts.shape[1], dtype=torch.int64, device=unit.device)
        work = reduce_scatter_single(
            receive, parts.view(-1), group=unit.reduce_group, async_op=True
        )
        self._received[key] = (work, receive)

    def finish(self, unit: Unit) -> None:
        """Wait for the unit's reduce-scatter; each shard's .grad becomes its piece of the
        mean (inf on an overflow); a parameter no rank used keeps its .grad."""
        work, receive = self._received.pop(id(unit))
        work.wait()
        shifts = self._shifts.pop(id(unit))
        *flags, count, overflows = receive[unit.layout.shard_numel :].tolist()
        self.count = count
        overflowed = bool(overflows) or count > 2**COUNT_BITS
        self.overflowed = self.overflowed or overflowed
        for j, (piece, shard_param) in enumerate(zip(unit.pieces, unit.shards, strict=True)):
            if not (flags[j] and shard_param.requires_grad):
                continue
            _, a, b, at = piece
            grad = torch.empty(b - a, dtype=shard_param.dtype, device=shard_param.device)
            if overflowed:
                grad.fill_(math.inf)
            else:
                mean_from_fixed(receive[at : at + b - a], shifts[j], count, grad)
            shard_param.grad = grad

    def end_step(self) -> None:
        """After the synchronized backward: the step's BatchNorm statistics (collective), and
        a new step."""
        self.forwards.combine(self.count)
        self.micro_batches, self._shifts = 0, {}

    def close(self) -> None:
        release_group(self._group)
        self._group = None

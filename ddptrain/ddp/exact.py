"""Sums whose bits do not depend on their order: fixed-point integers for gradients and norms.

    shift = fixed_point_shift(reference)          # per parameter, from an agreed magnitude
    acc = torch.zeros(numel, dtype=torch.int64)   # the accumulator (a bucket slot)
    overflowed = add_fixed(acc, grad, shift)      # acc += round(grad * 2**shift), exactly
    ... acc summed over ranks by any all_reduce: integer addition is associative ...
    mean_from_fixed(acc, shift, count, grad)      # grad = acc * 2**-shift / count, rounded
    norm = exact_norm(grads, group)               # the same bits however the grads are split

A float sum's last bits depend on the order of its additions, so a mean over ranks changes
with the number of ranks. Rounding each term once to a grid of 2**-shift and adding integers
does not: any grouping, any ring or tree, any backend gives the same sum, which is rounded
once more when it becomes a float mean. The grid is per parameter: its spacing is 2**-34 of
the reference magnitude (the largest element of one agreed micro-batch's gradient), so
elements near it keep more bits than a float32 sum would and elements 10**6 times smaller keep
about fourteen; a term more than 2**HEADROOM_BITS times the reference, or more than
2**COUNT_BITS terms in one sum, would not fit in 63 bits: that is an overflow, reported, never
wrapped around.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.ddp.buckets import memory_format, memory_order
from ddptrain.ddp.hooks import CommHook, Transport, global_rank, transport_hook
from ddptrain.ddp.micro_batches import MicroBatchForwards
from ddptrain.ddp.reducer import Reducer, refuse_create_graph, span

# A term may be this many powers of two above the reference before it overflows.
HEADROOM_BITS = 16
# Up to 2**COUNT_BITS terms (micro-batches summed over every rank) in one accumulator.
COUNT_BITS = 12
# Bits of an int64 the magnitudes may use (one spare below the sign bit).
_VALUE_BITS = 62
# Integers a float64 holds exactly, sums of them included.
FLOAT_EXACT = 2.0**53
# Elements per piece converted at once: its float64 scratch (2 MiB) stays in cache, and each
# operation on it is long enough that its dispatch costs little.
_PIECE = 1 << 18


def fixed_point_shift(reference: float) -> int:
    """The power of two a gradient is scaled by before rounding: values up to
    reference * 2**HEADROOM_BITS, summed 2**COUNT_BITS times, still fit in 62 bits. A zero
    (micro-batch 0 did not reach the parameter) or non-finite reference counts as 1.0."""
    if not math.isfinite(reference) or reference <= 0:
        reference = 1.0
    exponent = math.frexp(reference)[1]  # reference < 2**exponent
    return _VALUE_BITS - COUNT_BITS - HEADROOM_BITS - exponent


def term_bound(shift: int) -> float:
    """The largest magnitude a term may have under `shift` without overflowing."""
    return math.ldexp(1.0, _VALUE_BITS - COUNT_BITS - shift)


def _flat_pair(acc: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad and acc as 1-D views with their elements in the same order (acc's layout)."""
    grad = grad.detach()
    if grad.stride() != acc.stride():
        grad = grad.contiguous(memory_format=memory_format(acc))
    if acc.is_contiguous():
        return grad.view(-1), acc.view(-1)
    return memory_order(grad), memory_order(acc)


def add_fixed(
    acc: torch.Tensor, grad: torch.Tensor, shift: int, *, first: bool = False
) -> torch.Tensor:
    """acc += round(grad * 2**shift) (acc: int64, grad's shape, any dense layout; `first`:
    acc = ..., whatever it held). Returns a 0-dim bool tensor, True if a term was out of
    range: it was clipped to the bound and the sum is not to be used (a tensor, so that an
    accelerator never waits for it)."""
    flat, target = _flat_pair(acc, grad)
    if not flat.numel():
        return torch.zeros((), dtype=torch.bool, device=acc.device)
    bound = term_bound(shift)
    lo, hi = torch.aminmax(flat)
    # Written so that NaN counts as out of range.
    overflow = torch.logical_not((lo >= -bound) & (hi <= bound))
    scale = math.ldexp(1.0, shift)
    limit = bound * scale
    for start in range(0, flat.numel(), _PIECE):
        # float64 holds every float32 times a power of two exactly; round half to even.
        piece = flat[start : start + _PIECE].to(torch.float64)
        piece.mul_(scale).clamp_(-limit, limit).round_()
        out = target[start : start + piece.numel()]
        if first:
            out.copy_(piece)
        else:
            out.add_(piece.to(torch.int64))
    return overflow


def add_fixed_float(
    acc: torch.Tensor,
    grad: torch.Tensor,
    shift: int,
    room: float,
    *,
    first: bool = False,
    last: bool = False,
) -> float | None:
    """acc += round(grad * 2**shift) with acc float64 holding integers, if every term's
    magnitude is within `room` and the term bound; returns the largest, or None (acc and grad
    left as they were: add_fixed is the way then). The caller keeps every partial sum within
    FLOAT_EXACT, so each add is exact and the sum independent of order, as in int64; on a CPU,
    float64's conversions and adds cost about a third of int64's. `first`: acc = ..., whatever
    it held; `last`: the sum is written as int64 into acc's memory (float_to_fixed's result).
    grad (float32 or float64) is consumed: it is scaled and rounded in place, no scratch."""
    if grad.dtype not in (torch.float32, torch.float64) or not -126 <= shift <= 127:
        return None  # a power of two outside float32's range: add_fixed works in float64
    flat, target = _flat_pair(acc, grad)
    if not flat.numel():
        return 0.0
    lo, hi = (v.item() for v in torch.aminmax(flat))
    peak = math.ldexp(max(-lo, hi), shift)
    # Written so that NaN fails it.
    if not (peak <= room and peak <= math.ldexp(term_bound(shift), shift)):
        return None
    scale = math.ldexp(1.0, shift)
    ints = target.view(torch.int64)
    for start in range(0, flat.numel(), _PIECE):
        # A float32 times a power of two it can hold is exact; round half to even.
        piece = flat[start : start + _PIECE].mul_(scale).round_()
        n = piece.numel()
        if first:
            target[start : start + n].copy_(piece)
        else:
            target[start : start + n].add_(piece)
        if last:
            # Same-size elements: each is read before it is overwritten in place.
            ints[start : start + n].copy_(target[start : start + n])
    return peak


def float_to_fixed(acc: torch.Tensor) -> torch.Tensor:
    """The int64 view of a float64 accumulator of integers (each |value| <= FLOAT_EXACT),
    converted in place."""
    flat = memory_order(acc)
    # Same-size elements: each is read before it is overwritten.
    flat.view(torch.int64).copy_(flat)
    return acc.view(torch.int64)


def mean_from_fixed(acc: torch.Tensor, shift: int, count: int, out: torch.Tensor) -> None:
    """out = acc * 2**-shift / count, each element rounded to out's dtype (every rank, every
    world size: the same bits from the same sum); out and acc share one dense layout."""
    flat_out = memory_order(out) if out.stride() == acc.stride() else None
    source = memory_order(acc)
    scale = math.ldexp(1.0, -shift)
    piece = torch.empty(min(_PIECE, source.numel()), dtype=torch.float64, device=acc.device)
    result = []
    for start in range(0, source.numel(), _PIECE):
        n = min(_PIECE, source.numel() - start)
        p = piece[:n]
        p.copy_(source[start : start + n]).mul_(scale).div_(count)
        if flat_out is not None:
            flat_out[start : start + n].copy_(p)
        else:
            result.append(p.to(out.dtype))
    if flat_out is None:
        out.copy_(torch.cat(result).view(out.shape) if result else out)


def exact_norm(
    grads: list[torch.Tensor], group: Any = None, sharded: bool = False, numel: int | None = None
) -> torch.Tensor:
    """The 2-norm of all `grads` (float32), the same bits whatever their order or split: each
    square rounded to a grid fixed by the largest element, summed as integers. `sharded`: each
    rank holds a part of the gradient (collective: one MAX, one SUM on `group`), and `numel`
    bounds the whole gradient's elements at any world size (the model's); else every rank
    holds all of it and nothing is sent. Non-finite gradients give a non-finite norm."""
    device = grads[0].device if grads else torch.device("cpu")
    numel = sum(g.numel() for g in grads) if numel is None else numel
    peak = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g.numel():
            peak = torch.maximum(peak, g.detach().abs().amax().double())
    # NaN does not survive a MAX on every backend: as inf it does, and wins.
    peak = torch.nan_to_num(peak, nan=math.inf, posinf=math.inf)
    if sharded and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    top = peak.item()
    if not math.isfinite(top):
        return torch.tensor(math.inf, dtype=torch.float32, device=device)
    if top == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    # (top * scale)**2 * numel stays below 2**62: the integer sum cannot overflow.
    square_bits = _VALUE_BITS - max(0, math.ceil(math.log2(max(numel, 1))))
    shift = square_bits // 2 - math.frexp(top)[1]
    scale = math.ldexp(1.0, shift)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for g in grads:
        flat = g.detach().reshape(-1)
        for start in range(0, flat.numel(), _PIECE):
            squares = flat[start : start + _PIECE].double().mul_(scale).square_().round_()
            total += squares.to(torch.int64).sum()
    if sharded and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return (total.double() * math.ldexp(1.0, -2 * shift)).sqrt().float()


# ----------------------------------------------------------------------------- the exact mode
class ExactReducer(Reducer):
    """The reducer of DistributedDataParallel(deterministic=True): every micro-batch's gradient
    is rounded into an int64 accumulator, its bucket slot, and buckets are summed as integers,
    so after the synchronized backward each .grad is the mean over every rank's micro-batches
    with the same bits at any world size (design.md, "Same bits at any world size").

    - The grid of each parameter is agreed once per step, from rank 0's first micro-batch
      (micro-batch 0 at every world size): its gradients wait in .grad until the end of that
      backward, then one broadcast of n magnitudes; later ones go straight into the slots.
    - Micro-batch k (counted over ranks: k = j * world_size + rank for a rank's j-th) draws
      its random numbers from micro_batch_seed(seed, step, k), seed being rank 0's.
    - Its BatchNorm layers update their running statistics from where the step began; the
      step's statistics are the mean of the micro-batches' results, in the order of k.
    - The last bucket's tail sums the used flags, the micro-batch count (the mean's divisor),
      overflows and the carried value: still one reduction per bucket.
    """

    bucket_dtype = torch.int64

    def __init__(self, module: nn.Module, *args: Any) -> None:
        super().__init__(*args)
        self.forwards = MicroBatchForwards(module, self.process_group)
        # This rank's backwards since the last synchronized one.
        self.micro_batches = 0
        # Per parameter, the grid's exponent for this step; None until the first backward ends.
        self.shifts: list[int] | None = None
        # Whether the last synchronized backward overflowed (its gradients are then inf).
        self.overflowed = False
        self._overflows = torch.zeros((), dtype=torch.int64)
        self._in_backward = False
        # Per parameter: a bound on its slot's partial sums while the slot holds float64
        # integers (add_fixed_float), None once it holds int64 (always on an accelerator).
        self._float_sums: list[float | None] = []
        self._reset_float_sums()

    def _reset_float_sums(self) -> None:
        """A new step: every slot is written by its first term, in float64 on a CPU."""
        on_cpu = not self.params or self.params[0].device.type == "cpu"
        self._float_sums = [0.0 if on_cpu else None] * len(self.params)
        self._written = [False] * len(self.params)

    @property
    def step(self) -> int:
        """Synchronized backwards so far: keys the micro-batches' random numbers; a resumed
        run sets it to the step it resumes from."""
        return self.forwards.step

    @step.setter
    def step(self, value: int) -> None:
        self.forwards.step = value

    def use_hook(self, state: object, hook: CommHook) -> None:
        """Only a Transport that sums int64 buckets exactly (not a cast, not a torch hook)."""
        if not (isinstance(state, Transport) and hook is transport_hook and state.sums_exactly):
            raise ValueError(
                f"deterministic=True sums integer buckets; {type(state).__name__} with "
                f"{getattr(hook, '__name__', hook)} does not (a torch hook, a bf16/fp16 cast or "
                "PowerSGD rounds them): use the default hook, or named_hook('allreduce'), 'shm', "
                "'tcp' or 'ring'"
            )
        super().use_hook(state, hook)

    def _tail_values(self) -> list[int]:
        return [*self.used, self.micro_batches, int(self._overflows), self._carry_value]

    def claim_slot(self, param: torch.Tensor) -> None:
        return None  # slots are integers: autograd never writes a gradient there

    def reduce_gradients(self, divisor: int | None = None) -> None:
        raise RuntimeError(
            "uneven inputs (torch's Join) are not supported with deterministic=True: a rank "
            "that runs out changes which micro-batches make a step"
        )

    # ----------------------------------------------------------------------------- backward
    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        self.used[index] = True
        if not self._in_backward:
            self._in_backward = True
            self.micro_batches += 1
            if self.sync:
                self._start_reducing(index)
            else:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_micro_batch)
        elif self.ready[index]:
            raise RuntimeError(
                f"gradient of '{self.names[index]}' became ready twice in one backward"
            )
        refuse_create_graph(param.grad)
        self.ready[index] = True
        if self.sync and self._ready_order is not None:
            self._ready_order.append(index)
        if self.shifts is None:
            return  # the step's first backward: in .grad until the grids are agreed
        self._accumulate(index)
        if self.sync and self._bucket_of[index].arrived():
            self._launch_ready_buckets()

    def _accumulate(self, index: int) -> None:
        param, slot, shift = self.params[index], self._views[index], self.shifts[index]
        first, self._written[index] = not self._written[index], True
        with span("ddptrain.fill bucket", self._bucket_of[index].index):
            bound = self._float_sums[index]
            if bound is not None:
                # The sync backward holds this rank's last term of the step: int64 for the sum.
                peak = add_fixed_float(
                    slot.view(torch.float64),
                    param.grad,
                    shift,
                    FLOAT_EXACT - bound,
                    first=first,
                    last=self.sync,
                )
                if peak is None and not first:
                    self._to_fixed(index)
                self._float_sums[index] = None if peak is None or self.sync else bound + peak
                if peak is not None:
                    param.grad = None
                    return
            overflow = add_fixed(slot, param.grad, shift, first=first)
            self._overflows = self._overflows.to(overflow.device) + overflow
        param.grad = None

    def _to_fixed(self, index: int) -> None:
        if self._float_sums[index] is not None:
            float_to_fixed(self._views[index].view(torch.float64))
            self._float_sums[index] = None

    def _agree_grids(self) -> None:
        """End of the step's first backward: every rank takes rank 0's magnitudes (one
        broadcast), then rounds what waits in .grad."""
        device = self.buckets[0].flat.device if self.buckets else torch.device("cpu")
        peaks = torch.zeros(len(self.params), dtype=torch.float64, device=device)
        if self.forwards.rank == 0:
            for i, p in enumerate(self.params):
                if self.ready[i] and p.grad is not None and p.grad.numel():
                    peaks[i] = p.grad.detach().abs().amax().double()
        if self.world_size > 1:
            dist.broadcast(peaks, global_rank(self.process_group, 0), group=self.process_group)
        self.shifts = [fixed_point_shift(v) for v in peaks.tolist()]
        for i, ready in enumerate(self.ready):
            if ready and self.params[i].grad is not None:
                self._accumulate(i)

    def _end_micro_batch(self) -> None:
        """Queued at the end of a backward under no_sync()."""
        if self.shifts is None:
            self._agree_grids()
        self._in_backward = False
        self.ready = [False] * len(self.params)

    def _finalize_buckets(self) -> None:
        self.synchronized_once = True
        try:
            if self.shifts is None:
                self._agree_grids()
                for i, ready in enumerate(self.ready):
                    if ready:
                        self._bucket_of[i].arrived()
            for i, ready in enumerate(self.ready):
                if not ready:
                    if self._written[i]:
                        self._to_fixed(i)
                    else:
                        self._views[i].zero_()  # no micro-batch of this rank reached it
                    self._bucket_of[i].arrived()
            self._launch_ready_buckets()
            started = time.perf_counter()
            for b, bucket in enumerate(self.buckets):
                with span("ddptrain.wait bucket", b):
                    bucket.wait()
            self.last_comm_wait_s = time.perf_counter() - started
            *flags, count, overflows, carried = self._tail.tolist()
            self._carry_value, self.carried = 0, carried
            self.forwards.combine(count)
            self.overflowed = bool(overflows) or count > 2**COUNT_BITS
            for index, p in enumerate(self.params):
                if flags[index]:
                    p.grad = torch.empty_like(p)
                    if self.overflowed:
                        p.grad.fill_(math.inf)
                    else:
                        mean_from_fixed(self._views[index], self.shifts[index], count, p.grad)
            if self._ready_order is not None:
                self._rebuild_in_ready_order()
        except BaseException:
            self._runner.close()
            raise
        finally:
            self._reset_step()
            self.shifts, self._in_backward = None, False
            self._overflows = torch.zeros((), dtype=torch.int64)
            self._reset_float_sums()
            self.micro_batches = 0

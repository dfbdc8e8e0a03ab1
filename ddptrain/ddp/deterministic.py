"""The DDP wrapper's deterministic mode: DistributedDataParallel(deterministic=True).

    model = DistributedDataParallel(net, deterministic=True)   # builds an ExactReducer
    for j, (x, y) in enumerate(micro_batches):                  # micro-batch k = j * W + rank
        with model.no_sync() if j < last else contextlib.nullcontext():
            loss_fn(model(x), y).backward()                     # the loss undivided
    # .grad: the mean over every rank's micro-batches, the same bits at any world size

Each micro-batch's gradient is rounded into an int64 slot of its bucket (exact.py's
fixed-point sums) and the buckets are summed as integers: see design.md, "Same bits at any
world size".
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.ddp.buckets import memory_order, view_like
from ddptrain.ddp.exact import (
    COUNT_BITS,
    FLOAT_EXACT,
    PIECE,
    add_fixed,
    add_fixed_floats,
    fixed_point_shift,
    float_to_fixed,
    largest_magnitudes,
    means_from_fixed,
    means_of_part,
    warm_up,
)
from ddptrain.ddp.hooks import CommHook, GradBucket, Transport, global_rank, transport_hook
from ddptrain.ddp.micro_batches import MicroBatchForwards
from ddptrain.ddp.reducer import Reducer, refuse_create_graph
from ddptrain.ddp.spans import span

# Gradients wait to be rounded until this many elements wait (or their backward ends, or their
# bucket is full), then go in one call per operation: a small tensor's conversion costs its
# calls, not its bytes, and a model of many small tensors pays that per micro-batch.
_WAITING_NUMEL = 1 << 18
# A bucket of more elements has its means computed by the ranks that sum it, each its part
# (Transport.reduce_finished), where the transport can: a smaller one's cost less than the
# barrier that takes.
FINISH_NUMEL = PIECE
# The BatchNorm statistics of a step travel in the last bucket's tail up to this many elements
# (count * record_numel), summed with the gradients; more go by an all_gather of their own.
_RECORDS_NUMEL = 1 << 18


class ExactReducer(Reducer):
    """The reducer of DistributedDataParallel(deterministic=True): every micro-batch's gradient
    is rounded into an int64 accumulator, its bucket slot, and buckets are summed as integers,
    so after the synchronized backward each .grad is the mean over every rank's micro-batches
    with the same bits at any world size (design.md, "Same bits at any world size").

    - The grid of each parameter is agreed once per step, from rank 0's first micro-batch
      (micro-batch 0 at every world size): its gradients wait until the end of that backward,
      then one broadcast of n magnitudes, which overlaps the next forward; later gradients go
      into the slots (small ones several at a time), summed in float64 on a CPU while that
      stays exact.
    - Micro-batch k (counted over ranks: k = j * world_size + rank for a rank's j-th) draws
      its random numbers from micro_batch_seed(seed, step, k), seed being rank 0's.
    - Its BatchNorm layers update their running statistics from where the step began; the
      step's statistics are the mean of the micro-batches' results, in the order of k.
    - The last bucket's tail sums the used flags, the micro-batch count (the mean's divisor),
      overflows, the carried value and, from the second step, the BatchNorm statistics (each
      rank's in its own place, zero elsewhere): still one reduction per bucket.
    """

    bucket_dtype = torch.int64

    def __init__(self, module: nn.Module, *args: Any) -> None:
        super().__init__(*args)
        self.forwards = MicroBatchForwards(module, self.process_group)
        # This rank's backwards since the last synchronized one.
        self.micro_batches = 0
        # Per parameter, the grid's exponent for this step; None until the first backward ends.
        self.shifts: list[int] | None = None
        # Rank 0's magnitudes on their way.
        self._agreement: tuple[Any, torch.Tensor] | None = None
        # Gradients not yet in their slots (index, gradient): for the grids, or for company.
        self._waiting: list[tuple[int, torch.Tensor]] = []
        self._waiting_numel = 0
        # Whether the last synchronized backward overflowed (its gradients are then inf).
        self.overflowed, self._in_backward = False, False
        self._overflows = torch.zeros((), dtype=torch.int64)
        # Per parameter: a bound on its slot's partial sums while the slot holds float64
        # integers (add_fixed_float), None once it holds int64 (always on an accelerator).
        self._float_sums: list[float | None] = []
        self._reset_float_sums()
        # Elements after the tail's values for the statistics (sized by the first step), and
        # whether this rank's did not fit there this step.
        self._records_room, self._records_missing = 0, 0
        warm_up(self.params)  # the compiler's seconds here, not in the first step

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

    def use_hook(self, state: object, hook: CommHook, beside: Transport | None = None) -> None:
        """Only a Transport that sums int64 buckets exactly (not a cast, not a torch hook)."""
        if not (isinstance(state, Transport) and hook is transport_hook and state.sums_exactly):
            raise ValueError(
                f"deterministic=True sums integer buckets; {type(state).__name__} with "
                f"{getattr(hook, '__name__', hook)} does not (a torch hook, a bf16/fp16 cast or "
                "PowerSGD rounds them): use the default hook, or named_hook('allreduce'), 'shm', "
                "'tcp' or 'ring'"
            )
        super().use_hook(state, hook, beside)

    def _tail_values(self) -> list[int]:
        missing, carried = self._records_missing, self._carry_value
        return [*self.used, self.micro_batches, int(self._overflows), missing, carried]

    def _tail_numel(self) -> int:
        return len(self._tail_values()) + self._records_room

    def _fill_tail(self) -> None:
        if self._records_room:
            region = self._tail[self._tail.numel() - self._records_room :]
            self._records_missing = int(not self.forwards.write_records(region))
        super()._fill_tail()

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
            if not self.micro_batches:
                self._move_kept_grads()
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
            if self._agreement is None:
                return  # the step's first backward: in .grad until the grids are agreed
            # What waited is from an earlier backward: not this rank's last terms.
            self._finish_agreement(last=False)
        self._wait(index, param.grad)
        param.grad = None
        full = self.sync and self._bucket_of[index].arrived()
        if full or self._waiting_numel >= _WAITING_NUMEL:
            self._accumulate_waiting(last=self.sync)
        if full:
            self._launch_ready_buckets()

    def _build_buckets(self, order: list[int]) -> None:
        super()._build_buckets(order)
        self._slot_storages = {b.flat.untyped_storage().data_ptr() for b in self.buckets}
        # Per bucket: its members' (slot start, numel, dtype, index), or None where the
        # transport is not to finish it (a small bucket's means cost less than a barrier).
        self._slots: list[list[tuple[int, int, torch.dtype, int]] | None] = []
        for bucket in self.buckets:
            members = [self.params[i] for i in bucket.members]
            starts = itertools.accumulate([p.numel() for p in members[:-1]], initial=0)
            fits = all(_grad_view_fits(p) for p in members) and bucket.flat.device.type == "cpu"
            large = fits and bucket.flat.numel() > FINISH_NUMEL
            slots = zip(starts, members, bucket.members, strict=True)
            self._slots.append([(a, p.numel(), p.dtype, i) for a, p, i in slots] if large else None)
        # Buckets whose means the transport wrote this step.
        self._finished: set[int] = set()

    def _reduce(self, bucket: GradBucket) -> torch.Tensor:
        """A large bucket goes to the transport with its means to compute (each rank the part
        it summed): the work of the means divided by the world size, half the bytes written
        back. The count is summed on the way, as the tail's is."""
        b, transport = bucket.index(), self._reduce_in_place
        if transport is not None and self._slots[b] is not None:
            finish = functools.partial(self._finish_part, b)
            with span("ddptrain.reduce bucket", b), torch.no_grad():
                if transport.reduce_finished(bucket, finish, self.micro_batches):
                    self._finished.add(b)
                    return bucket.buffer()
        return super()._reduce(bucket)

    def _finish_part(self, b: int, start: int, summed: torch.Tensor, count: int) -> list:
        """Bucket b's elements start, start + 1, ... summed over ranks -> the means where the
        .grad views read them, and the tail's sums: every rank's bucket after the step."""
        slots = [(a, n, dtype, self.shifts[i]) for a, n, dtype, i in self._slots[b]]
        return means_of_part(summed, start, slots, count)

    def _grad_view(self, index: int) -> torch.Tensor:
        """The parameter's gradient in the first bytes of its spent slot (an int64 has room for
        any float), so that the mode holds no gradient beside its buckets."""
        p, slot = self.params[index], self._views[index]
        if not _grad_view_fits(p):
            return torch.empty_like(p)
        raw = memory_order(slot).view(torch.uint8)[: p.numel() * p.element_size()]
        return view_like(raw.view(p.dtype), p)

    def _move_kept_grads(self) -> None:
        """A step begins: a .grad kept from the last one (no zero_grad, or
        zero_grad(set_to_none=False)) still lies in its slot, which this step writes; it moves
        out, and autograd adds to it there."""
        for p in self.params:
            if p.grad is not None and p.grad.untyped_storage().data_ptr() in self._slot_storages:
                p.grad = p.grad.clone()

    def _wait(self, index: int, grad: torch.Tensor) -> None:
        self._waiting.append((index, grad))
        self._waiting_numel += grad.numel()

    def _accumulate_waiting(self, last: bool) -> None:
        """Round the waiting gradients into their slots; `last`: this rank's last terms of the
        step (in a synchronized backward), whose slots become int64 for the sum."""
        waiting, self._waiting, self._waiting_numel = self._waiting, [], 0
        if not waiting:
            return
        indices = [i for i, _ in waiting]
        firsts = [not self._written[i] for i in indices]
        for i in indices:
            self._written[i] = True
        # Slots of float64 integers first; a refused term (None) goes to int64 below.
        peaks: list[float | None] = [None] * len(waiting)
        floats = [j for j, i in enumerate(indices) if self._float_sums[i] is not None]
        if floats:
            with span("ddptrain.fill bucket", self._bucket_of[indices[floats[0]]].index):
                taken = add_fixed_floats(
                    [self._views[indices[j]].view(torch.float64) for j in floats],
                    [waiting[j][1] for j in floats],
                    [self.shifts[indices[j]] for j in floats],
                    [FLOAT_EXACT - self._float_sums[indices[j]] for j in floats],
                    [firsts[j] for j in floats],
                    last=last,
                )
            for j, peak in zip(floats, taken, strict=True):
                peaks[j] = peak
        for (index, grad), first, peak in zip(waiting, firsts, peaks, strict=True):
            if peak is not None:
                bound = self._float_sums[index]
                self._float_sums[index] = None if last else bound + peak
                continue
            if not first:
                self._to_fixed(index)
            self._float_sums[index] = None
            overflow = add_fixed(self._views[index], grad, self.shifts[index], first=first)
            self._overflows = self._overflows.to(overflow.device) + overflow

    def _to_fixed(self, index: int) -> None:
        if self._float_sums[index] is not None:
            float_to_fixed(self._views[index].view(torch.float64))
            self._float_sums[index] = None

    def _start_agreement(self) -> None:
        """End of the step's first backward: rank 0's magnitudes go to every rank (one
        broadcast, left in flight while the next micro-batch's forward runs); the gradients
        waiting in .grad move aside, so that the next backward does not add to them."""
        device = self.buckets[0].flat.device if self.buckets else torch.device("cpu")
        peaks = torch.zeros(len(self.params), dtype=torch.float64, device=device)
        for i, p in enumerate(self.params):
            if self.ready[i] and p.grad is not None:
                self._wait(i, p.grad)
                p.grad = None
        if self.forwards.rank == 0:
            held = [(i, g) for i, g in self._waiting if g.numel()]
            if held:
                where = torch.tensor([i for i, _ in held], device=device)
                peaks[where] = largest_magnitudes([g for _, g in held])
        work = None
        if self.world_size > 1:
            root = global_rank(self.process_group, 0)
            work = dist.broadcast(peaks, root, group=self.process_group, async_op=True)
        self._agreement = (work, peaks)

    def _finish_agreement(self, last: bool) -> None:
        """The grids are known: round what was held aside (`last`: as this rank's last terms)."""
        work, peaks = self._agreement
        if work is not None:
            work.wait()
        self.shifts = [fixed_point_shift(v) for v in peaks.tolist()]
        self._accumulate_waiting(last)

    def _end_micro_batch(self) -> None:
        """Queued at the end of a backward under no_sync()."""
        if self.shifts is None and self._agreement is None:
            self._start_agreement()
        else:
            self._accumulate_waiting(last=False)
        self._in_backward = False
        self.ready = [False] * len(self.params)

    def _finalize_buckets(self) -> None:
        self.synchronized_once = True
        try:
            if not self.micro_batches:
                self._move_kept_grads()  # a backward that reached no parameter
            if self.shifts is None:
                first_backward = self._agreement is None
                if first_backward:
                    self._start_agreement()
                self._finish_agreement(last=True)
                for i, ready in enumerate(self.ready):
                    if ready and first_backward:
                        self._bucket_of[i].arrived()
            self._accumulate_waiting(last=True)
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
            values = self._tail[: len(self._tail_values())].tolist()
            *flags, count, overflows, missing, carried = values
            self._carry_value, self.carried = 0, carried
            records = count * self.forwards.record_numel
            gathered = None
            if records and not missing and records <= self._records_room:
                gathered = self._tail[len(values) :][:records].view(torch.float64)
            self.forwards.combine(count, gathered)
            self.overflowed = bool(overflows) or count > 2**COUNT_BITS
            used = [i for i, flag in enumerate(flags) if flag]
            grads = [self._grad_view(i) for i in used]
            for i, grad in zip(used, grads, strict=True):
                self.params[i].grad = grad
            if self.overflowed:
                for grad in grads:
                    grad.fill_(math.inf)
            else:
                # Each mean is written over its spent sum; the next step's first terms overwrite
                # it (a .grad kept until then is moved out first: _move_kept_grads). The
                # transport wrote those of the buckets it finished.
                done = self._finished
                left = [k for k, i in enumerate(used) if self._bucket_of[i].index not in done]
                views = [self._views[used[k]] for k in left]
                shifts = [self.shifts[used[k]] for k in left]
                means_from_fixed(views, shifts, count, [grads[k] for k in left])
            slots = self._slot_storages
            if self._ready_order is not None:
                self._rebuild_in_ready_order()
            if self._records_room < records <= _RECORDS_NUMEL:
                # Every rank decides alike, from sums: the buckets (a collective) grow by it.
                self._records_room = records
                self._build_buckets(self.bucket_order)
            if self._slot_storages is not slots:
                # The buckets were rebuilt: each mean moves into its new slot.
                for i in used:
                    self.params[i].grad = self._grad_view(i).copy_(self.params[i].grad)
        except BaseException:
            self._runner.close()
            raise
        finally:
            self._reset_step()
            self.shifts, self._in_backward, self._agreement = None, False, None
            self._waiting, self._waiting_numel = [], 0
            self._overflows = torch.zeros((), dtype=torch.int64)
            self._reset_float_sums()
            self.micro_batches, self._records_missing = 0, 0
            self._finished = set()


def _grad_view_fits(p: torch.Tensor) -> bool:
    """Whether the parameter's .grad can lie in its int64 slot's first bytes."""
    return p.dtype.is_floating_point and p.element_size() <= 8

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

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.ddp.exact import (
    COUNT_BITS,
    FLOAT_EXACT,
    add_fixed,
    add_fixed_float,
    fixed_point_shift,
    float_to_fixed,
    mean_from_fixed,
)
from ddptrain.ddp.hooks import CommHook, Transport, global_rank, transport_hook
from ddptrain.ddp.micro_batches import MicroBatchForwards
from ddptrain.ddp.reducer import Reducer, refuse_create_graph, span


class ExactReducer(Reducer):
    """The reducer of DistributedDataParallel(deterministic=True): every micro-batch's gradient
    is rounded into an int64 accumulator, its bucket slot, and buckets are summed as integers,
    so after the synchronized backward each .grad is the mean over every rank's micro-batches
    with the same bits at any world size (design.md, "Same bits at any world size").

    - The grid of each parameter is agreed once per step, from rank 0's first micro-batch
      (micro-batch 0 at every world size): its gradients wait until the end of that backward,
      then one broadcast of n magnitudes, which overlaps the next forward; later gradients go
      straight into the slots, summed in float64 on a CPU while that stays exact.
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
        # Rank 0's magnitudes on their way, and the gradients that wait for them.
        self._agreement: tuple[Any, torch.Tensor] | None = None
        self._held: list[tuple[int, torch.Tensor]] = []
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
            if self._agreement is None:
                return  # the step's first backward: in .grad until the grids are agreed
            self._finish_agreement()
        self._accumulate(index, param.grad)
        param.grad = None
        if self.sync and self._bucket_of[index].arrived():
            self._launch_ready_buckets()

    def _accumulate(self, index: int, grad: torch.Tensor) -> None:
        slot, shift = self._views[index], self.shifts[index]
        first, self._written[index] = not self._written[index], True
        with span("ddptrain.fill bucket", self._bucket_of[index].index):
            bound = self._float_sums[index]
            if bound is not None:
                # The sync backward holds this rank's last term of the step: int64 for the sum.
                peak = add_fixed_float(
                    slot.view(torch.float64),
                    grad,
                    shift,
                    FLOAT_EXACT - bound,
                    first=first,
                    last=self.sync,
                )
                if peak is None and not first:
                    self._to_fixed(index)
                self._float_sums[index] = None if peak is None or self.sync else bound + peak
                if peak is not None:
                    return
            overflow = add_fixed(slot, grad, shift, first=first)
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
        self._held = [(i, p.grad) for i, p in enumerate(self.params) if self.ready[i]]
        self._held = [(i, g) for i, g in self._held if g is not None]
        if self.forwards.rank == 0:
            for i, g in self._held:
                if g.numel():
                    lo, hi = torch.aminmax(g.detach())
                    peaks[i] = torch.maximum(-lo, hi).double()
        for i, _ in self._held:
            self.params[i].grad = None
        work = None
        if self.world_size > 1:
            root = global_rank(self.process_group, 0)
            work = dist.broadcast(peaks, root, group=self.process_group, async_op=True)
        self._agreement = (work, peaks)

    def _finish_agreement(self) -> None:
        """The grids are known: round what was held aside."""
        work, peaks = self._agreement
        if work is not None:
            work.wait()
        self.shifts = [fixed_point_shift(v) for v in peaks.tolist()]
        for i, grad in self._held:
            self._accumulate(i, grad)
        self._held = []

    def _end_micro_batch(self) -> None:
        """Queued at the end of a backward under no_sync()."""
        if self.shifts is None and self._agreement is None:
            self._start_agreement()
        self._in_backward = False
        self.ready = [False] * len(self.params)

    def _finalize_buckets(self) -> None:
        self.synchronized_once = True
        try:
            if self.shifts is None:
                first_backward = self._agreement is None
                if first_backward:
                    self._start_agreement()
                self._finish_agreement()
                for i, ready in enumerate(self.ready):
                    if ready and first_backward:
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
            self.shifts, self._in_backward, self._agreement, self._held = None, False, None, []
            self._overflows = torch.zeros((), dtype=torch.int64)
            self._reset_float_sums()
            self.micro_batches = 0

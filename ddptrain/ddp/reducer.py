"""The wrapper's backward: buckets filled as gradients arrive, reduced while autograd goes on.

    reducer = Reducer(params, names, transport_or_none, group, buffers, caps, as_view, rebuild)
    reducer.use_hook(state, hook)            # torch's hook(state, bucket) -> Future
    reducer.prepare_for_forward(sync=True)   # a synchronized backward follows
    loss.backward()                          # per-parameter hooks -> fill -> launch -> finalize
    reducer.reduce_gradients()               # the same from .grad, with no backward of its own
    reducer.flag_next_sync(1)                # a value carried with the next reduction ...
    reducer.synced_flag                      # ... summed over ranks once it has run

A hook on each parameter fires when its gradient is accumulated; it copies the gradient into its
bucket slot (divided by world_size when the hook is a Transport), and once a bucket is full its
reduction is handed to the communication thread (runner.py), which runs the comm hook of one
bucket at a time, in bucket order, and waits for its future before the next. A callback queued
on the autograd engine fills what did not arrive, reduces the last bucket itself, waits for the
others, and points each `.grad` at its slot or copies the mean into it. The first synchronized
backward records the order gradients become ready; buckets are then rebuilt once in rank 0's.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.ddp import marks
from ddptrain.ddp.buckets import build_layout, fill_slot
from ddptrain.ddp.buffers import ModelBuffers
from ddptrain.ddp.groups import close_at_shutdown, global_rank
from ddptrain.ddp.hooks import CommHook, GradBucket, Transport, transport_hook
from ddptrain.ddp.linear_grads import has_other_hooks, will_accumulate
from ddptrain.ddp.runner import OrderedRunner
from ddptrain.ddp.step import StepState


class Reducer:
    """Buckets, the per-parameter hooks and one synchronized backward's reductions."""

    def __init__(
        self,
        params: list[torch.Tensor],
        names: list[str],
        process_group: Any,
        buffers: ModelBuffers,
        cap_bytes: int,
        first_cap_bytes: int,
        as_view: bool,
        rebuild: bool,
    ) -> None:
        self.params, self.names = params, names
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.buffers = buffers
        self._caps = (cap_bytes, first_cap_bytes)
        self._as_view, self._rebuild = as_view, rebuild
        # False inside no_sync(): a backward then only accumulates.
        self.sync = True
        self.synchronized_once = False
        # Seconds the last synchronized backward waited for its buckets after autograd was
        # done: the communication that overlap did not hide (the Trainer logs it as comm_s).
        self.last_comm_wait_s = 0.0
        # What flag_next_sync gave for the next reduction, and the sum over ranks the last one
        # carried (None: none has run since flag_next_sync).
        self._flag_value = 0
        self.synced_flag: int | None = None
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)
        ]
        # Each parameter's AccumulateGrad node, held so that it stays the one autograd uses:
        # a slot is claimed only in a backward that will run it (not torch.autograd.grad).
        self._grad_accs = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        self._runner = OrderedRunner("ddptrain-comm")
        weakref.finalize(self, self._runner.close)
        close_at_shutdown(self._runner.close)
        self._scratch = torch.empty(0)

    # ----------------------------------------------------------------------------- hook
    def use_hook(self, state: object, hook: CommHook) -> None:
        """Reduce buckets with `hook(state, bucket)`; a Transport state also places them, sums
        gradients already divided by world_size and carries the used flags in the last tail."""
        self.hook_state, self.hook = state, hook
        self.transport = state if isinstance(state, Transport) else None
        self._direct = self.transport if hook is transport_hook else None
        self.buffers.transport = self.transport
        self.divisor = self.world_size if self.transport is not None else 1
        self._build_buckets(list(reversed(range(len(self.params)))))
        self._ready_order: list[int] | None = [] if self._rebuild else None
        self._step = StepState(len(self.params), self.bucket_lens, self.divisor)

    def set_divisor(self, divisor: int) -> None:
        """A transport's reductions divide by `divisor` from now on (join: ranks still training)."""
        if self.transport is not None:
            self.divisor = self._step.divisor = divisor

    # ----------------------------------------------------------------------------- buckets
    def _build_buckets(self, order: list[int]) -> None:
        transport = self.transport
        layout = build_layout(
            self.params,
            order,
            *self._caps,
            transport.allocate if transport is not None else _zeros,
            self._as_view,
            flags=transport is not None,
        )
        # Unpacked: the hooks read these once per parameter per step.
        self.bucket_order = layout.order
        self.bucket_params = layout.members
        self._buckets = layout.flats
        self._views = layout.views
        self._param_bucket = layout.bucket_of
        # The used flags and the synced value after them, written and read back in one copy.
        self._flag_tail = (
            layout.flats[-1][-len(self.params) - 1 :] if layout.used_flags is not None else None
        )
        self._grad_is_view = layout.grad_is_view
        self.bucket_lens = layout.lens
        last = len(layout.flats) - 1
        # What the hook is handed: for a transport, the last flat tensor with its flags.
        self.grad_buckets = [
            GradBucket(
                b,
                flat,
                [self._views[i] for i in members],
                [self.params[i] for i in members],
                b == last,
            )
            for b, (flat, members) in enumerate(zip(layout.flats, layout.members, strict=True))
        ]

    # ----------------------------------------------------------------------------- flags
    def flag_next_sync(self, value: int) -> None:
        """Carry `value` (a small non-negative integer) with the next synchronized reduction;
        `synced_flag` is then its sum over ranks (ranks that gave none count 0)."""
        self._flag_value = int(value)
        self.synced_flag = None

    # ----------------------------------------------------------------------------- forward
    def prepare_for_forward(self, synchronized: bool, buffers_with_gradients: bool) -> None:
        """A forward starts: its backward reduces (synchronized) or only accumulates; rank 0's
        buffers travel with the last bucket (buffers_with_gradients)."""
        step = self._step
        if synchronized:
            step.armed = True
            step.sync_buffers = step.sync_buffers or buffers_with_gradients
        elif torch.is_grad_enabled():
            step.no_sync_forward = True

    def claim_slot(self, param: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """The bucket view autograd may compute `param`'s gradient into, and the factor to
        scale it by there; once per backward, only where no one would see the difference
        (see linear_grads.py)."""
        index = self._index_of.get(id(param))
        step = self._step
        if index is None or not (self.sync and step.armed and self._grad_is_view[index]):
            return None
        if param.grad is not None or step.claimed[index] or has_other_hooks(param):
            return None
        if not will_accumulate(self._grad_accs[index]):
            return None  # torch.autograd.grad, or backward(inputs=) without this parameter
        step.claimed[index] = True
        return self._views[index], 1.0 / step.divisor

    # ----------------------------------------------------------------------------- backward
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index, param)

        return hook

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        step = self._step
        step.used[index] = True
        if not self.sync:
            return
        step.check_arrival(index, self.names[index], param.grad)
        if not step.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
            step.callback_queued = True
        step.ready[index] = True
        if self._ready_order is not None:
            self._ready_order.append(index)
        bucket = self._param_bucket[index]
        with marks.mark("ddptrain.fill bucket", bucket):
            self._fill_view(index, param.grad)
        if self._grad_is_view[index]:
            # Point .grad at its slot now, not when backward ends: autograd's private gradient
            # is freed as soon as it is copied, so no rank holds a whole extra copy at its peak.
            param.grad = self._views[index]
        step.pending[bucket] -= 1
        if step.pending[bucket] == 0:
            self._launch_ready_buckets()

    def _fill_view(self, index: int, grad: torch.Tensor | None) -> None:
        step = self._step
        self._scratch = fill_slot(
            self._views[index], grad, step.divisor, step.claimed[index], self._scratch
        )

    def _launch_ready_buckets(self) -> None:
        step = self._step
        last = len(self._buckets) - 1
        while step.next_bucket <= last and step.pending[step.next_bucket] == 0:
            b = step.next_bucket
            if b == last and self._flag_tail is not None:
                tail = [*step.used, self._flag_value]
                self._flag_tail.copy_(torch.tensor(tail, dtype=self._flag_tail.dtype))
            with marks.mark("ddptrain.launch bucket", b):
                # The last bucket is waited for as soon as backward ends: the waiting thread
                # runs it, sparing two thread wake-ups on the critical path.
                step.jobs[b] = self._runner.submit(self._reduce_bucket, b, wake=b != last)
            step.next_bucket += 1

    def _reduce_bucket(self, b: int) -> torch.Tensor:
        """Run the comm hook on bucket b and wait for its future (the communication thread,
        or the thread waiting for the last bucket)."""
        bucket = self.grad_buckets[b]
        with marks.mark("ddptrain.reduce bucket", b), torch.no_grad(), _on(bucket.buffer()):
            if self._direct is not None:
                # transport_hook's work without its future: ~10 us a bucket on a slow CPU.
                self._direct.reduce(bucket)
                return bucket.buffer()
            return self.hook(self.hook_state, bucket).wait()

    def finalize(self) -> None:
        """End one synchronized backward (queued on the autograd engine): every `.grad` is the
        mean over ranks when it returns."""
        with marks.mark("ddptrain.finalize"):
            self._finalize_buckets()

    def reduce_gradients(self, divisor: int | None = None) -> None:
        """Collective: reduce what `.grad` holds (None counts as zero) as a synchronized
        backward would; for a rank with no backward of its own to run (joined)."""
        self._step = StepState(len(self.params), self.bucket_lens, self.divisor)
        if divisor is not None:
            self.set_divisor(divisor)
        self._step.used = [p.grad is not None for p in self.params]
        self.finalize()

    def _finalize_buckets(self) -> None:
        step = self._step
        self.synchronized_once = True
        try:
            for index, ready in enumerate(step.ready):
                if not ready:
                    # No gradient here this backward: contribute what is accumulated (no_sync)
                    # or zero, so every rank still reduces every bucket.
                    self._fill_view(index, self.params[index].grad)
                    step.pending[self._param_bucket[index]] -= 1
            self._launch_ready_buckets()
            started = time.perf_counter()
            for b, job in enumerate(step.jobs):
                with marks.mark("ddptrain.wait bucket", b):
                    result = job.wait()
                flat = self.grad_buckets[b].buffer()
                if result is not None and result.data_ptr() != flat.data_ptr():
                    flat.copy_(result.view(-1))
            used_anywhere = self._exchange_flags(step.used)
            if step.sync_buffers:
                with marks.mark("ddptrain.buffers"):
                    self.buffers.sync(0)
            self.last_comm_wait_s = time.perf_counter() - started
            if self._ready_order is not None:
                self._rebuild_in_ready_order()
            self._point_grads(used_anywhere)
        except BaseException:
            # Reductions queued behind a failed one would run collectives no peer joins.
            self._runner.close()
            raise
        finally:
            self._step = StepState(len(self.params), self.bucket_lens, self.divisor)

    def _exchange_flags(self, used: list[bool]) -> list[bool]:
        """Which parameters got a gradient on some rank, and `synced_flag`: from the last
        bucket's tail, where a transport summed them, else one small all_reduce."""
        if self._flag_tail is not None:
            *sums, value = self._flag_tail.tolist()
            used_anywhere, total = [v != 0 for v in sums], round(value)
        elif self.world_size == 1:
            used_anywhere, total = list(used), self._flag_value
        else:
            device = self._buckets[0].device if self._buckets else torch.device("cpu")
            flags = torch.tensor([*used, self._flag_value], dtype=torch.int32, device=device)
            dist.all_reduce(flags, group=self.process_group)
            used_anywhere, total = (flags[:-1] != 0).tolist(), int(flags[-1])
        self._flag_value, self.synced_flag = 0, total
        return used_anywhere

    def _point_grads(self, used_anywhere: list[bool]) -> None:
        for index, p in enumerate(self.params):
            if not used_anywhere[index]:
                continue
            view = self._views[index]
            if self._grad_is_view[index]:
                # The hook pointed it there already unless no gradient came this backward.
                if p.grad is not view:
                    p.grad = view
            elif p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)

    def _rebuild_in_ready_order(self) -> None:
        """Rebuild buckets in the gradient-ready order rank 0 observed on the first backward."""
        observed, self._ready_order = dict.fromkeys(self._ready_order or []), None
        n = len(self.params)
        if n == 0:
            return
        # Never-ready parameters go last; rank 0 decides because ranks may see different
        # orders (a branch used on some ranks only) and every rank must build the same buckets.
        proposal = list(observed) + [i for i in reversed(range(n)) if i not in observed]
        order = torch.tensor(proposal, dtype=torch.int64, device=self._buckets[0].device)
        if self.world_size > 1:
            src = global_rank(self.process_group, 0)
            dist.broadcast(order, src=src, group=self.process_group)
        order_list = order.tolist()
        if order_list == self.bucket_order:
            return
        old_views = self._views
        self._build_buckets(order_list)
        with torch.no_grad():
            for new, old in zip(self._views, old_views, strict=True):
                new.copy_(old)


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def _on(tensor: torch.Tensor) -> Any:
    """The tensor's CUDA device as current (on the communication thread), else nothing."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else _NO_DEVICE


_NO_DEVICE = contextlib.nullcontext()

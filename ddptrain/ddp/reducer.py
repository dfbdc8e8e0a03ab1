"""The wrapper's backward: buckets filled as gradients arrive, reduced while autograd goes on.

    reducer = Reducer(params, names, group, buffers, cap_bytes, first_cap_bytes, as_view, True)
    reducer.use_hook(state, hook)                # torch's hook(state, bucket) -> Future
    reducer.prepare_for_forward(True, False)     # a synchronized backward follows
    loss.backward()                              # hooks -> fill, arrived -> launch -> finalize
    reducer.reduce_gradients()                   # the same from .grad, with no backward
    reducer.carry(1)                             # extension point: summed over ranks with the
    reducer.carried                              # next reduction, at no collective of its own

A hook on each parameter fires when autograd has accumulated its gradient: it copies it into
the parameter's slot in its `Bucket` (divided by world_size for a Transport); a full bucket's
reduction goes to the communication thread (hooks.OrderedRunner), which runs the comm hook of
one bucket at a time, in bucket order. A callback queued on the autograd engine (`finalize`)
fills the slots no gradient reached, reduces the last bucket itself, waits for the others and
points each `.grad` at its slot (or copies the mean into it). Buckets are rebuilt once, after
the first synchronized backward, in the order rank 0 saw gradients become ready.

The last bucket ends with a tail the transport sums with the gradients: a "used here" flag per
parameter (one no rank used keeps grad=None), then the value of `carry`, the extension point
the Trainer's stop at a step boundary rides on. With a torch hook it is one small sum of its
own: through the default transport the wrapper keeps beside the hook on CPU (shared memory:
microseconds, where gloo's loopback round trip took milliseconds a step), else the backend's.
"""

from __future__ import annotations

import enum
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.ddp.buckets import (
    Bucket,
    build_layout,
    fill_slot,
    has_other_hooks,
    will_accumulate,
    zeros,
)
from ddptrain.ddp.hooks import (
    CommHook,
    GradBucket,
    OrderedRunner,
    Transport,
    close_at_shutdown,
    global_rank,
    transport_hook,
)
from ddptrain.ddp.replicas import ModelBuffers
from ddptrain.ddp.spans import OFF, span


class Phase(enum.Enum):
    """Where the wrapper is between one synchronized backward and the next."""

    IDLE = "idle"  # no forward since the last synchronized backward
    ACCUMULATING = "accumulating"  # a forward ran under no_sync(): its backward only accumulates
    ARMED = "armed"  # a synchronized forward ran: its backward reduces
    REDUCING = "reducing"  # that backward has started: buckets fill and launch


class Reducer:
    """Buckets, the per-parameter hooks and one synchronized backward's reductions."""

    bucket_dtype: torch.dtype | None = None  # None: the parameters' (ddp/deterministic.py: int64)

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
        self.phase = Phase.IDLE
        self.synchronized_once = False
        # Seconds the last synchronized backward waited for its buckets after autograd was done.
        self.last_comm_wait_s = 0.0
        self._carry_value = 0
        self.carried: int | None = None
        self._index_of = {id(p): i for i, p in enumerate(params)}
        n = len(params)
        # Per parameter, reset after every synchronized backward: its gradient arrived in this
        # backward; autograd wrote it into the slot itself (claim_slot); it was used here
        # since the last synchronized backward, no_sync passes included.
        self.ready, self.claimed, self.used = [False] * n, [False] * n, [False] * n
        # A forward asked for rank 0's buffers with the last bucket (norm statistics only).
        self.sync_buffers = False
        self._next_bucket = 0
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
    def use_hook(self, state: object, hook: CommHook, beside: Transport | None = None) -> None:
        """Reduce buckets with `hook(state, bucket)`; a Transport state also places them, sums
        gradients already divided by world_size and carries the tail with the last bucket.
        `beside`: where a state is no Transport, one that sums the tail and sends the buffers
        (else the backend does)."""
        self.hook_state, self.hook = state, hook
        self.transport = state if isinstance(state, Transport) else None
        self._beside = beside if self.transport is None else None
        self._beside_tail: torch.Tensor | None = None
        # transport_hook's work without building its future, on the hot path once per bucket.
        self._reduce_in_place = self.transport if hook is transport_hook else None
        self.buffers.transport = self.transport or self._beside
        self.divisor = self.world_size if self.transport is not None else 1
        self._build_buckets(list(reversed(range(len(self.params)))))
        self._ready_order: list[int] | None = [] if self._rebuild else None

    def set_divisor(self, divisor: int) -> None:
        """A transport's reductions divide by `divisor` from now on (join: ranks still training)."""
        if self.transport is not None:
            self.divisor = divisor

    def carry(self, value: int) -> None:
        """Extension point: a small non-negative integer summed over ranks with the next
        synchronized reduction, at no collective of its own (exact up to 256 in a bf16 bucket,
        2048 in fp16). `carried` holds the sum (ranks that carried nothing count 0) once that
        reduction ran, None until then."""
        self._carry_value, self.carried = int(value), None

    # ----------------------------------------------------------------------------- buckets
    def _tail_values(self) -> list[int]:
        """What the last bucket's tail carries: the used flags, then the carried value."""
        return [*self.used, self._carry_value]

    def _tail_numel(self) -> int:
        """The tail's length: its values, and room a subclass adds after them."""
        return len(self._tail_values())

    def _fill_tail(self) -> None:
        values = self._tail_values()
        self._tail[: len(values)].copy_(torch.tensor(values, dtype=self._tail.dtype))

    def _build_buckets(self, order: list[int]) -> None:
        transport = self.transport
        layout = build_layout(
            self.params,
            order,
            *self._caps,
            transport.allocate if transport is not None else zeros,
            self._as_view,
            tail=self._tail_numel() if transport is not None else 0,
            bucket_dtype=self.bucket_dtype,
        )
        self.bucket_order = layout.order
        self._views = layout.views
        self._grad_is_view = layout.grad_is_view
        self._tail = layout.tail
        last = len(layout.flats) - 1
        self.buckets = [
            Bucket(b, flat, members, self._views, self.params, b == last)
            for b, (flat, members) in enumerate(zip(layout.flats, layout.members, strict=True))
        ]
        self._bucket_of = [self.buckets[b] for b in layout.bucket_of]

    # ----------------------------------------------------------------------------- forward
    def prepare_for_forward(self, synchronized: bool, buffers_with_gradients: bool) -> None:
        """A forward starts: its backward reduces (synchronized) or only accumulates; rank 0's
        buffers travel with the last bucket (buffers_with_gradients)."""
        if synchronized:
            self.phase = Phase.ARMED
            self.sync_buffers = self.sync_buffers or buffers_with_gradients
        elif torch.is_grad_enabled() and self.phase is Phase.IDLE:
            self.phase = Phase.ACCUMULATING

    def claim_slot(self, param: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """The bucket view autograd may compute `param`'s gradient into, and the factor to
        scale it by there (a transport's forward_mode asks: ddptrain/cpu/linear_slots.py);
        once per backward, only where no one would see the difference."""
        index = self._index_of.get(id(param))
        if index is None or not self.sync or self.phase not in (Phase.ARMED, Phase.REDUCING):
            return None
        if not self._grad_is_view[index] or param.grad is not None or self.claimed[index]:
            return None
        if has_other_hooks(param) or not will_accumulate(self._grad_accs[index]):
            return None  # torch.autograd.grad, or backward(inputs=) without this parameter
        self.claimed[index] = True
        return self._views[index], 1.0 / self.divisor

    # ----------------------------------------------------------------------------- backward
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index, param)

        return hook

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        self.used[index] = True
        if not self.sync:
            return
        if self.phase is not Phase.REDUCING:
            self._start_reducing(index)
        elif self.ready[index]:
            raise RuntimeError(
                f"gradient of '{self.names[index]}' became ready twice in one backward"
            )
        refuse_create_graph(param.grad)
        self.ready[index] = True
        if self._ready_order is not None:
            self._ready_order.append(index)
        bucket = self._bucket_of[index]
        with span("ddptrain.fill bucket", bucket.index):
            self._fill(index, param.grad)
        if self._grad_is_view[index]:
            # Point .grad at its slot now, not when backward ends: autograd's private gradient
            # is freed as soon as it is copied, so no rank holds a whole extra copy at its peak.
            param.grad = self._views[index]
        if bucket.arrived():
            self._launch_ready_buckets()

    def _start_reducing(self, index: int) -> None:
        """The first gradient of a synchronized backward: check the forward armed it, queue
        the callback that ends it."""
        name = self.names[index]
        if self.phase is Phase.ACCUMULATING:
            raise RuntimeError(
                f"gradient of '{name}' arrived in a backward outside no_sync() whose forward ran "
                "inside it: the forward decides whether gradients are averaged. Run the forward "
                "and its backward both inside no_sync() (to accumulate) or both outside (to "
                "synchronize)"
            )
        if self.phase is Phase.IDLE:
            raise RuntimeError(
                f"gradient of '{name}' arrived with no forward pass since the last synchronized "
                "backward: backward was called twice on one forward under "
                "DistributedDataParallel. Run a new forward before each backward, or use "
                "no_sync() for the extra backward passes"
            )
        self.phase = Phase.REDUCING
        torch.autograd.Variable._execution_engine.queue_callback(self.finalize)

    def _fill(self, index: int, grad: torch.Tensor | None) -> None:
        self._scratch = fill_slot(
            self._views[index], grad, self.divisor, self.claimed[index], self._scratch
        )

    def _launch_ready_buckets(self) -> None:
        last = len(self.buckets) - 1
        while self._next_bucket <= last and self.buckets[self._next_bucket].pending == 0:
            b = self._next_bucket
            if b == last and self._tail is not None:
                self._fill_tail()
            with span("ddptrain.launch bucket", b):
                # The last bucket is waited for as soon as backward ends: the waiting thread
                # runs it, sparing two thread wake-ups on the critical path.
                self.buckets[b].launch(self._runner, self._reduce, wait_at_once=b == last)
            self._next_bucket += 1

    def _reduce(self, bucket: GradBucket) -> torch.Tensor:
        """Run the comm hook on one bucket and wait for its future (the communication thread,
        or the thread waiting for the last bucket)."""
        with span("ddptrain.reduce bucket", bucket.index()), torch.no_grad():
            with _on_device(bucket.buffer()):
                if self._reduce_in_place is not None:
                    self._reduce_in_place.reduce(bucket)
                    return bucket.buffer()
                return self.hook(self.hook_state, bucket).wait()

    def finalize(self) -> None:
        """End one synchronized backward (queued on the autograd engine): every `.grad` is the
        mean over ranks when it returns."""
        with span("ddptrain.finalize"):
            self._finalize_buckets()

    def reduce_gradients(self, divisor: int | None = None) -> None:
        """Collective: reduce what `.grad` holds (None counts as zero) as a synchronized
        backward would; for a rank with no backward of its own to run (joined)."""
        self._reset_step()
        if divisor is not None:
            self.set_divisor(divisor)
        self.used = [p.grad is not None for p in self.params]
        self.phase = Phase.REDUCING
        self.finalize()

    def _finalize_buckets(self) -> None:
        self.synchronized_once = True
        try:
            for index, ready in enumerate(self.ready):
                if not ready:
                    # No gradient here this backward: contribute what is accumulated (no_sync)
                    # or zero, so every rank still reduces every bucket.
                    self._fill(index, self.params[index].grad)
                    self._bucket_of[index].arrived()
            self._launch_ready_buckets()
            started = time.perf_counter()
            for b, bucket in enumerate(self.buckets):
                with span("ddptrain.wait bucket", b):
                    bucket.wait()
            used_anywhere = self._sum_tail()
            if self.sync_buffers:
                with span("ddptrain.buffers"):
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
            self._reset_step()

    def _reset_step(self) -> None:
        n = len(self.params)
        self.ready, self.claimed, self.used = [False] * n, [False] * n, [False] * n
        self.sync_buffers, self._next_bucket, self.phase = False, 0, Phase.IDLE
        for bucket in self.buckets:
            bucket.reset()

    def _sum_tail(self) -> list[bool]:
        """The tail's sums over ranks: which parameters got a gradient on some rank (returned),
        and `carried`. A transport summed them in the last bucket; else `_sum_apart`."""
        if self._tail is not None:
            *sums, total = self._tail.tolist()
            used_anywhere, total = [v != 0 for v in sums], round(total)
        elif self.world_size == 1:
            used_anywhere, total = list(self.used), self._carry_value
        else:
            *sums, total = self._sum_apart([*self.used, self._carry_value])
            used_anywhere, total = [v != 0 for v in sums], int(total)
        self._carry_value, self.carried = 0, total
        return used_anywhere

    def _sum_apart(self, values: list[int]) -> list[int]:
        """Collective: `values` summed over ranks, through the transport beside a hook (its
        buffer made at the first call, which every rank reaches in the same order), else one
        small all_reduce of the backend."""
        if self._beside is None:
            device = self.buckets[0].flat.device if self.buckets else torch.device("cpu")
            tail = torch.tensor(values, dtype=torch.int32, device=device)
            dist.all_reduce(tail, group=self.process_group)
            return tail.tolist()
        if self._beside_tail is None:
            self._beside_tail = self._beside.allocate(len(values), torch.int64, torch.device("cpu"))
        tail = self._beside_tail
        tail.copy_(torch.tensor(values, dtype=torch.int64))
        self._beside.reduce(GradBucket(len(self.buckets), tail, [], [], True))
        return tail.tolist()

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
        order = torch.tensor(proposal, dtype=torch.int64, device=self.buckets[0].flat.device)
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


def refuse_create_graph(grad: torch.Tensor | None) -> None:
    if grad is not None and grad.requires_grad:
        raise RuntimeError(
            "backward(create_graph=True) is not supported under DistributedDataParallel (nor "
            "under torch's): averaged gradients are written into buckets outside autograd. For "
            "a gradient penalty, take torch.autograd.grad(loss, params, create_graph=True), add "
            "the penalty to the loss, then call backward() on it"
        )


def _on_device(tensor: torch.Tensor) -> Any:
    """The tensor's CUDA device as current (on the communication thread), else nothing."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else OFF

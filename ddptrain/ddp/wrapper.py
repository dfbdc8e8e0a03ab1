"""The DDP wrapper: init broadcast, bucketed asynchronous all_reduce overlapped with backward.

    info = ddptrain.init_distributed()
    model = ddptrain.DDP(Net().to(info.device))      # rank 0's weights everywhere
    loss = loss_fn(model(x), y)
    loss.backward()                                  # every .grad is now the mean over ranks
    optimizer.step()

    with model.no_sync():                            # gradient accumulation
        loss_fn(model(x1), y1).backward()            # local only
    loss_fn(model(x2), y2).backward()                # reduces the accumulated sum

    with model.join():                               # ranks with different numbers of batches
        ...                                          # (parallel/join.py)

How it works: gradients are packed into flat per-dtype/device buckets. A hook on each parameter
fires when its gradient is accumulated; it copies the gradient (scaled by 1/world_size) into
its bucket slot, and once a bucket is full its all_reduce is launched asynchronously while
autograd keeps computing earlier layers. A callback queued on the autograd engine waits for all
buckets at the end of backward and points each `.grad` at its slot (gradient_as_bucket_view,
the default: no copy back) or copies the average into it.

Buffers come from rank 0 (parallel/buffers.py): the running statistics of norm layers in
training mode travel with the last bucket, since a training forward never reads them; any other
buffer is broadcast before the forward, as official DDP does.

Defaults chosen by measurement (docs/benchmarks.md): when every rank is a CPU process on one
host under gloo, buckets live in shared memory and are summed there (shm.SharedMemoryHook)
instead of crossing loopback TCP; CPU ranks on several hosts sum over TCP connections of the
wrapper's own (tcp.SocketHook); a process alone sends nothing (comm.local_hook); elsewhere
the backend's all_reduce is used. The first
synchronized backward records the order gradients become ready, and buckets are rebuilt once
in rank 0's order. Pass `comm_hook=allreduce_hook` to force the backend's all_reduce.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain import profiling
from ddptrain.ddp.buckets import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_CAP_MB,
    mb_to_bytes,
)
from ddptrain.ddp.buffers import ModelBuffers
from ddptrain.ddp.hooks import (
    HOOK_NAMES,
    CommHook,
    allreduce_hook,
    default_transport,
    local_hook,
    make_hook,
)
from ddptrain.ddp.layout import build_layout, fill_slot
from ddptrain.ddp.linear_grads import (
    LinearSlots,
    has_other_hooks,
    slot_params,
    will_accumulate,
)
from ddptrain.ddp.replicas import broadcast_coalesced, coalesce, verify_same_model
from ddptrain.ddp.step import StepState
from ddptrain.dist import global_rank


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper written on plain torch.distributed collectives.

    Invariants:
    - Every rank wraps a model with the same parameters and buffers, in the same order, with the
      same shapes and dtypes; this is checked at construction (a clear error, never a hang).
    - Parameters and buffers come from rank 0: broadcast at construction, and buffers again
      at every step when `broadcast_buffers=True`: before the forward, or, when every buffer
      is a running statistic of a norm layer in training mode, by the end of the backward
      (every rank then ends the step with rank 0's buffers).
    - When `loss.backward()` returns outside `no_sync()`, every `.grad` holds the mean over ranks.
    - A parameter with no gradient on some ranks counts as zero there; one with no gradient on
      any rank keeps `grad=None`, so optimizers skip it.
    - Buckets are launched in the same order on every rank (bucket index order); after the
      first synchronized backward they are rebuilt once, in rank 0's gradient-ready order.
    - With `gradient_as_bucket_view=True` (default) each `.grad` is a view into its bucket
      after backward; `zero_grad(set_to_none=True)` and `zero_grad(set_to_none=False)` both work.
    - No parameters are added after wrapping; one forward is followed by at most one backward.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_CAP_MB,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        gradient_as_bucket_view: bool = True,
        comm_hook: CommHook | str | None = None,
        rebuild_buckets: bool = True,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs an initialized process group; "
                "call ddptrain.init_distributed() (or torch.distributed.init_process_group) first"
            )
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        if comm_hook == "default":
            comm_hook = None
        elif isinstance(comm_hook, str):
            comm_hook = make_hook(comm_hook, process_group)  # a name, as TrainerConfig takes
        elif comm_hook is not None and not callable(comm_hook):
            raise TypeError(
                f"comm_hook must be a hook (callable) or one of default, {', '.join(HOOK_NAMES)}"
                f", got {type(comm_hook).__name__}"
            )
        self.comm_hook: CommHook = comm_hook or _default_hook(module, process_group)
        self._named_params = list(module.named_parameters())
        # Sizes of every module's parameter and child dicts, checked each forward: far cheaper
        # than walking module.parameters() (~50 us/step on a small MLP), which is only needed
        # once a module was added somewhere.
        modules = list(module.modules())
        self._param_dicts = [m._parameters for m in modules]
        self._module_dicts = [m._modules for m in modules]
        self._sizes_at_wrap = (_total_len(self._param_dicts), _total_len(self._module_dicts))
        self._model_buffers = ModelBuffers(module, self.comm_hook, process_group)
        verify_same_model(self._named_params, list(module.named_buffers()), process_group)
        with torch.no_grad():
            states = [p.detach() for _, p in self._named_params] + self._model_buffers.tensors
            broadcast_coalesced(coalesce(states), process_group)
        self._params = [p for _, p in self._named_params if p.requires_grad]
        self._param_names = [n for n, p in self._named_params if p.requires_grad]
        self._cap_bytes = mb_to_bytes(bucket_cap_mb)
        self._first_cap_bytes = mb_to_bytes(first_bucket_cap_mb)
        # Reverse registration order approximates the order gradients become ready; the
        # first synchronized backward records the real order and rebuilds once (as torch does).
        self._build_buckets(list(reversed(range(len(self._params)))))
        self._ready_order: list[int] | None = [] if rebuild_buckets else None
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]
        # Each parameter's AccumulateGrad node, held so that it stays the one autograd uses:
        # a slot is claimed only in a backward that will run it (not torch.autograd.grad).
        self._grad_accs = [p.view_as(p).grad_fn.next_functions[0][0] for p in self._params]
        self._sync = True
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        # The mode costs ~1 us of Python per torch call in the forward: entered only for large
        # CPU Linear layers, where copying gradients is the cost it saves (memory bandwidth).
        slotted = slot_params(modules) if gradient_as_bucket_view else []
        self._linear_slots = LinearSlots(self._claim_slot, slotted) if slotted else None
        self._scratch = torch.empty(0)
        self._step = StepState(len(self._params), self._bucket_lens, self.world_size)
        self._join: Any = None
        # Seconds the last synchronized backward waited for its buckets after autograd was
        # done: the communication that overlap did not hide (the Trainer logs it as comm_s).
        self.last_comm_wait_s = 0.0

    # ----------------------------------------------------------------------------- buckets
    def _build_buckets(self, order: list[int]) -> None:
        # A hook may place buckets where its transport reads them best (shared memory), and
        # in the dtype it sends (bf16), so casting rides on the copies made anyway.
        allocate = getattr(self.comm_hook, "allocate", None) or _zeros
        layout = build_layout(
            self._params,
            order,
            self._cap_bytes,
            self._first_cap_bytes,
            allocate,
            self.gradient_as_bucket_view,
        )
        # Unpacked: the hooks read these once per parameter per step.
        self._bucket_order = layout.order
        self._bucket_params = layout.members
        self._buckets = layout.flats
        self._views = layout.views
        self._param_bucket = layout.bucket_of
        self._used_flags = layout.used_flags
        self._grad_is_view = layout.grad_is_view
        self._bucket_lens = layout.lens

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._param_names[i] for i in members] for members in self._bucket_params]

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Gradient bytes per bucket, in launch order."""
        return [
            sum(self._params[i].numel() * self._params[i].element_size() for i in members)
            for members in self._bucket_params
        ]

    # ----------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._parameters_changed():
            raise RuntimeError(
                "the wrapped module's parameters changed after wrapping; their gradients would "
                "never be averaged. Add every parameter before wrapping with "
                "DistributedDataParallel"
            )
        buffer_src = 0
        if self._join is not None:
            buffer_src, self._step.divisor = self._join.on_forward()
        synchronized = torch.is_grad_enabled() and self._sync
        if self.broadcast_buffers and self.world_size > 1 and self._model_buffers:
            # With the last bucket when this forward cannot read them and a synchronized
            # backward follows; never under join(), whose joined ranks shadow the broadcast.
            if (
                self._join is not None
                or not self._buckets
                or not self._model_buffers.follow_gradients()
            ):
                self._model_buffers.sync(buffer_src)
            elif synchronized:
                self._step.sync_buffers = True
        if synchronized:
            self._step.armed = True
            if self._linear_slots is not None and not torch.compiler.is_compiling():
                with self._linear_slots:
                    return self.module(*args, **kwargs)
        elif torch.is_grad_enabled():
            self._step.no_sync_forward = True
        return self.module(*args, **kwargs)

    def _parameters_changed(self) -> bool:
        if _total_len(self._module_dicts) != self._sizes_at_wrap[1]:
            return sum(1 for _ in self.module.parameters()) != len(self._named_params)
        return _total_len(self._param_dicts) != self._sizes_at_wrap[0]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces the accumulated sum."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Any:
        """Context manager for ranks with different numbers of batches (see parallel/join.py)."""
        # Imported here: join.py builds on this module's helpers.
        from ddptrain.ddp.join import Join

        return Join(
            self,
            divide_by_initial_world_size=divide_by_initial_world_size,
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
        )

    # ----------------------------------------------------------------------------- backward
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index, param)

        return hook

    def _claim_slot(self, param: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """The bucket view autograd may compute `param`'s gradient into, and the factor to
        scale it by there; once per backward, only where no one would see the difference
        (see linear_grads.py)."""
        index = self._index_of.get(id(param))
        step = self._step
        if index is None or not (self._sync and step.armed and self._grad_is_view[index]):
            return None
        if param.grad is not None or step.claimed[index] or has_other_hooks(param):
            return None
        if not will_accumulate(self._grad_accs[index]):
            return None  # torch.autograd.grad, or backward(inputs=) without this parameter
        step.claimed[index] = True
        return self._views[index], 1.0 / step.divisor

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        step = self._step
        step.used[index] = True
        if not self._sync:
            return
        step.check_arrival(index, self._param_names[index], param.grad)
        if not step.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            step.callback_queued = True
        step.ready[index] = True
        if self._ready_order is not None:
            self._ready_order.append(index)
        bucket = self._param_bucket[index]
        with profiling.mark("ddptrain.fill bucket", bucket):
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
        scratch = fill_slot(
            self._views[index], grad, step.divisor, step.claimed[index], self._scratch
        )
        if scratch is not self._scratch:
            # Written only when new: nn.Module's __setattr__ costs ~3 us, per parameter per step.
            self._scratch = scratch

    def _launch_ready_buckets(self) -> None:
        step = self._step
        last = len(self._buckets) - 1
        while step.next_bucket <= last and step.pending[step.next_bucket] == 0:
            b = step.next_bucket
            if b == last:
                # "Used here" flags ride in the last bucket's tail: no extra collective.
                self._used_flags.copy_(torch.tensor(step.used, dtype=self._used_flags.dtype))
            # The last bucket is waited on as soon as backward ends: a hook may run it there.
            launch = getattr(self.comm_hook, "call_on_wait", None) if b == last else None
            with profiling.mark("ddptrain.launch bucket", b):
                step.works[b] = (launch or self.comm_hook)(self._buckets[b], self.process_group)
            step.next_bucket += 1
            if b == last and step.sync_buffers:
                with profiling.mark("ddptrain.launch buffers"):
                    step.buffer_work = self._model_buffers.start_sync(0)

    def _finalize(self) -> None:
        with profiling.mark("ddptrain.finalize"):
            self._finalize_buckets()

    def _finalize_buckets(self) -> None:
        step = self._step
        try:
            for index, ready in enumerate(step.ready):
                if not ready:
                    # No gradient here this backward: contribute what is accumulated (no_sync)
                    # or zero, so every rank still launches every bucket.
                    self._fill_view(index, self._params[index].grad)
                    step.pending[self._param_bucket[index]] -= 1
            self._launch_ready_buckets()
            started = time.perf_counter()
            for b, work in enumerate(step.works):
                with profiling.mark("ddptrain.wait bucket", b):
                    work.wait()
            if step.buffer_work is not None:
                with profiling.mark("ddptrain.wait buffers"), torch.no_grad():
                    step.buffer_work.wait()
            self.last_comm_wait_s = time.perf_counter() - started
            used_anywhere = (self._used_flags != 0).tolist()
            if self._ready_order is not None:
                self._rebuild_in_ready_order()
            for index, p in enumerate(self._params):
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
        finally:
            self._step = StepState(len(self._params), self._bucket_lens, self.world_size)

    def _rebuild_in_ready_order(self) -> None:
        """Rebuild buckets in the gradient-ready order rank 0 observed on the first backward."""
        observed, self._ready_order = dict.fromkeys(self._ready_order or []), None
        n = len(self._params)
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
        if order_list == self._bucket_order:
            return
        old_views = self._views
        self._build_buckets(order_list)
        with torch.no_grad():
            for new, old in zip(self._views, old_views, strict=True):
                new.copy_(old)


DDP = DistributedDataParallel


def _total_len(dicts: list[dict]) -> int:
    return sum(map(len, dicts))


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def _default_hook(module: nn.Module, group: Any) -> CommHook:
    """Nothing to send alone; for CPU processes, shared memory on one host or direct TCP
    across hosts (comm.default_transport); else the backend's all_reduce."""
    if dist.get_world_size(group) == 1:
        return local_hook
    on_cpu = all(p.device.type == "cpu" for p in module.parameters())
    return default_transport(group, on_cpu) or allreduce_hook

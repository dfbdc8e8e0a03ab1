"""The DDP wrapper: init broadcast, bucketed reductions overlapped with backward.

    info = ddptrain.init_distributed()
    model = ddptrain.DDP(Net().to(info.device))      # rank 0's weights everywhere
    loss = loss_fn(model(x), y)
    loss.backward()                                  # every .grad is now the mean over ranks
    optimizer.step()

    with model.no_sync():                            # gradient accumulation
        loss_fn(model(x1), y1).backward()            # local only
    loss_fn(model(x2), y2).backward()                # reduces the accumulated sum

    model.register_comm_hook(state, hook)            # torch's hook protocol (ddp/hooks.py)
    with Join([model, optimizer]): ...               # torch's Join: uneven inputs (ddp/join.py)

How it works: gradients are packed into flat per-dtype/device buckets. A hook on each parameter
fires when its gradient is accumulated; it copies the gradient into its bucket slot, and once a
bucket is full its reduction is handed to the communication thread, which runs the comm hook
of one bucket at a time, in bucket order, while autograd keeps computing earlier layers. A
callback queued on the autograd engine reduces the last bucket itself, waits for the others,
and points each `.grad` at its slot (gradient_as_bucket_view, the default: no copy back) or
copies the average into it. The first synchronized backward records the order gradients become
ready, and buckets are rebuilt once in rank 0's order.

The comm hook decides how a bucket travels. By default it is a Transport (ddp/hooks.py:
shared memory for CPU ranks on one host, TCP across hosts, nothing alone, else the backend's
all_reduce), which also places the buckets and is given gradients already divided by
world_size. Buffers come from rank 0 (ddp/buffers.py).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from ddptrain.ddp import compat, marks
from ddptrain.ddp.buckets import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_CAP_MB,
    build_layout,
    fill_slot,
    mb_to_bytes,
)
from ddptrain.ddp.buffers import ModelBuffers
from ddptrain.ddp.groups import close_at_shutdown, global_rank, resolve
from ddptrain.ddp.hooks import (
    NAMES,
    CommHook,
    GradBucket,
    Transport,
    default_transport,
    make_transport,
    module_on_cpu,
    transport_hook,
)
from ddptrain.ddp.join import JoinContext, WrapperJoinHook
from ddptrain.ddp.linear_grads import LinearSlots, has_other_hooks, slot_params, will_accumulate
from ddptrain.ddp.replicas import broadcast_coalesced, coalesce, verify_same_model
from ddptrain.ddp.runner import OrderedRunner
from ddptrain.ddp.step import StepState


class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel wrapper written on plain torch.distributed collectives; takes the
    arguments of torch's `DistributedDataParallel` (ddp/compat.py says which apply).

    Invariants:
    - Every rank wraps a model with the same parameters and buffers, in the same order, with the
      same shapes and dtypes; this is checked at construction (a clear error, never a hang).
    - Parameters and buffers come from rank 0: broadcast at construction, and buffers again
      at every step when `broadcast_buffers=True`: before the forward, or, when every buffer
      is a running statistic of a norm layer in training mode, by the end of the backward.
    - When `loss.backward()` returns outside `no_sync()`, every `.grad` holds the mean over ranks.
    - A parameter with no gradient on some ranks counts as zero there; one with no gradient on
      any rank keeps `grad=None`, so optimizers skip it.
    - Comm hooks run one bucket at a time, in bucket order, on every rank (each starts once the
      previous bucket's future is done), so a hook's own collectives pair up across ranks.
      After the first synchronized backward, buckets are rebuilt once in rank 0's ready order.
    - With `gradient_as_bucket_view=True` (default) each `.grad` is a view into its bucket
      after backward; `zero_grad(set_to_none=True)` and `zero_grad(set_to_none=False)` both work.
    - No parameters are added after wrapping; one forward is followed by at most one backward.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = True,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_CAP_MB,
        comm_hook: Transport | str | None = None,
        rebuild_buckets: bool = True,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs an initialized process group; "
                "call ddptrain.init_distributed() (or torch.distributed.init_process_group) first"
            )
        options = compat.torch_options(
            module,
            device_ids=device_ids,
            output_device=output_device,
            broadcast_buffers=broadcast_buffers,
            init_sync=init_sync,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            bucket_cap_mb_list=bucket_cap_mb_list,
            forward_sync_buffers=forward_sync_buffers,
            default_bucket_cap_mb=DEFAULT_BUCKET_CAP_MB,
        )
        self.module = module
        self.device_ids = options.device_ids
        self._input_device = options.input_device
        # None for the default group: holding its object would keep gloo's threads alive
        # after shutdown().
        self.process_group = options.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.broadcast_buffers = options.broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # torch's name: False inside no_sync(), when a backward only accumulates.
        self.require_backward_grad_sync = True
        self._named_params = list(module.named_parameters())
        self._params = [p for _, p in self._named_params if p.requires_grad]
        self._param_names = [n for n, p in self._named_params if p.requires_grad]
        # Sizes of every module's parameter and child dicts, checked each forward: far cheaper
        # than walking module.parameters() (~50 us/step on a small MLP), which is only needed
        # once a module was added somewhere.
        modules = list(module.modules())
        self._param_dicts = [m._parameters for m in modules]
        self._module_dicts = [m._modules for m in modules]
        self._sizes_at_wrap = (_total_len(self._param_dicts), _total_len(self._module_dicts))
        self._model_buffers = ModelBuffers(module, self.process_group)
        if options.init_sync:
            verify_same_model(self._named_params, list(module.named_buffers()), self.process_group)
            self.sync_from(0)
        self._cap_bytes = mb_to_bytes(options.bucket_cap_mb)
        self._first_cap_bytes = mb_to_bytes(first_bucket_cap_mb)
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]
        # Each parameter's AccumulateGrad node, held so that it stays the one autograd uses:
        # a slot is claimed only in a backward that will run it (not torch.autograd.grad).
        self._grad_accs = [p.view_as(p).grad_fn.next_functions[0][0] for p in self._params]
        # The mode costs ~1 us of Python per torch call in the forward: entered only for large
        # CPU Linear layers, where copying gradients is the cost it saves (memory bandwidth).
        slotted = slot_params(modules) if gradient_as_bucket_view else []
        self._linear_slots = LinearSlots(self._claim_slot, slotted) if slotted else None
        self._runner = OrderedRunner("ddptrain-comm")
        weakref.finalize(self, self._runner.close)
        close_at_shutdown(self._runner.close)
        self._scratch = torch.empty(0)
        self._synchronized_once = False
        self._rebuild_buckets = rebuild_buckets
        self._user_hook = False
        if isinstance(comm_hook, str) and comm_hook != "default":
            comm_hook = make_transport(comm_hook, self.process_group)
        elif comm_hook is not None and not isinstance(comm_hook, (Transport, str)):
            raise TypeError(
                f"comm_hook must be a transport name (default, {', '.join(NAMES)}) or a "
                f"ddptrain.ddp.hooks.Transport, got {type(comm_hook).__name__}; register a "
                "hook(state, bucket) with model.register_comm_hook(state, hook)"
            )
        if not isinstance(comm_hook, Transport):
            comm_hook = default_transport(self.process_group, module_on_cpu(module))
        self._use_hook(comm_hook, transport_hook)
        self.join_hook_in_use: WrapperJoinHook | None = None
        # Seconds the last synchronized backward waited for its buckets after autograd was
        # done: the communication that overlap did not hide (the Trainer logs it as comm_s).
        self.last_comm_wait_s = 0.0

    # ----------------------------------------------------------------------------- hooks
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """torch's protocol: `hook(state, bucket) -> Future[Tensor]` reduces each bucket (the
        SUM of local gradients; the future holds their mean). Once, before the first backward."""
        if self._user_hook:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        if self._synchronized_once:
            raise RuntimeError(
                "register_comm_hook must be called before the first synchronized backward"
            )
        self._refuse_shared_group(state)
        if self._transport is not None:
            self._transport.close()
        self._use_hook(state, hook)
        self._user_hook = True

    @property
    def comm_hook(self) -> tuple[object, CommHook]:
        """(state, hook) that reduces the buckets."""
        return self._hook_state, self._hook

    def _use_hook(self, state: object, hook: CommHook) -> None:
        # A transport places the buckets, sums gradients pre-divided by world_size and carries
        # the used flags in the last bucket's tail; a torch hook gets plain sums.
        self._hook_state, self._hook = state, hook
        self._transport = state if isinstance(state, Transport) else None
        self._model_buffers.transport = self._transport
        self._divisor = self.world_size if self._transport is not None else 1
        self._build_buckets(list(reversed(range(len(self._params)))))
        self._ready_order: list[int] | None = [] if self._rebuild_buckets else None
        self._step = StepState(len(self._params), self._bucket_lens, self._divisor)

    def _refuse_shared_group(self, state: object) -> None:
        """A torch hook's collectives run on the communication thread while the model's own
        (SyncBatchNorm's backward) run on autograd's: on one group they would pair wrongly."""
        if state is None or isinstance(state, dist.ProcessGroup):
            group = resolve(state)
        elif hasattr(state, "process_group"):  # torch's PowerSGDState, for one
            group = resolve(state.process_group)
        else:
            return  # a state of the hook's own: its business
        for name, m in self.module.named_modules():
            if hasattr(m, "process_group") and resolve(m.process_group) == group:
                raise ValueError(
                    f"the comm hook reduces on the process group that '{name}' "
                    f"({type(m).__name__}) runs collectives on in backward; give one of them a "
                    "group of its own: convert_sync_batchnorm(model, dist.new_group()) or "
                    "register_comm_hook(dist.new_group(), hook)"
                )

    # ----------------------------------------------------------------------------- buckets
    def _build_buckets(self, order: list[int]) -> None:
        transport = self._transport
        layout = build_layout(
            self._params,
            order,
            self._cap_bytes,
            self._first_cap_bytes,
            transport.allocate if transport is not None else _zeros,
            self.gradient_as_bucket_view,
            flags=transport is not None,
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
        # What the hook is handed: for a transport, the last flat tensor with its flags.
        last = len(self._buckets) - 1
        self._grad_buckets = [
            GradBucket(
                b,
                flat,
                [self._views[i] for i in members],
                [self._params[i] for i in members],
                b == last,
            )
            for b, (flat, members) in enumerate(zip(self._buckets, layout.members, strict=True))
        ]

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
        joining = self._join_config.enable and self.join_hook_in_use is not None
        if joining:
            if not self._join_config.is_first_joinable:
                raise ValueError("put the model first in Join([model, ...]): its forward counts")
            buffer_src = self.join_hook_in_use.on_forward()
        synchronized = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.broadcast_buffers and self.world_size > 1 and self._model_buffers:
            # With the last bucket when this forward cannot read them and a synchronized
            # backward follows; never under join, whose joined ranks shadow the broadcast.
            if joining or not self._buckets or not self._model_buffers.follow_gradients():
                self._model_buffers.sync(buffer_src)
            elif synchronized:
                self._step.sync_buffers = True
        args, kwargs = compat.move_inputs(args, kwargs, self._input_device)
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

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces the accumulated sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ----------------------------------------------------------------------------- join
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> JoinContext:
        """torch's `Join([model])`: ranks with different numbers of batches (ddp/join.py)."""
        return JoinContext(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> WrapperJoinHook:
        """torch's Joinable: the hook a joined rank shadows the others' iterations with."""
        hook = WrapperJoinHook(self, kwargs.get("divide_by_initial_world_size", True))
        self.join_hook_in_use = hook
        return hook

    @property
    def join_device(self) -> torch.device:
        """torch's Joinable: where the join's own collectives run."""
        first = next(iter(self.module.parameters()), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        """torch's Joinable: the group the join's own collectives run on."""
        return resolve(self.process_group)

    def end_join(self, hook: WrapperJoinHook) -> None:
        """The join context ended: forwards stop taking part in it."""
        if self.join_hook_in_use is hook:
            self.join_hook_in_use = None
            self._divisor = self.world_size if self._transport is not None else 1
            self._step.divisor = self._divisor
            self._join_config = type(self._join_config).construct_disabled_join_config()

    def set_gradient_divisor(self, divisor: int) -> None:
        """Under join: a transport's next reduction divides by `divisor`, not world_size."""
        if self._transport is not None:
            self._divisor = divisor
            self._step.divisor = divisor

    # ----------------------------------------------------------------------------- collectives
    def sync_buffers(self, src: int = 0) -> None:
        """Collective: every rank's buffers become rank `src`'s."""
        if self._model_buffers:
            self._model_buffers.sync(src)

    @torch.no_grad()
    def sync_from(self, src: int) -> None:
        """Collective: rank `src`'s parameters (and buffers, when broadcast_buffers) everywhere."""
        tensors = [p.detach() for _, p in self._named_params]
        if self.broadcast_buffers:
            tensors += self._model_buffers.tensors
        broadcast_coalesced(coalesce(tensors), self.process_group, src)

    def reduce_gradients(self, divisor: int | None = None) -> None:
        """Collective: reduce the gradients this rank holds in `.grad` (None counts as zero) as
        a synchronized backward would, so every `.grad` becomes the mean; for a rank that has no
        backward of its own to run (joined)."""
        self._step = StepState(len(self._params), self._bucket_lens, self._divisor)
        if divisor is not None:
            self.set_gradient_divisor(divisor)
        self._step.used = [p.grad is not None for p in self._params]
        self._finalize()

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
        if index is None or not (self.require_backward_grad_sync and step.armed):
            return None
        if not self._grad_is_view[index]:
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
        if not self.require_backward_grad_sync:
            return
        step.check_arrival(index, self._param_names[index], param.grad)
        if not step.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
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
            if b == last and self._used_flags is not None:
                self._used_flags.copy_(torch.tensor(step.used, dtype=self._used_flags.dtype))
            with marks.mark("ddptrain.launch bucket", b):
                # The last bucket is waited for as soon as backward ends: the waiting thread
                # runs it, sparing two thread wake-ups on the critical path.
                step.jobs[b] = self._runner.submit(self._reduce_bucket, b, wake=b != last)
            step.next_bucket += 1

    def _reduce_bucket(self, b: int) -> torch.Tensor:
        """Run the comm hook on bucket b and wait for its future (the communication thread,
        or the thread waiting for the last bucket)."""
        bucket = self._grad_buckets[b]
        with marks.mark("ddptrain.reduce bucket", b), torch.no_grad(), _on(bucket.buffer()):
            return self._hook(self._hook_state, bucket).wait()

    def _finalize(self) -> None:
        with marks.mark("ddptrain.finalize"):
            self._finalize_buckets()

    def _finalize_buckets(self) -> None:
        step = self._step
        if not self._synchronized_once:
            self._synchronized_once = True
        try:
            for index, ready in enumerate(step.ready):
                if not ready:
                    # No gradient here this backward: contribute what is accumulated (no_sync)
                    # or zero, so every rank still reduces every bucket.
                    self._fill_view(index, self._params[index].grad)
                    step.pending[self._param_bucket[index]] -= 1
            self._launch_ready_buckets()
            started = time.perf_counter()
            for b, job in enumerate(step.jobs):
                with marks.mark("ddptrain.wait bucket", b):
                    result = job.wait()
                flat = self._grad_buckets[b].buffer()
                if result is not None and result.data_ptr() != flat.data_ptr():
                    flat.copy_(result.view(-1))
            used_anywhere = self._used_anywhere(step.used)
            if step.sync_buffers:
                with marks.mark("ddptrain.buffers"):
                    self._model_buffers.sync(0)
            self.last_comm_wait_s = time.perf_counter() - started
            if self._ready_order is not None:
                self._rebuild_in_ready_order()
            self._point_grads(used_anywhere)
        except BaseException:
            # Reductions queued behind a failed one would run collectives no peer joins.
            self._runner.close()
            raise
        finally:
            self._step = StepState(len(self._params), self._bucket_lens, self._divisor)

    def _used_anywhere(self, used: list[bool]) -> list[bool]:
        """Which parameters got a gradient on some rank: from the last bucket's tail, where
        a transport summed the flags, else one small all_reduce."""
        if self._used_flags is not None:
            return (self._used_flags != 0).tolist()
        if self.world_size == 1:
            return list(used)
        flags = torch.tensor(used, dtype=torch.int32, device=self.join_device)
        dist.all_reduce(flags, group=self.process_group)
        return (flags != 0).tolist()

    def _point_grads(self, used_anywhere: list[bool]) -> None:
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


def _on(tensor: torch.Tensor) -> Any:
    """The tensor's CUDA device as current (on the communication thread), else nothing."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else _NO_DEVICE


_NO_DEVICE = contextlib.nullcontext()

"""The DDP wrapper: rank 0's model everywhere, gradients averaged while backward runs.

    info = ddptrain.init_distributed()
    model = ddptrain.DDP(Net().to(info.device))      # rank 0's weights everywhere
    loss = loss_fn(model(x), y)
    loss.backward()                                  # every .grad is now the mean over ranks
    optimizer.step()

    with model.no_sync():                            # gradient accumulation
        loss_fn(model(x1), y1).backward()            # local only
    loss_fn(model(x2), y2).backward()                # reduces the accumulated sum

    model.register_comm_hook(state, hook)            # torch's hook protocol (ddp/hooks.py)
    ddptrain.DDP(net, deterministic=True)            # the same bits at any world size (exact.py)
    with Join([model, optimizer]): ...               # torch's Join: uneven inputs (ddp/join.py)

This module is the wrapper as torch's users meet it: construction (torch's arguments, checks,
rank 0's weights, the transport), the forward (buffers, the join's per-forward exchange,
arming the backward) and the public collectives the join hook is built on. The backward
itself, buckets filled as gradients arrive and reduced while autograd goes on, is
reducer.py's; the transports that carry buckets are reached through ddp/hooks.py; buffers and
the replica checks are replicas.py's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from ddptrain.ddp.buckets import mb_to_bytes
from ddptrain.ddp.hooks import (
    CommHook,
    Transport,
    cpu_forward_mode,
    default_transport,
    module_on_cpu,
    refuse_shared_group,
    resolve,
    transport_hook,
)
from ddptrain.ddp.join import JoinContext, WrapperJoinHook
from ddptrain.ddp.reducer import Reducer
from ddptrain.ddp.replicas import (
    ModelBuffers,
    broadcast_coalesced,
    coalesce,
    verify_same_model,
)
from ddptrain.ddp.torch_args import move_inputs, torch_options


class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel wrapper written on plain torch.distributed collectives; takes the
    arguments of torch's `DistributedDataParallel` (`torch_options` says which apply).

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
    - With `deterministic=True` (ddp/deterministic.py) `.grad` is instead the mean over every rank's
      micro-batches since the last synchronized backward (one forward and backward each, the
      same number on every rank), with the same bits at any world size.
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
        first_bucket_cap_mb: float | None = None,
        comm_hook: tuple[object, CommHook] | None = None,
        rebuild_buckets: bool = True,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs an initialized process group; "
                "call ddptrain.init_distributed() (or torch.distributed.init_process_group) first"
            )
        options = torch_options(
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
            first_bucket_cap_mb=first_bucket_cap_mb,
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
        self._named_params = list(module.named_parameters())
        # Sizes of every module's parameter and child dicts, checked each forward: far cheaper
        # than walking module.parameters(), which is only needed once a module was added.
        modules = list(module.modules())
        self._param_dicts = [m._parameters for m in modules]
        self._module_dicts = [m._modules for m in modules]
        self._sizes_at_wrap = (_total_len(self._param_dicts), _total_len(self._module_dicts))
        self._model_buffers = ModelBuffers(module, self.process_group)
        if options.init_sync:
            verify_same_model(self._named_params, list(module.named_buffers()), self.process_group)
            self.sync_from(0)
        trained = [(n, p) for n, p in self._named_params if p.requires_grad]
        reducer: Any = Reducer
        if deterministic:
            # The exact mode, in a module of its own: read only by those who ask for it.
            from ddptrain.ddp.deterministic import ExactReducer

            reducer = functools.partial(ExactReducer, module)
        self.reducer = reducer(
            [p for _, p in trained],
            [n for n, _ in trained],
            self.process_group,
            self._model_buffers,
            mb_to_bytes(options.bucket_cap_mb),
            mb_to_bytes(options.first_bucket_cap_mb),
            gradient_as_bucket_view,
            rebuild_buckets,
        )
        # A hook given here counts as registered: register_comm_hook then refuses another.
        self._user_hook = comm_hook is not None
        state, hook = self._hook(comm_hook)
        self._use_hook(state, hook, self._transport_beside(state))
        self.join_hook_in_use: WrapperJoinHook | None = None

    def _hook(self, comm_hook: tuple[object, CommHook] | None) -> tuple[object, CommHook]:
        """Collective: the (state, hook) pair that reduces buckets (None: the default transport;
        ddptrain.named_hook builds the others by name)."""
        if comm_hook is None:
            transport = default_transport(self.process_group, module_on_cpu(self.module))
            return transport, transport_hook
        if isinstance(comm_hook, tuple) and len(comm_hook) == 2 and callable(comm_hook[1]):
            state, hook = comm_hook
            refuse_shared_group(self.module, state)
            return state, hook
        raise TypeError(
            "comm_hook must be a (state, hook) pair, as torch's register_comm_hook takes, got "
            f"{type(comm_hook).__name__}; for a hook by name use "
            "comm_hook=ddptrain.named_hook('bf16') (ddptrain/comm.py lists the names)"
        )

    def _transport_beside(self, state: object, kept: Transport | None = None) -> Transport | None:
        """For a hook that is no Transport, on CPU under gloo, the transport for the wrapper's
        own small collectives (the used flags, buffers): `kept`, else a new default one
        (collective). gloo's loopback round trip costs milliseconds a step on a busy host,
        shared memory microseconds."""
        on_cpu = module_on_cpu(self.module) and dist.get_backend(self.process_group) == "gloo"
        if isinstance(state, Transport) or not on_cpu:
            return None
        return kept if kept is not None else default_transport(self.process_group, on_cpu=True)

    # ----------------------------------------------------------------------------- hooks
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """torch's protocol: `hook(state, bucket) -> Future[Tensor]` reduces each bucket (the
        SUM of local gradients; the future holds their mean). Once, before the first backward."""
        if self._user_hook:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        if self.reducer.synchronized_once:
            raise RuntimeError(
                "register_comm_hook must be called before the first synchronized backward"
            )
        refuse_shared_group(self.module, state)
        # The default transport stays for the wrapper's own sums beside a hook that is none;
        # its bucket rows go with the buckets the reducer rebuilds.
        old = self.reducer.transport
        beside = self._transport_beside(state, kept=old)
        if old is not None and old is not beside:
            old.close()
        self._use_hook(state, hook, beside)
        self._user_hook = True

    def _use_hook(self, state: object, hook: CommHook, beside: Transport | None = None) -> None:
        self.reducer.use_hook(state, hook, beside)
        # On the CPU, large Linear layers may compute their gradients straight into their
        # bucket slots (ddptrain/cpu/linear_slots.py), where .grad is the slot itself.
        self._forward_mode = None
        if self.gradient_as_bucket_view and type(self.reducer) is Reducer:
            self._forward_mode = cpu_forward_mode(self.module, self.reducer.claim_slot)

    @property
    def comm_hook(self) -> tuple[object, CommHook]:
        """(state, hook) that reduces the buckets."""
        return self.reducer.hook_state, self.reducer.hook

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        names = self.reducer.names
        return [[names[i] for i in b.members] for b in self.reducer.buckets]

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Gradient bytes per bucket, in launch order."""
        params = self.reducer.params
        return [
            sum(params[i].numel() * params[i].element_size() for i in b.members)
            for b in self.reducer.buckets
        ]

    @property
    def last_comm_wait_s(self) -> float:
        """Seconds the last synchronized backward waited for its buckets after autograd was
        done: the communication overlap did not hide."""
        return self.reducer.last_comm_wait_s

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
        synchronized = torch.is_grad_enabled() and self.reducer.sync
        with_gradients = False
        if self.broadcast_buffers and self.world_size > 1 and self._model_buffers:
            # With the last bucket when this forward cannot read them and a synchronized
            # backward follows; never under join, whose joined ranks shadow the broadcast.
            if joining or not self._model_buffers.follow_gradients():
                self._model_buffers.sync(buffer_src)
            else:
                with_gradients = synchronized
        self.reducer.prepare_for_forward(synchronized, with_gradients)
        args, kwargs = move_inputs(args, kwargs, self._input_device)
        if synchronized and self._forward_mode is not None and not torch.compiler.is_compiling():
            with self._forward_mode:
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    def _parameters_changed(self) -> bool:
        if _total_len(self._module_dicts) != self._sizes_at_wrap[1]:
            return sum(1 for _ in self.module.parameters()) != len(self._named_params)
        return _total_len(self._param_dicts) != self._sizes_at_wrap[0]

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch's name: False inside no_sync(), when a backward only accumulates."""
        return self.reducer.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.sync = value

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces the accumulated sum."""
        previous = self.reducer.sync
        self.reducer.sync = False
        try:
            yield
        finally:
            self.reducer.sync = previous

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
            self.reducer.set_divisor(self.world_size)
            self._join_config = type(self._join_config).construct_disabled_join_config()

    def set_gradient_divisor(self, divisor: int) -> None:
        """Under join: a transport's next reductions divide by `divisor`, not world_size (a
        torch hook divides by the group size itself)."""
        self.reducer.set_divisor(divisor)

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
        self.reducer.reduce_gradients(divisor)


DDP = DistributedDataParallel


def _total_len(dicts: list[dict]) -> int:
    return sum(map(len, dicts))

"""Fully sharded data parallel (ZeRO stage 3; stage 2 with reshard_after_forward=False).

    info = ddptrain.init_distributed()
    model = ddptrain.FullyShardedDataParallel(net, units=list(net.blocks))  # or by size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # built on this rank's shards
    loss_fn(model(x), y).backward()      # each shard's .grad: its piece of the mean gradient
    opt.step()                           # steps this rank's shards only
    state = model.state_dict()           # collective: whole tensors, the plain module's keys
    optim_state = model.optim_state_dict(opt)   # collective: the plain optimizer's layout
    ddptrain.FSDP(net, deterministic=True)      # the same bits at any world size (as DDP's)

Every parameter is kept as world_size shards, one per rank (fsdp/unit.py); between steps the
module holds this rank's shard as each parameter, so an optimizer built on model.parameters()
holds 1/world_size of the state. The model is cut into units (submodules named in `units`, or
by size; fsdp/layout.py), each gathered whole just before its forward and, with ZeRO-3, freed
after it and gathered again just before its backward. When a unit's backward is done, its
gradients are reduce-scattered: each rank receives only its shard's piece of the mean. The
next unit's gather is started before this one's forward or backward runs, and reduce-scatters
run while autograd goes on, so communication overlaps compute as the DDP wrapper's buckets do.
Every forward gathers every unit, in one order on every rank (rank 0's first forward's), and
every synchronized backward reduces every unit: a unit that some ranks' inputs skip (a
data-dependent branch) is gathered and reduced there too, so the collectives pair up.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ddptrain.ddp.hooks import close_at_shutdown, new_group_like, release_group
from ddptrain.ddp.replicas import ModelBuffers, broadcast_coalesced, coalesce, verify_same_model
from ddptrain.fsdp import state
from ddptrain.fsdp.deterministic import ExactGradients
from ddptrain.fsdp.layout import DEFAULT_UNIT_MIN_NUMEL, choose_units, group_parameters
from ddptrain.fsdp.passes import (
    Pass,
    PostBackward,
    Schedule,
    check_no_late_gradients,
    learn_order,
)
from ddptrain.fsdp.unit import Unit

# Reduce-scatters in flight at once, each holding a unit-sized send buffer: a backward's gradient
# memory stays near one shard plus two units (the one computing, the one travelling).
MAX_REDUCING = 1


class FullyShardedDataParallel(nn.Module):
    """Shards parameters, gradients and optimizer state across ranks (ZeRO-3; ZeRO-2 with
    `reshard_after_forward=False`: parameters stay gathered from a unit's forward to the end of
    its backward instead of being gathered twice).

    Invariants:
    - Every rank wraps the same model (checked); rank 0's parameters and buffers are everywhere
      after construction.
    - Between steps every parameter attribute of the module is this rank's shard (1-D, the
      parameter's elements in memory order); inside a unit's forward it is the whole parameter.
    - Each unit runs at most once per forward (checked), on any rank in any order: every
      forward gathers every unit, in one schedule the ranks share (fsdp/passes.py), so a unit
      a rank skips (a branch) pairs with the gathers of the ranks that run it and counts as
      zero there. One forward is followed by at most one backward.
    - When backward returns outside no_sync(), each shard's .grad holds its piece of the mean
      gradient over ranks (added to what it held); a parameter no rank got a gradient for keeps
      its .grad (None after zero_grad), as under the DDP wrapper. deterministic=True: the mean
      over every rank's micro-batches instead, the DDP wrapper's bits (fsdp/deterministic.py).
    - state_dict(), optim_state_dict(), summon_full_params(), grad_norm() and clip_grad_norm_()
      are collective; load_state_dict() and load_optim_state_dict() are not.
    - Parameters keep their storage after wrapping (no `p.data = ...`, no `.to()`).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: Any = None,
        units: Iterable[nn.Module | type[nn.Module]] | None = None,
        unit_min_numel: int = DEFAULT_UNIT_MIN_NUMEL,
        reshard_after_forward: bool = True,
        broadcast_buffers: bool = True,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "FullyShardedDataParallel needs an initialized process group; call "
                "ddptrain.init_distributed() (or torch.distributed.init_process_group) first"
            )
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.reshard_after_forward = reshard_after_forward
        self.broadcast_buffers = broadcast_buffers
        verify_same_model(
            list(module.named_parameters()), list(module.named_buffers()), process_group
        )
        with torch.no_grad():
            broadcast_coalesced(coalesce(list(module.buffers())), process_group)
        unit_modules = choose_units(module, units, unit_min_numel)
        groups = group_parameters(module, unit_modules)
        # Gathers and reduce-scatters each on a group of their own, in an order every rank
        # agrees on; a SyncBatchNorm's collectives on the model's group never pair with theirs.
        self._gather_group = new_group_like(process_group)
        self._reduce_group = new_group_like(process_group)
        close_at_shutdown(self.close)
        # Each unit takes its shard of rank 0's parameters (a scatter, one unit at a time).
        self.units = [
            Unit(m, refs, self.rank, self.world_size, self._gather_group, self._reduce_group)
            for m, refs in zip(unit_modules, groups, strict=True)
            if refs
        ]
        for unit in self.units:
            unit.use_shards()
            unit.module.register_forward_pre_hook(
                functools.partial(self._before_forward, unit), with_kwargs=True
            )
            unit.module.register_forward_hook(functools.partial(self._after_forward, unit))
        self._root = next((u for u in self.units if u.module is module), None)
        self._model_buffers = ModelBuffers(module, process_group)
        self.exact = ExactGradients(module, process_group) if deterministic else None
        self.require_backward_grad_sync = True
        self.last_comm_wait_s = 0.0
        self._pass = Pass(sync=True)
        self._pass.done = True
        # Module order until the first training forward shows the order units run in.
        self._schedule = Schedule(self.units)
        self._order_learned = False
        self._summoned = False

    # ----------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._pass.done:
            self._end_pass()  # the last forward had no backward: nothing of it is needed now
        if self.broadcast_buffers and self.world_size > 1 and self._model_buffers:
            self._model_buffers.sync(0)
        if self._summoned:
            return self.module(*args, **kwargs)  # every unit is whole: nothing to gather
        training = torch.is_grad_enabled()
        if training:
            self._pass = Pass(sync=self.require_backward_grad_sync)
        self._schedule.begin()
        out = self.module(*args, **kwargs)
        self._end_forward(training)
        return out

    def _before_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """A unit's forward pre-hook: gather it and the next one in the schedule; under grad,
        route its inputs through PostBackward so its backward's end is seen."""
        if self._summoned:
            return None
        p = self._pass
        training = torch.is_grad_enabled()
        if training:
            p.enter(unit)
        self._schedule.issue_through(unit)
        # Its scheduled gather was freed (a unit run again under no_grad) or there is no
        # schedule (called outside the wrapper's forward): gathered as every rank calls it.
        unit.gather()
        unit.wait()
        unit.use_full()
        if not training:
            return None
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            return None  # the first unit: the final callback finds its gradients complete
        routed = PostBackward.apply(
            functools.partial(self._after_backward, unit, p), *[flat[i] for i in where]
        )
        for i, t in zip(where, routed, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _after_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        """A unit's forward hook: free it (ZeRO-3, or no backward to come); under grad, hook
        the start of its backward on its outputs."""
        if self._summoned:
            return
        p = self._pass
        training = torch.is_grad_enabled() and not p.done
        is_root = unit.module is self.module
        if not training or (self.reshard_after_forward and not is_root):
            # The root is not freed after a training forward: its backward comes first.
            unit.free()
        if not training:
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        tensors = [t for t in tensors if t.requires_grad]
        if tensors:
            hook = functools.partial(self._before_backward, unit, p)
            register_multi_grad_hook(tensors, hook, mode="any")

    def _end_forward(self, training: bool) -> None:
        """Gather what the forward skipped, to pair with the ranks that ran it, and free it;
        after a training forward, the orders of its backward (the same on every rank)."""
        self._schedule.end()
        ran = {id(u) for u in self._pass.ran} if training else set()
        for unit in self.units:
            if id(unit) not in ran:
                unit.free()
        if not training:
            return
        if not self._order_learned:
            self._schedule = Schedule(learn_order(self._pass.ran, self.units, self._gather_group))
            self._order_learned = True
        self._pass.plan_backward(self._schedule.units, self._root, self.reshard_after_forward)

    # ----------------------------------------------------------------------------- backward
    def _before_backward(self, unit: Unit, p: Pass, *grads: Any) -> None:
        """Gradients reached a unit's outputs: gather it (ZeRO-3) and prefetch the next."""
        p.check_current(self._pass)
        self._queue_end_of_backward(p)
        position = p.gather_position.get(id(unit))
        if position is None:
            return  # still gathered since its forward
        # Gathers are issued in gather_order on every rank, even for a unit whose backward does
        # not run here, so that they pair with the other ranks'; the next one is prefetched.
        p.issue_gathers(position + 2)
        unit.wait()
        unit.use_full()
        p.free_skipped(position)

    def _queue_end_of_backward(self, p: Pass) -> None:
        if not p.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            p.callback_queued = True
            if self.exact is not None:
                self.exact.backward_started()

    def _after_backward(self, unit: Unit, p: Pass) -> None:
        """A unit's backward is done (its inputs' gradients are computed): free its parameters,
        reduce-scatter its gradients when their turn in reduce_order comes."""
        p.check_current(self._pass)
        self._queue_end_of_backward(p)
        unit.free()
        p.ready.add(id(unit))
        self._launch_reductions(p)

    def _launch_reductions(self, p: Pass) -> None:
        """Start the reduce-scatters of ready units, strictly in reduce_order: every rank issues
        the same ones in the same order, whichever units' backward ended first here."""
        while p.reduced < len(p.reduce_order) and id(p.reduce_order[p.reduced]) in p.ready:
            unit = p.reduce_order[p.reduced]
            p.reduced += 1
            if self.exact is not None and unit.trainable:
                self.exact.accumulate(unit)
            if not (p.sync and unit.trainable):
                continue  # no_sync(): the whole gradients stay, to be added to next time
            while len(p.reducing) >= MAX_REDUCING:
                self._finish(p.reducing.pop(0))
            if self.exact is not None:
                self.exact.reduce(unit)
            else:
                unit.reduce_gradients()
            p.reducing.append(unit)

    def _finish(self, unit: Unit) -> None:
        """Wait for a unit's reduce-scatter; its shards' .grad hold their piece of the mean."""
        if self.exact is not None:
            self.exact.finish(unit)
        else:
            unit.finish_gradients()

    def _end_backward(self) -> None:
        """Queued on the autograd engine: reduce what did not report, wait for every
        reduce-scatter, free every unit. Each shard's .grad is then final."""
        p = self._pass
        p.ready.update(id(u) for u in p.reduce_order)
        self._launch_reductions(p)
        p.issue_gathers(len(p.gather_order))
        started = time.perf_counter()
        while p.reducing:
            self._finish(p.reducing.pop(0))
        self.last_comm_wait_s = time.perf_counter() - started
        self._end_pass()
        if p.sync and self.exact is not None:
            self.exact.end_step()
        if p.sync:
            check_no_late_gradients(self.units)

    def _end_pass(self) -> None:
        for unit in self.units:
            unit.free()
        self._pass.done = True

    # ----------------------------------------------------------------------------- sync
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate whole gradients locally (the full gradient's memory on every rank); the
        next backward outside reduce-scatters the accumulated sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """Refused: a comm hook reduces whole buckets; here each rank receives only its shard."""
        raise RuntimeError(
            "FullyShardedDataParallel reduce-scatters gradients: a DDP comm hook (which reduces "
            "whole buckets) has nothing to act on; use the DDP wrapper (zero_stage 0 or 1)"
        )

    def join(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a joined rank cannot answer the gathers of units it would not run."""
        raise RuntimeError(
            "uneven inputs (torch's Join) are not supported under FullyShardedDataParallel: every "
            "forward gathers from every rank. Give every rank the same number of batches"
        )

    # ----------------------------------------------------------------------------- whole
    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Collective: inside, the module holds every whole parameter, to read (evaluation
        on uneven per-rank shards, inspection); changes are not kept. Costs the model's size."""
        self._require_between_steps("summon_full_params()")
        for unit in self.units:
            unit.gather()
        for unit in self.units:
            unit.wait()
            unit.use_full()
        self._summoned = True
        try:
            yield
        finally:
            self._summoned = False
            for unit in self.units:
                unit.free()

    def state_dict(
        self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """Collective: the unwrapped module's state_dict, whole tensors (rank 0's buffers are
        this rank's own), loadable into the plain module."""
        self._require_between_steps("state_dict()")
        full = state.full_state_dict(self)
        if destination is None:
            return full
        destination.update({prefix + k: v for k, v in full.items()})
        return destination

    def load_state_dict(
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ):
        """Load a whole state (the plain module's, from any world size): each rank keeps its
        pieces. Not collective."""
        self._require_between_steps("load_state_dict()")
        return state.load_full_state_dict(self, state_dict, strict)

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Collective: `optimizer`'s state (built on this wrapper's parameters) in the layout
        of the same optimizer over the plain module: loads at any world size, or into it."""
        return state.full_optim_state_dict(self, optimizer)

    def load_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        """Load a plain-layout optimizer state into `optimizer`: each rank keeps its pieces."""
        state.load_full_optim_state_dict(self, optimizer, state_dict)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Collective: the norm of the whole gradient, from every rank's shards."""
        return state.whole_grad_norm(self, norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Collective: scale every shard's gradient so the whole gradient's norm is at most
        max_norm; returns the norm before clipping (the 2-norm: the exact one, the same bits
        as the DDP wrapper's at any world size)."""
        return state.clip_whole_grad_norm(self, max_norm, norm_type)

    def _require_between_steps(self, what: str) -> None:
        if not self._pass.done:
            raise RuntimeError(
                f"{what} runs between steps under FullyShardedDataParallel, not between a "
                "forward and its backward"
            )

    # ----------------------------------------------------------------------------- facts
    @property
    def unit_names(self) -> list[str]:
        """Each unit's module name in the wrapped module ("" for the module itself)."""
        names = {id(m): n for n, m in self.module.named_modules()}
        return [names[id(u.module)] for u in self.units]

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Gradient bytes of each unit: what one reduce-scatter carries."""
        return [u.numel * u.dtype.itemsize for u in self.units]

    def close(self) -> None:
        """Release the wrapper's process groups (ddptrain.shutdown() calls it)."""
        release_group(self._gather_group)
        release_group(self._reduce_group)
        self._gather_group = self._reduce_group = None
        if self.exact is not None:
            self.exact.close()


FSDP = FullyShardedDataParallel

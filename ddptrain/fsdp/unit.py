"""One unit of the fully sharded wrapper: its parameters kept as shards, gathered when used.

    unit = Unit(module, refs, rank, world_size, gather_group, reduce_group)
    unit.gather(); unit.wait()         # every rank's shard into the flat tensor (async, then wait)
    unit.use_full()                    # the modules hold the whole parameters (for the forward)
    unit.reduce_gradients()            # after its backward: start the reduce-scatter
    unit.finish_gradients()            # wait; shard.grad += this rank's piece of the mean
    unit.free()                        # the modules hold the shards; the flat tensor's memory goes

Between steps each module attribute holds this rank's shard: a 1-D nn.Parameter with the
parameter's elements [a, b) in memory order, a view of `shard_flat`, so model.parameters() (what
an optimizer is built on) are the shards. `full[j]` is a persistent nn.Parameter of the original
shape on the storage of `flat`, allocated only while the unit is gathered: autograd keeps
referring to the same tensor across the forward, the freeing and the gathering again for
backward (the storage is resized, never replaced). It is not a view of `flat`, so a gather
(an in-place write to `flat`) does not move the version counter autograd checks on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.ddp.buckets import memory_order
from ddptrain.ddp.hooks import global_rank
from ddptrain.fsdp.layout import ParamRef, flat_layout

# torch 2.13's names; earlier versions have only the older ones (same arguments, same order).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Unit:
    """One unit's parameters: sharded between uses, gathered for its forward and backward."""

    def __init__(
        self,
        module: nn.Module,
        refs: list[ParamRef],
        rank: int,
        world_size: int,
        gather_group: Any,
        reduce_group: Any,
    ) -> None:
        params = [r.param for r in refs]
        kinds = sorted({(str(p.dtype), str(p.device)) for p in params})
        if len(kinds) > 1:
            raise ValueError(
                f"unit {type(module).__name__} holds parameters of several dtypes/devices "
                f"({', '.join(' on '.join(k) for k in kinds)}); a unit is one flat tensor: give "
                "each dtype its own unit (units=[...]) or convert the model to one dtype"
            )
        self.module = module
        self.names = [r.name for r in refs]
        # Where each parameter is held; not the parameters: the originals must be freed.
        self.owners = [r.owners for r in refs]
        self.rank, self.world_size = rank, world_size
        self.gather_group, self.reduce_group = gather_group, reduce_group
        self.layout = flat_layout([p.numel() for p in params], world_size)
        self.dtype, self.device = params[0].dtype, params[0].device
        # Each rank's pieces (reduce-scatter fills every rank's part) and the gaps between them.
        self.all_pieces = [self.layout.pieces(r) for r in range(world_size)]
        self.all_gaps = [self.layout.gaps(r) for r in range(world_size)]
        self.pieces = self.all_pieces[rank]
        # Dense parameters (channels_last too) keep their strides: shards hold memory order.
        self.strides = [torch.empty_like(p).stride() for p in params]
        self.shard_flat = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self._take_from_rank0(params)
        self.shards = [
            nn.Parameter(self.shard_flat[at : at + b - a], requires_grad=p.requires_grad)
            for p, (_, a, b, at) in zip(params, self.pieces, strict=True)
        ]
        self.flat = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        self.full = [
            nn.Parameter(_alias(self.flat, p.shape, stride, o), requires_grad=p.requires_grad)
            for p, o, stride in zip(params, self.layout.offsets, self.strides, strict=True)
        ]
        _resize(self.flat, 0)
        self._gathering: Any = None
        self.gathered = False
        # The reduce-scatter started and not yet finished: (work, send buffer, receive buffer).
        self._reduction: tuple[Any, torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def _take_from_rank0(self, params: list[torch.Tensor]) -> None:
        """Collective on the gather group: this rank's part of rank 0's parameters. Rank 0 lays
        out one unit at a time, so no rank holds a second copy of the whole model."""
        parts = None
        if self.rank == 0:
            whole = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
            for p, o, stride in zip(params, self.layout.offsets, self.strides, strict=True):
                whole[o : o + p.numel()].copy_(in_memory_order(p, stride))
            parts = list(whole.chunk(self.world_size))
        src = global_rank(self.gather_group, 0)
        dist.scatter(self.shard_flat, parts, src=src, group=self.gather_group)

    @property
    def trainable(self) -> bool:
        """Whether any parameter of the unit takes gradients."""
        return any(s.requires_grad for s in self.shards)

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters (without padding)."""
        return sum(self.layout.numels)

    # ---------------------------------------------------------------------------- parameters
    def gather(self) -> None:
        """Collective on the gather group: start gathering every rank's shard (no-op if
        gathered or on its way)."""
        if self.gathered or self._gathering is not None:
            return
        _resize(self.flat, self.layout.padded_numel)
        self._gathering = all_gather_single(
            self.flat, self.shard_flat, group=self.gather_group, async_op=True
        )

    def wait(self) -> None:
        """Wait for the gather started by gather()."""
        if self._gathering is not None:
            self._gathering.wait()
            self._gathering = None
            self.gathered = True

    def use_full(self) -> None:
        """Point every module attribute at the whole (gathered) parameter."""
        for full, shard, owners in zip(self.full, self.shards, self.owners, strict=True):
            if full.requires_grad != shard.requires_grad:
                full.requires_grad_(shard.requires_grad)  # frozen or unfrozen since
            for module, name in owners:
                # The dict itself: setattr's checks, per parameter twice a step, add up.
                module._parameters[name] = full

    def use_shards(self) -> None:
        """Point every module attribute at this rank's shard."""
        for shard, owners in zip(self.shards, self.owners, strict=True):
            for module, name in owners:
                module._parameters[name] = shard

    def free(self) -> None:
        """Back to shards: the modules hold them and the gathered memory is released."""
        if not self.gathered and self._gathering is None:
            return  # the modules hold the shards already
        self.wait()
        self.use_shards()
        if self.gathered:
            _resize(self.flat, 0)
            self.gathered = False

    # ---------------------------------------------------------------------------- gradients
    def reduce_gradients(self) -> None:
        """Collective on the reduce group: start reduce-scattering the whole parameters'
        gradients (each / world_size, so the sum is the mean) and free them.

        Each rank's part of the send buffer ends in one "used here" flag per parameter, so
        the part every rank receives says which parameters got a gradient on some rank."""
        ws, shard_numel, n = self.world_size, self.layout.shard_numel, len(self.full)
        send = torch.empty(ws * (shard_numel + n), dtype=self.dtype, device=self.device)
        parts = send.view(ws, shard_numel + n)
        used = []
        for j, full in enumerate(self.full):
            grad = full.grad
            used.append(1.0 if grad is not None else 0.0)
            flat_grad = None if grad is None else in_memory_order(grad, self.strides[j])
            for rank in range(ws):
                _, a, b, at = self.all_pieces[rank][j]
                target = parts[rank, at : at + b - a]
                if flat_grad is None:
                    target.zero_()
                else:
                    # Scaling while copying, as the DDP wrapper's buckets do (buckets.fill_slot).
                    torch.mul(flat_grad[a:b], 1.0 / ws, out=target)
            full.grad = None  # the whole gradient is copied: free it now, not at the step's end
        for rank, gaps in enumerate(self.all_gaps):
            for start, stop in gaps:
                parts[rank, start:stop].zero_()
        parts[:, shard_numel:] = torch.tensor(used, dtype=self.dtype)
        receive = torch.empty(shard_numel + n, dtype=self.dtype, device=self.device)
        work = reduce_scatter_single(receive, send, group=self.reduce_group, async_op=True)
        self._reduction = (work, send, receive)

    def finish_gradients(self) -> None:
        """Wait for the reduce-scatter; add this rank's piece of the mean to each shard's .grad
        (set it if None). A parameter no rank had a gradient for keeps its .grad."""
        work, _, receive = self._reduction
        self._reduction = None
        work.wait()
        shard_numel = self.layout.shard_numel
        used_anywhere = (receive[shard_numel:] != 0).tolist()
        for shard, used, (_, a, b, at) in zip(self.shards, used_anywhere, self.pieces, strict=True):
            if not (used and shard.requires_grad):
                continue
            piece = receive[at : at + b - a]
            if shard.grad is None:
                shard.grad = piece
            else:
                shard.grad.add_(piece)


def in_memory_order(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """t's elements as a 1-D tensor in the memory order of a tensor of t's shape with `stride`
    (t itself, viewed, when its strides are those)."""
    if t.stride() != stride:
        t = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
    return memory_order(t)


def _alias(
    flat: torch.Tensor, shape: torch.Size, stride: tuple[int, ...], offset: int
) -> torch.Tensor:
    """A tensor on flat's storage that is not a view of it: it has a version counter of its
    own, which the gathers (in-place writes to flat, as autograd counts them) leave alone."""
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
        flat.untyped_storage(), offset, shape, stride
    )


def _resize(flat: torch.Tensor, numel: int) -> None:
    """Give `flat`'s storage room for `numel` elements (0: release its memory)."""
    flat.untyped_storage().resize_(numel * flat.element_size())

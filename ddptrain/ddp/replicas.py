"""Making replicas: the same model on every rank, rank 0's values broadcast into it, and
rank 0's buffers sent again at every step.

    verify_same_model(list(m.named_parameters()), list(m.named_buffers()), group)
    chunks = coalesce([p.detach() for p in m.parameters()] + list(m.buffers()))
    broadcast_coalesced(chunks, group)           # every rank now holds rank 0's values
    buffers = ModelBuffers(module, group)
    if buffers and not buffers.follow_gradients():       # a forward that may read them
        buffers.sync(src=0)                              # collective: rank 0's, in place

The wrapper calls these at construction, and on its buffers at every step when
broadcast_buffers=True. Comparing shapes first turns a mismatched model into the same clear
error on every rank, where a broadcast of different sizes would hang or corrupt.

Official DDP broadcasts rank 0's buffers before every forward. A norm layer in training mode
(BatchNorm, InstanceNorm, SyncBatchNorm: torch's _NormBase) normalizes with the batch's own
statistics and only writes its running ones, so for a model whose every buffer is such a
statistic, rank 0's values as its forward left them can travel with the last bucket instead:
training is the same, the ranks meet once per step instead of twice, and every rank ends the
step with rank 0's statistics. Any other buffer, and a norm layer in eval mode, may be read by
the forward, so those are sent before it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _NormBase

from ddptrain.ddp.hooks import Transport, global_rank

# Broadcasts at construction and of buffers are coalesced in pieces of this size, as the
# official wrapper does, so a huge model does not need a second full copy in one flat tensor.
_BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def verify_same_model(
    named_params: list[tuple[str, torch.Tensor]],
    named_buffers: list[tuple[str, torch.Tensor]],
    group: Any,
) -> None:
    """Raise the same clear error on every rank if ranks wrap different models."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    mine = [("parameter", n, tuple(t.shape), str(t.dtype)) for n, t in named_params]
    mine += [("buffer", n, tuple(t.shape), str(t.dtype)) for n, t in named_buffers]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        problem = _first_difference(reference, theirs)
        if problem:
            raise RuntimeError(
                f"ranks wrap different models: {problem} (rank 0 vs rank {rank}). Every rank "
                "must build the same architecture with the same parameter order before wrapping"
            )


def _first_difference(a: list[tuple], b: list[tuple]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x[0] != y[0] or x[2:] != y[2:]:
            return (
                f"{x[0]} #{i} is '{x[1]}' {list(x[2])} {x[3]} on one rank but "
                f"{y[0]} '{y[1]}' {list(y[2])} {y[3]} on the other"
            )
    if len(a) != len(b):
        n_a = sum(1 for t in a if t[0] == "parameter")
        n_b = sum(1 for t in b if t[0] == "parameter")
        return (
            f"{n_a} parameters and {len(a) - n_a} buffers on one rank but "
            f"{n_b} parameters and {len(b) - n_b} buffers on the other"
        )
    return None


def coalesce(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors by dtype/device into chunks of at most ~_BROADCAST_CHUNK_BYTES each."""
    chunks: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if key not in chunks or filled[key] + nbytes > _BROADCAST_CHUNK_BYTES:
            chunks.setdefault(key, []).append([])
            filled[key] = 0
        chunks[key][-1].append(t)
        filled[key] += nbytes
    return [chunk for per_key in chunks.values() for chunk in per_key if chunk]


def broadcast_coalesced(chunks: list[list[torch.Tensor]], group: Any, src: int = 0) -> None:
    """Broadcast each chunk of tensors in place from `src` (a rank of `group`) as one flat
    tensor."""
    if dist.get_world_size(group) == 1:
        return
    receive = dist.get_rank(group) != src
    global_src = global_rank(group, src)
    for chunk in chunks:
        flat = _flatten_dense_tensors(chunk)
        dist.broadcast(flat, src=global_src, group=group)
        if receive:
            for t, synced in zip(chunk, _unflatten_dense_tensors(flat, chunk), strict=True):
                t.copy_(synced)


class ModelBuffers:
    """A module's buffers, and how to make every rank's equal to one rank's."""

    def __init__(self, module: nn.Module, process_group: Any) -> None:
        self.tensors = list(module.buffers())
        self._chunks = coalesce(self.tensors)
        self._group = process_group
        # A transport with a broadcast of its own (shared memory) saves the backend's round trip.
        self.transport: Transport | None = None
        owners = [m for m in module.modules() if next(m.buffers(recurse=False), None) is not None]
        self._norm_layers = [m for m in owners if isinstance(m, _NormBase)]
        self._only_norm_statistics = len(self._norm_layers) == len(owners)

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def follow_gradients(self) -> bool:
        """Whether a forward now may leave them to the gradients: it cannot read them."""
        return self._only_norm_statistics and all(layer.training for layer in self._norm_layers)

    @torch.no_grad()
    def sync(self, src: int) -> None:
        """Collective: every rank's buffers become rank `src`'s."""
        if self.transport is None or not self.transport.broadcast(self.tensors, src):
            broadcast_coalesced(self._chunks, self._group, src)

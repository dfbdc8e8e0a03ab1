"""The ring all-reduce: its schedule apart from how bytes travel, and a transport on it.

    ring_reduce(flat, rank, world_size, scratch, exchange)   # in-place SUM over the ranks
    # exchange(send, recv): send `send` to rank + 1 while receiving `recv` from rank - 1
    ring_all_reduce(t)                                       # the same over isend/irecv
    ddptrain.DDP(net, comm_hook=ddptrain.named_hook("ring"))   # Ring: the wrapper's buckets

Reduce-scatter, then all-gather: each rank sends and receives 2 * (world_size - 1) /
world_size of the tensor, whatever the world size. Every chunk is summed by one rank and then
copied to the others, so all ranks end with the same bits; at world size 2 each element is
a + b, bitwise the backend's all_reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.ddp.hooks import (
    GradBucket,
    Transport,
    close_at_shutdown,
    global_rank,
    new_group_like,
    release_group,
)

Exchange = Callable[[torch.Tensor, torch.Tensor], None]


def ring_chunks(flat: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """`world_size` contiguous pieces of a 1-D tensor; empty ones where it is too small."""
    chunks = list(torch.chunk(flat, world_size))
    # torch.chunk returns fewer pieces when the tensor is small; empty ones keep the indexing.
    return chunks + [flat[:0]] * (world_size - len(chunks))


def ring_reduce(
    flat: torch.Tensor,
    rank: int,
    world_size: int,
    scratch: torch.Tensor,
    exchange: Exchange,
) -> torch.Tensor:
    """In-place SUM of a 1-D tensor over a ring; `scratch` holds one chunk (receive buffer)."""
    chunks = ring_chunks(flat, world_size)
    for step in range(world_size - 1):
        send, recv = chunks[(rank - step) % world_size], chunks[(rank - step - 1) % world_size]
        incoming = scratch[: recv.numel()]
        exchange(send, incoming)
        recv.add_(incoming)
    # Now rank r holds the full sum of chunk r + 1; pass the finished chunks around.
    for step in range(world_size - 1):
        send, recv = chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size]
        exchange(send, recv)
    return flat


def scratch_for(flat: torch.Tensor, world_size: int, scratch: torch.Tensor | None) -> torch.Tensor:
    """`scratch` if it can hold a chunk of `flat` (same dtype), else a new buffer that can."""
    needed = -(-flat.numel() // world_size)
    if scratch is None or scratch.dtype != flat.dtype or scratch.numel() < needed:
        return torch.empty(needed, dtype=flat.dtype, device=flat.device)
    return scratch


def ring_all_reduce(
    tensor: torch.Tensor, group: Any = None, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """In-place SUM all_reduce of a contiguous tensor: ring reduce-scatter, then ring all-gather.

    Each rank sends and receives 2 * (world_size - 1) / world_size of the tensor, whatever the
    world size. At world size 2 the result is bitwise equal to `dist.all_reduce`; at larger
    sizes the summation order differs, so results agree to rounding. `scratch` (same dtype, at
    least numel / world_size elements, rounded up) is reused for receiving instead of a new
    buffer per call.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1 or tensor.numel() == 0:
        return tensor
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor (it reduces views in place)")
    rank = dist.get_rank(group)
    right = global_rank(group, (rank + 1) % world_size)
    left = global_rank(group, (rank - 1) % world_size)
    flat = tensor.view(-1)
    scratch = scratch_for(flat, world_size, scratch)
    ring_reduce(flat, rank, world_size, scratch, lambda s, r: _exchange(s, r, right, left, group))
    return tensor


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group: Any) -> None:
    # Sizes are the same on every rank, so a rank skips an empty piece exactly when its peer does.
    works = []
    if send.numel():
        works.append(dist.isend(send, dst=right, group=group))
    if recv.numel():
        works.append(dist.irecv(recv, src=left, group=group))
    for work in works:
        work.wait()


class Ring(Transport):
    """Buckets summed by `ring_all_reduce` on a group of the transport's own (built here:
    every rank must construct it), so its point-to-point messages never interleave with
    other collectives."""

    def __init__(self, process_group: Any = None) -> None:
        self.group = new_group_like(process_group)
        self.world_size = dist.get_world_size(self.group)
        # One receive buffer, grown to the largest bucket: no allocation per bucket and step.
        self._scratch = torch.empty(0)
        close_at_shutdown(self.close)

    def reduce(self, bucket: GradBucket) -> None:
        """Sum the bucket over the ring, in place."""
        if self.group is None:
            raise RuntimeError(
                "this ring transport was closed (ddptrain.shutdown() closes it); build the "
                "model's wrapper again after init_distributed()"
            )
        flat = bucket.buffer()
        self._scratch = scratch_for(flat, self.world_size, self._scratch)
        ring_all_reduce(flat, self.group, self._scratch)

    def close(self) -> None:
        """Destroy the transport's group; ddptrain.shutdown() calls it."""
        release_group(self.group)
        self.group = None

"""The ring all-reduce schedule, apart from how bytes travel (process-group p2p or sockets).

    ring_reduce(flat, rank, world_size, scratch, exchange)   # in-place SUM over the ranks
    # exchange(send, recv): send `send` to rank + 1 while receiving `recv` from rank - 1

Reduce-scatter, then all-gather: each rank sends and receives 2 * (world_size - 1) /
world_size of the tensor, whatever the world size. Every chunk is summed by one rank and then
copied to the others, so all ranks end with the same bits; at world size 2 each element is
a + b, bitwise the backend's all_reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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

"""Bucketed broadcasts from several owners: how ZeRO shares updated parameters and its state.

    calls = plan_broadcasts([tensors_of_rank0, tensors_of_rank1])   # pure: same on every rank
    broadcast_calls(calls, rank, group)                              # collective, in order

Tensors of at least 1 MiB travel alone, in place; smaller ones are packed per owner and
dtype/device into flat buckets of up to 4 MiB, so many small tensors cost one call, not one each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddptrain.ddp.hooks import global_rank

# A big tensor is broadcast in place (a copy would cost what the saved call costs); smaller
# ones are packed, per owner and dtype, into flat buckets of up to the cap.
_IN_PLACE_MIN_BYTES = 1 << 20
_BUCKET_CAP_BYTES = 4 << 20


def plan_broadcasts(by_owner: list[list[torch.Tensor]]) -> list[tuple[int, list[torch.Tensor]]]:
    """Broadcast calls (owner, tensors): big tensors alone, small ones packed per dtype/device."""
    calls: list[tuple[int, list[torch.Tensor]]] = []
    for owner, tensors in enumerate(by_owner):
        packs: dict[tuple, list[torch.Tensor]] = {}
        filled: dict[tuple, int] = {}
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue
            if nbytes >= _IN_PLACE_MIN_BYTES:
                calls.append((owner, [t]))
                continue
            key = (t.dtype, t.device)
            if filled.get(key, 0) + nbytes > _BUCKET_CAP_BYTES:
                calls.append((owner, packs.pop(key)))
                filled[key] = 0
            packs.setdefault(key, []).append(t)
            filled[key] = filled.get(key, 0) + nbytes
        calls += [(owner, pack) for pack in packs.values()]
    return calls


@torch.no_grad()
def broadcast_calls(calls: list[tuple[int, list[torch.Tensor]]], rank: int, group: Any) -> None:
    """Run the broadcasts in order; packed tensors travel as one flat tensor per call."""
    for owner, tensors in calls:
        src = global_rank(group, owner)
        if len(tensors) == 1:
            dist.broadcast(tensors[0], src=src, group=group)
            continue
        if rank == owner:
            dist.broadcast(torch.cat([t.reshape(-1) for t in tensors]), src=src, group=group)
            continue
        flat = torch.empty(
            sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device
        )
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

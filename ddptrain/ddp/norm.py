"""The 2-norm of a gradient whose bits do not depend on how it is split over ranks.

    norm = exact_norm(grads)                          # every rank holds all of it
    norm = exact_norm(shard, group, sharded=True, numel=model_numel)   # each rank a part

Squares are rounded to a grid fixed by the largest element and summed as integers
(exact.py's reasoning): the Trainer's clipping and ZeRO-3's give the same bits at any world
size and stage.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.ddp.exact import PIECE, VALUE_BITS, largest_magnitudes


def _piece_size(device: torch.device) -> int:
    """Elements converted at once: on a CPU a piece that stays in cache; on a GPU a large one,
    each operation being a kernel launch whose cost the CPU pays whatever its size."""
    return PIECE if device.type == "cpu" else 1 << 24


def _pieces(tensors: list[torch.Tensor], size: int):
    """The tensors' elements in order, as pieces of at most `size`: a large tensor cut in
    slices, consecutive small ones joined (a model of many small parameters costs a few
    operations a piece, not a few a parameter)."""
    parts: list[torch.Tensor] = []
    held = 0
    for t in tensors:
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), size):
            part = flat[start : start + size]
            if parts and held + part.numel() > size:
                yield parts[0] if len(parts) == 1 else torch.cat(parts)
                parts, held = [], 0
            parts.append(part)
            held += part.numel()
    if parts:
        yield parts[0] if len(parts) == 1 else torch.cat(parts)


def exact_norm(
    grads: list[torch.Tensor], group: Any = None, sharded: bool = False, numel: int | None = None
) -> torch.Tensor:
    """The 2-norm of all `grads` (float32), the same bits whatever their order or split: each
    square rounded to a grid fixed by the largest element, summed as integers. `sharded`: each
    rank holds a part of the gradient (collective: one MAX, one SUM on `group`), and `numel`
    bounds the whole gradient's elements at any world size (the model's); else every rank
    holds all of it and nothing is sent. Non-finite gradients give a non-finite norm."""
    device = grads[0].device if grads else torch.device("cpu")
    numel = sum(g.numel() for g in grads) if numel is None else numel
    grads = [g.detach() for g in grads if g.numel()]
    peak = torch.zeros((), dtype=torch.float64, device=device)
    if grads:
        peak = largest_magnitudes(grads).max()
    # NaN does not survive a MAX on every backend: as inf it does, and wins.
    peak = torch.nan_to_num(peak, nan=math.inf, posinf=math.inf)
    if sharded and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    top = peak.item()
    if not math.isfinite(top):
        return torch.tensor(math.inf, dtype=torch.float32, device=device)
    if top == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    # (top * scale)**2 * numel stays below 2**62: the integer sum cannot overflow.
    square_bits = VALUE_BITS - max(0, math.ceil(math.log2(max(numel, 1))))
    shift = square_bits // 2 - math.frexp(top)[1]
    scale = math.ldexp(1.0, shift)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for piece in _pieces(grads, _piece_size(device)):
        total += piece.double().mul_(scale).square_().round_().to(torch.int64).sum()
    if sharded and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return (total.double() * math.ldexp(1.0, -2 * shift)).sqrt().float()

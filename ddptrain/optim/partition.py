"""How ZeRO cuts parameters across ranks, and the checks every rank runs on what it was given
(pure: shapes and lists, no collectives).

    pieces = shard_ranges([p.numel() for p in params], world_size=2)   # per rank: (j, a, b)
    groups = as_groups(params)           # param groups as torch.optim.Optimizer accepts them
    problem = local_problem(groups, earlier=[])   # a reason this rank cannot shard them, or None
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

import torch

# Cuts fall on multiples of 64 elements inside a parameter, so a shard's vectorised loops see
# the same element alignment as the whole tensor's would.
ALIGN = 64

Piece = tuple[int, int, int]  # (parameter index in its group, start, end) in flat elements


def shard_ranges(numels: Sequence[int], world_size: int, align: int = ALIGN) -> list[list[Piece]]:
    """Each rank's pieces of one param group: the parameters laid end to end, cut evenly."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    total = starts[-1]
    cuts = [0]
    for r in range(1, world_size):
        x = r * total // world_size
        j = max(bisect_right(starts, x) - 1, 0)
        cuts.append(max(cuts[-1], starts[j] + (x - starts[j]) // align * align))
    cuts.append(total)
    pieces: list[list[Piece]] = [[] for _ in range(world_size)]
    for j, n in enumerate(numels):
        if n == 0:
            pieces[0].append((j, 0, 0))  # no elements to share, but the inner optimizer sees it
    for r in range(world_size):
        for j in range(len(numels)):
            a, b = max(cuts[r], starts[j]), min(cuts[r + 1], starts[j + 1])
            if a < b:
                pieces[r].append((j, a - starts[j], b - starts[j]))
    return pieces


def as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Param groups as dicts with list-valued "params", as torch.optim.Optimizer accepts them."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of dicts, not one tensor")
    items = list(params)
    if not items or not isinstance(items[0], dict):
        return [{"params": items}]
    groups = []
    for group in items:
        p = group["params"]
        groups.append({**group, "params": [p] if isinstance(p, torch.Tensor) else list(p)})
    return groups


def local_problem(groups: list[dict], earlier: list[torch.Tensor]) -> str | None:
    seen = {id(p): f"#{i} of the earlier groups" for i, p in enumerate(earlier)}
    for g, group in enumerate(groups):
        for j, p in enumerate(group["params"]):
            where = f"parameter #{j} of group {g} ({list(p.shape)} {p.dtype})"
            if id(p) in seen:
                return (
                    f"{where} is given twice (also as {seen[id(p)]}); pass each parameter "
                    "once (tied weights appear once in model.parameters())"
                )
            if not p.is_contiguous():
                return (
                    f"{where} is not contiguous; ZeRO cuts parameters as flat views: use "
                    "model.to(memory_format=torch.contiguous_format)"
                )
            seen[id(p)] = f"parameter #{j} of group {g}"
    return None


def describe(groups: list[dict]) -> list[list[tuple]]:
    return [[(tuple(p.shape), str(p.dtype)) for p in group["params"]] for group in groups]


def first_difference(a: list[list[tuple]], b: list[list[tuple]]) -> str:
    if len(a) != len(b):
        return f"{len(a)} param groups"
    for g, (x, y) in enumerate(zip(a, b, strict=True)):
        for j, (p, q) in enumerate(zip(x, y, strict=False)):
            if p != q:
                return f"parameter #{j} of group {g} = {list(p[0])} {p[1]}"
        if len(x) != len(y):
            return f"{len(x)} parameters in group {g}"
    return "the same"

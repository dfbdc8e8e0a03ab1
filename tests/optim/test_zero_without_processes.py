"""ZeRO without processes: how parameters' elements are partitioned among ranks and broadcast
from their owners, and one process with no process group, where ZeRO is the plain optimizer."""

from __future__ import annotations

import pytest
import torch

from ddptrain.optim.broadcast import plan_broadcasts
from ddptrain.optim.partition import ALIGN, shard_ranges
from ddptrain.optim.zero import ZeroRedundancyOptimizer
from support.state_diff import optimizer_state_diff


# ---------------------------------------------------------------------------- partition (pure)
@pytest.mark.parametrize(
    "numels, world_size",
    [([10, 3000, 7, 500], 2), ([10, 3000, 7, 500], 3), ([5, 0, 1, 2], 4), ([0, 0], 2), ([1], 3)],
)
def test_shard_ranges_cover_every_element_exactly_once(numels, world_size):
    """Every element of every parameter is in exactly one rank's pieces; empty ones on rank 0."""
    pieces = shard_ranges(numels, world_size)
    assert len(pieces) == world_size
    covered = [[0] * n for n in numels]
    for rank_pieces in pieces:
        for j, a, b in rank_pieces:
            assert 0 <= a <= b <= numels[j]
            for i in range(a, b):
                covered[j][i] += 1
    assert all(c == 1 for per_param in covered for c in per_param)
    empty = {j for j, n in enumerate(numels) if n == 0}
    assert {j for j, a, b in pieces[0] if a == b} == empty


@pytest.mark.parametrize("world_size", [2, 3, 4, 7])
def test_shard_ranges_balanced_and_aligned(world_size):
    """Each rank gets total/world_size elements within ALIGN; cuts inside parameters are aligned."""
    numels = [784 * 2240, 2240] + [2240 * 2240, 2240] * 3 + [22400, 10]  # the bench MLP
    total = sum(numels)
    pieces = shard_ranges(numels, world_size)
    for rank_pieces in pieces:
        count = sum(b - a for _, a, b in rank_pieces)
        assert abs(count - total / world_size) <= ALIGN
        assert all(a % ALIGN == 0 for _, a, _ in rank_pieces)


def test_shard_ranges_more_ranks_than_elements():
    """With more ranks than elements some ranks own nothing, and that is fine."""
    pieces = shard_ranges([3], 5)
    assert sum(len(p) for p in pieces) == 1 and [0, 0, 3] in [list(p) for r in pieces for p in r]


def test_plan_broadcasts_packs_small_tensors_and_sends_big_ones_alone():
    """Per owner in rank order: >= 1 MiB tensors alone, the small ones in one call per dtype."""
    big = torch.empty(2**20 // 4)  # 1 MiB of float32
    small = [torch.empty(10), torch.empty(3), torch.empty(5, dtype=torch.float64)]
    calls = plan_broadcasts([[small[0], big, small[1]], [small[2]], []])
    assert [(owner, len(ts)) for owner, ts in calls] == [(0, 1), (0, 2), (1, 1)]
    assert calls[0][1][0] is big and calls[1][1] == [small[0], small[1]]


# ---------------------------------------------------------------------------- one process
def _train_alike(a: torch.nn.Module, zero, b: torch.nn.Module, plain) -> None:
    """Three identical steps of `a` under `zero` and `b` under `plain`; asserts equal weights."""
    for _ in range(3):
        for model, opt in ((a, zero), (b, plain)):
            opt.zero_grad()
            model(torch.ones(2, 5)).sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_one_process_without_a_process_group():
    """With no process group ZeRO is the plain optimizer (world size 1), state_dict and all."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    zero = ZeroRedundancyOptimizer(a.parameters(), torch.optim.AdamW, lr=0.1)
    plain = torch.optim.AdamW(b.parameters(), lr=0.1)
    _train_alike(a, zero, b, plain)
    assert optimizer_state_diff(zero.state_dict(), plain.state_dict()) == 0.0


@pytest.mark.parametrize("kind", [torch.optim.Adagrad, torch.optim.AdamW, torch.optim.SGD])
def test_from_optimizer_takes_a_fresh_optimizer_even_one_that_fills_state_when_built(kind):
    """from_optimizer takes any optimizer that has not stepped, trains like it, refuses the rest."""
    # Adagrad builds its state (step 0) in __init__, yet has not stepped.
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    options = {"lr": 0.1, "momentum": 0.9} if kind is torch.optim.SGD else {"lr": 0.1}
    zero = ZeroRedundancyOptimizer.from_optimizer(kind(a.parameters(), **options))
    plain = kind(b.parameters(), **options)
    _train_alike(a, zero, b, plain)
    with pytest.raises(ValueError, match="from_optimizer needs an optimizer that has not stepped"):
        ZeroRedundancyOptimizer.from_optimizer(plain)

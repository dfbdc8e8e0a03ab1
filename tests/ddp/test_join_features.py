"""Join with SyncBatchNorm, gradient accumulation rounds, throw_on_early_termination and
enable=False, one spawned world per size; against official DDP: test_join.py."""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddptrain.nn.sync_batchnorm import convert_sync_batchnorm
from support import worlds
from support.join_nets import Net, batch, state, train, wrap

# SyncBatchNorm under join against one process with nn.BatchNorm training, at each step, on the
# batches of the ranks still training, concatenated. Tolerance: SyncBatchNorm merges statistics
# in float64 where nn.BatchNorm reduces float32 over the concatenated batch, and the two losses
# are summed in a different order: 1.8e-7 measured after 5 momentum steps.
SBN_ATOL = 1e-6
# (name, batches per rank, transport, divide_by_initial_world_size, SyncBatchNorm's group):
# the transports reduce on channels of their own, so SyncBatchNorm may share the model's group.
SBN_CASES = [
    ("3/5", [3, 5], "default", True, "own"),
    ("0/4", [0, 4], "allreduce", False, "model's"),
    ("5/2 ring", [5, 2], "ring", True, "model's"),
]
# Gradient accumulation in rounds of up to `round` micro-batches, each rank's last round cut
# short by its data: (name, batches per rank, round, divide_by_initial_world_size, ranks whose
# reduction is deferred because another rank is still accumulating when theirs ends). Official
# DDP has no counterpart (its ranks mismatch collectives there); the oracle is one process
# summing each rank's round mean: float32 sums in another order, 1e-6 (as SBN_ATOL).
ROUND_CASES = {
    2: [
        ("3/8 accumulating 2", [3, 8], 2, True, [0]),
        ("5/8 accumulating 3", [5, 8], 3, False, [0]),
        ("7/4 accumulating 2", [7, 4], 2, True, []),
    ],
    3: [
        ("5/3/8 accumulating 2", [5, 3, 8], 2, True, [0, 1]),
        ("4/5/6 accumulating 3", [4, 5, 6], 3, False, [0, 1]),
    ],
}


def _case_sbn(info) -> dict:
    own = torch.distributed.new_group()
    return {
        name: _sbn_case(info.rank, batches, hook_name, divide, own if group == "own" else None)
        for name, batches, hook_name, divide, group in SBN_CASES
    }


def _case_rounds(info) -> dict:
    return {
        name: _rounds_case(info.rank, batches, round_len, divide)
        for name, batches, round_len, divide, _ in ROUND_CASES[info.world_size]
    }


def _sbn_case(rank: int, batches: list[int], hook_name: str, divide: bool, group) -> dict:
    torch.manual_seed(11)
    base = Net(batchnorm=True)
    ours = wrap(convert_sync_batchnorm(copy.deepcopy(base), group), hook_name, copied=False)
    train(ours, batches[rank], 1, ours.join(divide_by_initial_world_size=divide))
    single = copy.deepcopy(base)
    opt = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for i in range(max(batches)):
        active = [r for r, n in enumerate(batches) if i < n]
        xs, ys = zip(*(batch(r, i) for r in active), strict=True)
        out = single(torch.cat(xs)).split(len(ys[0]))
        losses = [F.cross_entropy(o, y) for o, y in zip(out, ys, strict=True)]
        (sum(losses) / (len(batches) if divide else len(active))).backward()
        opt.step()
        opt.zero_grad()
    return {"max_diff": (state(ours.module) - state(single)).abs().max().item()}


def _rounds_case(rank: int, batches: list[int], round_len: int, divide: bool) -> dict:
    torch.manual_seed(7)
    base = Net(batchnorm=False)
    ours = wrap(base, "default")
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    join = ours.join(divide_by_initial_world_size=divide)
    deferred = False
    with join:
        for start in range(0, batches[rank], round_len):
            size = min(round_len, batches[rank] - start)
            for i in range(start, start + size):
                x, y = batch(rank, i)
                with nullcontext() if i == start + size - 1 else ours.no_sync():
                    (F.cross_entropy(ours(x), y) / size).backward()
            if join.deferred:
                deferred = True  # its gradients went to the others' reduction: no step here
                break
            opt.step()
            opt.zero_grad()
    single = copy.deepcopy(base)
    opt = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    rounds = [math.ceil(n / round_len) for n in batches]
    for k in range(max(rounds)):
        contributing = [r for r, count in enumerate(rounds) if k < count]
        loss = torch.zeros(())
        for r in contributing:
            indices = range(k * round_len, min((k + 1) * round_len, batches[r]))
            losses = [F.cross_entropy(single(x), y) for x, y in map(partial(batch, r), indices)]
            loss = loss + sum(losses) / len(indices)
        (loss / (len(batches) if divide else len(contributing))).backward()
        opt.step()
        opt.zero_grad()
    return {
        "max_diff": (state(ours.module) - state(single)).abs().max().item(),
        "deferred": deferred,
        "state": state(ours.module),
    }


def _case_torch_hook_on_sbn_group(info) -> str | None:
    model = wrap(convert_sync_batchnorm(Net(batchnorm=True)), "default", copied=False)
    try:
        model.register_comm_hook(None, allreduce_hook)
    except ValueError as e:
        return str(e)
    return None


def _case_throw(info) -> dict:
    rank = info.rank
    model = wrap(Net(batchnorm=True), "default")
    steps = 0
    try:
        with model.join(throw_on_early_termination=True):
            for i in range(3 + 2 * rank):
                F.cross_entropy(model(batch(rank, i)[0]), batch(rank, i)[1]).backward()
                steps += 1
    except RuntimeError as e:
        return {"error": str(e), "steps": steps}
    return {"error": None, "steps": steps}


def _case_disabled(info) -> dict:
    """enable=False: forwards join no collective, and training is as without join."""
    torch.manual_seed(3)
    base = Net(batchnorm=True)
    disabled, plain = wrap(base, "default"), wrap(base, "default")
    join = disabled.join(enable=False)
    train(disabled, 3, 1, join)
    train(plain, 3, 1)
    # Rank 0 alone runs a forward in a disabled join: an enabled one would wait for the others
    # in its per-forward all_reduce until the collective timeout.
    lone = wrap(Net(batchnorm=False), "default")
    aside = torch.distributed.new_group()
    if info.rank == 0:
        with lone.join(enable=False), torch.no_grad():
            lone(batch(0, 0)[0])
    torch.distributed.barrier(group=aside)
    return {"equal": torch.equal(state(disabled.module), state(plain.module))}


def test_sync_batchnorm_under_join_equals_one_process_on_active_batches(world):
    """SyncBatchNorm under join, on any group, equals one process on the active ranks' batches."""
    results = worlds.outcome(world(2), "sbn")
    for name, _, hook_name, divide, group in SBN_CASES:
        diffs = [r[name]["max_diff"] for r in results]
        print(f"ws=2 SyncBatchNorm {name} {hook_name} {divide} {group}: max|diff|={max(diffs):.3g}")
        assert max(diffs) <= SBN_ATOL, (name, diffs)


def test_a_torch_hook_on_the_group_sync_batchnorm_uses_is_refused(world):
    """A torch hook on SyncBatchNorm's group is refused at registration, naming the way out."""
    # Its reductions would interleave with SyncBatchNorm's backward.
    for r in worlds.outcome(world(2), "torch_hook_on_sbn_group"):
        assert "a group of its own" in (r or ""), r


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_round_cut_short_while_others_accumulate_is_deferred_not_mismatched(world, world_size):
    """A round cut short on a rank is deferred where others accumulate, and equals one process."""
    results = worlds.outcome(world(world_size), "rounds")
    for name, _, _, _, deferred in ROUND_CASES[world_size]:
        diffs = [r[name]["max_diff"] for r in results]
        print(f"ws={world_size} rounds {name}: max|diff|={max(diffs):.3g}")
        assert max(diffs) <= SBN_ATOL, (name, diffs)
        seen = [rank for rank, r in enumerate(results) if r[name]["deferred"]]
        assert seen == deferred, name
        for r in results[1:]:
            assert torch.equal(r[name]["state"], results[0][name]["state"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_throw_on_early_termination_raises_on_every_rank(world, world_size):
    """throw_on_early_termination: every rank raises torch's error at the shortest rank's end."""
    results = worlds.outcome(world(world_size), "throw")
    assert "Rank 0 exhausted all inputs" in (results[0]["error"] or "")
    for r in results[1:]:
        assert "Detected at least one rank that exhausted inputs" in (r["error"] or ""), r
    assert [r["steps"] for r in results] == [3] * world_size


def test_enable_false_is_a_no_op(world):
    """join(enable=False) adds no collective: a lone forward passes, even inputs train as before."""
    assert all(r["equal"] for r in worlds.outcome(world(2), "disabled"))


CASES = {
    "sbn": _case_sbn,
    "torch_hook_on_sbn_group": _case_torch_hook_on_sbn_group,
    "rounds": _case_rounds,
    "throw": _case_throw,
    "disabled": _case_disabled,
}
BY_WORLD = {2: list(CASES), 3: ["rounds", "throw"]}
world = worlds.fixture(CASES, BY_WORLD, timeout_s=300)

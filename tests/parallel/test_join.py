"""Uneven inputs: ddptrain's model.join() against official DDP's, one spawned world per size.

World size 1 runs inside the world of 2, each rank alone in its own process group.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
from ddptrain.parallel.comm import make_hook
from ddptrain.parallel.ddp import DistributedDataParallel
from ddptrain.parallel.join import EarlyTerminationError
from ddptrain.parallel.sync_batchnorm import convert_sync_batchnorm

# Stated tolerance against official DDP at world size 3: with a rank joined, the two still
# training sum their gradients in a different order (shared-memory rows by rank vs gloo's
# ring), so last bits differ and 8 momentum steps can carry that to ~1e-7. At world size <= 2
# every sum is a + b or a + 0: bitwise.
WS3_ATOL = 1e-6
# Tiny buckets (about 1 KB): several per model, so launch order and the rebuild are exercised.
BUCKET_MB = 0.001
MICRO_STEPS = 2

# (name, batches per rank, comm hook, divide_by_initial_world_size, model)
CASES = {
    2: [
        ("3/5", [3, 5], "default", True, "bn"),
        ("3/5", [3, 5], "default", False, "bn"),
        ("8/3", [8, 3], "default", True, "bn"),
        ("8/3", [8, 3], "default", False, "bn"),
        ("0/5", [0, 5], "default", True, "bn"),
        ("5/0", [5, 0], "default", False, "bn"),
        ("3/5 allreduce", [3, 5], "allreduce", True, "bn"),
        ("8/3 allreduce", [8, 3], "allreduce", False, "bn"),
        ("3/8 ring", [3, 8], "ring", True, "bn"),
        ("5/3 ring", [5, 3], "ring", False, "bn"),
        ("3/8 tcp", [3, 8], "tcp", True, "bn"),
        ("5/3 tcp", [5, 3], "tcp", False, "bn"),
        ("3/8 no_sync", [3, 8], "default", True, "no_sync"),
        ("8/5 no_sync", [8, 5], "allreduce", False, "no_sync"),
        ("4/4", [4, 4], "default", True, "bn"),
    ],
    3: [
        ("3/5/8", [3, 5, 8], "default", True, "bn"),
        ("3/5/8", [3, 5, 8], "default", False, "bn"),
        ("0/8/5", [0, 8, 5], "allreduce", True, "bn"),
        ("8/0/3 ring", [8, 0, 3], "ring", False, "bn"),
        ("0/5/8 tcp", [0, 5, 8], "tcp", True, "bn"),
        ("5/3/8 no_sync", [5, 3, 8], "default", True, "no_sync"),
    ],
}
# At world size 1 the batch count is the rank's own (each rank is alone in its group).
WS1_CASES = [("ws1", [5, 0], "default", True, "bn"), ("ws1", [5, 0], "allreduce", False, "bn")]
# SyncBatchNorm under join against one process with nn.BatchNorm training, at each step, on the
# batches of the ranks still training, concatenated. Tolerance: SyncBatchNorm merges statistics
# in float64 where nn.BatchNorm reduces float32 over the concatenated batch, and the two losses
# are summed in a different order: 1.8e-7 measured after 5 momentum steps.
SBN_ATOL = 1e-6
SBN_CASES = [
    ("3/5", [3, 5], "default", True),
    ("0/4", [0, 4], "allreduce", False),
    ("5/2 ring", [5, 2], "ring", True),
]
# Gradient accumulation in rounds of up to `round` micro-batches, each rank's last round cut
# short by its data: (name, batches per rank, round, divide_by_initial_world_size, ranks whose
# reduction is deferred because another rank is still accumulating when theirs ends). Official
# DDP has no counterpart (its ranks mismatch collectives there); the oracle is one process
# summing each rank's round mean: float32 sums in another order, 1e-6 (as SBN_ATOL).
ROUND_CASES = {
    2: [
        ("3/8 round 2", [3, 8], 2, True, [0]),
        ("5/8 round 3", [5, 8], 3, False, [0]),
        ("7/4 round 2", [7, 4], 2, True, []),
    ],
    3: [
        ("5/3/8 round 2", [5, 3, 8], 2, True, [0, 1]),
        ("4/5/6 round 3", [4, 5, 6], 3, False, [0, 1]),
    ],
}
# Cast hooks have no official counterpart (torch's bf16 hook narrows before dividing), so their
# oracle is this wrapper with the same hook where the short rank, instead of joining, keeps
# stepping with zero gradients: a joined rank must be indistinguishable from that.
CAST_CASES = {2: [("3/5", [3, 5], h) for h in ("bf16", "fp16", "allreduce-bf16", "ring-fp16")]}


class _Net(nn.Module):
    """BatchNorm buffers to broadcast, several buckets, and optionally a layer no rank uses.

    Official DDP's joined rank reports stale "used" flags (its last backward's, or
    uninitialized memory if it never ran one), so a never-used layer is left out of the
    comparisons with it; ours reports none used, checked against zero-gradient steps.
    """

    def __init__(self, batchnorm: bool, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(16, 16)
        self.never_used = nn.Linear(16, 16) if unused else None
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


def _batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(6, 12, generator=g), torch.randint(0, 10, (6,), generator=g)


def _train(model, n_batches: int, micro: int, join=None, pad_to: int = 0) -> tuple[int, list]:
    """Train on n_batches (then pad_to - n_batches zero-gradient ones).

    Returns the steps taken and the parameters with grad=None after the last backward.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    steps = 0
    grad_none: list[str] = []
    rank = torch.distributed.get_rank()
    with join if join is not None else nullcontext():
        for i in range(max(n_batches, pad_to)):
            x, y = _batch(rank, i)
            sync = (i + 1) % micro == 0
            with nullcontext() if sync else model.no_sync():
                loss = F.cross_entropy(model(x), y)
                (loss if i < n_batches else loss * 0).backward()
            grad_none = sorted(n for n, p in model.module.named_parameters() if p.grad is None)
            if sync:
                opt.step()
                opt.zero_grad()
                steps += 1
    return steps, grad_none


def _state(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])


def _ours(base: nn.Module, hook_name: str, group=None, copied=True) -> DistributedDataParallel:
    hook = None if hook_name == "default" else make_hook(hook_name, group)
    return DistributedDataParallel(
        copy.deepcopy(base) if copied else base,
        bucket_cap_mb=BUCKET_MB,
        first_bucket_cap_mb=BUCKET_MB,
        comm_hook=hook,
        process_group=group,
    )


def _compare(ours: nn.Module, theirs: nn.Module) -> dict:
    a, b = _state(ours), _state(theirs)
    return {
        "max_diff": (a - b).abs().max().item(),
        "bitwise": torch.equal(a, b),
        "state": a,
    }


def _against_official(rank: int, cases: list, group=None) -> dict:
    out = {}
    for name, batches, hook_name, divide, kind in cases:
        torch.manual_seed(99 + rank)  # different initial weights: rank 0's must win
        base = _Net(batchnorm=kind == "bn")
        micro = MICRO_STEPS if kind == "no_sync" else 1
        ours = _ours(base, hook_name, group)
        n = batches[rank]
        _train(ours, n, micro, ours.join(divide_by_initial_world_size=divide))
        theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_MB, process_group=group)
        _train(theirs, n, micro, theirs.join(divide_by_initial_world_size=divide))
        out[(name, hook_name, divide)] = _compare(ours.module, theirs.module)
    return out


def _run_world(world_size: int) -> dict:
    info = ddptrain.init_distributed()
    out = _against_official(info.rank, CASES[world_size])
    if world_size == 2:
        alone = [torch.distributed.new_group([r]) for r in range(world_size)][info.rank]
        out["ws1"] = _against_official(info.rank, WS1_CASES, alone)
    for name, batches, hook_name in CAST_CASES.get(world_size, []):
        torch.manual_seed(5 + info.rank)
        base = _Net(batchnorm=False, unused=True)
        n = batches[info.rank]
        joined = _ours(base, hook_name)
        _, grad_none = _train(joined, n, 1, joined.join())
        padded = _ours(base, hook_name)
        _train(padded, n, 1, pad_to=max(batches))
        result = _compare(joined.module, padded.module)
        out[(name, hook_name, True)] = {
            **result,
            "oracle_rank": batches.index(max(batches)),
            "grad_none": grad_none,
        }
    if world_size == 2:
        sbn_group = torch.distributed.new_group()
        for name, batches, hook_name, divide in SBN_CASES:
            out[("sbn", name)] = _sbn_case(info.rank, batches, hook_name, divide, sbn_group)
        out["sbn_same_group"] = _sbn_same_group_error()
    for name, batches, round_len, divide, _ in ROUND_CASES[world_size]:
        out[("rounds", name)] = _rounds_case(info.rank, batches, round_len, divide)
    out["throw"] = _throw_case(info.rank, world_size)
    out["disabled"] = _disabled_case(info.rank)
    return out


def _sbn_case(rank: int, batches: list[int], hook_name: str, divide: bool, group) -> dict:
    torch.manual_seed(11)
    base = _Net(batchnorm=True)
    ours = _ours(convert_sync_batchnorm(copy.deepcopy(base), group), hook_name, copied=False)
    _train(ours, batches[rank], 1, ours.join(divide_by_initial_world_size=divide))
    single = copy.deepcopy(base)
    opt = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for i in range(max(batches)):
        active = [r for r, n in enumerate(batches) if i < n]
        xs, ys = zip(*(_batch(r, i) for r in active), strict=True)
        out = single(torch.cat(xs)).split(len(ys[0]))
        losses = [F.cross_entropy(o, y) for o, y in zip(out, ys, strict=True)]
        (sum(losses) / (len(batches) if divide else len(active))).backward()
        opt.step()
        opt.zero_grad()
    return {"max_diff": (_state(ours.module) - _state(single)).abs().max().item()}


def _rounds_case(rank: int, batches: list[int], round_len: int, divide: bool) -> dict:
    torch.manual_seed(7)
    base = _Net(batchnorm=False)
    ours = _ours(base, "default")
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    join = ours.join(divide_by_initial_world_size=divide)
    deferred = False
    with join:
        for start in range(0, batches[rank], round_len):
            size = min(round_len, batches[rank] - start)
            for i in range(start, start + size):
                x, y = _batch(rank, i)
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
            losses = [F.cross_entropy(single(x), y) for x, y in map(partial(_batch, r), indices)]
            loss = loss + sum(losses) / len(indices)
        (loss / (len(batches) if divide else len(contributing))).backward()
        opt.step()
        opt.zero_grad()
    return {
        "max_diff": (_state(ours.module) - _state(single)).abs().max().item(),
        "deferred": deferred,
        "state": _state(ours.module),
    }


def _sbn_same_group_error() -> str | None:
    model = _ours(convert_sync_batchnorm(_Net(batchnorm=True)), "allreduce", copied=False)
    try:
        with model.join():
            pass
    except ValueError as e:
        return str(e)
    return None


def _throw_case(rank: int, world_size: int) -> dict:
    model = _ours(_Net(batchnorm=True), "default")
    steps = 0
    try:
        with model.join(throw_on_early_termination=True):
            for i in range(3 + 2 * rank):
                F.cross_entropy(model(_batch(rank, i)[0]), _batch(rank, i)[1]).backward()
                steps += 1
    except EarlyTerminationError as e:
        return {"error": str(e), "steps": steps}
    return {"error": None, "steps": steps}


def _disabled_case(rank: int) -> dict:
    """enable=False with even inputs: no extra collective, same result as without join."""
    torch.manual_seed(3)
    base = _Net(batchnorm=True)
    disabled, plain = _ours(base, "default"), _ours(base, "default")
    join = disabled.join(enable=False)
    with join:
        attached = disabled._join is not None
    _train(disabled, 3, 1, join)
    _train(plain, 3, 1)
    return {
        "attached": attached,
        "equal": torch.equal(_state(disabled.module), _state(plain.module)),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"ws{w}")
def world(request) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, ddptrain.spawn(_run_world, world_size, world_size, timeout_s=240)


def test_join_matches_official_ddp(world):
    """Uneven batches finish on every rank and equal official DDP.join(): bitwise at ws<=2."""
    world_size, results = world
    for name, _, hook_name, divide, _ in CASES[world_size]:
        key = (name, hook_name, divide)
        diffs = [r[key]["max_diff"] for r in results]
        print(
            f"ws={world_size} {name:14} {hook_name:9} divide_by_initial={divide!s:5} "
            f"max|diff|={max(diffs):.3g}"
        )
        for rank, r in enumerate(results):
            if world_size <= 2:
                assert r[key]["bitwise"], (key, rank, r[key]["max_diff"])
            else:
                assert r[key]["max_diff"] <= WS3_ATOL, (key, rank, r[key]["max_diff"])


def test_world_size_one_takes_the_same_path(world):
    """At world size 1 (a rank alone in its group) join equals official DDP's, 5 or 0 batches."""
    world_size, results = world
    if world_size != 2:
        pytest.skip("world size 1 runs inside the world of 2")
    for rank, r in enumerate(results):
        for name, _, hook_name, divide, _ in WS1_CASES:
            assert r["ws1"][(name, hook_name, divide)]["bitwise"], (rank, hook_name)


def test_replicas_agree_after_join(world):
    """After join every rank holds the same parameters and buffers, whatever it trained on."""
    world_size, results = world
    for name, _, hook_name, divide, _ in CASES[world_size]:
        key = (name, hook_name, divide)
        for r in results[1:]:
            assert torch.equal(r[key]["state"], results[0][key]["state"]), key


def test_cast_hooks_under_join_equal_zero_gradient_steps(world):
    """With bf16/fp16 hooks a joined rank is bitwise a rank adding zero gradients, using nothing."""
    world_size, results = world
    if world_size not in CAST_CASES:
        pytest.skip("cast hooks are checked at world size 2")
    for name, _, hook_name in CAST_CASES[world_size]:
        key = (name, hook_name, True)
        r = results[results[0][key]["oracle_rank"]][key]
        print(f"ws={world_size} {name} {hook_name}: max|diff|={r['max_diff']:.3g}")
        assert r["bitwise"], (key, r["max_diff"])
        # The last backward ran with the other rank joined: it marked no parameter used.
        assert r["grad_none"] == ["never_used.bias", "never_used.weight"], r["grad_none"]


def test_sync_batchnorm_under_join_equals_one_process_on_active_batches(world):
    """SyncBatchNorm with a joined rank: equal to one process on the active ranks' batches."""
    world_size, results = world
    if world_size != 2:
        pytest.skip("SyncBatchNorm under join is checked at world size 2")
    for name, _, hook_name, divide in SBN_CASES:
        diffs = [r[("sbn", name)]["max_diff"] for r in results]
        print(f"ws=2 SyncBatchNorm {name} {hook_name} divide={divide}: max|diff|={max(diffs):.3g}")
        assert max(diffs) <= SBN_ATOL, (name, diffs)
    for r in results:
        assert "give SyncBatchNorm its own group" in (r["sbn_same_group"] or ""), r


def test_a_round_cut_short_while_others_accumulate_is_deferred_not_mismatched(world):
    """Accumulation rounds that end early on a rank out of data: no hang, equal to one process
    summing every rank's round mean, deferred exactly where another rank still accumulates."""
    world_size, results = world
    for name, _, _, _, deferred in ROUND_CASES[world_size]:
        diffs = [r[("rounds", name)]["max_diff"] for r in results]
        print(f"ws={world_size} rounds {name}: max|diff|={max(diffs):.3g}")
        assert max(diffs) <= SBN_ATOL, (name, diffs)
        seen = [rank for rank, r in enumerate(results) if r[("rounds", name)]["deferred"]]
        assert seen == deferred, name
        for r in results[1:]:
            assert torch.equal(r[("rounds", name)]["state"], results[0][("rounds", name)]["state"])


def test_throw_on_early_termination_raises_on_every_rank(world):
    """throw_on_early_termination: every rank raises the same error at the shortest rank's end."""
    world_size, results = world
    errors = {r["throw"]["error"] for r in results}
    assert len(errors) == 1 and None not in errors, errors
    assert "rank(s) [0] ran out of inputs" in errors.pop()
    assert [r["throw"]["steps"] for r in results] == [3] * world_size


def test_enable_false_is_a_no_op(world):
    """join(enable=False) adds no collective: even inputs train exactly as without join."""
    _, results = world
    assert all(r["disabled"]["equal"] and not r["disabled"]["attached"] for r in results)

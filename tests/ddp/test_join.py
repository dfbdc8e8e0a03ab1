"""Uneven inputs: ddptrain's model.join() against official DDP's, one spawned world per size.

World size 1 runs inside the world of 2, each rank alone in its own process group. Join with
SyncBatchNorm, accumulation rounds and its options: test_join_features.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from support import worlds
from support.join_nets import BUCKET_MB, Net, compare, train, wrap

# Stated tolerance against official DDP at world size 3: with a rank joined, the two still
# training sum their gradients in a different order (shared-memory rows by rank vs gloo's
# ring), so last bits differ and 8 momentum steps can carry that to ~1e-7. At world size <= 2
# every sum is a + b or a + 0: bitwise.
WS3_ATOL = 1e-6
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
# bf16/fp16 transports have no official counterpart (torch's bf16 hook narrows before
# dividing), so their oracle is this wrapper with the same hook where the short rank, instead
# of joining, keeps stepping with zero gradients: a joined rank must be indistinguishable.
CAST_CASES = {2: [("3/5", [3, 5], h) for h in ("bf16", "fp16", "allreduce-bf16", "ring-fp16")]}


def _against_official(rank: int, cases: list, group=None) -> dict:
    out = {}
    for name, batches, hook_name, divide, kind in cases:
        torch.manual_seed(99 + rank)  # different initial weights: rank 0's must win
        base = Net(batchnorm=kind == "bn")
        micro = MICRO_STEPS if kind == "no_sync" else 1
        ours = wrap(base, hook_name, group)
        n = batches[rank]
        train(ours, n, micro, ours.join(divide_by_initial_world_size=divide))
        theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_MB, process_group=group)
        train(theirs, n, micro, theirs.join(divide_by_initial_world_size=divide))
        out[(name, hook_name, divide)] = compare(ours.module, theirs.module)
    return out


def _case_official(info) -> dict:
    return _against_official(info.rank, CASES[info.world_size])


def _case_ws1(info) -> dict:
    alone = [torch.distributed.new_group([r]) for r in range(info.world_size)][info.rank]
    return _against_official(info.rank, WS1_CASES, alone)


def _case_cast(info) -> dict:
    out = {}
    for name, batches, hook_name in CAST_CASES[info.world_size]:
        torch.manual_seed(5 + info.rank)
        base = Net(batchnorm=False, unused=True)
        n = batches[info.rank]
        joined = wrap(base, hook_name)
        _, grad_none = train(joined, n, 1, joined.join())
        padded = wrap(base, hook_name)
        train(padded, n, 1, pad_to=max(batches))
        result = compare(joined.module, padded.module)
        out[(name, hook_name, True)] = {
            **result,
            "oracle_rank": batches.index(max(batches)),
            "grad_none": grad_none,
        }
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_matches_official_ddp(world, world_size):
    """Uneven batches finish on every rank and equal official DDP.join(): bitwise at ws<=2."""
    results = worlds.outcome(world(world_size), "official")
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
    for rank, r in enumerate(worlds.outcome(world(2), "ws1")):
        for name, _, hook_name, divide, _ in WS1_CASES:
            assert r[(name, hook_name, divide)]["bitwise"], (rank, hook_name)


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicas_agree_after_join(world, world_size):
    """After join every rank holds the same parameters and buffers, whatever it trained on."""
    results = worlds.outcome(world(world_size), "official")
    for name, _, hook_name, divide, _ in CASES[world_size]:
        key = (name, hook_name, divide)
        for r in results[1:]:
            assert torch.equal(r[key]["state"], results[0][key]["state"]), key


def test_cast_transports_under_join_equal_zero_gradient_steps(world):
    """With bf16/fp16 transports a joined rank is bitwise a rank adding zero gradients."""
    results = worlds.outcome(world(2), "cast")
    for name, _, hook_name in CAST_CASES[2]:
        key = (name, hook_name, True)
        r = results[results[0][key]["oracle_rank"]][key]
        print(f"ws=2 {name} {hook_name}: max|diff|={r['max_diff']:.3g}")
        assert r["bitwise"], (key, r["max_diff"])
        # The last backward ran with the other rank joined: it marked no parameter used.
        assert r["grad_none"] == ["never_used.bias", "never_used.weight"], r["grad_none"]


BY_WORLD = {2: ["official", "ws1", "cast"], 3: ["official"]}
world = worlds.fixture(
    {"official": _case_official, "ws1": _case_ws1, "cast": _case_cast}, BY_WORLD, timeout_s=300
)

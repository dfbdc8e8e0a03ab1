"""SharedMemory.broadcast: the wrapper's per-forward buffer sync through shared memory.

One spawned world of 3 runs the cases (ddptrain.spawn); the tests read their results.
"""

from __future__ import annotations

import os

import torch

from ddptrain.compress.half import HalfPrecision
from ddptrain.cpu.shm import SHM_DIR, SharedMemory
from ddptrain.ddp.hooks import AllReduce
from ddptrain.ddp.wrapper import DistributedDataParallel
from support import worlds
from support.sums import needs_shm

WORLD_SIZE = 3
CALLS = 5


def _tensors(rank: int, call: int) -> list[torch.Tensor]:
    """Mixed dtypes and shapes, valued by (rank, call) so a stale or foreign slot shows."""
    tag = 100 * call + rank
    return [
        torch.full((5,), tag + 0.5),
        torch.tensor(tag, dtype=torch.int64),  # 0-dim, as BatchNorm's num_batches_tracked
        torch.arange(6, dtype=torch.float64).reshape(2, 3) + tag,
        torch.tensor([rank % 2 == 0, call % 2 == 0]),
    ]


def _case_broadcast(info) -> dict:
    hook = SharedMemory()
    seen = []
    for call in range(CALLS):
        tensors = _tensors(info.rank, call)
        src = call % info.world_size  # every rank in turn, the two slots alternating
        handled = hook.broadcast(tensors, src)
        seen.append((handled, src, [t.clone() for t in tensors]))
    # The same tensors every call, changed in place between calls, as a wrapper's buffers are.
    kept, reused = _tensors(info.rank, 0), []
    for call in range(CALLS):
        for t, values in zip(kept, _tensors(info.rank, call), strict=True):
            t.copy_(values)
        src = (call + 1) % info.world_size
        reused.append((hook.broadcast(kept, src), src, [t.clone() for t in kept]))
    kept[0].data = torch.full((5,), 1000.0 + info.rank)  # new memory behind the same tensor
    moved = (hook.broadcast(kept, 1), kept[0].clone())
    strided = torch.zeros(4, 4).t()
    refused = hook.broadcast([strided], 0)
    # bf16 over shared memory passes buffers through untouched (not cast to bf16).
    cast = HalfPrecision(torch.bfloat16, hook)
    precise = torch.full((3,), 1.0 + 2.0**-20 + info.rank)
    by_cast = cast.broadcast([precise], 0)
    hook.close()
    return {
        "seen": seen,
        "reused": reused,
        "moved": moved,
        "refused_non_contiguous": refused,
        "cast": (by_cast, precise),
        "cast_to_backend": HalfPrecision(torch.bfloat16, AllReduce()).broadcast([precise], 0),
        "prefix": hook._prefix,
    }


def _case_buffers_in_the_wrapper(info) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.BatchNorm1d(4))
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + info.rank))
        model(x).sum().backward()
    # The last forward's broadcast brought rank 0's stats; its own batch then moved them.
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 4))  # eval forward: broadcast only, nothing updated
    return [b.clone() for b in model.module.buffers()]


CASES = {"broadcast": _case_broadcast, "buffers": _case_buffers_in_the_wrapper}


world = worlds.fixture(
    CASES, {WORLD_SIZE: list(CASES)}, timeout_s=240, setup=worlds.share_small_buckets
)


@needs_shm
def test_broadcast_copies_the_source_rank_tensors_on_every_call(world):
    """Each call leaves src's values on all ranks: new tensors, reused ones, moved memory."""
    results = worlds.outcome(world(WORLD_SIZE), "broadcast")
    for rank, r in enumerate(results):
        assert len(r["seen"]) == CALLS
        for call, (handled, src, got) in enumerate(r["seen"]):
            assert handled, (rank, call)
            for g, expected in zip(got, _tensors(src, call), strict=True):
                assert g.dtype == expected.dtype and torch.equal(g, expected), (rank, call, src)
        for call, (handled, src, got) in enumerate(r["reused"]):
            assert handled, (rank, call)
            for g, expected in zip(got, _tensors(src, call), strict=True):
                assert torch.equal(g, expected), (rank, call, src)
        assert r["moved"][0] and torch.equal(r["moved"][1], torch.full((5,), 1001.0)), rank
        assert r["refused_non_contiguous"] is False
        by_cast, precise = r["cast"]
        assert by_cast and torch.equal(precise, torch.full((3,), 1.0 + 2.0**-20)), rank
        assert r["cast_to_backend"] is False
    leftovers = [f for f in os.listdir(SHM_DIR) if f.startswith(os.path.basename(r["prefix"]))]
    assert leftovers == []


@needs_shm
def test_wrapper_buffers_equal_rank_0s_after_an_eval_forward(world):
    """The wrapper's forward brings rank 0's BatchNorm buffers to every rank (shared memory)."""
    results = worlds.outcome(world(WORLD_SIZE), "buffers")
    for rank, buffers in enumerate(results[1:], start=1):
        for got, expected in zip(buffers, results[0], strict=True):
            assert torch.equal(got, expected), rank
    # Rank 0's stats moved off their initial values, so equality is not vacuous.
    assert not torch.equal(results[0][0], torch.zeros(4))

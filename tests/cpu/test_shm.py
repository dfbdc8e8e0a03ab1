"""The shared-memory transport (cpu/shm.py): sums against the backend, the default on one
host, and the barrier's answers to a dead or silent peer.

One spawned world per world size runs every multi-process case of this module
(worlds.run_cases); the tests read their case's results from it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from ddptrain.comm import named_hook
from ddptrain.cpu.barrier import COUNTER_STRIDE, SharedBarrier
from ddptrain.cpu.shm import SHM_DIR, SharedMemory
from ddptrain.ddp.wrapper import DistributedDataParallel
from support import worlds
from support.sums import ATOL, NUMELS, RTOL, backend_sum, needs_shm, reduce_with

WORLD_TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)


def _case_shm_vs_backend(info) -> dict:
    shm = SharedMemory(min_bytes=0)  # share even the tiny test buckets
    out: dict = {"float": [], "repeat": [], "prefix": shm._prefix}
    for numel in NUMELS:
        g = torch.Generator().manual_seed(numel * 7 + info.rank)
        x = torch.randn(numel, generator=g)
        bucket = shm.allocate(numel, torch.float32, torch.device("cpu"))
        bucket.copy_(x)
        reduce_with(shm, bucket)
        out["float"].append((numel, bucket.clone(), backend_sum(x)))
        # A second reduction on the same shared bucket: rows are overwritten, never mixed.
        bucket.fill_(info.rank + 1.0)
        reduce_with(shm, bucket)
        out["repeat"].append(bucket.clone())
    # A bucket's file is let go with the bucket: only the last one is still mapped.
    out["mapped"] = [len(shm._shared)]
    del bucket
    out["mapped"].append(len(shm._shared))
    plain = torch.full((3,), float(info.rank))
    reduce_with(shm, plain)  # not allocated by the transport: backend all_reduce
    out["plain"] = plain.tolist()
    default = SharedMemory(min_bytes=64 * 1024)
    small = default.allocate(1000, torch.float32, torch.device("cpu"))
    large = default.allocate(64 * 1024 // 4, torch.float32, torch.device("cpu"))
    small.fill_(1.0)
    large.fill_(1.0)
    reduce_with(default, small)
    reduce_with(default, large)
    out["default_shared"] = [len(default._shared), small.sum().item(), large[:3].tolist()]
    out["available"] = SharedMemory.available()
    shm.close()
    return out


@needs_shm
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_memory_all_reduce_equals_backend(world, world_size):
    """Shared-memory SUM equals dist.all_reduce (bitwise at ws 2), repeats, frees its files."""
    results = worlds.outcome(world(world_size), "shm_vs_backend")
    total = sum(r + 1.0 for r in range(world_size))
    for rank, r in enumerate(results):
        assert r["available"]
        for numel, got, expected in r["float"]:
            assert got.shape == (numel,)
            if world_size == 2:
                assert torch.equal(got, expected), (rank, numel)
            else:
                torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        for got in r["repeat"]:
            assert torch.equal(got, torch.full_like(got, total))
        assert r["plain"] == [sum(range(world_size))] * 3
        # Under min_bytes a bucket stays private (backend all_reduce); both sum right.
        assert r["default_shared"] == [1, 1000.0 * world_size, [float(world_size)] * 3]
        assert r["mapped"] == [1, 0], rank
    leftovers = [f for f in os.listdir(SHM_DIR) if f.startswith(os.path.basename(r["prefix"]))]
    assert leftovers == []


def _case_default_hooks(info) -> tuple[str, str]:
    default = DistributedDataParallel(torch.nn.Linear(2, 2))
    forced = DistributedDataParallel(torch.nn.Linear(2, 2), comm_hook=named_hook("allreduce"))
    return type(default.comm_hook[0]).__name__, type(forced.comm_hook[0]).__name__


@needs_shm
def test_default_hook_is_shared_memory_on_one_host_and_nothing_alone(world):
    """Ranks on one CPU host get shared-memory buckets by default; one process sends nothing."""
    assert worlds.outcome(world(2), "default_hooks") == [("SharedMemory", "AllReduce")] * 2
    assert worlds.outcome(world(1), "default_hooks") == [("SingleRank", "AllReduce")]


def test_shared_barrier_names_a_peer_that_died_and_times_out_on_a_silent_one():
    """A waiting rank raises naming a dead peer before its timeout; a live silent one times out."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    counters = torch.zeros(2 * COUNTER_STRIDE, dtype=torch.int64)
    counters[1], counters[COUNTER_STRIDE + 1] = os.getpid(), peer.pid
    # Only the death check can end the wait before timeout_s; half of it is slack for a
    # loaded machine (the peer exits after 0.5 s, liveness is polled every 0.2 s).
    barrier = SharedBarrier(counters, rank=0, world_size=2, timeout_s=120)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {peer.pid}\\) exited"):
        barrier.wait()
    assert time.monotonic() - start < 60
    peer.wait()
    counters[COUNTER_STRIDE + 1] = os.getpid()  # a peer that lives but never arrives
    silent = SharedBarrier(counters, rank=0, world_size=2, timeout_s=0.3)
    with pytest.raises(RuntimeError, match="did not reach"):
        silent.wait()


CASES = {"shm_vs_backend": _case_shm_vs_backend, "default_hooks": _case_default_hooks}
CASES_BY_WORLD = {
    1: ["default_hooks"],
    2: ["shm_vs_backend", "default_hooks"],
    3: ["shm_vs_backend"],
    4: ["shm_vs_backend"],
}


world = worlds.fixture(
    CASES, CASES_BY_WORLD, timeout_s=WORLD_TIMEOUT_S, setup=worlds.share_small_buckets
)

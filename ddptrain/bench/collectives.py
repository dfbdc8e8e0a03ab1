"""All-reduce time by size: the hand-written ring, the backend, shared memory, and the bound.

    times = bench_all_reduce((1, 8, 64), reps=10, device)   # collective: every rank calls it
    times["shm"][8]                                          # seconds per 8 MiB call, per rep

The bound is what one thread's add + copy of the same bytes costs (every rank at once, as
the ranks' reductions share memory): a reduction on one host cannot beat it by much.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.cpu.ring import ring_all_reduce
from ddptrain.cpu.shm import SharedMemory, shared_memory_usable
from ddptrain.ddp.hooks import GradBucket


def bench_all_reduce(sizes_mb: tuple[int, ...], reps: int, device: torch.device) -> dict[str, Any]:
    """Seconds per in-place SUM all_reduce: hand-written ring, backend, shared memory (CPU), and
    the bound one thread's add + copy of the same bytes sets (CPU)."""
    tensors = {mb: torch.ones(mb * 2**20 // 4, device=device) for mb in sizes_mb}
    kinds = {
        "ring": lambda t: ring_all_reduce(t),
        "backend": lambda t: dist.all_reduce(t),
    }
    shm_tensors = {}
    if device.type == "cpu" and shared_memory_usable():
        shm = SharedMemory()
        shm_tensors = {mb: shm.allocate(t.numel(), t.dtype, device) for mb, t in tensors.items()}
        kinds["shm"] = lambda t: shm.reduce(GradBucket(0, t, [], [], True))
        # The memory-bandwidth bound of a reduction: one thread adds the same bytes into another
        # buffer and copies them out (every rank at once, as the ranks' reductions share memory).
        scratch = {t.numel(): (torch.ones_like(t), torch.empty_like(t)) for t in tensors.values()}
        kinds["add_copy"] = lambda t: _add_copy(t, *scratch[t.numel()])
    times: dict[str, dict[int, list[float]]] = {kind: {} for kind in kinds}
    for rep in range(reps + 1):
        for mb in sizes_mb:
            order = list(kinds)[rep % len(kinds) :] + list(kinds)[: rep % len(kinds)]
            for kind in order:
                t = shm_tensors[mb] if kind == "shm" else tensors[mb]
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                kinds[kind](t)
                _sync(device)
                if rep > 0:
                    times[kind].setdefault(mb, []).append(time.perf_counter() - start)
    return times


def _add_copy(source: torch.Tensor, into: torch.Tensor, out: torch.Tensor) -> None:
    into.add_(source)
    out.copy_(into)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

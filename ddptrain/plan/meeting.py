"""What ranks lose meeting at a collective they reach from their own compute.

    idle, busy = measure_meeting(lambda: dist.broadcast(t, 0), synced_s=2e-4, share=0.5)

A collective timed from a barrier finds every rank already there. In a step the ranks arrive
from their own work, and wait for each other first: a peer not yet scheduled, a wake-up. Two
cases, each the mean over `cycles` of the seconds beyond the fluid model and beyond `synced_s`,
the operation's own wall time from a barrier:

- idle: every rank computes `compute_s` of CPU on one thread, then runs the operation there (the
  cycle beyond the compute at `share` of a core each);
- busy: another thread of every rank runs a backward throughout while this one sleeps
  `compute_s`, then runs it, as a communication thread does while backward computes.

The timeline (timeline.Job) charges them before each collective; calibrate.py stores them per
operation and world size.

    points = measure_uneven_share(lambda: shm.reduce(last_bucket), synced_s=2e-4, share=2 / 3)

Where ranks outnumber the cores, the kernel does not share the cores evenly within a cycle, and
at each meeting every rank waits for the one that got least: the longer the cycle, the more it
loses (scripts/sharing_probe.py). `measure_uneven_share` times the idle case's cycle for several
lengths of compute, taking them in turns: (cycle at an even share, seconds lost beyond it), the
median over cycles.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

COMPUTE_S = 5e-3
CYCLES = 48
# Compute a cycle for the uneven share (the first as the meetings'), each timed for SHARE_S
# in SHARE_PASSES turns: with 3 ranks on 2 cores, cycles of 5-20 ms sometimes lose a third
# (two ranks on one core for the whole cycle) and sometimes a tenth, by spells of seconds.
SHARE_COMPUTE_S = (COMPUTE_S, 80e-3, 320e-3)
SHARE_S = 3.6
SHARE_PASSES = 3
SHARE_MIN_CYCLES = 3


def burn_cpu(seconds: float, block: torch.Tensor | None = None) -> None:
    """Matrix products on this thread until it has spent `seconds` of CPU."""
    block = torch.ones(256, 256) if block is None else block
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        torch.mm(block, block)


def measure_meeting(
    fn: Callable[[], object],
    synced_s: float,
    share: float,
    *,
    compute_s: float = COMPUTE_S,
    cycles: int = CYCLES,
    compute: Callable[[float], None] | None = None,
) -> tuple[float, float]:
    """Collective: (idle, busy) seconds lost meeting at `fn` (module docstring), each at least
    0; `share`: of a core each rank gets while all compute; `compute`: what spends the idle
    case's seconds (default: matrix products for that much CPU time)."""
    burn = torch.ones(256, 256)
    spend = compute or (lambda seconds: burn_cpu(seconds, burn))

    def mean_beyond(busy: bool) -> float:
        dist.barrier()
        fn()
        took = []
        for _ in range(cycles):
            start = time.perf_counter()
            if busy:
                time.sleep(compute_s)
                start = time.perf_counter()
            else:
                spend(compute_s)
            fn()
            took.append(time.perf_counter() - start)
        return statistics.fmean(took) - (0.0 if busy else compute_s / share) - synced_s

    idle = mean_beyond(busy=False)
    stop = threading.Event()
    # A backward, as a training main thread runs: autograd's engine computes without the GIL
    # (a loop of torch ops would hold it, and every wake-up of this thread would wait for it).
    weights = [torch.randn(256, 256, requires_grad=True) for _ in range(8)]
    out = burn
    for w in weights:
        out = torch.tanh(out @ w)
    loss = out.sum()

    def backward_throughout() -> None:
        while not stop.is_set():
            torch.autograd.grad(loss, weights, retain_graph=True)

    beside = threading.Thread(target=backward_throughout, daemon=True)
    beside.start()
    try:
        busy = mean_beyond(busy=True)
    finally:
        stop.set()
        beside.join()
    dist.barrier()
    return max(0.0, idle), max(0.0, busy)


def measure_uneven_share(
    fn: Callable[[], object],
    synced_s: float,
    share: float,
    *,
    compute_s: tuple[float, ...] = SHARE_COMPUTE_S,
    seconds: float = SHARE_S,
    passes: int = SHARE_PASSES,
    compute: Callable[[float], None] | None = None,
) -> list[tuple[float, float]]:
    """Collective: per length in `compute_s`, (its cycle at an even share, compute / `share`;
    the median cycle's seconds beyond that and `synced_s`), cycles of compute then `fn`
    filling about `seconds` a length, in `passes` that take the lengths in turn (module
    docstring); `compute` as measure_meeting's."""
    burn = torch.ones(256, 256)
    spend = compute or (lambda s: burn_cpu(s, burn))
    took: list[list[float]] = [[] for _ in compute_s]
    for _ in range(passes):
        for k, c in enumerate(compute_s):
            # Rank 0 decides the count for every rank: all must meet as often.
            cycle = c / share + synced_s
            cycles = torch.tensor([max(SHARE_MIN_CYCLES, round(seconds / passes / cycle))])
            dist.broadcast(cycles, 0)
            dist.barrier()
            fn()
            for _ in range(int(cycles.item())):
                start = time.perf_counter()
                spend(c)
                fn()
                took[k].append(time.perf_counter() - start)
    dist.barrier()
    return [
        (c / share, statistics.median(t) - c / share - synced_s)
        for c, t in zip(compute_s, took, strict=True)
    ]

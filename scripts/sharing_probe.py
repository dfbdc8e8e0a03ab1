"""What ranks lose when they outnumber the cores: fixed work per rank, then a barrier.

    python scripts/sharing_probe.py                                  # about a minute on 2 cores
    python scripts/sharing_probe.py --work-ms 10,80 --world-sizes 3 --out probe.json

Each rank (a process, one torch thread) runs the same matrix products, then meets the others,
cycle after cycle. With an even share of the cores a cycle would take the work's time alone
times max(1, world size / cores); the ratio printed is the measured cycle (the slowest rank's
median) over that. Two barriers: the shared-memory transport's (`ddptrain.cpu.barrier`: polls,
yielding the core, then sleeps 50 us at a time) and a futex one (`multiprocessing.Barrier`).
The planner measures the same loss in its link calibration and charges it to the DDP wrapper's
steps (docs/plan.md, "the uneven share").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch

from ddptrain.bench.report import machine
from ddptrain.cpu.barrier import COUNTER_STRIDE, SharedBarrier, announce

BARRIERS = ("shared", "futex")


def _products(count: int, a: torch.Tensor) -> None:
    for _ in range(count):
        torch.mm(a, a)


def _rank(rank, world_size, count, cycles, barrier, counters, futex, results) -> None:
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    announce(counters, rank)
    futex.wait()  # every rank announced before any SharedBarrier reads the ids
    wait = futex.wait
    if barrier == "shared":
        wait = SharedBarrier(counters, rank, world_size, timeout_s=60.0).wait
    _products(count, a)
    wait()
    took = []
    for _ in range(cycles):
        start = time.perf_counter()
        _products(count, a)
        wait()
        took.append(time.perf_counter() - start)
    results.put(statistics.median(took))


def cycle_s(world_size: int, count: int, cycles: int, barrier: str) -> float:
    """The slowest rank's median cycle: `count` products of 256 x 256, then `barrier`."""
    ctx = mp.get_context("fork")
    counters = torch.zeros(COUNTER_STRIDE * world_size, dtype=torch.int64).share_memory_()
    futex, results = ctx.Barrier(world_size), ctx.Queue()
    args = (world_size, count, cycles, barrier, counters, futex, results)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        medians = [results.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return max(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-ms", default="5,10,20,40,80,160", help="each rank's work a cycle")
    parser.add_argument("--world-sizes", default="2,3,4")
    parser.add_argument("--seconds", type=float, default=4.0, help="of cycles per measurement")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    _products(50, a)
    start = time.perf_counter()
    _products(400, a)
    product_s = (time.perf_counter() - start) / 400
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    rows = []
    for work_ms in [float(w) for w in args.work_ms.split(",")]:
        count = max(1, round(work_ms / 1e3 / product_s))
        cycles = max(10, int(args.seconds / (2 * work_ms / 1e3)))
        alone = cycle_s(1, count, cycles, "futex")
        line = [f"work {work_ms:5.0f} ms: alone {1e3 * alone:6.1f} ms"]
        for n in [int(w) for w in args.world_sizes.split(",")]:
            even = alone * max(1.0, n / cores)
            for barrier in BARRIERS:
                took = cycle_s(n, count, cycles, barrier)
                rows.append(
                    {
                        "work_ms": work_ms,
                        "world_size": n,
                        "barrier": barrier,
                        "alone_s": alone,
                        "cycle_s": took,
                        "over_even_share": took / even,
                    }
                )
                line.append(f"ws{n} {barrier} {took / even:.2f}")
        print("  ".join(line), flush=True)
    if args.out:
        report = {"machine": machine(), "cores": cores, "load_avg_1m_before": load_before}
        with open(args.out, "w") as f:
            json.dump({**report, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

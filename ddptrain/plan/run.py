"""One setup trained for real on every rank: the step times and peak memory --check compares.

    results = ddptrain.spawn(run_rank, 4, setup.as_dict(), Steps())     # one host, by function
    torchrun ... -m ddptrain.plan.run --setup '{"model": "mlp"}' --out DIR # a launcher's ranks

A step is zero_grad, forward, loss, backward, optimizer step, as the step bench's. After
`warmup` steps, `blocks` blocks start at a barrier and run their steps back to back: `block`
steps, or as many more as the slowest rank's last warm-up step fits in `block_s` seconds. A
block's time per step is taken on every rank, and a step is as slow as its slowest rank. Long
blocks, since a training run meets no barrier: ranks leave one up to milliseconds apart, and
the first step after it waits for the last (LeNet at world size 2, 2 cores: 15.6-17.4 ms a
step in blocks of 2, 14.1-14.3 ms in blocks of 20).
Memory per rank, reset just before the first step (meter.py): on CPU the RSS before the model
was built and the peak RSS while training (the kernel's high-water mark), with glibc returning
freed blocks at once (bench/memory.py's `return_freed_memory`): the allocator the prediction
assumes. On CUDA (NCCL, one GPU per rank) the caching allocator's bytes, memory_allocated
before the model and max_memory_allocated while training; a block's wall time ends with a
synchronize, so it holds the device's work.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ddptrain
from ddptrain.bench.memory import return_freed_memory
from ddptrain.plan.meter import Meter, meter_for
from ddptrain.plan.profile import rank_device
from ddptrain.plan.setup import Setup, build


@dataclass(frozen=True)
class Steps:
    """How many steps a run takes and how they are timed."""

    warmup: int = 3
    blocks: int = 6
    block: int = 2
    block_s: float = 0.5


# Blocks of a fast model stay this short at most, whatever block_s asks.
MAX_BLOCK = 200


def block_steps(steps: Steps, warm_step_s: float) -> int:
    """Steps a block takes: `block`, or as many as `warm_step_s` fits in `block_s` seconds."""
    if steps.block_s <= 0 or warm_step_s <= 0:
        return steps.block
    return max(steps.block, min(MAX_BLOCK, math.ceil(steps.block_s / warm_step_s)))


def run_rank(
    setup_dict: dict[str, Any], steps: Steps, meter: Meter | None = None
) -> dict[str, Any]:
    """This rank's measurements (spawned by ddptrain.spawn, or under a launcher); `meter`:
    the setup's device's (meter.py) unless given."""
    freed = return_freed_memory()
    setup = Setup(**setup_dict)
    device = rank_device(setup)
    meter = meter or meter_for(setup.device)
    work = setup.workload
    rss_before_model = meter.allocated_bytes()
    model, optimizer = build(setup, device)
    x, y = work.batch(torch.Generator().manual_seed(dist.get_rank()))
    if x.is_floating_point():
        x = x.to(setup.dtype)
    x, y = x.to(device), y.to(device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        work.loss(model(x), y).backward()
        optimizer.step()

    meter.reset_peak()
    warm = torch.zeros(1, dtype=torch.float64, device=device)
    for _ in range(steps.warmup):
        meter.sync()
        start = time.perf_counter()
        step()
        meter.sync()
        warm[0] = time.perf_counter() - start
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    block = block_steps(steps, warm.item())
    block_s, cpu_s = [], []
    for _ in range(steps.blocks):
        meter.sync()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(block):
            step()
        meter.sync()
        block_s.append((time.perf_counter() - start) / block)
        cpu_s.append((time.process_time() - start_cpu) / block)
    return {
        "rank": dist.get_rank(),
        "device": setup.device,
        "step_s": block_s,
        "block_steps": block,
        "cpu_s": cpu_s,
        "rss_before_model_bytes": rss_before_model,
        "peak_rss_bytes": meter.peak_bytes(),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "malloc_returns_freed": freed,
    }


def main(argv: list[str] | None = None) -> None:
    """Under a launcher: run the setup on this rank; rank 0 writes every rank's results."""
    p = argparse.ArgumentParser(prog="python -m ddptrain.plan.run", description=__doc__)
    p.add_argument("--setup", required=True, help="the Setup's fields as JSON")
    p.add_argument("--steps", default="{}", help="the Steps' fields as JSON")
    p.add_argument("--out", type=Path, required=True, help="rank 0 writes run.json here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        mine = run_rank(json.loads(args.setup), Steps(**json.loads(args.steps)))
        gathered: list[Any] | None = [None] * dist.get_world_size() if mine["rank"] == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    finally:
        ddptrain.shutdown()
    if gathered is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "run.json").write_text(
            json.dumps({"ranks": gathered, "steps": asdict(Steps(**json.loads(args.steps)))})
        )


if __name__ == "__main__":
    main()

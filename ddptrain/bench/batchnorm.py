"""What SyncBatchNorm costs: step time of a BatchNorm conv net under DDP, local BN vs synced.

    python -m ddptrain.bench.batchnorm                       # world size 2, batch 8 and 32 per rank
    python -m ddptrain.bench.batchnorm --rounds 40 --per-rank-batch 8

Both variants live in the same processes and take turns (the order alternates every round),
so machine noise hits them alike. A turn is --block back-to-back steps (zero_grad, forward,
backward, SGD step) after one barrier; its time is the slowest rank's / block. Prints medians
and the load average before and after.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddptrain
from ddptrain.models import LeNet


def _step_times(args: argparse.Namespace, batch: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    base = LeNet(dropout=0.0, width=args.width, batchnorm=True)
    variants = {
        "local BN": ddptrain.DDP(copy.deepcopy(base)),
        "SyncBatchNorm": ddptrain.DDP(ddptrain.convert_sync_batchnorm(copy.deepcopy(base))),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in variants.items()}
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for round_ in range(args.warmup + args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            model, opt = variants[name], opts[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                opt.zero_grad()
                F.nll_loss(model(x), y).backward()
                opt.step()
            elapsed = torch.tensor([(time.perf_counter() - start) / args.block])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_ >= args.warmup:
                times[name].append(elapsed.item())
    return times


def _worker(args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    ddptrain.init_distributed()
    return {batch: _step_times(args, batch) for batch in args.per_rank_batch}


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison on --world-size local processes and print the medians."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--per-rank-batch", type=int, nargs="+", default=[8, 32])
    p.add_argument(
        "--width", type=int, default=3, help="LeNet width (3: 30-60-150, the recipe's old default)"
    )
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block", type=int, default=5)
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    results = ddptrain.spawn(_worker, args.world_size, args, timeout_s=1800)[0]
    load_after = os.getloadavg()
    print(f"LeNet(width={args.width}, batchnorm=True), world_size={args.world_size}, gloo, CPU")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (1 min)")
    for batch, times in results.items():
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        extra = med["SyncBatchNorm"] - med["local BN"]
        print(
            f"per-rank batch {batch:3d}: local BN {med['local BN']:.2f} ms, SyncBatchNorm "
            f"{med['SyncBatchNorm']:.2f} ms (+{extra:.2f} ms, {extra / med['local BN']:+.0%}), "
            f"median of {len(times['local BN'])} blocks of {args.block} steps"
        )
    return results


if __name__ == "__main__":
    main()

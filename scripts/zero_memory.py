"""Optimizer-state bytes and peak RSS per rank, AdamW on the bench MLP, sharded (ZeRO-1) or not.

    python scripts/zero_memory.py                          # world sizes 1, 2, 4; a few minutes
    python scripts/zero_memory.py --world-sizes 2 --comm-hook allreduce --out zero-memory.json

Every (world size, sharded) pair runs in fresh processes, so ru_maxrss is that run's own peak:
build the MLP, wrap it, take --steps AdamW steps at batch 32 per rank, then report.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.nn.functional as F

import ddptrain
from ddptrain.bench.report import machine
from ddptrain.models import MLP
from ddptrain.train.config import COMM_HOOKS


def _run(sharded: bool, steps: int, comm_hook: str) -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(0)
    model = ddptrain.DistributedDataParallel(MLP(), comm_hook=comm_hook)
    if sharded:
        opt = ddptrain.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(info.rank)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    tensors = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="1,2,4")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--comm-hook", default="default", choices=COMM_HOOKS, help="the transport")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    rows = []
    load_before = os.getloadavg()[0]
    for world_size in map(int, args.world_sizes.split(",")):
        for sharded in (False, True):
            per_rank = ddptrain.spawn(_run, world_size, sharded, args.steps, args.comm_hook)
            rows.append({"world_size": world_size, "sharded": sharded, "ranks": per_rank})
    unsharded = {r["world_size"]: r["ranks"][0]["state_bytes"] for r in rows if not r["sharded"]}
    print(
        f"{'ws':>3} {'ZeRO':>5} {'state MB/rank (min-max)':>24} {'vs total/ws':>11} "
        f"{'peak RSS MB/rank (min-max)':>27}"
    )
    for r in rows:
        state = [x["state_bytes"] / 1e6 for x in r["ranks"]]
        rss = [x["peak_rss_bytes"] / 1e6 for x in r["ranks"]]
        target = unsharded[r["world_size"]] / 1e6 / r["world_size"]
        print(
            f"{r['world_size']:>3} {'yes' if r['sharded'] else 'no':>5} "
            f"{min(state):>11.2f} - {max(state):>10.2f} {max(state) / target:>11.4f} "
            f"{min(rss):>13.1f} - {max(rss):>11.1f}"
        )
    load = [load_before, os.getloadavg()[0]]
    print(f"load average (1 min) before/after: {load[0]:.1f} / {load[1]:.1f}")
    if args.out:
        meta = {"machine": machine(), "comm_hook": args.comm_hook, "steps": args.steps}
        meta.update({"load_avg_1m_before_after": load, "date": time.strftime("%F %T")})
        with open(args.out, "w") as f:
            json.dump({"settings": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""GPU memory of one rank: DDP, ZeRO-1, ZeRO-2 and ZeRO-3, AdamW on a wide MLP, on one GPU.

    python scripts/gpu_memory.py                       # world size 4 as seen by rank 0
    python scripts/gpu_memory.py --world-size 8 --width 4096 --out gpu-memory.json

One GPU cannot hold two NCCL ranks, so each variant runs as rank 0 of a world of --world-size
under torch's fake process group: its collectives move no data, but every buffer, shard and
optimizer state is allocated exactly as on a real rank, so the allocator's figures are one rank's.
The one stand-in: ZeRO-2/3's reduce-scatter keeps this rank's part of what it sends, since the
fake one writes nothing and the "which parameters got a gradient" flags would be garbage.
Each variant runs in a fresh process. "held" is what stays allocated between steps; "peak" is
torch.cuda.max_memory_allocated over the steps. Without CUDA it runs on CPU and reports held bytes
counted from the tensors (a check that the script works, not a memory figure).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddptrain
import ddptrain.fsdp.unit
from ddptrain.bench.report import machine
from ddptrain.models import MLP

VARIANTS = ("ddp", "zero1", "zero2", "zero3")
MIB = 2**20


class _Done:
    def wait(self) -> bool:
        return True


def _local_reduce_scatter(output: torch.Tensor, input: torch.Tensor, **_: object) -> _Done:
    output.copy_(input[: output.numel()])  # rank 0's part, as a real reduce-scatter leaves it
    return _Done()


def _run(variant: str, world_size: int, width: int, depth: int, steps: int) -> dict:
    # Imported here: torch's test utilities are not needed by anything else in the package.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    ddptrain.fsdp.unit.reduce_scatter_single = _local_reduce_scatter
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    try:
        torch.manual_seed(0)
        module = MLP(width=width, depth=depth).to(device)
        n_params = sum(p.numel() for p in module.parameters())
        if variant in ("zero2", "zero3"):
            model = ddptrain.FSDP(module, reshard_after_forward=variant == "zero3")
        else:
            model = ddptrain.DistributedDataParallel(module)
        if variant == "zero1":
            opt = ddptrain.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(32, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (32,), device=device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if any(p.grad is None for p in model.parameters()):
            raise RuntimeError(f"{variant}: a parameter has no gradient; the figures would be low")
        states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        tensors = list(model.parameters()) + [p.grad for p in model.parameters()] + states
        counted = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        row = {"variant": variant, "params": n_params, "counted_mib": counted / MIB}
        if cuda:
            torch.cuda.synchronize()
            row["held_mib"] = torch.cuda.memory_allocated() / MIB
            row["peak_mib"] = torch.cuda.max_memory_allocated() / MIB
        return row
    finally:
        dist.destroy_process_group()


def _child(queue: mp.Queue, *args) -> None:
    queue.put(_run(*args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--world-size", type=int, default=4, help="the simulated world (default: %(default)s)"
    )
    p.add_argument("--width", type=int, default=4096, help="hidden width (default: %(default)s)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default: %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="default: %(default)s")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            p.error(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        queue = ctx.Queue()
        proc = ctx.Process(
            target=_child,
            args=(queue, variant, args.world_size, args.width, args.depth, args.steps),
        )
        proc.start()
        proc.join(600)
        if proc.exitcode != 0:
            raise SystemExit(f"{variant}: the child exited with {proc.exitcode}")
        rows.append(queue.get(timeout=10))
    print(f"rank 0 of {args.world_size}, MLP {rows[0]['params'] / 1e6:.1f}M parameters, AdamW")
    print(f"{'variant':>8} {'counted MiB':>12} {'held MiB':>9} {'peak MiB':>9} {'peak vs DDP':>12}")
    base = next((r for r in rows if r["variant"] == "ddp"), None)
    for r in rows:
        held, peak = r.get("held_mib", float("nan")), r.get("peak_mib", float("nan"))
        ratio = peak / base["peak_mib"] if base and "peak_mib" in base else float("nan")
        print(
            f"{r['variant']:>8} {r['counted_mib']:>12.1f} {held:>9.1f} {peak:>9.1f} {ratio:>12.3f}"
        )
    if args.out:
        meta = {"machine": machine(), "date": time.strftime("%F %T"), **vars(args)}
        with open(args.out, "w") as f:
            json.dump({"settings": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

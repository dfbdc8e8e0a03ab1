"""A model too big for one rank's memory cap: ZeRO-3 trains it, DDP (and ZeRO-1) cannot.

    python -m ddptrain.bench --capped                 # ws=4, a 64.6M-parameter MLP, 600 MiB/rank
    python -m ddptrain.bench --capped --wrappers ddp,zero3 --cap-mib 600 --width 2048 --depth 16
    python -m ddptrain.bench --capped --quick         # 16.6M parameters under 210 MiB (seconds)

Each rank caps its own address space (RLIMIT_AS) at what it has mapped once its process group
is up plus --cap-mib, then builds the model (every rank builds it whole), wraps it, and takes
--steps AdamW steps. Past the cap an allocation fails (torch raises "can't allocate memory"),
the rank raises, and the run is reported as failed with that line. Per parameter, AdamW under
DDP needs 16 bytes on every rank (weights, gradient bucket, two moments) plus the transient
copy the first broadcast makes; ZeRO-3 needs the whole weights once while building, then 16 /
world_size bytes plus a few units gathered at a time. glibc is told to map every block over
64 KiB on its own (bench/memory.py's --malloc return), so freed memory leaves the address
space at once, for every wrapper alike. Writes nothing; prints one line per wrapper.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch
import torch.nn.functional as F

import ddptrain
from ddptrain.bench.memory import return_freed_memory, status_bytes
from ddptrain.comm import named_hook
from ddptrain.ddp.wrapper import DistributedDataParallel
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.launch.spawn import WorkerError
from ddptrain.models import MLP
from ddptrain.optim.zero import ZeroRedundancyOptimizer

WRAPPERS = ("ddp", "zero1", "zero2", "zero3")
_MIB = 2**20


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return status_bytes(f.read(), key)


def _rank(wrapper: str, width: int, depth: int, steps: int, cap_mib: int) -> dict[str, Any]:
    """One rank: cap its address space, then build, wrap and train."""
    return_freed_memory()
    info = ddptrain.init_distributed()
    cap = _vm("VmSize") + cap_mib * _MIB
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        return _train(info, wrapper, width, depth, steps, cap - cap_mib * _MIB)
    finally:
        # Lifted before any error is reported: its report starts a thread, which needs room.
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def _train(
    info: Any, wrapper: str, width: int, depth: int, steps: int, base: int
) -> dict[str, Any]:
    started = time.perf_counter()
    torch.manual_seed(0)
    module = MLP(width=width, depth=depth)
    if wrapper in ("zero2", "zero3"):
        model: torch.nn.Module = FullyShardedDataParallel(
            module, reshard_after_forward=wrapper == "zero3"
        )
    else:
        # Over the backend's all_reduce: the shared-memory transport maps every rank's bucket
        # rows in each rank, which would fail sooner, and for a reason of its own.
        model = DistributedDataParallel(module, comm_hook=named_hook("allreduce"))
    if wrapper == "zero1":
        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(info.rank)
    x, y = torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "peak_vm_above_cap_base_mib": (_vm("VmPeak") - base) / _MIB,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": time.perf_counter() - started,
    }


def run(
    wrapper: str, world_size: int, width: int, depth: int, steps: int, cap_mib: int
) -> dict[str, Any]:
    """Train under the cap in fresh processes: {"trained": bool, "ranks" or "error": ...}."""
    try:
        ranks = ddptrain.spawn(
            _rank, world_size, wrapper, width, depth, steps, cap_mib, timeout_s=600
        )
    except WorkerError as e:
        lines = [line for line in e.worker_traceback.splitlines() if line.strip()]
        last = lines[-1] if lines else str(e).splitlines()[0]  # a rank may die unheard
        return {"trained": False, "rank": e.rank, "error": last.strip()[:200]}
    return {"trained": True, "ranks": ranks}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick: a 16.6M-parameter MLP under 210 MiB."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.bench --capped", description=__doc__.split("\n")[0]
    )
    p.add_argument("--capped", action="store_true", help="this mode (python -m ddptrain.bench)")
    p.add_argument("--wrappers", default=",".join(WRAPPERS), help=f"subset of {WRAPPERS}")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cap-mib", type=int, default=600, help="address space per rank, MiB")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.cap_mib = 1024, 16, 210
    args.wrappers = [w for w in args.wrappers.split(",") if w]
    if any(w not in WRAPPERS for w in args.wrappers):
        p.error(f"--wrappers: choose from {list(WRAPPERS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run each wrapper under the cap; print one line each; return the outcomes."""
    args = parse_args(argv)
    params = sum(p.numel() for p in MLP(width=args.width, depth=args.depth).parameters())
    print(
        f"MLP {args.width}x{args.depth}: {params / 1e6:.1f}M parameters ({4 * params / _MIB:.0f} "
        f"MiB), AdamW, world size {args.world_size}, cap {args.cap_mib} MiB of address space "
        "per rank"
    )
    out = {}
    for wrapper in args.wrappers:
        r = run(wrapper, args.world_size, args.width, args.depth, args.steps, args.cap_mib)
        out[wrapper] = r
        if r["trained"]:
            peak = max(rank["peak_vm_above_cap_base_mib"] for rank in r["ranks"])
            losses = ", ".join(f"{v:.3f}" for v in r["ranks"][0]["losses"])
            print(f"{wrapper:<6} trained: losses {losses}; peak address space {peak:.0f} MiB")
        else:
            print(f"{wrapper:<6} failed on rank {r['rank']}: {r['error']}")
    return out

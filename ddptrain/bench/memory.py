"""Peak memory per rank: ddptrain's wrapper vs official DDP vs no wrapper, each in fresh processes.

    python -m ddptrain.bench --memory                   # the MLP at world size 2
    python -m ddptrain.bench --memory --models mlp,lenet --world-size 3 --steps 10
    python -m ddptrain.bench --memory --quick           # smoke run (seconds)
    python -m ddptrain.bench --memory --models mlp,deep-mlp --optimizer adamw --world-size 4 \
        --variants ddptrain,zero1,zero2,zero3           # the ZeRO stages

Each variant gets its own world (a process's peak RSS covers its whole life), builds the model,
runs --steps training steps (zero_grad, forward, backward, SGD step) on random data and reports
per rank: the peak RSS (getrusage ru_maxrss, which includes the pages of shared memory the rank
touched), the shared-memory files it maps (/dev/shm/ddptrain-*, from /proc/self/maps; unlinked
once mapped) and the resident part of those (RssShmem). Two ways to count the shared rows:
- "peak + shm" counts every mapped shared byte in full in every rank that maps it: peak RSS -
  RssShmem + mapped (the most a rank can be charged);
- "host share" counts each shared file once per host, split evenly among the world_size ranks
  that map it: peak RSS - RssShmem + mapped / world_size (the host's memory per rank).
Two more figures per rank: "held", the bytes of the parameters, gradients and optimizer state
the rank holds after its last step (tensor sizes: shards where sharded), and "train peak", its
peak RSS while training (from the first step on, so without the whole model every rank builds
before wrapping) above its RSS before the model was built: what the rank needed to train.
glibc keeps its default (adaptive) thresholds here, as users get them, unless --malloc return:
then every block over 64 KiB is mapped on its own and unmapped when freed, so RSS follows the
live tensors. The sharded variants allocate and free unit-sized buffers every step, which stock
glibc keeps for reuse in its heaps (one per thread that allocates): their stock peak is what
the allocator held, the "return" one what the rank used. Writes <out>/memory.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
from ddptrain.bench.models import MODELS
from ddptrain.bench.report import machine
from ddptrain.ddp.wrapper import DistributedDataParallel
from ddptrain.fsdp.layout import choose_units
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.optim.zero import ZeroRedundancyOptimizer

VARIANTS = ("ddptrain", "torch_ddp", "local")
# Opt-in (--variants): ZeRO stage 1 (ddptrain's DDP wrapper and ZeroRedundancyOptimizer), 2 and 3
# (the fully sharded wrapper), and torch's fully_shard on the same units (ZeRO-3).
ZERO_VARIANTS = ("zero1", "zero2", "zero3", "torch_fsdp")
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
_FIGURES = ("peak_rss_bytes", "shm_mapped_bytes", "peak_with_shm_bytes", "peak_host_share_bytes")
_TENSOR_FIGURES = ("held_bytes", "training_peak_bytes")
# Each count's gap to official DDP, in gradient copies.
_GAPS = {
    "peak_with_shm_bytes": "vs_torch_ddp_grad_copies",
    "peak_host_share_bytes": "host_share_vs_torch_ddp_grad_copies",
}
SHM_PREFIX = "/dev/shm/ddptrain-"
_MIB = 2**20


def shm_mapped_bytes(maps: str, prefix: str = SHM_PREFIX) -> int:
    """Bytes of the mappings in /proc/<pid>/maps text whose file starts with `prefix` (pure)."""
    total = 0
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(prefix):
            lo, hi = fields[0].split("-")
            total += int(hi, 16) - int(lo, 16)
    return total


def status_bytes(status: str, key: str) -> int:
    """A `Key:   123 kB` field of /proc/<pid>/status text, in bytes; 0 when absent (pure)."""
    for line in status.splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_figures(peak: int, shmem: int, mapped: int, world_size: int) -> dict[str, int]:
    """A rank's peak RSS with its shared rows counted in full, and as its share of the host's
    (every shared file is mapped by all world_size ranks) (pure)."""
    private = peak - shmem
    return {
        "peak_rss_bytes": peak,
        "shm_mapped_bytes": mapped,
        "rss_shmem_bytes": shmem,
        "peak_with_shm_bytes": private + mapped,
        "peak_host_share_bytes": private + mapped // world_size,
    }


def shared_files_bytes() -> int:
    """Bytes of this process's mappings of the shared-memory transport's files, now."""
    with open("/proc/self/maps") as f:
        return shm_mapped_bytes(f.read())


def _measure(world_size: int) -> dict[str, int]:
    mapped = shared_files_bytes()
    with open("/proc/self/status") as f:
        shmem = status_bytes(f.read(), "RssShmem")
    # Linux reports ru_maxrss in KiB.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak_figures(peak, shmem, mapped, world_size)


def _wrap(variant: str, module: torch.nn.Module) -> torch.nn.Module:
    if variant in ("ddptrain", "zero1"):
        return DistributedDataParallel(module)
    if variant in ("zero2", "zero3"):
        return FullyShardedDataParallel(module, reshard_after_forward=variant == "zero3")
    if variant == "torch_fsdp":
        from torch.distributed.fsdp import fully_shard

        for unit in reversed(choose_units(module, None)[1:]):
            fully_shard(unit)
        return fully_shard(module)
    return TorchDDP(module) if variant == "torch_ddp" else module


def _held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this rank holds (its shards)."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    # torch's fully_shard holds DTensors: this rank's part is their local tensor.
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def status_field(key: str) -> int:
    """A field of this process's /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return status_bytes(f.read(), key)


def reset_peak_rss() -> bool:
    """Restart the kernel's count of this process's peak RSS (VmHWM); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def keep_freed_memory() -> bool:
    """Stop glibc returning freed memory to the OS (and mapping it anew) between steps; False
    without glibc."""
    # Stock glibc adapts its mmap/trim thresholds as it goes, so a 20 MB gradient freed in one
    # step may be page-faulted back in the next (thousands of faults on the MLP) or not,
    # depending on allocation history that interleaved variants share: the tax lands on
    # whichever variant the history punishes. Fixed thresholds remove it for all alike.
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 1 << 30))


def return_freed_memory() -> bool:
    """Have glibc map every block over 64 KiB on its own and unmap it when freed (a fixed
    mmap threshold, one heap): freed memory leaves the process at once. False without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold, m_arena_max = -3, -8
    return bool(libc.mallopt(m_mmap_threshold, 64 * 1024) and libc.mallopt(m_arena_max, 1))


def _worker(
    model_name: str, variant: str, steps: int, optimizer_name: str, malloc: str
) -> dict[str, Any]:
    if malloc == "return":
        return_freed_memory()
    info = ddptrain.init_distributed()
    factory, sample_shape, batch_size, _ = MODELS[model_name]
    before_model = status_field("VmRSS")
    torch.manual_seed(0)
    module = factory().to(info.device)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    model = _wrap(variant, module)
    cls = OPTIMIZERS[optimizer_name]
    if variant == "zero1":
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(model.parameters(), cls, lr=1e-3)
    else:
        optimizer = cls(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randn(batch_size, *sample_shape, generator=g)
    y = torch.randint(0, 10, (batch_size,), generator=g)
    reset = reset_peak_rss()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {
        **_measure(info.world_size),
        "rss_before_model_bytes": before_model,
        "param_bytes": params,
        "held_bytes": _held_bytes(model, optimizer),
        "training_peak_bytes": status_field("VmHWM") - before_model if reset else 0,
    }


def summarize(raw: dict[str, dict[str, list[dict]]], settings: dict[str, Any]) -> dict[str, Any]:
    """Per model, variant and rank measurements in; the worst rank and the gaps out (pure)."""
    models = {}
    for name, variants in raw.items():
        rows = {}
        for v, ranks in variants.items():
            rows[v] = {key: max(r.get(key, 0) for r in ranks) for key in _FIGURES + _TENSOR_FIGURES}
            rows[v]["per_rank"] = ranks
        grad_bytes = next(iter(variants.values()))[0]["param_bytes"]
        official = rows.get("torch_ddp")
        for row in rows.values():
            # In gradient-sized copies: the unit the wrappers' buffers come in.
            for key, gap in _GAPS.items():
                row[gap] = (row[key] - official[key]) / grad_bytes if official else None
        models[name] = {"grad_bytes": grad_bytes, "variants": rows}
    return {"settings": settings, "models": models}


def format_table(result: dict[str, Any]) -> str:
    """The table printed at the end of a run (MiB; the worst rank)."""
    lines = [
        f"{'model':<8} {'variant':<10} {'peak RSS':>9} {'shm mapped':>10} {'peak+shm':>9} "
        f"{'vs DDP (grads)':>14} {'host share':>10} {'vs DDP (grads)':>14} {'held':>8} "
        f"{'train peak':>10}"
    ]
    for name, entry in result["models"].items():
        for v, row in entry["variants"].items():
            peak, shm, both, share = (row[k] / _MIB for k in _FIGURES)
            held, train = (row.get(k, 0) / _MIB for k in _TENSOR_FIGURES)
            full, shared = (_signed(row[gap]) for gap in _GAPS.values())
            lines.append(
                f"{name:<8} {v:<10} {peak:>9.1f} {shm:>10.1f} {both:>9.1f} {full:>14} "
                f"{share:>10.1f} {shared:>14} {held:>8.1f} {train:>10.1f}"
            )
        lines.append(f"{name:<8} one gradient copy = {entry['grad_bytes'] / _MIB:.1f} MiB")
    return "\n".join(lines)


def _signed(gap: float | None) -> str:
    return "-" if gap is None else f"{gap:+.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick: two steps."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.bench --memory", description=__doc__.split("\n")[0]
    )
    p.add_argument("--memory", action="store_true", help="this report (python -m ddptrain.bench)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--models", default="mlp", help=f"subset of {','.join(MODELS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--optimizer", default="sgd", choices=list(OPTIMIZERS), help="(default: sgd)")
    p.add_argument(
        "--malloc",
        default="stock",
        choices=["stock", "return"],
        help="glibc as users get it, or returning freed blocks at once (default: stock)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--quick", action="store_true", help="two steps: seconds")
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 2
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [m for m in args.models if m not in MODELS]
    variants = [*VARIANTS, *ZERO_VARIANTS]
    unknown += [v for v in args.variants if v not in variants]
    if unknown:
        p.error(f"unknown {unknown}; models: {list(MODELS)}, variants: {variants}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the table, write memory.json; return the result."""
    args = parse_args(argv)
    raw = {
        m: {
            v: ddptrain.spawn(
                _worker,
                args.world_size,
                m,
                v,
                args.steps,
                args.optimizer,
                args.malloc,
                timeout_s=args.timeout_s,
            )
            for v in args.variants
        }
        for m in args.models
    }
    settings = {
        "world_size": args.world_size,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "malloc": args.malloc,
        "batch_size_per_rank": {m: MODELS[m][2] for m in args.models},
        "machine": machine(),
        "load_avg_1m": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    result = summarize(raw, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(result, indent=1))
    print(format_table(result))
    print(f"wrote {args.out / 'memory.json'}")
    return result

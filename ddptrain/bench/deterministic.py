"""What the same bits at any world size cost: DDP(deterministic=True) against the default DDP
with the same micro-batch accumulation, step time and memory per rank.

    python -m ddptrain.bench --deterministic                # recipe LeNet and MLP at ws 2 and 4
    python -m ddptrain.bench --deterministic --world-sizes 2 --models mlp --rounds 20
    python -m ddptrain.bench --deterministic --quick        # smoke run (seconds)

A step is --micro-batches micro-batches of --micro-batch-size samples (the global batch), so
each of W ranks runs micro_batches / W of them: one backward each, all but the last under
no_sync(), then an SGD step; both modes see the same data. One thread per rank.
- Step time: one world per model and world size holds both modes, which take turns (the order
  alternates every round), so machine noise hits them alike; a turn is --block steps after one
  barrier, timed as the slowest rank's. "ratio" is the median of each round's own
  deterministic / default ratio. glibc keeps freed memory (fixed thresholds, as the step
  bench): with its adaptive ones, page faults of the model's own buffers land on one mode or
  the other by allocation history, milliseconds a step (--stock-malloc keeps them).
- Memory: one fresh world per mode, glibc returning every freed block over 64 KiB at once (so a
  rank's RSS follows its live tensors); "train peak" is a rank's peak RSS over --memory-steps
  steps above its RSS before the model was built, less the library code paged in meanwhile
  (file-backed pages: each mode runs kernels the other does not) and the heap of the compiler
  of the deterministic mode's large-gradient pass (compiled before, in both modes, and
  reported apart: compiler_rss_bytes in the JSON), the worst rank; "extra" is
  the difference in gradient-sized copies (the model's parameter bytes). RSS also counts the
  pages of other ranks' shared-memory buckets this rank sums, and the allocator's rounding,
  which blur a small model's figure; "held" counts bytes exactly: the wrapper's buckets (this
  rank's row) plus the .grad tensors that are not views of them, after the last step, the
  deterministic mode's excess in gradient-sized copies.
Writes <out>/deterministic.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddptrain
from ddptrain.bench.memory import (
    keep_freed_memory,
    peak_figures,
    reset_peak_rss,
    return_freed_memory,
    shared_files_bytes,
    status_field,
)
from ddptrain.bench.models import MODELS
from ddptrain.bench.report import machine

MODES = ("default", "deterministic")
_MIB = 2**20


def _batches(name: str, args: argparse.Namespace, rank: int, world_size: int) -> list[tuple]:
    """This rank's micro-batches of one step: random samples of the model's input shape."""
    sample_shape = MODELS[name][1]
    g = torch.Generator().manual_seed(rank)
    n = args.micro_batch_size
    return [
        (torch.randn(n, *sample_shape, generator=g), torch.randint(0, 10, (n,), generator=g))
        for _ in range(args.micro_batches // world_size)
    ]


def _step(model: ddptrain.DDP, opt: torch.optim.Optimizer, batches: list[tuple], exact: bool):
    """One optimizer step of micro-batch accumulation, torch's idiom."""
    opt.zero_grad(set_to_none=True)
    for j, (x, y) in enumerate(batches):
        with model.no_sync() if j < len(batches) - 1 else torch.enable_grad():
            loss = F.cross_entropy(model(x), y)
            # The exact mode averages over micro-batches itself; the float mode needs the 1/n.
            (loss if exact else loss / len(batches)).backward()
    opt.step()


def _wrap(name: str, mode: str) -> tuple[ddptrain.DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ddptrain.DDP(MODELS[name][0](), deterministic=mode == "deterministic")
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _time_worker(name: str, args: argparse.Namespace) -> tuple[dict[str, list[float]], bool]:
    malloc_fixed = not args.stock_malloc and keep_freed_memory()
    torch.set_num_threads(1)
    info = ddptrain.init_distributed()
    batches = _batches(name, args, info.rank, info.world_size)
    runs = {mode: _wrap(name, mode) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.warmup + args.rounds):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            model, opt = runs[mode]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                _step(model, opt, batches, mode == "deterministic")
            elapsed = torch.tensor([(time.perf_counter() - start) / args.block])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_ >= args.warmup:
                times[mode].append(elapsed.item())
    return times, malloc_fixed


def held_bytes(model: ddptrain.DDP) -> int:
    """Bytes the wrapper holds between steps: its buckets (this rank's row of a shared one) and
    the .grad tensors that are not views of them."""
    flats = [b.flat for b in model.reducer.buckets]
    storages = {f.untyped_storage().data_ptr() for f in flats}
    held = sum(f.numel() * f.element_size() for f in flats)
    for p in model.parameters():
        if p.grad is not None and p.grad.untyped_storage().data_ptr() not in storages:
            held += p.grad.numel() * p.grad.element_size()
    return held


def _memory_worker(name: str, mode: str, args: argparse.Namespace) -> dict[str, int]:
    freed_at_once = return_freed_memory()
    torch.set_num_threads(1)
    info = ddptrain.init_distributed()
    batches = _batches(name, args, info.rank, info.world_size)
    # The exact mode's modules load, and its large-gradient pass compiles, on first use: done
    # here in both modes, the peaks compare the tensors training holds, not code or the
    # compiler's own heap (reported apart).
    exact = importlib.import_module("ddptrain.ddp.exact")
    before_compiler = status_field("VmRSS")
    exact.warm_up(MODELS[name][0]().parameters())
    compiler = status_field("VmRSS") - before_compiler
    before_model, code_before = status_field("VmRSS"), status_field("RssFile")
    shared_before, rows_before = status_field("RssShmem"), shared_files_bytes()
    model, opt = _wrap(name, mode)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reset = reset_peak_rss()
    for _ in range(args.memory_steps):
        _step(model, opt, batches, mode == "deterministic")
    # Library code paged in by kernels only one mode runs is file-backed: not held memory.
    code = status_field("RssFile") - code_before
    peak = status_field("VmHWM") - before_model - code if reset else 0
    # The shared rows' pages this rank touched (its own, and parts of the others' that it
    # sums or writes: still there at the end), counted instead as its share of the host's.
    touched = status_field("RssShmem") - shared_before
    mapped = shared_files_bytes() - rows_before
    share = peak_figures(peak, touched, mapped, info.world_size)["peak_host_share_bytes"]
    return {
        "train_peak_bytes": peak,
        "train_peak_share_bytes": share if reset else 0,
        "held_bytes": held_bytes(model),
        "grad_bytes": grad_bytes,
        "compiler_bytes": compiler,
        "freed_at_once": freed_at_once,
    }


def summarize(
    times: dict[str, dict[int, dict[str, list[float]]]],
    memory: dict[str, dict[int, dict[str, list[dict[str, int]]]]],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Raw per-round times and per-rank memory in; medians, ratios and gaps out (pure)."""
    rows = []
    for name, by_world in times.items():
        for world_size, modes in by_world.items():
            ms = {m: statistics.median(v) * 1e3 for m, v in modes.items()}
            ratio = statistics.median(
                d / f for d, f in zip(modes["deterministic"], modes["default"], strict=True)
            )
            ranks = memory[name][world_size]
            peak = {m: max(r["train_peak_bytes"] for r in ranks[m]) for m in MODES}
            share = {m: max(r["train_peak_share_bytes"] for r in ranks[m]) for m in MODES}
            held = {m: max(r["held_bytes"] for r in ranks[m]) for m in MODES}
            grad_bytes = ranks["default"][0]["grad_bytes"]
            rows.append(
                {
                    "model": name,
                    "world_size": world_size,
                    "micro_batches_per_rank": settings["micro_batches"] // world_size,
                    "default_ms": ms["default"],
                    "deterministic_ms": ms["deterministic"],
                    "ratio": ratio,
                    "rounds": len(modes["default"]),
                    "grad_bytes": grad_bytes,
                    "default_train_peak_bytes": peak["default"],
                    "deterministic_train_peak_bytes": peak["deterministic"],
                    "extra_grad_copies": (peak["deterministic"] - peak["default"]) / grad_bytes,
                    "default_train_peak_share_bytes": share["default"],
                    "deterministic_train_peak_share_bytes": share["deterministic"],
                    "extra_share_grad_copies": (share["deterministic"] - share["default"])
                    / grad_bytes,
                    "default_held_bytes": held["default"],
                    "deterministic_held_bytes": held["deterministic"],
                    "extra_held_grad_copies": (held["deterministic"] - held["default"])
                    / grad_bytes,
                    # RSS gained over the warm-up before the baseline: a throwaway model built
                    # and, where it has large parameters, the exact mode's pass compiled.
                    "compiler_rss_bytes": max(
                        r.get("compiler_bytes", 0) for m in MODES for r in ranks[m]
                    ),
                }
            )
    return {"settings": settings, "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    """The table printed at the end of a run."""
    lines = [
        f"{'model':<13} {'ws':>2} {'mb/rank':>7} {'default ms':>10} {'determ. ms':>10} "
        f"{'ratio':>6} {'grad MiB':>8} {'peak default':>12} {'peak determ.':>12} {'extra':>6} "
        f"{'share':>6} {'held':>6}"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['model']:<13} {r['world_size']:>2} {r['micro_batches_per_rank']:>7} "
            f"{r['default_ms']:>10.2f} {r['deterministic_ms']:>10.2f} {r['ratio']:>5.3f}x "
            f"{r['grad_bytes'] / _MIB:>8.2f} {r['default_train_peak_bytes'] / _MIB:>12.2f} "
            f"{r['deterministic_train_peak_bytes'] / _MIB:>12.2f} "
            f"{r['extra_grad_copies']:>+6.2f} {r['extra_share_grad_copies']:>+6.2f} "
            f"{r['extra_held_grad_copies']:>+6.2f}"
        )
    lines.append(
        "ratio: median of per-round deterministic/default step times; peaks in MiB (worst "
        "rank); extra: the deterministic peak's excess in gradient-sized copies; share: the "
        "same with the shared rows a rank touched counted as its share of the host's; held: the "
        "excess of the wrapper's buckets and separate .grad tensors, in gradient-sized copies"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick: LeNet at world size 2, a few rounds."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.bench --deterministic",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--deterministic", action="store_true", help="this report")
    p.add_argument("--models", default="lenet-recipe,mlp", help=f"subset of {','.join(MODELS)}")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument(
        "--micro-batches", type=int, default=8, help="per step, over all ranks (default 8)"
    )
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--block", type=int, default=3, help="steps per timed turn")
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument(
        "--stock-malloc", action="store_true", help="time with glibc's adaptive thresholds"
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.world_sizes, args.rounds, args.warmup, args.block = (
            "lenet-recipe",
            "2",
            2,
            1,
            1,
        )
    args.models = [m for m in args.models.split(",") if m]
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    uneven = [w for w in args.world_sizes if w < 1 or args.micro_batches % w]
    if uneven:
        p.error(f"--micro-batches {args.micro_batches} does not split over world sizes {uneven}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the table, write deterministic.json; return the result."""
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    times, memory, malloc_fixed = {}, {}, []
    for name in args.models:
        times[name], memory[name] = {}, {}
        for w in args.world_sizes:
            ranks = ddptrain.spawn(_time_worker, w, name, args, timeout_s=args.timeout_s)
            times[name][w] = ranks[0][0]
            malloc_fixed += [fixed for _, fixed in ranks]
            memory[name][w] = {
                mode: ddptrain.spawn(_memory_worker, w, name, mode, args, timeout_s=args.timeout_s)
                for mode in MODES
            }
    settings = {
        "micro_batch_size": args.micro_batch_size,
        "micro_batches": args.micro_batches,
        "rounds": args.rounds,
        "block": args.block,
        "optimizer": "SGD(lr=0.01, momentum=0.9)",
        "threads_per_rank": 1,
        "malloc_fixed_thresholds": all(malloc_fixed),
        "machine": machine(),
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    result = summarize(times, memory, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "deterministic.json").write_text(json.dumps(result, indent=1))
    print(format_table(result))
    print(
        f"load average {settings['load_avg_1m_before']:.1f} before, "
        f"{settings['load_avg_1m_after']:.1f} after; wrote {args.out / 'deterministic.json'}"
    )
    return result

"""Side-by-side step time of ddptrain's wrapper, official DDP, naive all_reduce and no comm.

    python -m ddptrain.bench                        # world size 2, three models, a few minutes
    python -m ddptrain.bench --quick                # smoke run (seconds)
    python -m ddptrain.bench --models mlp --steps 60 --extras bf16,fp16,ring
    python -m ddptrain.bench --models mlp,lenet --extras adamw,zero,zero-sgd   # ZeRO stage 1
    python -m ddptrain.bench --models mlp,deep-mlp --extras zero2,zero3,torch_fsdp  # stages 2, 3
    python -m ddptrain.bench --models mlp --extras gloo --ladder   # docs/walkthrough.md's steps
    torchrun --nproc_per_node=2 -m ddptrain.bench --quick   # ranks from a launcher, any hosts
    python -m ddptrain.bench --models mlp --extras powersgd,torch-powersgd   # bench/compression.py

All variants live in the same processes and take turns (the order rotates every round), so
machine noise hits them alike. Each turn is a block of --block steps run back to back, as in
training, after one barrier; a step is zero_grad, forward, backward, SGD step; its time is
the block's (slowest rank's) / block, and the table shows medians. "exposed comm" is step
time minus the compute-only floor ("local": the same step with no communication); "comm alone"
is the wrapper's bucket reductions with no compute. Writes <out>/bench.json (and bench.png).

Started by a launcher (torchrun, srun, mpirun: launcher variables set), every process is one
rank and rank 0 writes the results; --world-size is then the launcher's. Otherwise the bench
spawns its own ranks on this host. The JSON's settings say which launcher and hosts ran it
and how the wrapper's buckets were reduced: "shared_memory" (one host) or "backend".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
from ddptrain.bench import compression
from ddptrain.bench.collectives import bench_all_reduce
from ddptrain.bench.memory import keep_freed_memory
from ddptrain.bench.models import MODELS
from ddptrain.bench.placement import bucket_transport, hosts, this_host, transport
from ddptrain.bench.report import format_table, machine, plot, summarize
from ddptrain.comm import named_hook
from ddptrain.ddp.hooks import GradBucket, Transport
from ddptrain.ddp.wrapper import DistributedDataParallel
from ddptrain.dist import LaunchError, launched_by
from ddptrain.fsdp.layout import choose_units
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.optim.zero import ZeroRedundancyOptimizer

BASE_VARIANTS = ("ddptrain", "torch_ddp", "naive", "local")
# Opt-in ddptrain variants: --extras name -> the hook it uses, by name (ddptrain/comm.py).
EXTRAS = {
    "gloo": "allreduce",
    "bf16": "bf16",
    "fp16": "fp16",
    "gloo-bf16": "allreduce-bf16",
    "ring": "ring",
    "tcp": "tcp",
}
# Opt-in optimizer variants (ddptrain's wrapper, default hook): name -> (optimizer class, sharded
# by ZeRO-1). The others step plain SGD: compare zero with adamw, zero-sgd with ddptrain.
OPTIMIZER_EXTRAS = {
    "adamw": (torch.optim.AdamW, False),
    "zero": (torch.optim.AdamW, True),
    "zero-sgd": (torch.optim.SGD, True),
}
# Opt-in sharded variants: ddptrain's fully sharded wrapper as ZeRO-2 and ZeRO-3, and torch's
# fully_shard (FSDP2) on the same units, all stepping plain SGD on their shards.
SHARDED_EXTRAS = ("zero2", "zero3", "torch_fsdp")
# Opt-in (--ladder) rungs of docs/walkthrough.md, between "naive" and "ddptrain_gloo": each adds
# one idea to the one before, all over the backend's all_reduce.
LADDER = ("flat", "hooked", "hooked_rebuild")
# Opt-in (--sync-only): no wrapper, one 4-byte all_reduce after backward. What meeting the other
# ranks once per step costs on this machine (waiting for the slowest), whatever the wrapper.
SYNC_ONLY = "sync_only"
RING_SIZES_MB = (1, 2, 4, 8, 16, 32, 64)


def _naive_average(model: nn.Module, world_size: int) -> None:
    # The classic tutorial's average_gradients: one blocking all_reduce per parameter.
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world_size)


def _flat_average(model: nn.Module, world_size: int) -> None:
    # One all_reduce of every gradient packed flat, after backward: one call's latency instead
    # of one per parameter, but still nothing overlaps backward.
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(world_size)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


def _make_variant(
    name: str, base: nn.Module, world_size: int, powersgd_rank: int
) -> tuple[nn.Module, Callable]:
    """A (model, after_backward) pair for one variant, each with its own copy of the weights."""
    module = copy.deepcopy(base)
    after: Callable[[], None] = lambda: None  # noqa: E731
    if name in compression.EXTRAS.values():
        model: nn.Module = compression.make_variant(name, module, powersgd_rank)
    elif name == "ddptrain" or name.removeprefix("ddptrain_") in OPTIMIZER_EXTRAS:
        model = DistributedDataParallel(module)
    elif name.startswith("ddptrain_"):
        hook = named_hook(EXTRAS[name.removeprefix("ddptrain_")])
        model = DistributedDataParallel(module, comm_hook=hook)
    elif name == "flat":
        model = module
        after = lambda: _flat_average(module, world_size)  # noqa: E731
    elif name in ("hooked", "hooked_rebuild"):
        model = DistributedDataParallel(
            module,
            comm_hook=named_hook("allreduce"),
            rebuild_buckets=name == "hooked_rebuild",
            gradient_as_bucket_view=False,
        )
    elif name in ("zero2", "zero3"):
        model = FullyShardedDataParallel(module, reshard_after_forward=name == "zero3")
    elif name == "torch_fsdp":
        from torch.distributed.fsdp import fully_shard

        for unit in reversed(choose_units(module, None)[1:]):
            fully_shard(unit)
        model = fully_shard(module)
    elif name == "torch_ddp":
        model = TorchDDP(module)
    elif name == "naive":
        model = module
        after = lambda: _naive_average(module, world_size)  # noqa: E731
    elif name == "local":
        model = module
    elif name == SYNC_ONLY:
        model, flag = module, torch.zeros(1, device=next(module.parameters()).device)
        after = lambda: dist.all_reduce(flag)  # noqa: E731
    else:
        raise ValueError(f"unknown variant {name!r}")
    return model, after


def _make_optimizer(variant: str, model: nn.Module) -> torch.optim.Optimizer:
    cls, sharded = OPTIMIZER_EXTRAS.get(variant.removeprefix("ddptrain_"), (torch.optim.SGD, False))
    if sharded:
        return ZeroRedundancyOptimizer(model.parameters(), cls, lr=1e-3)
    return cls(model.parameters(), lr=1e-3)


def _bench_model(
    name: str,
    variants: list[str],
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """Seconds per step of each variant on this rank: blocks of steps, variants interleaved."""
    factory, sample_shape, batch_size, default_steps = MODELS[name]
    steps, warmup, block = args.steps or default_steps, args.warmup, args.block
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    base = factory().to(device)
    runs = {}
    for v in variants:
        model, after = _make_variant(v, base, world_size, args.powersgd_rank)
        runs[v] = (model, after, _make_optimizer(v, model))
    ours = runs.get("ddptrain", (None,))[0]
    comm_buckets = []
    transport = ours.comm_hook[0] if isinstance(ours, DistributedDataParallel) else None
    if isinstance(transport, Transport):
        # Buffers placed as the wrapper's transport places its buckets (shared memory or not).
        sizes = ours.bucket_sizes_bytes
        for b, nbytes in enumerate(sizes):
            flat = transport.allocate(nbytes // 4, torch.float32, device)
            comm_buckets.append(GradBucket(b, flat, [], [], b == len(sizes) - 1))
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch_size, *sample_shape, generator=g).to(device)
    y = torch.randint(0, 10, (batch_size,), generator=g).to(device)
    timings: dict[str, list[float]] = {v: [] for v in variants}
    if comm_buckets:
        timings["comm_alone"] = []
    order = list(timings)
    # CPU seconds of the whole process (all threads): the work a variant costs, which noise
    # from other processes on the machine inflates far less than wall time.
    cpu: dict[str, list[float]] = {v: [] for v in order}
    rounds = -(-steps // block)
    for r in range(warmup + rounds):
        shift = r % len(order)
        for v in order[shift:] + order[:shift]:
            _sync(device)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            # Back to back, as in training: a barrier before every step would hide how
            # collectives behave when ranks arrive out of step (gloo's small all_reduce is
            # much slower then), so only each block of steps starts aligned.
            for _ in range(block):
                if v == "comm_alone":
                    for bucket in comm_buckets:
                        transport.reduce(bucket)
                else:
                    model, after, opt = runs[v]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(model(x), y).backward()
                    after()
                    opt.step()
            _sync(device)
            if r >= warmup:
                timings[v].append((time.perf_counter() - start) / block)
                cpu[v].append((time.process_time() - start_cpu) / block)
    n_params = sum(p.numel() for p in base.parameters())
    out = {"timings": timings, "cpu": cpu, "params": n_params, "bucket_bytes": []}
    sent = {v: compression.compressed_elements(runs[v][0]) for v in variants}
    out["powersgd_elements"] = {v: e for v, e in sent.items() if e is not None}
    if isinstance(ours, DistributedDataParallel):
        out["bucket_bytes"] = ours.bucket_sizes_bytes
        out["transport"] = bucket_transport(ours)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    malloc_fixed = not args.stock_malloc and keep_freed_memory()
    info = ddptrain.init_distributed(backend=args.backend)
    variants = list(BASE_VARIANTS)
    variants += [
        e if e in SHARDED_EXTRAS else compression.EXTRAS.get(e, f"ddptrain_{e}")
        for e in args.extras
    ]
    variants += list(LADDER) if args.ladder else []
    variants += [SYNC_ONLY] if args.sync_only else []
    out: dict[str, Any] = {
        "models": {m: _bench_model(m, variants, args, info.device) for m in args.models},
    }
    if args.ring_reps > 0 and info.world_size > 1:
        out["ring"] = bench_all_reduce(tuple(args.ring_sizes), args.ring_reps, info.device)
    out["backend"] = info.backend
    out["malloc_fixed_thresholds"] = malloc_fixed
    out["device"] = str(info.device)
    out["launcher"] = info.launcher
    out["host"] = this_host()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick shrinks everything to a smoke run."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.bench",
        description=__doc__.split("\n")[0],
        epilog="Other modes, each with its own --help: --recipe (the whole recipe run against "
        "the standard stack and the no-communication floor), --gpt (a GPT on the Trainer "
        "against nanoGPT's plain DDP loop), --memory (peak RSS per rank), --capped (training "
        "under a per-rank memory cap), --deterministic (what the same bits at any world size "
        "cost), --two-hosts (step times across two network namespaces; root).",
    )
    p.add_argument(
        "--world-size", type=int, default=None, help="ranks to spawn (default 2; a launcher's own)"
    )
    p.add_argument("--models", default="lenet,mlp,convnet", help=f"subset of {','.join(MODELS)}")
    p.add_argument(
        "--steps", type=int, default=0, help="timed steps per variant (default: per model)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds before measuring")
    p.add_argument("--block", type=int, default=4, help="back-to-back steps timed as one")
    p.add_argument(
        "--extras",
        default=",".join(EXTRAS),
        help="opt-in variants: subset of "
        f"{','.join([*EXTRAS, *OPTIMIZER_EXTRAS, *SHARDED_EXTRAS, *compression.EXTRAS])}, "
        "or 'none'",
    )
    p.add_argument(
        "--powersgd-rank",
        type=int,
        default=compression.DEFAULT_RANK,
        help="the PowerSGD extras' matrix rank",
    )
    p.add_argument("--ladder", action="store_true", help=f"add {', '.join(LADDER)}")
    p.add_argument(
        "--sync-only", action="store_true", help="add sync_only: a 4-byte all_reduce per step"
    )
    p.add_argument("--ring-reps", type=int, default=10, help="0 skips the ring bandwidth test")
    p.add_argument("--ring-sizes", default=",".join(map(str, RING_SIZES_MB)), help="MiB")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl if CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--quick", action="store_true", help="LeNet, 3 steps, 1 MiB ring: seconds")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--stock-malloc", action="store_true", help="keep glibc's adaptive thresholds (noisier)"
    )
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.warmup, args.block = "lenet", 3, 1, 1
        args.ring_reps, args.ring_sizes = 2, "1"
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    args.extras = [] if args.extras == "none" else [e for e in args.extras.split(",") if e]
    extras = [*EXTRAS, *OPTIMIZER_EXTRAS, *SHARDED_EXTRAS, *compression.EXTRAS]
    unknown += [e for e in args.extras if e not in extras]
    if args.powersgd_rank < 1:
        p.error(f"--powersgd-rank must be >= 1, got {args.powersgd_rank}")
    if unknown:
        p.error(f"unknown model/extra {unknown}; models: {list(MODELS)}, extras: {extras}")
    args.ring_sizes = [int(s) for s in args.ring_sizes.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run the benchmark, print the tables, write bench.json (and bench.png); return the result
    (None on ranks other than 0 under a launcher)."""
    args = parse_args(argv)
    load_before = os.getloadavg()
    if launched_by() == "single":
        world_size = args.world_size or 2
        raw = ddptrain.spawn(
            _worker, world_size, args, timeout_s=args.timeout_s, threads_per_rank=args.threads
        )
    else:
        raw = _launched(args)
        if raw is None:
            return None
    settings = {
        "world_size": len(raw),
        "launcher": raw[0]["launcher"],
        "hosts": hosts(raw),
        "bucket_transport": transport(raw),
        "backend": raw[0]["backend"],
        "device": raw[0]["device"],
        "threads_per_rank": args.threads,
        "malloc_fixed_thresholds": raw[0]["malloc_fixed_thresholds"],
        "steps": {m: args.steps or MODELS[m][3] for m in args.models},
        "warmup_rounds": args.warmup,
        "steps_per_block": args.block,
        "batch_size_per_rank": {m: MODELS[m][2] for m in args.models},
        "powersgd_rank": args.powersgd_rank,
        "machine": machine(),
        "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    result = summarize(raw, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(result, indent=1))
    print(format_table(result))
    print(
        f"{len(raw)} ranks on {len(settings['hosts'])} host(s) via {settings['launcher']}; "
        f"the wrapper's buckets went over {settings['bucket_transport']}"
    )
    if not args.no_plot and plot(result, args.out / "bench.png"):
        print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    else:
        print(f"wrote {args.out / 'bench.json'}")
    return result


@record
def _launched(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """This process is one rank of a launcher's world: bench here, every rank's raw results to
    rank 0 (None elsewhere)."""
    torch.set_num_threads(args.threads)
    try:
        world_size = ddptrain.init_distributed(backend=args.backend).world_size
        if args.world_size not in (None, world_size):
            raise LaunchError(
                f"--world-size {args.world_size} but the launcher started {world_size} ranks; "
                "leave --world-size out (the launcher sets it, e.g. torchrun --nproc_per_node)"
            )
        raw = _worker(args)
        gathered: list[Any] | None = [None] * world_size if dist.get_rank() == 0 else None
        dist.gather_object(raw, gathered, dst=0)
    finally:
        ddptrain.shutdown()
    return gathered

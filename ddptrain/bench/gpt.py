"""A GPT trained by ddptrain's Trainer against the loop its users would otherwise write.

    python -m ddptrain.bench --gpt                  # world size 2: eager, compiled, ZeRO-3
    python -m ddptrain.bench --gpt --quick          # smoke run (a minute)
    python -m ddptrain.bench --gpt --steps 600 --repeats 2 --variants ddptrain,plain
    python -m ddptrain.bench --gpt --recipe-args "--n-embd 192 --n-layer 6"

Every variant trains recipes/gpt.py's model (its flags, defaults unless --recipe-args) on its
data (the standard library's windows; validation on its held-out windows), with its optimizer
(AdamW with adamw_groups, warmup_cosine), clipping at its --grad-clip-norm, from its seed:
- ddptrain: the recipe's GPTTrainer; _compiled with compile=True, _zero3 with zero_stage=3;
- plain: the loop of nanoGPT's train.py around torch's DistributedDataParallel (torch.compile
  before wrapping for plain_compiled), a DistributedSampler and DataLoader over the same
  windows, the lr set by hand each step; plain_seed2 is the same loop from the next seed (other
  initial weights and order): how far two runs of one program land apart;
- fully_shard: that loop with torch's fully_shard (FSDP2) on each block, then the root.
tokens/s is steady-state training: tokens a step over the median interval between optimizer
steps, leaving out the first --skip-steps (compilation, warm-up) and those holding an
evaluation; cpu ms/step is the median CPU time of such a step on a rank (every thread's),
which other jobs on a shared machine inflate far less than the wall time. On a GPU (ranks take
one each, NCCL), MFU is the model's training FLOPs a token (models.GPT.flops_per_token) times
tokens/s over the card's datasheet peak at the recipe's --precision (--peak-tflops for a card
the table lacks); the plain loop autocasts as the Trainer does. Every --eval-every
steps each variant scores the same validation windows (bits per byte).
Variants run in separate worlds one after another (the order rotates every repeat); ratios
are of the medians, and "paired" is the median of each repeat's own ratio.
Writes <out>/gpt.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, DistributedSampler

import ddptrain
from ddptrain.bench.gpt_report import (
    PEAK_SOURCE,
    format_table,
    peak_flops,
    summarize,
)
from ddptrain.bench.recipe import glue_recipe_args, rotated_repeats
from ddptrain.bench.report import machine
from ddptrain.train.optimizers import adamw_groups, warmup_cosine_factor

RECIPE_PATH = Path(__file__).resolve().parents[2] / "recipes" / "gpt.py"
VARIANTS = (
    "ddptrain",
    "plain",
    "ddptrain_compiled",
    "plain_compiled",
    "ddptrain_zero3",
    "fully_shard",
    "plain_seed2",
)


@functools.cache
def _load_recipe() -> Any:
    """recipes/gpt.py as a module, once per process: the bench follows its model, data, flags."""
    if not RECIPE_PATH.is_file():
        raise FileNotFoundError(f"{RECIPE_PATH} not found: run the GPT bench from a checkout")
    spec = importlib.util.spec_from_file_location("ddptrain_recipe_gpt", RECIPE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_ddptrain(args: argparse.Namespace, flags: argparse.Namespace, variant: str) -> dict:
    """The recipe's Trainer for args.steps steps, evaluating every args.eval_every."""
    recipe = _load_recipe()
    ends: list[tuple[float, float]] = []
    log_dir = args.out / "logs" / variant

    class BenchTrainer(recipe.GPTTrainer):
        def configure_optimizers(self, model):
            made = super().configure_optimizers(model)
            made[0].register_step_post_hook(lambda *_: ends.append(_now()))
            return made

    config = dataclasses.replace(
        recipe.build_config(flags),
        max_steps=args.steps,
        eval_every_steps=args.eval_every,
        compile=variant == "ddptrain_compiled",
        zero_stage=3 if variant == "ddptrain_zero3" else flags.zero_stage,
        checkpoint_dir=None,
        resume=None,
        log_dir=str(log_dir),
        log_every_steps=args.eval_every,
        progress_bar=False,
        profile_steps=None,
        loggers=("jsonl",),
    )
    if dist.get_rank() == 0 and (log_dir / "metrics.jsonl").exists():
        (log_dir / "metrics.jsonl").unlink()
    dist.barrier()
    summary = BenchTrainer(config, flags).fit()
    curve = []
    if dist.get_rank() == 0:
        for line in (log_dir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "eval_bpb" in record:
                curve.append((record["step"], record["eval_bpb"]))
    return {"ends": ends, "curve": curve, "wall_s": summary["wall_s"]}


def _now() -> tuple[float, float]:
    """(wall clock, this process's CPU seconds, every thread's)."""
    return time.perf_counter(), time.process_time()


def _run_plain(
    args: argparse.Namespace, flags: argparse.Namespace, variant: str, device: torch.device
) -> dict:
    """nanoGPT's loop: torch's DDP (or fully_shard), AdamW, lr by hand, clipping, evaluation,
    the forward under autocast at the recipe's --precision."""
    recipe = _load_recipe()
    if flags.precision == "fp16":
        raise ValueError("the plain loop runs --precision fp32 or bf16 (fp16 needs a GradScaler)")
    precision = torch.autocast(device.type, torch.bfloat16, enabled=flags.precision == "bf16")
    seed = flags.seed + (1 if variant == "plain_seed2" else 0)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train, val, _ = recipe.load_text(flags, flags.seed)
    torch.manual_seed(seed)
    model = recipe.GPTTrainer(recipe.build_config(flags), flags).build_model().to(device)
    if variant == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        ddp_model = fully_shard(model)
    else:
        if variant == "plain_compiled":
            model = torch.compile(model)
        ddp_model = TorchDDP(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(
        adamw_groups(model, flags.weight_decay), lr=flags.lr, betas=(flags.beta1, flags.beta2)
    )
    warmup = min(flags.warmup_steps, args.steps // 2)
    sampler = DistributedSampler(train, shuffle=True, seed=seed)
    per_rank = flags.global_batch_size // world_size
    loader = DataLoader(train, batch_size=per_rank, sampler=sampler, drop_last=True)
    ends: list[tuple[float, float]] = []
    curve = []
    start = time.perf_counter()
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            lr = flags.lr * warmup_cosine_factor(
                step, warmup_steps=warmup, total_steps=args.steps, min_lr_ratio=flags.min_lr_ratio
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with precision:
                logits = ddp_model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), flags.grad_clip_norm)
            optimizer.step()
            ends.append(_now())
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                with precision:
                    curve.append((step, _evaluate(model, val, flags.eval_batch_size, device)))
            if step == args.steps:
                break
        epoch += 1
    wall_s = time.perf_counter() - start
    return {"ends": ends, "curve": curve if rank == 0 else [], "wall_s": wall_s}


@torch.no_grad()
def _evaluate(model: torch.nn.Module, val: Any, batch_size: int, device: torch.device) -> float:
    """Bits per byte over every validation window (every rank all of them, as nanoGPT's
    estimate_loss does; a fully sharded model needs every rank in every forward)."""
    model.eval()
    nats, count = 0.0, 0
    for i in range(0, len(val), batch_size):
        x, y = (t.to(device) for t in val.get_batch(range(i, min(i + batch_size, len(val)))))
        logits = model(x).float()
        nats += F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1).sum().item()
        count += len(x)
    model.train()
    return nats / count / math.log(2)


def _worker(variant: str, args: argparse.Namespace) -> dict:
    flags = _load_recipe().parse_args(args.recipe_args)
    info = ddptrain.init_distributed()
    try:
        if variant.startswith("ddptrain"):
            run = _run_ddptrain(args, flags, variant)
        else:
            run = _run_plain(args, flags, variant, info.device)
    finally:
        ddptrain.shutdown()
    run["tokens_per_step"] = flags.global_batch_size * flags.block_size
    run["device"] = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu"
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick shrinks the run to a smoke test."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.bench --gpt", description=__doc__.split("\n")[0]
    )
    p.add_argument("--gpt", action="store_true", help="this benchmark (python -m ddptrain.bench)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per variant")
    p.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    p.add_argument(
        "--skip-steps", type=int, default=10, help="first steps left out of tokens/s (compiling)"
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of every variant, order rotated")
    p.add_argument("--recipe-args", default="", help="flags for recipes/gpt.py's parser")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--quick", action="store_true", help="a tiny model, 24 steps: a minute")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="the peak for MFU (default: datasheet's)"
    )
    args = p.parse_args(glue_recipe_args(sys.argv[1:] if argv is None else argv))
    if args.quick:
        args.steps, args.eval_every, args.skip_steps = 24, 12, 4
        args.recipe_args += " --n-layer 1 --n-embd 32 --n-head 2 --eval-windows 16"
    args.recipe_args = shlex.split(args.recipe_args)
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    _load_recipe().parse_args(args.recipe_args)  # a bad flag: one error here, not per rank
    return args


def _flops_per_token(flags: argparse.Namespace) -> int:
    recipe = _load_recipe()
    with torch.device("meta"):  # shapes only: no memory, no initialisation work
        model = recipe.GPTTrainer(recipe.build_config(flags), flags).build_model()
    return model.flops_per_token()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison, print the tables, write gpt.json; return the result."""
    args = parse_args(argv)
    load_before = os.getloadavg()
    runs = rotated_repeats(
        args.variants,
        args.repeats,
        lambda v: ddptrain.spawn(_worker, args.world_size, v, args, timeout_s=args.timeout_s),
        progress=True,
    )
    settings = {
        "world_size": args.world_size,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "skip_steps": args.skip_steps,
        "repeats": args.repeats,
        "recipe_args": args.recipe_args,
        "threads_per_rank": 1,
        "machine": machine(),
        "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    flags = _load_recipe().parse_args(args.recipe_args)
    device = runs[0][args.variants[0]][0]["device"]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device, flags.precision)
    settings |= {
        "device": device,
        "precision": flags.precision,
        "flops_per_token": _flops_per_token(flags),
        "peak_flops": peak,
        "peak_source": "--peak-tflops" if args.peak_tflops else PEAK_SOURCE,
    }
    result = summarize(runs, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpt.json").write_text(json.dumps(result, indent=1))
    print(format_table(result))
    print(f"wrote {args.out / 'gpt.json'}")
    return result

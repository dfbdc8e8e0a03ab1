"""The whole training run: ddptrain's recipe, the standard official-DDP loop, the no-comm floor.

    python -m ddptrain.bench --recipe                   # world size 2, one epoch each (235 steps)
    python -m ddptrain.bench --recipe --quick           # smoke run (seconds)
    python -m ddptrain.bench --recipe --world-size 3 --recipe-args "--global-batch-size 252" \
        --epochs 2 --repeats 2 --out bench-results/r3        # the global batch splits over ranks
    python -m ddptrain.bench --recipe --recipe-args "--width 1 --global-batch-size 128"

Same data (Fashion-MNIST from /usr/share/datasets/fashion-mnist, else synthetic images of its
shape), same model (the recipe's build_model: LeNet with BatchNorm in channels_last by default,
or --model mlp) and SGD settings (recipes/mnist.py's flags, defaults unless --recipe-args),
same number of optimizer steps, one thread per rank (each rank reports its model's parameters):
- ddptrain: the recipe's Trainer (recipes/mnist.py's MNISTTrainer) with no evaluation set, so
  its wall time is training only;
- standard: the loop of pytorch/examples: torch's DistributedDataParallel, DistributedSampler,
  DataLoader over a Dataset that converts and normalizes each sample in __getitem__;
- floor: world_size independent one-process runs of the recipe (its world size 1, the per-rank
  batch) side by side: the same work with no communication at all.
samples/s: synchronous runs count all ranks' samples over the slowest rank's wall time; the
floor sums each process's own samples/s. Variants run in separate worlds one after another (the
order rotates every repeat); the ratios are of the medians, and "paired" is the median of each
repeat's own ratio, which load that changes between repeats moves less. The floor's processes
also time each optimizer step: held in lockstep by a meeting that cost nothing, each step would
last as long as the slowest process's, and the rate that keeps (floor_lockstep_bound) is the
most of the floor any synchronous run could reach under this machine's step-to-step jitter.
Writes <out>/recipe.json and <out>/recipe.png (matplotlib).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ddptrain
from ddptrain.bench.recipe_report import format_table, plot, summarize
from ddptrain.bench.report import machine
from ddptrain.cli import UsageError
from ddptrain.data.datasets import DEBIAN_FASHION_MNIST, fashion_mnist
from ddptrain.data.idx import IDXDataset
from ddptrain.train.config import ConfigError

VARIANTS = ("ddptrain", "standard", "floor")
RECIPE_PATH = Path(__file__).resolve().parents[2] / "recipes" / "mnist.py"
# Fashion-MNIST's train split: what the synthetic stand-in imitates (--quick: a smaller one).
TRAIN_SAMPLES, QUICK_SAMPLES, MEAN, STD = 60_000, 4096, 0.2860, 0.3530
# pytorch/examples' mnist: log_interval=10 reads the loss every 10 batches.
LOG_INTERVAL = 10


@functools.cache
def _load_recipe() -> Any:
    """recipes/mnist.py as a module, once per process: the bench follows the recipe's model,
    data and flags."""
    if not RECIPE_PATH.is_file():
        raise FileNotFoundError(f"{RECIPE_PATH} not found: run the recipe bench from a checkout")
    spec = importlib.util.spec_from_file_location("ddptrain_recipe_mnist", RECIPE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_images(data: str, quick: bool) -> IDXDataset:
    """The train split as the recipe loads it, or synthetic images of the same shape."""
    if data == "fashion-mnist":
        return fashion_mnist(train=True)
    g = torch.Generator().manual_seed(0)
    n = QUICK_SAMPLES if quick else TRAIN_SAMPLES
    images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
    targets = torch.randint(0, 10, (n,), generator=g)
    return IDXDataset(images, targets, mean=MEAN, std=STD)


class PerSampleDataset(Dataset):
    """uint8 images converted and normalized one sample at a time, as ToTensor + Normalize do."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, mean: float, std: float):
        self.images, self.targets, self.mean, self.std = images, targets, mean, std

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[i].unsqueeze(0).float().div(255)
        return (x - self.mean) / self.std, self.targets[i]


def _run_ddptrain(args: argparse.Namespace, recipe_args: argparse.Namespace, solo: bool) -> dict:
    """The recipe's Trainer for args.steps steps; solo: a world of one on the per-rank batch."""
    recipe = _load_recipe()
    if solo:
        # Start together, then leave: each process trains alone in a world of its own.
        ddptrain.init_distributed()
        batch = recipe_args.global_batch_size // torch.distributed.get_world_size()
        torch.distributed.barrier()
        ddptrain.shutdown()
        ddptrain.init_distributed(env={})
    else:
        batch = recipe_args.global_batch_size
    counted = {"samples": 0, "parameters": 0}
    step_ends: list[float] = []

    class BenchTrainer(recipe.MNISTTrainer):
        def build_model(self):
            model = super().build_model()
            counted["parameters"] = sum(p.numel() for p in model.parameters())
            return model

        def build_datasets(self):
            return _train_images(args.data, args.quick), None

        def configure_optimizers(self, model):
            made = super().configure_optimizers(model)
            optimizer = made[0] if isinstance(made, tuple) else made
            optimizer.register_step_post_hook(lambda *_: step_ends.append(time.perf_counter()))
            return made

        def training_step(self, model, batch):
            counted["samples"] += len(batch[1])
            return super().training_step(model, batch)

    # The recipe's own settings, minus evaluation, checkpoints, logs and profiling.
    config = dataclasses.replace(
        recipe.build_config(recipe_args),
        global_batch_size=batch,
        epochs=math.ceil(args.steps / math.ceil(args.train_samples / batch)),
        max_steps=args.steps,
        checkpoint_dir=None,
        resume=None,
        log_dir=None,
        log_every_steps=50,
        eval_every_steps=None,
        progress_bar=False,
        profile_steps=None,
        loggers=("jsonl",),
    )
    summary = BenchTrainer(config, recipe_args).fit()
    # The floor's step times give its lockstep bound; the synchronous runs need none.
    return {**counted, "wall_s": summary["wall_s"], **({"step_ends": step_ends} if solo else {})}


def _run_standard(args: argparse.Namespace, recipe_args: argparse.Namespace) -> dict:
    """pytorch/examples' DDP loop: DistributedSampler, DataLoader, per-sample normalize."""
    info = ddptrain.init_distributed()
    torch.manual_seed(recipe_args.seed)
    split = _train_images(args.data, args.quick)
    dataset = PerSampleDataset(split.images, split.targets, split.mean, split.std)
    sampler = DistributedSampler(dataset, shuffle=True, seed=recipe_args.seed)
    loader = DataLoader(
        dataset, batch_size=recipe_args.global_batch_size // info.world_size, sampler=sampler
    )
    # The recipe's own build_model, so the two stacks train the same model whatever the flags
    # (--model, --width, memory layout). Local BatchNorm even for --sync-batchnorm: the recipe
    # converts later, in the Trainer, and torch's SyncBatchNorm runs on CUDA only.
    recipe = _load_recipe()
    module = recipe.MNISTTrainer(recipe.build_config(recipe_args), recipe_args).build_model()
    model = TorchDDP(module)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=recipe_args.lr,
        momentum=recipe_args.momentum,
        weight_decay=recipe_args.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model.train()
    step, samples, epoch = 0, 0, 0
    start = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(loader):
            optimizer.zero_grad()
            # The recipe's --precision bf16 is autocast around the forward; the same here.
            with torch.autocast("cpu", torch.bfloat16, enabled=recipe_args.precision == "bf16"):
                loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if batch_idx % LOG_INTERVAL == 0:
                loss.item()
            step, samples = step + 1, samples + len(target)
            if step == args.steps:
                break
        epoch += 1
    wall_s = time.perf_counter() - start
    parameters = sum(p.numel() for p in module.parameters())
    return {"samples": samples, "parameters": parameters, "wall_s": wall_s}


def _worker(variant: str, args: argparse.Namespace) -> dict:
    recipe_args = _load_recipe().parse_args(args.recipe_args)
    if variant == "standard":
        return _run_standard(args, recipe_args)
    return _run_ddptrain(args, recipe_args, solo=variant == "floor")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --quick shrinks the run to a smoke test."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.bench --recipe", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--recipe", action="store_true", help="this benchmark (python -m ddptrain.bench)"
    )
    p.add_argument("--world-size", type=int, default=2)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, help="optimizer steps per variant")
    length.add_argument("--epochs", type=int, default=None, help="default 1 (235 steps at 256)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every variant, order rotated")
    p.add_argument(
        "--data",
        choices=["auto", "fashion-mnist", "synthetic"],
        default="auto",
        help="auto: Fashion-MNIST when installed, else synthetic",
    )
    p.add_argument("--recipe-args", default="", help="flags for recipes/mnist.py's parser")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--quick", action="store_true", help="synthetic data, 6 steps: seconds")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args(glue_recipe_args(sys.argv[1:] if argv is None else argv))
    if args.data == "auto":
        args.data = "fashion-mnist" if DEBIAN_FASHION_MNIST.is_dir() else "synthetic"
    if args.quick:
        args.data, args.steps, args.epochs = "synthetic", 6, None
    args.recipe_args = shlex.split(args.recipe_args)
    try:  # here, once, rather than as a traceback in every spawned rank
        recipe_flags = _load_recipe().parse_args(args.recipe_args)
    except UsageError as e:
        # The recipe's parser names the running program (here the bench) in its hint.
        problem = str(e).rsplit(" (see ", 1)[0]
        p.error(f"--recipe-args: {problem} (see python recipes/mnist.py --help)")
    try:  # the Trainer's own check, once here instead of a traceback from every rank
        _load_recipe().build_config(recipe_flags).check_world_size(args.world_size)
    except ConfigError as e:
        p.error(f"--world-size {args.world_size}: {e}; set it with --recipe-args")
    args.model = recipe_flags.model
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.train_samples = QUICK_SAMPLES if args.quick else TRAIN_SAMPLES
    if args.steps is None:
        batch = recipe_flags.global_batch_size
        args.steps = (args.epochs or 1) * math.ceil(args.train_samples / batch)
    return args


def glue_recipe_args(argv: list[str]) -> list[str]:
    """`--recipe-args --sync-batchnorm` as `--recipe-args=--sync-batchnorm`: argparse would take
    a lone value that starts with `--` for an option and say the flag has no argument."""
    glued = list(argv)
    for i, arg in enumerate(glued[:-1]):
        if arg == "--recipe-args":
            glued[i : i + 2] = [f"--recipe-args={glued[i + 1]}"]
            break
    return glued


def rotated_repeats(
    variants: list[str], repeats: int, run: Callable[[str], Any], progress: bool = False
) -> list[dict[str, Any]]:
    """`repeats` runs of every variant, each repeat starting one variant later, so no variant
    always runs first on a machine that warms up or is shared; results in `variants` order."""
    runs = []
    for r in range(repeats):
        k = r % len(variants)
        done = {}
        for v in variants[k:] + variants[:k]:
            done[v] = run(v)
            if progress:
                print(f"repeat {r + 1}/{repeats}: {v} done", flush=True)
        runs.append({v: done[v] for v in variants})
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison, print the table, write recipe.json (and recipe.png); return it."""
    args = parse_args(argv)
    load_before = os.getloadavg()
    runs = rotated_repeats(
        args.variants,
        args.repeats,
        lambda v: ddptrain.spawn(_worker, args.world_size, v, args, timeout_s=args.timeout_s),
    )
    settings = {
        "world_size": args.world_size,
        "steps": args.steps,
        "data": args.data,
        "train_samples": args.train_samples,
        "recipe_args": args.recipe_args,
        "model": args.model,
        "repeats": args.repeats,
        "threads_per_rank": 1,
        "machine": machine(),
        "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    result = summarize(runs, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recipe.json").write_text(json.dumps(result, indent=1))
    print(format_table(result))
    if not args.no_plot and plot(result, args.out / "recipe.png"):
        print(f"wrote {args.out / 'recipe.json'} and {args.out / 'recipe.png'}")
    elif not args.no_plot:
        print(f"wrote {args.out / 'recipe.json'} (no chart: pip install matplotlib)")
    else:
        print(f"wrote {args.out / 'recipe.json'}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

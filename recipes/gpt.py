"""A byte-level GPT on text every machine has: the Python standard library's own source.

Usage:
    ddptrain-run --standalone --nproc_per_node=2 recipes/gpt.py   # ~9 minutes on 2 CPU cores
    python recipes/gpt.py --dry-run                                 # one process, seconds
    ddptrain-run --standalone --nproc_per_node=2 recipes/gpt.py --data notes.txt
    ... --zero-stage 3 --activation-checkpointing --compile --precision bf16
(ddptrain-run is torchrun ending a failed job with the workers' error line and exit code;
plain torchrun runs it the same.)

By default the text is the *.py files of this interpreter's standard library
(sysconfig.get_paths()["stdlib"]), leaving out the folders test/, tests/ and site-packages/;
--data PATH reads a text file, or the files matching --files under a folder. The first lines
say which folder, how many files and bytes, and which files are held out for validation:
--val-fraction of them, drawn by file with --seed, so no file is in both splits. The model
reads windows of --block-size bytes and predicts each next byte (a vocabulary of 256).

Each evaluation prints the validation loss in bits per byte (eval_bpb: 8 is a uniform guess);
the end prints a few texts sampled from the model, then a summary:
    FINAL data=stdlib val_bpb=1.97.. steps=2400 wall_s=.. tokens_per_s=.. world_size=2

Every TrainerConfig field is a flag (--max-steps, --zero-stage, --checkpoint-dir, --resume,
--log-dir, --grad-accum-steps, ...), as in recipes/mnist.py; python recipes/gpt.py --help
lists them all with their defaults. --dry-run trains a one-layer model for 5 steps.
"""

import argparse
import math
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import ddptrain
from ddptrain import cli
from ddptrain.cli import run_alike
from ddptrain.data.text import ByteWindows, read_bytes, split_by_file, text_files
from ddptrain.flags import (
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    Check,
    add_flags,
    from_flags,
    setting,
)
from ddptrain.models import GPT
from ddptrain.train.build import whole_parameters
from ddptrain.train.config import ConfigError, TrainerConfig
from ddptrain.train.optimizers import adamw_groups, warmup_cosine
from ddptrain.train.trainer import Trainer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FRACTION = Check(lambda v: 0 < v < 1, "in (0, 1)")


class GPTTrainer(Trainer):
    """GPT on byte windows: AdamW (no decay on biases, norms, embeddings), warmup + cosine,
    cross-entropy per byte, validation in bits per byte."""

    def __init__(self, config: TrainerConfig, args: argparse.Namespace) -> None:
        super().__init__(config)
        self.args = args

    def build_model(self) -> torch.nn.Module:
        a = self.args
        return GPT(
            block_size=a.block_size,
            n_layer=a.n_layer,
            n_head=a.n_head,
            n_embd=a.n_embd,
            dropout=a.dropout,
        )

    def build_datasets(self):
        # Alike on every rank, so a missing or unreadable file is one error line.
        train, val, lines = run_alike(lambda: load_text(self.args, self.config.seed))
        ddptrain.print0("\n".join(lines))
        return train, val

    def configure_optimizers(self, model: torch.nn.Module):
        a = self.args
        opt = torch.optim.AdamW(
            adamw_groups(model, a.weight_decay), lr=a.lr, betas=(a.beta1, a.beta2)
        )
        warmup = min(a.warmup_steps, self.total_steps // 2)
        schedule = warmup_cosine(
            opt, warmup_steps=warmup, total_steps=self.total_steps, min_lr_ratio=a.min_lr_ratio
        )
        return opt, schedule

    def training_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        # Per window, the mean over its bytes: every window has block_size of them, so the
        # Trainer's mean over windows is the mean over bytes.
        nats = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1).sum()
        return {"loss": nats, "bpb": nats / math.log(2)}


def load_text(args: argparse.Namespace, seed: int) -> tuple[ByteWindows, ByteWindows, list[str]]:
    """(train windows, validation windows, the lines that describe them) from --data."""
    root = Path(args.data) if args.data else STDLIB
    files = text_files(root, args.files, args.exclude)
    if not files:
        left_out = f", leaving out {','.join(args.exclude)}" if args.exclude else ""
        raise FileNotFoundError(f"no file matches --files {args.files} under {root}{left_out}")
    what = "the standard library" if args.data is None else "--data"
    if len(files) == 1:
        data = read_bytes(files)
        cut = len(data) - max(args.block_size + 1, round(args.val_fraction * len(data)))
        train_data, val_data = data[:cut], data[cut:]
        lines = [
            f"data: {what} {root}: one file, {len(data):,} bytes",
            f"held out: its last {len(val_data):,} bytes (one file, so not split by file)",
        ]
    else:
        train_files, val_files = split_by_file(files, root, args.val_fraction, seed)
        train_data, val_data = read_bytes(train_files), read_bytes(val_files)
        excluded = f" outside {', '.join(d + '/' for d in args.exclude)}" if args.exclude else ""
        lines = [
            f"data: {what} {root}: {len(files)} files ({args.files}{excluded}), "
            f"{len(train_data) + len(val_data):,} bytes",
            f"held out by file (--val-fraction {args.val_fraction}, --seed {seed}): "
            f"{len(val_files)} files, {len(val_data):,} bytes, e.g. "
            + ", ".join(f.relative_to(root).as_posix() for f in val_files[:3]),
        ]
    for name, part in (("training", train_data), ("validation", val_data)):
        if len(part) <= args.block_size:
            raise ConfigError(
                f"the {name} text holds {len(part):,} bytes, less than one window of "
                f"block_size {args.block_size} + 1; use more text or a smaller block_size"
            )
    train = ByteWindows(train_data, args.block_size)
    val = ByteWindows(val_data, args.block_size, max_windows=args.eval_windows)
    lines.append(
        f"train: {len(train):,} windows of {args.block_size} bytes; validation: {len(val)} "
        f"windows spread over the held-out text; 8.00 bits per byte is a uniform guess"
    )
    return train, val, lines


@torch.no_grad()
def sample(module: GPT, args: argparse.Namespace, seed: int) -> list[str]:
    """args.samples texts of args.sample_bytes bytes after args.prompt, the same on every rank."""
    module.eval()
    prompt = torch.tensor([list(args.prompt.encode())], dtype=torch.long)
    device = next(module.parameters()).device
    texts = []
    for i in range(args.samples):
        g = torch.Generator(device).manual_seed(seed + i)
        out = module.generate(
            prompt.to(device),
            args.sample_bytes,
            temperature=args.temperature,
            top_k=args.top_k,
            generator=g,
        )
        texts.append(bytes(out[0].tolist()).decode("utf-8", errors="replace"))
    return texts


@dataclass(kw_only=True)
class GPTSettings:
    """What is this recipe's own: the text, the model, AdamW and the samples; every other flag
    is TrainerConfig's."""

    data: str | None = setting(
        None,
        "a text file, or a folder whose files matching --files are read",
        group="data",
        metavar="PATH",
        unset="this interpreter's standard library",
    )
    files: str = setting("*.py", "which files of a folder are read (a glob)", group="data")
    exclude: tuple[str, ...] = setting(
        ("test", "tests", "site-packages"),
        "folders whose files are left out; none reads every folder",
        group="data",
        metavar="NAME,...",
    )
    val_fraction: float = setting(
        0.05,
        "share of the files held out for validation, drawn by file with the seed",
        group="data",
        check=FRACTION,
    )
    eval_windows: int = setting(
        256,
        "validation windows scored at each evaluation, spread evenly over the held-out text",
        group="data",
        check=POSITIVE,
    )
    block_size: int = setting(128, "context length in bytes", group="model", check=POSITIVE)
    n_layer: int = setting(4, "transformer blocks", group="model", check=POSITIVE)
    n_head: int = setting(4, "attention heads per block", group="model", check=POSITIVE)
    n_embd: int = setting(
        128, "width of the residual stream; divisible by n_head", group="model", check=POSITIVE
    )
    dropout: float = setting(0.0, "dropout probability", group="model", check=PROBABILITY)
    lr: float = setting(
        2e-3,
        "AdamW's peak learning rate, reached after the warm-up",
        group="optimizer",
        check=POSITIVE,
    )
    warmup_steps: int = setting(
        100,
        "optimizer steps of linear warm-up (at most half the run)",
        group="optimizer",
        check=NON_NEGATIVE,
    )
    min_lr_ratio: float = setting(
        0.1,
        "the cosine decay ends at this share of lr, at the last step",
        group="optimizer",
        check=PROBABILITY,
    )
    weight_decay: float = setting(
        0.1,
        "AdamW weight decay on the weights of matmuls (none on biases, norms, embeddings)",
        group="optimizer",
        check=NON_NEGATIVE,
    )
    beta1: float = setting(0.9, "AdamW's beta1", group="optimizer", check=PROBABILITY)
    beta2: float = setting(0.95, "AdamW's beta2", group="optimizer", check=PROBABILITY)
    samples: int = setting(3, "texts sampled at the end", group="sampling", check=NON_NEGATIVE)
    sample_bytes: int = setting(300, "bytes generated per sample", group="sampling", check=POSITIVE)
    prompt: str = setting("def ", "the text each sample starts from", group="sampling")
    temperature: float = setting(
        0.8, "divides the logits before sampling", group="sampling", check=POSITIVE
    )
    top_k: int | None = setting(
        None, "sample among the k likeliest bytes", group="sampling", check=POSITIVE, unset="all"
    )
    dry_run: bool = setting(
        False,
        "5 steps of a one-layer model (sizes left at their defaults shrink), one evaluation and "
        "a short sample, for CI",
        group="run",
    )
    debug: bool = setting(
        False,
        f"show the traceback of a user error instead of one error: line; also {cli.DEBUG_ENV}=1",
        group="run",
    )


# What the flags are made from, so that an error about a setting names its flag.
SETTINGS = (GPTSettings, TrainerConfig)
# 2400 steps of 32 windows of 128 bytes (9.8M bytes, most of an epoch of the standard library):
# a run that visibly improves in minutes at world size 2 on 2 CPU cores (docs/benchmarks.md).
RECIPE_DEFAULTS = {
    "global_batch_size": 32,
    "max_steps": 2400,
    "eval_every_steps": 200,
    "eval_batch_size": 64,
    "grad_clip_norm": 1.0,
    "log_every_steps": 100,
    "seed": 1234,
}
# --dry-run's sizes for the settings left at their defaults.
DRY_RUN = {"n_layer": 1, "n_embd": 32, "n_head": 2, "eval_windows": 16, "sample_bytes": 40}


def build_parser() -> argparse.ArgumentParser:
    """The recipe's flags: its own settings, then every TrainerConfig field's."""
    p = cli.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(p, [GPTSettings, TrainerConfig], RECIPE_DEFAULTS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of `argv` (default: the command line), checked together."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.dry_run:
        for name, value in DRY_RUN.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
        args.max_steps, args.log_every_steps, args.samples = 5, 5, min(args.samples, 1)
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.checkpoint_dir and args.best_metric is None:
        args.best_metric, args.best_mode = "eval_bpb", "min"
    return args


def build_config(args: argparse.Namespace) -> TrainerConfig:
    """The TrainerConfig these flags describe (the bench builds its runs from it too)."""
    return from_flags(TrainerConfig, args)


def main(argv: list[str] | None = None) -> int:
    """1 flags -> 2 config -> 3 trainer (data, model, wrap, optimizer, resume, loop) -> 4
    samples from the trained model."""
    args = parse_args(argv)
    config = build_config(args)
    # The recipe holds the process group, so the samples can gather a sharded model after fit.
    ddptrain.init_distributed(config.backend, timeout_s=config.timeout_s)
    try:
        trainer = GPTTrainer(config, args)
        summary = trainer.fit()
        with whole_parameters(trainer.model), torch.compiler.set_stance("force_eager"):
            texts = sample(trainer.model.module, args, config.seed)
    finally:
        ddptrain.shutdown()
    for i, text in enumerate(texts, 1):
        ddptrain.print0(f"--- sample {i} (temperature {args.temperature}) ---\n{text}")
    bpb = summary["eval"].get("eval_bpb", float("nan"))
    data = "stdlib" if args.data is None else args.data
    ddptrain.print0(
        f"FINAL data={data} val_bpb={bpb:.4f} steps={summary['step']} "
        f"wall_s={summary['wall_s']:.1f} "
        f"tokens_per_s={summary['samples_per_s'] * args.block_size:.0f} "
        f"world_size={summary['world_size']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main, settings=SETTINGS))

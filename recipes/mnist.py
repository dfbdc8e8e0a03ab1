"""LeNet on MNIST (or Fashion-MNIST) with ddptrain: synchronous data-parallel SGD.

Usage:
    torchrun --standalone --nproc_per_node=2 recipes/mnist.py    # downloads MNIST into data/
    python recipes/mnist.py --data-dir data                      # one process, same code path
    # offline machine: Debian ships Fashion-MNIST, a drop-in MNIST replacement
    apt-get install -y dataset-fashion-mnist
    torchrun --standalone --nproc_per_node=2 recipes/mnist.py --dataset fashion-mnist

The first line printed says where the data was read from. Missing MNIST files are downloaded
into --data-dir/MNIST/raw/ by local rank 0 of each host (MD5-checked, written under a temporary
name and renamed once verified) while the other ranks wait, unless that folder holds
Fashion-MNIST. A --data-dir you name is read alone: Debian's Fashion-MNIST stands in only for
the default data/. --mirror URL (or DDPTRAIN_MNIST_MIRROR=URL) replaces the standard mirrors:
an https://, http:// or file:// folder holding the four .gz files.

Mistakes (flags, settings, data files, checkpoints) print one `error: ...` line and exit 2
(flags and settings) or 1; --debug (or DDPTRAIN_DEBUG=1) shows the traceback instead.

Common flags:
    --dataset {mnist,fashion-mnist}   --data-dir DIR (MNIST/raw/, raw/ or flat IDX files)
    --epochs 6   --global-batch-size 256 (split over ranks)   --lr 0.2   --momentum   --seed
    --width 2 --dropout 0.1 (LeNet 20-40-100 with BatchNorm; --width 1 --dropout 0.5
    --no-batchnorm is the tutorial's net)   --no-channels-last (NCHW weights)
    --checkpoint-dir DIR   --resume {auto,PATH}   --dry-run (a few steps, for CI)
    --mirror URL (where to download MNIST from)   --debug (tracebacks for errors)
    --target-acc 0.99 (exit 1 if final test accuracy is below it)
    --comm-hook {default,allreduce,bf16,ring,..} (how gradients are reduced)
    --zero-stage 1 (shard the optimizer state across ranks: ZeRO stage 1)
    --no-batchnorm (LeNet without BatchNorm)   --sync-batchnorm (statistics over all ranks)
    --log-dir runs/x (metrics.jsonl; then: python -m ddptrain.plot runs/x -o curves.png)
    --profile-steps 20:22 (Chrome traces of steps 20-22 per rank into --log-dir)   --tensorboard
    --model mlp (the benchmark's 16.8M-parameter MLP instead of LeNet)

The last line printed is a summary:
    FINAL dataset=mnist test_accuracy=0.99.. epochs=6 steps=1410 wall_s=.. samples_per_s=..
          world_size=2    (one line)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
import torch.nn.functional as F

import ddptrain
from ddptrain.bench.models import MLP
from ddptrain.cli import (
    ArgumentParser,
    non_negative,
    positive,
    probability,
    run_alike,
    run_main,
)
from ddptrain.data.datasets import (
    DEBIAN_FASHION_MNIST,
    download_mnist,
    fashion_mnist,
    mnist,
    survey_data_dir,
)
from ddptrain.data.download import DownloadError
from ddptrain.models import LeNet
from ddptrain.train.config import COMM_HOOKS, PRECISIONS, ZERO_STAGES, TrainerConfig
from ddptrain.train.trainer import Trainer

DEFAULT_DATA_DIR = "data"
TITLES = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST"}


class MNISTTrainer(Trainer):
    """LeNet, SGD with momentum and a cosine schedule, NLL loss, accuracy on the test split."""

    def __init__(self, config: TrainerConfig, args: argparse.Namespace) -> None:
        super().__init__(config)
        self.args = args

    def build_model(self) -> torch.nn.Module:
        if self.args.model == "mlp":
            return torch.nn.Sequential(MLP(), torch.nn.LogSoftmax(dim=1))
        batchnorm = self.args.batchnorm or self.args.sync_batchnorm
        model = LeNet(dropout=self.args.dropout, width=self.args.width, batchnorm=batchnorm)
        if self.args.channels_last:
            # NHWC convolutions and pooling: LeNet trains 1.3-1.7x faster on CPU this way.
            model = model.to(memory_format=torch.channels_last)
        return model

    def build_datasets(self):
        # Alike on every rank, so a bad or missing file is one error line, not one per rank.
        run_alike(self._download_on_local_rank_0)
        train_set, test_set = run_alike(self._load)
        ddptrain.print0(describe_data(self.args.dataset, train_set, test_set))
        return train_set, test_set

    def _download_on_local_rank_0(self) -> None:
        if self.args.dataset != "mnist" or self.info.local_rank != 0:
            return
        root = self.args.data_dir or DEFAULT_DATA_DIR
        try:
            download_mnist(root, [self.args.mirror] if self.args.mirror else None)
        except DownloadError as e:
            hint = _offline_hint(self.info.world_size, self.info.launcher, sys.argv[1:])
            raise DownloadError(f"{e}; {hint}") from None
        except FileNotFoundError:  # the folder holds Fashion-MNIST: nothing was written there
            raise FileNotFoundError(data_dir_error(self.args.dataset, self.args.data_dir)) from None

    def _load(self):
        # Debian's Fashion-MNIST stands in only for the default folder: a --data-dir the user
        # named must hold the data itself.
        explicit = self.args.data_dir is not None
        root = self.args.data_dir or DEFAULT_DATA_DIR
        try:
            if self.args.dataset == "mnist":
                return mnist(root, train=True), mnist(root, train=False)
            return (
                fashion_mnist(root, train=True, fallback=not explicit),
                fashion_mnist(root, train=False, fallback=not explicit),
            )
        except FileNotFoundError:
            raise FileNotFoundError(data_dir_error(self.args.dataset, self.args.data_dir)) from None

    def configure_optimizers(self, model: torch.nn.Module):
        opt = torch.optim.SGD(
            model.parameters(),
            lr=self.args.lr,
            momentum=self.args.momentum,
            weight_decay=self.args.weight_decay,
        )
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)

    def training_step(self, model, batch):
        x, y = batch
        return F.nll_loss(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        out = model(x)
        return {
            "loss": F.nll_loss(out, y, reduction="sum"),
            "accuracy": (out.argmax(1) == y).sum(),
        }


def describe_data(dataset: str, train_set, test_set) -> str:
    """The run's first line: which data, how much, and the folder it was read from."""
    train_dir, test_dir = (ds.paths[0].parent for ds in (train_set, test_set))
    train, test = f"train {len(train_set)}", f"test {len(test_set)}"
    if train_dir == test_dir:
        return f"data: {TITLES[dataset]} {train} / {test} from {train_dir}"
    return f"data: {TITLES[dataset]} {train} from {train_dir} / {test} from {test_dir}"


def data_dir_error(dataset: str, data_dir: str | None) -> str:
    """Why the data folder cannot serve `dataset` (what it holds instead), and what to do."""
    survey = survey_data_dir(data_dir or DEFAULT_DATA_DIR, dataset)
    where = f"--data-dir {survey}" if data_dir is not None else f"the default --data-dir {survey}"
    title = TITLES[dataset]
    # Offered only when the folder holds both of the other dataset's splits: it would train.
    other = next((key for key, name in TITLES.items() if name == survey.other), None)
    complete = other is not None and len(survey.other_splits) == 2
    use_other = f"train on it with --dataset {other}, or " if complete else ""
    if dataset == "mnist":
        return (
            f"{where}; {use_other}give MNIST a --data-dir of its own (missing files are "
            "downloaded into DIR/MNIST/raw/)"
        )
    if data_dir is not None:
        return (
            f"{where}; {use_other}point --data-dir at a folder holding {title}'s four IDX "
            f"files, or leave it out to read {DEFAULT_DATA_DIR}/ and then {DEBIAN_FASHION_MNIST}"
        )
    debian = survey_data_dir(DEBIAN_FASHION_MNIST, dataset)
    return (
        f"{title} not found: {where}, and {debian}; install Debian's copy (apt-get install -y "
        "dataset-fashion-mnist), or pass --data-dir DIR holding its four IDX files"
    )


def _offline_hint(world_size: int, launcher: str, flags: list[str]) -> str:
    """The same run on Fashion-MNIST: the user's flags kept, under the launcher they used."""
    kept, skip = [], False
    for flag in flags:
        if skip or flag == "--dataset" or flag.startswith("--dataset="):
            skip = flag == "--dataset"
            continue
        kept.append(flag)
    recipe = shlex.join([sys.argv[0], *kept, "--dataset", "fashion-mnist"])
    if launcher in ("torchrun", "single", "spawn"):
        launch = (
            f"torchrun --standalone --nproc_per_node={world_size}" if world_size > 1 else "python"
        )
        command = f"{launch} {recipe}"
    else:
        command = f"your {launcher} command with {recipe}"
    if DEBIAN_FASHION_MNIST.is_dir():
        return f"or train offline on Fashion-MNIST, installed here: {command}"
    install = "apt-get install -y dataset-fashion-mnist"
    return f"or train offline on Fashion-MNIST: {install}, then {command}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", choices=["mnist", "fashion-mnist"], default="mnist")
    p.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="folder with the IDX files (flat, raw/ or MNIST/raw/); missing MNIST files are "
        "downloaded into DIR/MNIST/raw/ unless DIR holds Fashion-MNIST (default: data/, and "
        f"for Fashion-MNIST then {DEBIAN_FASHION_MNIST})",
    )
    p.add_argument(
        "--mirror",
        default=os.environ.get("DDPTRAIN_MNIST_MIRROR"),
        help="base URL to download MNIST from (default: $DDPTRAIN_MNIST_MIRROR, else the "
        "standard mirrors)",
    )
    # The defaults are tuned for time to accuracy on a small CPU machine (docs/benchmarks.md):
    # Fashion-MNIST >= 91% in under 100 s at 2 ranks on 2 cores, MNIST ~99%.
    p.add_argument("--epochs", type=int, default=6)
    # Width 2 (20-40-100) with BatchNorm: the tutorial's 10-20-50 net tops out near 88% on
    # Fashion-MNIST; width 3 gains little in a short run and costs 1.6x the compute.
    p.add_argument(
        "--width", type=positive(int), default=2, help="LeNet width multiplier (1 = tutorial)"
    )
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--lr", type=positive(float), default=0.2)
    p.add_argument("--momentum", type=non_negative(float), default=0.9)
    p.add_argument("--weight-decay", type=non_negative(float), default=5e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument(
        "--resume", default=None, help="'auto' (latest valid in --checkpoint-dir) or a path"
    )
    p.add_argument("--log-dir", default=None, help="writes metrics.jsonl there (rank 0)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--comm-hook", choices=COMM_HOOKS, default="default")
    p.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=0)
    p.add_argument(
        "--batchnorm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="BatchNorm after each conv and the hidden layer (default: on)",
    )
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="LeNet's weights in NHWC layout (default: on, off with --zero-stage 1, whose "
        "flat shards need contiguous parameters)",
    )
    p.add_argument(
        "--sync-batchnorm", action="store_true", help="BatchNorm over the global batch (implies it)"
    )
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--dry-run", action="store_true", help="5 steps and one evaluation, for CI")
    p.add_argument("--target-acc", type=float, default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="tracebacks for errors (DDPTRAIN_DEBUG=1)")
    p.add_argument(
        "--profile-steps",
        nargs="+",
        default=None,
        metavar="A[:B]",
        help="trace optimizer steps A..B (A:B or A B) per rank into --log-dir",
    )
    p.add_argument("--tensorboard", action="store_true", help="also log to TensorBoard")
    p.add_argument(
        "--eval-every-steps", type=positive(int), default=None, help="default: each epoch"
    )
    # The benchmark's 16.8M-parameter MLP: little compute per gradient byte, so communication
    # shows in a timeline.
    p.add_argument("--model", choices=["lenet", "mlp"], default="lenet")
    args = p.parse_args(argv)
    args.profile_steps = _step_range(p, args.profile_steps)
    if args.channels_last is None:
        args.channels_last = args.zero_stage == 0
    elif args.channels_last and args.zero_stage:
        p.error(
            "--zero-stage 1 shards flat, contiguous parameters; drop --channels-last "
            "(--zero-stage 1 turns it off by default)"
        )
    return args


def _step_range(p: argparse.ArgumentParser, values: list[str] | None) -> tuple[int, int] | None:
    if values is None:
        return None
    parts = [v for value in values for v in value.split(":")]
    try:
        steps = [int(v) for v in parts]
    except ValueError:
        steps = []
    if len(steps) not in (1, 2):
        p.error(f"--profile-steps {' '.join(values)}: use A:B or A B (optimizer steps), e.g. 20:22")
    return steps[0], steps[-1]


def build_config(args: argparse.Namespace) -> TrainerConfig:
    """The TrainerConfig these flags describe (the bench builds its runs from it too)."""
    return TrainerConfig(
        global_batch_size=args.global_batch_size,
        epochs=args.epochs,
        max_steps=args.max_steps,
        seed=args.seed,
        precision=args.precision,
        comm_hook=args.comm_hook,
        zero_stage=args.zero_stage,
        sync_batchnorm=args.sync_batchnorm,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        log_dir=args.log_dir,
        log_every_steps=5 if args.dry_run else 50,
        eval_every_steps=args.eval_every_steps,
        progress_bar=False if args.no_progress else None,
        best_metric="eval_accuracy" if args.checkpoint_dir else None,
        profile_steps=args.profile_steps,
        loggers=("jsonl", "tensorboard") if args.tensorboard else ("jsonl",),
    )


def main(argv: list[str] | None = None) -> int:
    """1 flags -> 2 config -> 3 trainer (init, data, model, wrap, optimizer, resume, loop)."""
    args = parse_args(argv)
    if args.dry_run:
        # 5 steps even when a (small) data set has fewer batches per epoch.
        args.epochs, args.max_steps = 5, 5
    config = build_config(args)
    trainer = MNISTTrainer(config, args)
    summary = trainer.fit()
    accuracy = summary["eval"].get("eval_accuracy", float("nan"))
    ddptrain.print0(
        f"FINAL dataset={args.dataset} test_accuracy={accuracy:.4f} "
        f"epochs={summary['epoch']} steps={summary['step']} wall_s={summary['wall_s']:.1f} "
        f"samples_per_s={summary['samples_per_s']:.0f} world_size={summary['world_size']}"
    )
    if args.target_acc is not None and not accuracy >= args.target_acc:
        ddptrain.print0(f"test accuracy {accuracy:.4f} is below --target-acc {args.target_acc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))

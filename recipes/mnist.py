"""LeNet on MNIST (or Fashion-MNIST) with ddptrain: synchronous data-parallel SGD.

Usage:
    ddptrain-run --standalone --nproc_per_node=2 recipes/mnist.py   # downloads MNIST into data/
    python recipes/mnist.py --data-dir data                         # one process, same code path
    # offline machine: Debian ships Fashion-MNIST, a drop-in MNIST replacement
    apt-get install -y dataset-fashion-mnist
    ddptrain-run --standalone --nproc_per_node=2 recipes/mnist.py --dataset fashion-mnist
(ddptrain-run is torchrun ending a failed job with the workers' error line and exit code;
plain torchrun runs it the same.)

The first line printed says where the data was read from. Missing MNIST files are downloaded
into --data-dir/MNIST/raw/ by local rank 0 of each host (MD5-checked, written under a temporary
name and renamed once verified) while the other ranks wait, unless that folder holds
Fashion-MNIST. A --data-dir you name is read alone: Debian's Fashion-MNIST stands in only for
the default data/. --mirror URL (or DDPTRAIN_MNIST_MIRROR=URL) replaces the standard mirrors:
an https://, http:// or file:// folder holding the four .gz files.

Mistakes (flags, settings, data files, checkpoints) print one `error: ...` line and exit 2
(flags and settings) or 1; --debug (or DDPTRAIN_DEBUG=1) shows the traceback instead.
Log lines, the progress bar and the FINAL line number epochs from 1 (`step 470 epoch 2/6`).

Checkpoints, and continuing from the newest valid one after a restart:
    python recipes/mnist.py --checkpoint-dir ckpt --resume auto    # the same line each time
    ... --checkpoint-every-steps 100 --keep-last 5                 # every 100 steps, keep 5
    ... --checkpoint-every-minutes 10                              # and every 10 minutes
With --checkpoint-dir, SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 save the current step and exit with
status 76 (--preempt-signals chooses which); with --resume auto the same command then continues
from there.

python recipes/mnist.py --help lists every flag with its default.

The last line printed is a summary:
    FINAL dataset=mnist test_accuracy=0.99.. epoch=6/6 steps=1410 wall_s=.. samples_per_s=..
          world_size=2    (one line)
"""

import argparse
import os
import shlex
import sys
import textwrap
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import ddptrain
from ddptrain import cli
from ddptrain.cli import run_alike
from ddptrain.data.datasets import (
    DEBIAN_FASHION_MNIST,
    download_mnist,
    fashion_mnist,
    mnist,
    survey_data_dir,
)
from ddptrain.data.download import DownloadError
from ddptrain.flags import NON_NEGATIVE, POSITIVE, PROBABILITY, add_flags, from_flags, setting
from ddptrain.launch.report import under_ddptrain_run
from ddptrain.models import MLP, LeNet
from ddptrain.train.config import TrainerConfig
from ddptrain.train.trainer import Trainer

DEFAULT_DATA_DIR = "data"
MIRROR_ENV = "DDPTRAIN_MNIST_MIRROR"
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
            # NHWC convolutions and pooling train LeNet faster on CPU (docs/benchmarks.md).
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
        runner = "ddptrain-run" if under_ddptrain_run() else "torchrun"
        launch = (
            f"{runner} --standalone --nproc_per_node={world_size}" if world_size > 1 else "python"
        )
        command = f"{launch} {recipe}"
    else:
        command = f"your {launcher} command with {recipe}"
    if DEBIAN_FASHION_MNIST.is_dir():
        return f"or train offline on Fashion-MNIST, installed here: {command}"
    install = "apt-get install -y dataset-fashion-mnist"
    return f"or train offline on Fashion-MNIST: {install}, then {command}"


@dataclass(kw_only=True)
class MNISTSettings:
    """What is this recipe's own: the data and the model; every other flag is TrainerConfig's."""

    dataset: Literal["mnist", "fashion-mnist"] = setting(
        "mnist", "which data set to train and test on", group="data"
    )
    data_dir: str | None = setting(
        None,
        "folder with the IDX files (flat, raw/ or MNIST/raw/); missing MNIST files are "
        "downloaded into DIR/MNIST/raw/ unless DIR holds Fashion-MNIST",
        group="data",
        metavar="DIR",
        unset=f"{DEFAULT_DATA_DIR}/, and for Fashion-MNIST then {DEBIAN_FASHION_MNIST}",
    )
    mirror: str | None = setting(
        None,
        "base URL (https://, http:// or file://) of a folder holding MNIST's four .gz files",
        group="data",
        metavar="URL",
        unset=f"${MIRROR_ENV}, else the standard mirrors",
    )
    model: Literal["lenet", "mlp"] = setting(
        "lenet",
        "mlp: the benchmark's 16.8M-parameter MLP, which shows communication in a timeline",
        group="model",
    )
    # Width 2 with BatchNorm: the best time to accuracy (docs/benchmarks.md, "Costs the code is
    # shaped around").
    width: int = setting(
        2,
        "LeNet width multiplier; 1 with --dropout 0.5 --no-batchnorm is the tutorial's net",
        group="model",
        check=POSITIVE,
    )
    dropout: float = setting(0.1, "dropout probability", group="model", check=PROBABILITY)
    batchnorm: bool = setting(True, "BatchNorm after each conv and the hidden layer", group="model")
    channels_last: bool | None = setting(
        None,
        "LeNet's weights in NHWC layout, faster convolutions on CPU",
        group="model",
        unset="on, off with --zero-stage 1, whose flat shards need contiguous parameters",
    )
    lr: float = setting(
        0.2,
        "SGD learning rate, the start of a cosine schedule",
        group="optimizer",
        check=POSITIVE,
    )
    momentum: float = setting(0.9, "SGD momentum", group="optimizer", check=NON_NEGATIVE)
    weight_decay: float = setting(5e-4, "SGD weight decay", group="optimizer", check=NON_NEGATIVE)
    target_acc: float | None = setting(
        None,
        "exit with status 1 if the final test accuracy is below this, e.g. 0.99",
        group="run",
        metavar="ACC",
        unset="none",
    )
    dry_run: bool = setting(False, "5 steps and one evaluation, for CI", group="run")
    debug: bool = setting(
        False,
        f"show the traceback of a user error instead of one error: line; also {cli.DEBUG_ENV}=1",
        group="run",
    )


# What the flags are made from, so that an error about a setting names its flag.
SETTINGS = (MNISTSettings, TrainerConfig)
# The defaults are tuned for time to accuracy on a small CPU machine (docs/benchmarks.md, "Time
# to accuracy"): Fashion-MNIST >= 91% in under 100 s at 2 ranks on 2 cores, MNIST ~99%.
RECIPE_DEFAULTS = {"epochs": 6, "global_batch_size": 256, "seed": 1234}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; help lines wrapped, but never inside a path or flag."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    """The recipe's flags: its own settings, then every TrainerConfig field's."""
    p = cli.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    defaults = {**RECIPE_DEFAULTS, "mirror": os.environ.get(MIRROR_ENV)}
    add_flags(p, [MNISTSettings, TrainerConfig], defaults)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of `argv` (default: the command line), checked together."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.channels_last is None:
        args.channels_last = args.zero_stage != 1
    elif args.channels_last and args.zero_stage == 1:
        p.error(
            "--zero-stage 1 shards flat, contiguous parameters; drop --channels-last "
            "(--zero-stage 1 turns it off by default)"
        )
    if args.dry_run:
        # 5 steps even when a (small) data set has fewer batches per epoch.
        args.epochs, args.max_steps, args.log_every_steps = 5, 5, 5
    if args.checkpoint_dir and args.best_metric is None:
        args.best_metric = "eval_accuracy"
    return args


def build_config(args: argparse.Namespace) -> TrainerConfig:
    """The TrainerConfig these flags describe (the bench builds its runs from it too)."""
    return from_flags(TrainerConfig, args)


def main(argv: list[str] | None = None) -> int:
    """1 flags -> 2 config -> 3 trainer (init, data, model, wrap, optimizer, resume, loop)."""
    args = parse_args(argv)
    config = build_config(args)
    trainer = MNISTTrainer(config, args)
    summary = trainer.fit()
    accuracy = summary["eval"].get("eval_accuracy", float("nan"))
    ddptrain.print0(
        f"FINAL dataset={args.dataset} test_accuracy={accuracy:.4f} "
        f"epoch={summary['epoch']}/{config.epochs} steps={summary['step']} "
        f"wall_s={summary['wall_s']:.1f} "
        f"samples_per_s={summary['samples_per_s']:.0f} world_size={summary['world_size']}"
    )
    if args.target_acc is not None and not accuracy >= args.target_acc:
        ddptrain.print0(f"test accuracy {accuracy:.4f} is below --target-acc {args.target_acc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(main, settings=SETTINGS))

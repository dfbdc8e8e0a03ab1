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
status 76 (--preempt-signals chooses which); the same command then continues from there.

python recipes/mnist.py --help lists every flag with its default.

The last line printed is a summary:
    FINAL dataset=mnist test_accuracy=0.99.. epoch=6/6 steps=1410 wall_s=.. samples_per_s=..
          world_size=2    (one line)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap

import torch
import torch.nn.functional as F

import ddptrain
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
from ddptrain.launch.report import under_ddptrain_run
from ddptrain.models import MLP, LeNet
from ddptrain.train.config import COMM_HOOKS, PRECISIONS, ZERO_STAGES, TrainerConfig
from ddptrain.train.preempt import DEFAULT_PREEMPT_SIGNALS, signal_number
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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; help lines wrapped, but never inside a path or flag."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    """The recipe's flags, each with a help line that names its default."""
    p = ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument(
        "--dataset",
        choices=["mnist", "fashion-mnist"],
        default="mnist",
        help="which data set to train and test on (default: %(default)s)",
    )
    data.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="folder with the IDX files (flat, raw/ or MNIST/raw/); missing MNIST files are "
        "downloaded into DIR/MNIST/raw/ unless DIR holds Fashion-MNIST (default: data/, and "
        f"for Fashion-MNIST then {DEBIAN_FASHION_MNIST})",
    )
    data.add_argument(
        "--mirror",
        default=os.environ.get("DDPTRAIN_MNIST_MIRROR"),
        metavar="URL",
        help="base URL (https://, http:// or file://) of a folder holding MNIST's four .gz "
        "files (default: $DDPTRAIN_MNIST_MIRROR, else the standard mirrors)",
    )

    train = p.add_argument_group("training")
    # The defaults are tuned for time to accuracy on a small CPU machine (docs/benchmarks.md):
    # Fashion-MNIST >= 91% in under 100 s at 2 ranks on 2 cores, MNIST ~99%.
    train.add_argument(
        "--epochs",
        type=int,
        default=6,
        metavar="N",
        help="passes over the training set (default: %(default)s)",
    )
    train.add_argument(
        "--max-steps",
        type=int,
        default=None,
        metavar="N",
        help="stop after N optimizer steps (default: none, all the epochs)",
    )
    train.add_argument(
        "--global-batch-size",
        type=int,
        default=256,
        metavar="N",
        help="samples per optimizer step, split over the ranks (default: %(default)s)",
    )
    train.add_argument(
        "--lr",
        type=positive(float),
        default=0.2,
        help="SGD learning rate, the start of a cosine schedule (default: %(default)s)",
    )
    train.add_argument(
        "--momentum",
        type=non_negative(float),
        default=0.9,
        help="SGD momentum (default: %(default)s)",
    )
    train.add_argument(
        "--weight-decay",
        type=non_negative(float),
        default=5e-4,
        help="SGD weight decay (default: %(default)s)",
    )
    train.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="seed of the model, data order and dropout (default: %(default)s)",
    )
    train.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="bf16: autocast; fp16: autocast and GradScaler, CUDA only (default: %(default)s)",
    )
    train.add_argument(
        "--comm-hook",
        choices=COMM_HOOKS,
        default="default",
        metavar="HOOK",
        help=f"how gradients are averaged over ranks: {', '.join(COMM_HOOKS)} (default: "
        "%(default)s, the wrapper's choice for the device and hosts)",
    )
    train.add_argument(
        "--powersgd-rank",
        type=positive(int),
        default=TrainerConfig.powersgd_rank,
        metavar="R",
        help="--comm-hook powersgd: the rank each weight's gradient is compressed to "
        "(default: %(default)s)",
    )
    train.add_argument(
        "--powersgd-start-step",
        type=int,
        default=TrainerConfig.powersgd_start_step,
        metavar="N",
        help="--comm-hook powersgd: average the first N steps uncompressed, N >= 2 "
        "(default: %(default)s)",
    )
    train.add_argument(
        "--zero-stage",
        type=int,
        choices=ZERO_STAGES,
        default=0,
        help="shard across ranks: 1 the optimizer state (ZeRO-1), 2 the gradients too, 3 the "
        "parameters too (default: %(default)s)",
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="5 steps and one evaluation, for CI (default: off)",
    )

    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        choices=["lenet", "mlp"],
        default="lenet",
        help="mlp: the benchmark's 16.8M-parameter MLP, which shows communication in a "
        "timeline (default: %(default)s)",
    )
    # Width 2 (20-40-100) with BatchNorm: the tutorial's 10-20-50 net tops out near 88% on
    # Fashion-MNIST; width 3 gains little in a short run and costs 1.6x the compute.
    model.add_argument(
        "--width",
        type=positive(int),
        default=2,
        help="LeNet width multiplier; 1 with --dropout 0.5 --no-batchnorm is the tutorial's "
        "net (default: %(default)s)",
    )
    model.add_argument(
        "--dropout",
        type=probability,
        default=0.1,
        help="dropout probability (default: %(default)s)",
    )
    model.add_argument(
        "--batchnorm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="BatchNorm after each conv and the hidden layer (default: on)",
    )
    model.add_argument(
        "--sync-batchnorm",
        action="store_true",
        help="BatchNorm statistics over the global batch; implies --batchnorm (default: off)",
    )
    model.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="LeNet's weights in NHWC layout (default: on, off with --zero-stage 1, whose "
        "flat shards need contiguous parameters)",
    )

    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="write checkpoints there, keeping the best by test accuracy too (default: none, "
        "no checkpoints)",
    )
    ckpt.add_argument(
        "--checkpoint-every-steps",
        type=positive(int),
        default=None,
        metavar="N",
        help="checkpoint every N optimizer steps instead of at each epoch's end; one is "
        "always written at the end (default: each epoch)",
    )
    ckpt.add_argument(
        "--checkpoint-every-minutes",
        type=positive(float),
        default=None,
        metavar="M",
        help="also checkpoint when M minutes have passed since the last checkpoint (rank 0's "
        "clock decides for every rank) (default: none)",
    )
    ckpt.add_argument(
        "--preempt-signals",
        type=_signal_names,
        default=DEFAULT_PREEMPT_SIGNALS,
        metavar="SIG,...",
        help="with --checkpoint-dir, these signals save the current step and exit with status "
        "76; 'none' keeps their default action (default: "
        f"{','.join(DEFAULT_PREEMPT_SIGNALS)})",
    )
    ckpt.add_argument(
        "--keep-last",
        type=positive(int),
        default=None,
        metavar="K",
        help="keep the newest K checkpoints (and the best one), delete older ones "
        f"(default: {TrainerConfig.keep_last})",
    )
    ckpt.add_argument(
        "--resume",
        default=None,
        metavar="{auto,PATH}",
        help="auto: the newest valid checkpoint in --checkpoint-dir, moving newer invalid ones "
        "into its invalid/ subfolder, or a fresh start; or a checkpoint's path (default: "
        "none, a fresh start)",
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--eval-every-steps",
        type=positive(int),
        default=None,
        metavar="N",
        help="evaluate every N optimizer steps (default: at each epoch's end)",
    )
    out.add_argument(
        "--target-acc",
        type=float,
        default=None,
        metavar="ACC",
        help="exit with status 1 if the final test accuracy is below ACC, e.g. 0.99 (default: "
        "none)",
    )
    out.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="write metrics.jsonl there, rank 0; then python -m ddptrain.plot DIR -o "
        "curves.png (default: none)",
    )
    out.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard scalars into --log-dir (default: off)",
    )
    out.add_argument(
        "--profile-steps",
        nargs="+",
        default=None,
        metavar="A[:B]",
        help="trace optimizer steps A..B (A:B or A B) per rank into --log-dir (default: none)",
    )
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (default: a bar on an interactive terminal)",
    )
    out.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of a user error instead of one error: line; also "
        "DDPTRAIN_DEBUG=1 (default: off)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of `argv` (default: the command line), checked together."""
    p = build_parser()
    args = p.parse_args(argv)
    args.profile_steps = _step_range(p, args.profile_steps)
    if args.channels_last is None:
        args.channels_last = args.zero_stage != 1
    elif args.channels_last and args.zero_stage == 1:
        p.error(
            "--zero-stage 1 shards flat, contiguous parameters; drop --channels-last "
            "(--zero-stage 1 turns it off by default)"
        )
    given = [
        flag
        for flag, value in (
            ("--checkpoint-every-steps", args.checkpoint_every_steps),
            ("--checkpoint-every-minutes", args.checkpoint_every_minutes),
            ("--keep-last", args.keep_last),
        )
        if value is not None
    ]
    if given and not args.checkpoint_dir:
        verb = "apply" if len(given) > 1 else "applies"
        p.error(f"{' and '.join(given)} {verb} to checkpoints; add --checkpoint-dir DIR")
    if args.keep_last is None:
        args.keep_last = TrainerConfig.keep_last
    return args


def _signal_names(text: str) -> tuple[str, ...]:
    """`SIGTERM,SIGUSR1` (or `TERM,USR1`) as signal names; `none` for no signal."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(signal_number(name.strip()).name for name in text.split(",") if name.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
        powersgd_rank=args.powersgd_rank,
        powersgd_start_step=args.powersgd_start_step,
        zero_stage=args.zero_stage,
        sync_batchnorm=args.sync_batchnorm,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every_steps=args.checkpoint_every_steps,
        checkpoint_every_minutes=args.checkpoint_every_minutes,
        preempt_signals=args.preempt_signals,
        keep_last=args.keep_last,
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
        f"epoch={summary['epoch']}/{config.epochs} steps={summary['step']} "
        f"wall_s={summary['wall_s']:.1f} "
        f"samples_per_s={summary['samples_per_s']:.0f} world_size={summary['world_size']}"
    )
    if args.target_acc is not None and not accuracy >= args.target_acc:
        ddptrain.print0(f"test accuracy {accuracy:.4f} is below --target-acc {args.target_acc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))

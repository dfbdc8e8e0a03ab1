"""What a run shows: the start lines, log lines above a progress bar on rank 0, the records
it writes (train/metrics.py), and the traces of profile_steps.

    out = RunOutput(cfg, info, total_steps, step=0, resumed=False)
    out.window.add(loss, samples)                   # every step, every rank
    out.log_step(step, epoch, lr, total_steps)      # collective when due: one all_reduce
    out.log_eval(step, epoch, metrics)              # a line above the bar, a record
    out.progress.summary(...)                       # what fit() returns
    out.close()

`epoch` is the epoch the step belongs to, counted from 1: `step 470 epoch 2/6` is the last step
of the second of six epochs, in the lines, the bar, metrics.jsonl and the checkpoints alike.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from ddptrain import profiling
from ddptrain.dist import DistInfo, print0
from ddptrain.train.config import TrainerConfig
from ddptrain.train.metrics import LossWindow, Progress, open_logs


class RunOutput:
    """The Trainer's output, opened when its loop starts and closed when it ends."""

    def __init__(
        self, cfg: TrainerConfig, info: DistInfo, total_steps: int, step: int, resumed: bool
    ) -> None:
        self.cfg = cfg
        # A resumed run never re-saves the step it resumed from (that file exists).
        self.progress = Progress(
            LossWindow(info.device, exact=cfg.deterministic), step, step if resumed else -1
        )
        self.window = self.progress.window
        self._log = open_logs(cfg.loggers, cfg.log_dir) if info.is_main and cfg.log_dir else None
        if self._log:
            self._log.write(start_record(cfg, info, step))
        enabled = info.is_main and want_progress_bar(cfg.progress_bar)
        self.bar = ProgressBar(total_steps, step, enabled=enabled, epochs=cfg.epochs)
        trace_dir = cfg.log_dir or cfg.checkpoint_dir
        self.tracer = profiling.StepTracer(cfg.profile_steps, trace_dir, info.rank)
        if step < total_steps and profiling.range_missed(cfg.profile_steps, step + 1, total_steps):
            first, last = cfg.profile_steps
            print0(
                f"warning: profile_steps=({first}, {last}) lies outside the steps this run "
                f"takes ({step + 1}..{total_steps}): no trace will be written"
            )

    def log_step(
        self, step: int, epoch: int, lr: float, total_steps: int, force: bool = False
    ) -> None:
        """Every log_every_steps, at the last step, or when `force`d: report the window's mean
        loss and time split (collective) to the bar and the logs."""
        if not (step % self.cfg.log_every_steps == 0 or step == total_steps or force):
            return
        progress = self.progress
        progress.last_loss, samples_per_s, split = self.window.report()
        record = {
            "step": step,
            "epoch": epoch,
            "loss": progress.last_loss,
            "lr": lr,
            "samples_per_s": samples_per_s,
            "time_s": time.perf_counter() - progress.start,
            **split,
        }
        self.bar.update(step, record)
        if self._log:
            self._log.write(record)

    def log_eval(self, step: int, epoch: int, metrics: dict[str, Any]) -> None:
        """An evaluation's metrics: one line above the bar, one record in the logs."""
        if not metrics:
            return
        self.bar.print(f"step {step} epoch {epoch}/{self.cfg.epochs}: {format_metrics(metrics)}")
        if self._log:
            time_s = time.perf_counter() - self.progress.start
            self._log.write({"step": step, "epoch": epoch, **metrics, "time_s": time_s})

    def close(self) -> None:
        """Write the trace (if profiling) and close the bar and the logs."""
        self.tracer.close()
        self.bar.close()
        if self._log:
            self._log.close()


class ProgressBar:
    """A tqdm bar over optimizer steps: the epoch (of `epochs`), loss, samples/s, exposed comm
    share; off when disabled."""

    def __init__(self, total: int, initial: int, enabled: bool, epochs: int | None = None) -> None:
        self._epochs = epochs
        self._bar = (
            tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True) if enabled else None
        )

    def update(self, step: int, record: dict[str, Any]) -> None:
        """Move to `step` and show its epoch, the latest loss, throughput and exposed-communication
        share."""
        if self._bar is None:
            return
        if "epoch" in record:
            of = f"/{self._epochs}" if self._epochs else ""
            self._bar.set_description(f"epoch {record['epoch']}{of}", refresh=False)
        self._bar.update(step - self._bar.n)
        shown = {"loss": f"{record['loss']:.4f}", "samples_s": f"{record['samples_per_s']:.0f}"}
        if "comm_share" in record:
            shown["comm"] = f"{record['comm_share']:.0%}"
        self._bar.set_postfix(shown)

    def print(self, text: str) -> None:
        """Print a line on rank 0 above the bar, which stays whole below it."""
        if self._bar is None:
            print0(text)
        else:
            self._bar.write(text)

    def close(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()


def describe_run(
    cfg: Any,
    info: Any,
    sampler: Any,
    model: Any,
    total_steps: int,
    resumed_at: int | None,
    epoch_steps: int | None = None,
) -> str:
    """What fit() prints before its first step, in short lines: who runs (launcher, world size,
    backend, device, precision), the batch split, the steps, the buckets. `epoch_steps`: the
    optimizer steps its epochs make (build.epoch_steps), to tell when max_steps cuts in."""
    buckets = ", ".join(f"{b / 2**20:.2f}" for b in model.bucket_sizes_bytes)
    accumulation = cfg.accumulation(info.world_size)
    per_rank = cfg.round_size(info.world_size) // info.world_size
    # No sampler: each rank reads its own part of an IterableDataset (train/epochs.py).
    # `is not None`: a sampler resumed at an epoch's end has no batches left, so len() is 0.
    batches = sampler.batches_per_epoch if sampler is not None else None
    epoch = f"{batches} micro-batches" if batches is not None else "uneven per-rank parts"
    epochs = f"{cfg.epochs} epoch(s)"
    if epoch_steps is not None and total_steps < epoch_steps:
        # A --dry-run or --max-steps run stops early: say so rather than promise every epoch.
        epochs = f"max_steps={cfg.max_steps} ends it within {epochs}"
    resumed = "" if resumed_at is None else f", resumed at step {resumed_at}"
    return "\n".join(
        [
            f"ddptrain: launcher={info.launcher} world_size={info.world_size} "
            f"backend={info.backend} device={info.device} precision={cfg.precision}",
            f"  global_batch_size={cfg.global_batch_size} = {info.world_size} ranks x "
            f"{per_rank} per rank x {accumulation} accumulation step(s)",
            f"  {total_steps} optimizer steps ({epochs} of {epoch}{resumed})",
            f"  buckets (MiB, launch order): [{buckets}]",
        ]
        + ["  deterministic: the same bits at any world size that divides the micro-batches"]
        * cfg.deterministic
    )


def start_record(cfg: Any, info: Any, step: int) -> dict[str, Any]:
    """A run's first log record: what a plot's legend needs to tell runs apart."""
    return {
        "event": "start",
        "step": step,
        "time_s": 0.0,
        "world_size": info.world_size,
        "backend": info.backend,
        "precision": cfg.precision,
        "comm_hook": cfg.comm_hook,
        "global_batch_size": cfg.global_batch_size,
        "grad_accum_steps": cfg.grad_accum_steps,
    }


def format_metrics(metrics: dict[str, float]) -> str:
    """`name=value, ...` as printed after an evaluation: counts whole, the rest to 4 places."""
    return ", ".join(
        f"{k}={v}" if isinstance(v, int) else f"{k}={v:.4f}" for k, v in metrics.items()
    )


def want_progress_bar(setting: bool | None) -> bool:
    """TrainerConfig.progress_bar, where None means: only when stderr is a terminal."""
    return setting if setting is not None else sys.stderr.isatty()

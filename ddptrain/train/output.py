"""What a run shows and writes: the start line, the progress bar and metrics.jsonl/TensorBoard
on rank 0, the loss window every rank keeps, and the traces of profile_steps.

    out = RunOutput(cfg, info, total_steps, step=0, resumed=False)
    out.window.add(loss, samples)                   # every step, every rank
    out.log_step(step, epoch, lr, total_steps)      # collective when due: one all_reduce
    out.log_eval(step, epoch, metrics)              # a line above the bar, a record

`epoch` is the epoch the step belongs to, counted from 1: `step 470 epoch 2/6` is the last step
of the second of six epochs, in the lines, the bar, metrics.jsonl and the checkpoints alike.
    out.progress.summary(...)                       # what fit() returns
    out.close()
"""

from __future__ import annotations

import time
from typing import Any

from ddptrain import profiling
from ddptrain.dist import DistInfo, print0
from ddptrain.train.config import TrainerConfig
from ddptrain.train.log import (
    LossWindow,
    Progress,
    ProgressBar,
    format_metrics,
    open_logs,
    start_record,
    want_progress_bar,
)


class RunOutput:
    """The Trainer's output, opened when its loop starts and closed when it ends."""

    def __init__(
        self, cfg: TrainerConfig, info: DistInfo, total_steps: int, step: int, resumed: bool
    ) -> None:
        self.cfg = cfg
        # A resumed run never re-saves the step it resumed from (that file exists).
        self.progress = Progress(LossWindow(info.device), step, step if resumed else -1)
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

"""What a run records: a JSON-lines metrics file and TensorBoard (rank 0), the loss window
and time split they report (every rank), and the run's progress that fit() sums up.

log = MetricsLog("runs/mnist")        # appends to runs/mnist/metrics.jsonl
log.write({"step": 10, "loss": 0.31})
log = open_logs(("jsonl", "tensorboard"), "runs/mnist")   # both, the same records
window = LossWindow(device)            # every rank: window.add(loss, samples) each step, and
window.times.add("comm_s", 0.002)      # the step's time split (StepTimes, below), then
mean_loss, samples_per_s, split = window.report()   # at a log step (a collective)
# read back: [json.loads(line) for line in open("runs/mnist/metrics.jsonl")]
# tensorboard --logdir runs    (needs the tensorboard package: pip install 'ddptrain[tensorboard]')
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.paths import make_dir

LOGGERS = ("jsonl", "tensorboard")
TENSORBOARD_HINT = (
    "loggers=('tensorboard',) needs the tensorboard package: pip install 'ddptrain[tensorboard]' "
    "(or: pip install tensorboard)"
)


class LogDirError(OSError):
    """log_dir cannot be created; the message names it."""


class MetricsLog:
    """Append-only JSON lines, one record per line, flushed at once so other tools can tail it."""

    def __init__(self, directory: str | os.PathLike) -> None:
        folder = make_dir(directory, "log_dir", LogDirError, "choose a log_dir you can write to")
        self.path = folder / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if not _ends_a_line(self.path):
            # A run killed mid-write left half a record: end it, or ours would be glued onto it
            # and both lost to a reader (plot skips the one bad line and keeps the rest).
            self._file.write("\n")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        # Strict JSON (NaN and inf as null): other readers (jq, JavaScript) reject NaN.
        self._file.write(json.dumps(_finite_or_null(record), sort_keys=True, allow_nan=False))
        self._file.write("\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def _finite_or_null(record: dict[str, Any]) -> dict[str, Any]:
    """The record with each non-finite float value replaced by None."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


def _ends_a_line(path: Path) -> bool:
    """Whether the file is empty or its last byte is a newline."""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class TensorBoardLog:
    """The same records as TensorBoard scalars: one tag per numeric field, x = the step."""

    def __init__(self, directory: str | os.PathLike) -> None:
        if not tensorboard_installed():
            raise ImportError(TENSORBOARD_HINT)
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(directory))

    def write(self, record: dict[str, Any]) -> None:
        """Add each numeric field (step and epoch aside) as a scalar at the record's step."""
        if "step" not in record or record.get("event"):
            return
        for name, value in record.items():
            if name in ("step", "epoch") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                self._writer.add_scalar(name, value, global_step=record["step"])
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class Logs:
    """Several logs written alike."""

    def __init__(self, logs: list[Any]) -> None:
        self._logs = logs

    def write(self, record: dict[str, Any]) -> None:
        """Write the record to every log."""
        for log in self._logs:
            log.write(record)

    def close(self) -> None:
        """Close every log."""
        for log in self._logs:
            log.close()


def open_logs(names: tuple[str, ...], directory: str | os.PathLike) -> Logs:
    """Open the named logs ("jsonl", "tensorboard") in `directory`."""
    kinds = {"jsonl": MetricsLog, "tensorboard": TensorBoardLog}
    return Logs([kinds[name](directory) for name in names])


def tensorboard_installed() -> bool:
    """Whether torch.utils.tensorboard can be imported (it needs the tensorboard package)."""
    return importlib.util.find_spec("tensorboard") is not None


class LossWindow:
    """Loss, samples and time split of the steps since the last log line, on every rank.
    `exact`: each step adds its micro-batches' losses, and the mean is taken over every
    rank's in micro-batch order (the deterministic mode: the same bits at any world size)."""

    def __init__(self, device: torch.device, exact: bool = False) -> None:
        self.loss = torch.zeros((), device=device)
        self.exact = exact
        self._losses: list[torch.Tensor] = []
        self.steps = 0
        self.samples = 0
        self.start = time.perf_counter()
        self.times = StepTimes()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """Add one optimizer step: its summed local loss (exact: this rank's micro-batch
        losses, one each) and this rank's sample count."""
        if self.exact:
            self._losses.append(loss.detach().double().reshape(-1))
        else:
            self.loss += loss
        self.steps += 1
        self.samples += samples

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time inside out of samples per second (evaluation, saving: not training)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began

    def report(self) -> tuple[float, float, dict[str, float]]:
        """Collective (one all_reduce; exact: and one all_gather): (mean loss per step over
        every rank's steps, samples per second over every rank, time split per step); then a
        new window starts. Ranks may have taken different numbers of steps (uneven data)."""
        counts = torch.tensor(
            [self.steps, self.samples, *self.times.values()],
            dtype=torch.float64,
            device=self.loss.device,
        )
        sums = torch.cat([self.loss.detach().reshape(1).double(), counts])
        if dist.get_world_size() > 1:
            dist.all_reduce(sums)
        loss, steps, samples, *times = sums.tolist()
        if self.exact:
            loss, steps = self._exact_mean_loss(), self.steps
        samples_per_s = samples / max(time.perf_counter() - self.start, 1e-9)
        self.start, self.steps, self.samples = time.perf_counter(), 0, 0
        self.loss.zero_()
        self.times.reset()
        return loss / max(steps, 1), samples_per_s, split_record(times, int(steps))

    def _exact_mean_loss(self) -> float:
        """The window's sum of per-step mean losses, each over every rank's micro-batches added
        in micro-batch order (rank r's j-th is j * world_size + r), the same at any world
        size. Every rank takes every step here."""
        if not self._losses:
            return 0.0
        mine = torch.stack(self._losses)  # [steps, micro-batches of this rank]
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        if world_size > 1:
            dist.all_gather(everyone, mine)
        else:
            everyone = [mine]
        ordered = torch.stack(everyone, dim=2).reshape(mine.shape[0], -1)
        self._losses = []
        total = 0.0
        for step in ordered.tolist():
            step_sum = 0.0
            for value in step:
                step_sum += value
            total += step_sum / len(step)
        return total


@dataclass
class Progress:
    """What the loop carries between steps: the log window, the latest metrics, what is done."""

    window: LossWindow
    first_step: int
    saved_at: int
    evaluated_at: int = -1
    metrics: dict[str, float] = field(default_factory=dict)
    last_loss: float = math.nan
    start: float = field(default_factory=time.perf_counter)

    def summary(self, step: int, epoch: int, global_batch: int, world_size: int) -> dict[str, Any]:
        """What fit() returns: throughput since this run (or resume) started, latest metrics."""
        wall_s = time.perf_counter() - self.start
        trained = (step - self.first_step) * global_batch
        return {
            "samples_per_s": trained / max(wall_s, 1e-9),
            "step": step,
            "epoch": epoch,
            "train_loss": self.last_loss,
            "eval": self.metrics,
            "wall_s": wall_s,
            "world_size": world_size,
        }


# ----------------------------------------------------------------------------- time split
# Where a step's time goes: wall-clock marks summed over a log window (Tstep = Tcomp + Tsync).
#
#     times = StepTimes()
#     times.add("data_s", 0.001); times.add("step_s", 0.010)      # per step, on each rank
#     record.update(split_record(times.values(), steps=10))      # means per step, comm share
#
# Phases: data_s (next batch, moved to the device), compute_s (forward + backward, minus the
# wait below), comm_s (the wrapper's wait for buckets after autograd is done: communication
# that overlap did not hide), optim_s (unscale, clip or norm, optimizer step), step_s (the
# whole step). They are host times: on CUDA, kernels still queued are not counted.
PHASES = ("data_s", "compute_s", "comm_s", "optim_s", "step_s")


class StepTimes:
    """Seconds per phase, summed since the last reset."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(PHASES, 0.0)

    def add(self, phase: str, seconds: float) -> None:
        """Add `seconds` to `phase`."""
        self.sums[phase] += seconds

    def values(self) -> list[float]:
        """The sums in PHASES order."""
        return [self.sums[p] for p in PHASES]

    def reset(self) -> None:
        """Start a new window."""
        self.sums = dict.fromkeys(PHASES, 0.0)


def split_record(sums: list[float], steps: int) -> dict[str, float]:
    """Per-step means of the phase sums over `steps` steps, and comm_s's share of step_s."""
    means = {p: s / max(steps, 1) for p, s in zip(PHASES, sums, strict=True)}
    means["comm_share"] = means["comm_s"] / means["step_s"] if means["step_s"] > 0 else 0.0
    return means

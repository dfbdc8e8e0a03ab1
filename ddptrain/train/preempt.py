"""Stopping on a signal (or a lost launcher) at a step boundary, having saved that step.

    boundary = Boundary(cfg, info)
    with boundary.stop.catching(boundary.signals):     # the handlers only record
        ...                                            # each step, on every rank:
        boundary.ride(model, lockstep=True)            # before the synchronized backward
        ...                                            # forward, backward, optimizer
        agreed = boundary.agree()                      # None, or what every rank wants
        if agreed: save                                # every rank; rank 0 writes
        if agreed and agreed.stop:                     # a SystemExit with the code:
            raise boundary.stopped(agreed, step, saved_here=True)

Why at a step boundary: a rank cannot save alone (rank 0 writes what every rank holds, and
every rank must stop at the same step, or the others wait in a collective for it). A handler
that did more than record could run in the middle of a collective or of the save itself; a
second SIGINT cannot abort a save half-way, since Python's KeyboardInterrupt is not raised while
these handlers are installed. Every rank learns at the next boundary whether any rank wants to
stop (or rank 0 wants a timed checkpoint): the value rides the step's gradient reduction
through the DDP wrapper's one extension point (`model.reducer.carry`, no collective of its
own); the sharded wrapper, and epochs whose ranks do not step together, cost one small
all_reduce per step instead. Only when some rank wants something do the ranks exchange why
(one all_gather_object).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.dist import DistInfo, print0
from ddptrain.launch import report
from ddptrain.train.health import LOST_RANK_EXIT_CODE

# Saved and stopped on a signal: run the same command again to resume. Distinct from the
# launcher's and the shell's codes (1, 2, 130: ddptrain.cli) and from a lost rank's (75).
PREEMPTED_EXIT_CODE = 76
# SIGUSR1: what SLURM's --signal sends before a time limit; SIGTERM: preemption, torchrun's
# forwarding, `docker stop`, Kubernetes; SIGINT: Ctrl-C.
DEFAULT_PREEMPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class Preempted(SystemExit):
    """fit() saved and stopped at a step boundary on a signal or a lost launcher; unless
    caught, the process exits with `code` (PREEMPTED_EXIT_CODE or LOST_RANK_EXIT_CODE)."""

    def __init__(self, code: int, step: int, message: str) -> None:
        super().__init__(code)
        self.step, self.message = step, message

    def __str__(self) -> str:
        return self.message


def signal_number(name: str) -> signal.Signals:
    """The signal called `name` ("SIGTERM" or "TERM"); ValueError naming the choices if none."""
    key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(
            f"unknown signal {name!r}; use names such as SIGTERM, SIGINT, SIGUSR1"
        ) from None


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on at a boundary: save now; and stop, why, with which code."""

    stop: bool
    exit_code: int
    reasons: dict[str, list[int]]  # why -> the ranks it happened on

    def describe(self) -> str:
        """`SIGTERM (ranks 0, 1); its torchrun agent is gone (rank 2)`."""
        return "; ".join(
            f"{why} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
            for why, ranks in self.reasons.items()
        )

    def message(self, step: int, saved: str, resumes: bool = True) -> str:
        """The line rank 0 prints as every rank stops at `step`, having `saved` (a phrase);
        `resumes`: the run's own command resumes (resume='auto')."""
        again = (
            "Run the same command again to continue from there."
            if resumes
            else "Run it again with resume='auto' (--resume auto) to continue from there."
        )
        return (
            f"ddptrain: stopped at step {step} on {self.describe()}: {saved}; exiting with code "
            f"{self.exit_code}. {again}"
        )


class StopRequest:
    """This rank's wish to stop (a signal, a lost launcher) and the boundary agreement."""

    def __init__(self) -> None:
        self._why: str | None = None
        self._code = 0
        self._lock = threading.Lock()

    @property
    def requested(self) -> bool:
        """Whether this rank wants to stop."""
        return self._why is not None

    def request(self, why: str, exit_code: int) -> None:
        """Ask to stop (a handler, the heartbeat thread); the first reason is kept, except that
        a lost launcher outranks a signal (its exit code asks for a restart)."""
        with self._lock:
            if self._why is None or (exit_code == LOST_RANK_EXIT_CODE != self._code):
                self._why, self._code = why, exit_code

    def launcher_lost(self, why: str) -> None:
        """The heartbeat's callback: this rank's launcher or its store is gone."""
        self.request(why, LOST_RANK_EXIT_CODE)

    @contextlib.contextmanager
    def catching(self, names: Sequence[str]) -> Iterator[None]:
        """Record the signals `names` (instead of their default action) while inside; only the
        main thread can install handlers, so elsewhere the defaults stay."""
        if not names or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}
        try:
            for name in names:
                number = signal_number(name)
                previous[number] = signal.signal(number, self._on_signal)
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _on_signal(self, number: int, frame: Any) -> None:
        self.request(signal.Signals(number).name, PREEMPTED_EXIT_CODE)

    def wanted(self, save_due: bool = False) -> int:
        """This rank's value for the next boundary: 1 to stop or to save (rank 0's clock)."""
        return int(self.requested or save_due)

    def agree(self, info: DistInfo, carried: int | None, save_due: bool = False) -> Agreed | None:
        """Collective at a boundary: None when no rank wants anything, else what they agreed.

        `carried`: the sum over ranks of `wanted()` that the step's reduction carried (the
        DDP reducer's `carried`); None runs one small all_reduce of `wanted(save_due)` instead."""
        total = carried
        if total is None:
            total = self.wanted(save_due)
            if info.world_size > 1:
                flag = torch.tensor([total], device=info.device)
                dist.all_reduce(flag)
                total = int(flag.item())
        if total == 0:
            return None
        everyone: list[Any] = [(self._why, self._code)]
        if info.world_size > 1:
            everyone = [None] * info.world_size
            dist.all_gather_object(everyone, (self._why, self._code))
        reasons: dict[str, list[int]] = {}
        for rank, (why, _) in enumerate(everyone):
            if why is not None:
                reasons.setdefault(why, []).append(rank)
        codes = {code for why, code in everyone if why is not None}
        exit_code = LOST_RANK_EXIT_CODE if LOST_RANK_EXIT_CODE in codes else PREEMPTED_EXIT_CODE
        return Agreed(stop=bool(reasons), exit_code=exit_code, reasons=reasons)


class Boundary:
    """The Trainer's step boundaries: where every rank learns whether any wants to stop, or
    rank 0's clock a timed save; enabled only where a checkpoint can be written."""

    def __init__(self, cfg: Any, info: DistInfo) -> None:
        self.info = info
        self.resumes = cfg.resume == "auto"
        self.stop = StopRequest()
        self.enabled = bool(cfg.checkpoint_dir) and bool(
            cfg.preempt_signals or cfg.checkpoint_every_minutes
        )
        self.signals = tuple(cfg.preempt_signals) if self.enabled else ()
        self._minutes = cfg.checkpoint_every_minutes
        # The last save: rank 0's clock times checkpoint_every_minutes from it (or the start).
        self._saved_time, self._saved_path, self._save_s = time.monotonic(), None, 0.0
        # The DDP reducer this step's value rides on (ride), until agree reads its sum.
        self._riding: Any = None

    def on_launcher_lost(self) -> Any:
        """The heartbeat's callback when this rank's launcher is gone (None: stop at once)."""
        return self.stop.launcher_lost if self.enabled else None

    def save_due(self) -> bool:
        """Rank 0's clock: checkpoint_every_minutes have passed since the last save."""
        if not self._minutes or not self.info.is_main:
            return False
        return time.monotonic() - self._saved_time >= 60 * self._minutes

    def ride(self, model: Any, lockstep: bool) -> None:
        """Before a step's synchronized backward: this rank's value rides its reduction when
        the model is the DDP wrapper and every rank takes the step (lockstep); else the
        boundary asks with a small all_reduce. As late as possible: a signal that arrives
        after this waits one more step."""
        reducer = getattr(model, "reducer", None)
        self._riding = reducer if self.enabled and lockstep and hasattr(reducer, "carry") else None
        if self._riding is not None:
            self._riding.carry(self.stop.wanted(self.save_due()))

    def agree(self) -> Agreed | None:
        """Collective at a step boundary: None when no rank wants anything, else what they
        agreed (from what rode the step's reduction, or one small all_reduce)."""
        carried = self._riding.carried if self._riding is not None else None
        self._riding = None
        return self.stop.agree(self.info, carried, self.save_due())

    def saved(self, path: Any, seconds: float) -> None:
        """A checkpoint was written (rank 0 knows its path) in `seconds`."""
        self._saved_time, self._saved_path, self._save_s = time.monotonic(), path, seconds

    def stopped(self, agreed: Agreed, step: int, saved_here: bool) -> Preempted:
        """The Preempted to raise as every rank stops at `step`; rank 0 prints why, once."""
        saved = (
            f"saved {self._saved_path or f'step {step}'} in {self._save_s:.2f} s"
            if saved_here
            else "nothing new to save"
        )
        message = agreed.message(step, saved, self.resumes)
        print0(message, file=sys.stderr)
        # Every rank: ddptrain-run exits with this code, and adds nothing to rank 0's line.
        report.worker_exit(agreed.exit_code)
        return Preempted(agreed.exit_code, step, message)

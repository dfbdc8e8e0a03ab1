"""Named spans for torch.profiler traces, free when no trace is being taken.

    from ddptrain import profiling
    with profiling.mark("ddptrain.wait bucket", 3):     # a no-op unless marks are on
        work.wait()

    with profiling.trace("runs/x/trace-rank0.json"):     # marks on, every thread profiled
        train_some_steps()                               # -> a Chrome trace (Perfetto opens it)

    tracer = StepTracer((5, 7), "runs/x", rank)           # what TrainerConfig.profile_steps does
    tracer.before_step(step + 1); ...; tracer.after_step(step + 1)

Marks are free while no trace is taken (`ddptrain.ddp.spans` says why). The profiler
records every thread, so a bucket's reduction on the wrapper's communication thread shows up
beside the backward pass that it overlaps.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from ddptrain.ddp import spans
from ddptrain.ddp.spans import span as mark

__all__ = ["StepTracer", "mark", "marks_on", "range_missed", "trace", "trace_path"]


@contextlib.contextmanager
def marks_on() -> Iterator[None]:
    """Turn marks on for a profiler you run yourself (torch.profiler.profile)."""
    previous, spans.tracing = spans.tracing, True
    try:
        yield
    finally:
        spans.tracing = previous


def _profiler() -> profile:
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    # Without profile_all_threads, spans on the shared-memory worker thread are dropped.
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    return profile(activities=activities, experimental_config=config)


@contextlib.contextmanager
def trace(path: str | os.PathLike) -> Iterator[profile]:
    """Profile the block on every thread with marks on; write a Chrome trace to `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with _profiler() as prof, marks_on():
        yield prof
    prof.export_chrome_trace(str(path))


def trace_path(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank`'s trace of profile_steps goes."""
    return Path(directory) / f"trace-rank{rank}.json"


def range_missed(steps: tuple[int, int] | None, first: int, last: int) -> bool:
    """Whether profile_steps asks for steps and none of them is among first..last (this run's)."""
    return steps is not None and (steps[0] > last or steps[1] < first)


class StepTracer:
    """Profiles optimizer steps first..last (numbered from 1, as in the log) on every rank."""

    def __init__(
        self, steps: tuple[int, int] | None, directory: str | os.PathLike | None, rank: int
    ):
        self.steps = steps
        # No directory only when nothing is profiled (TrainerConfig refuses the rest).
        self.path = trace_path(directory, rank) if directory is not None else None
        self._prof: profile | None = None
        self._was_active = False
        self._done = False

    def before_step(self, step: int) -> None:
        """Start profiling at the first step (about to run) in the range: its first, or the
        step a run resumed inside it starts with."""
        if self.steps is None or self.path is None or self._prof is not None or self._done:
            return
        if not self.steps[0] <= step <= self.steps[1]:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof = _profiler()
        self._prof.start()
        self._was_active, spans.tracing = spans.tracing, True
        # Ranks start their profilers at different moments; meeting here keeps that skew out
        # of the first profiled step's wait for buckets.
        if dist.is_initialized():
            dist.barrier()

    def after_step(self, step: int) -> None:
        """Stop and write the trace once `step` (just run) is the last profiled step."""
        if self._prof is not None and self.steps is not None and step >= self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop and write the trace if profiling (the loop may end before the last step)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        self._done = True
        spans.tracing = self._was_active
        prof.stop()
        prof.export_chrome_trace(str(self.path))

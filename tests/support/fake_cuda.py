"""A stand-in for torch.cuda on a CPU: what the planner's CUDA meter calls, with CUDA's rules.

    cuda = FakeCuda(peak_bytes=123)
    meter = CudaMeter(cuda)          # ddptrain/plan/meter.py, driven on CPU tensors
    cuda.calls                       # ["synchronize", "record", ...] in order
    FakeCuda(clock=ticks())          # each event 1 ms after the last: timings exact

The CPU runs each operation before returning, so an event's device time is the host clock when
it was recorded (or a tick clock's next value). As on CUDA, an event's elapsed_time may be read
only once a synchronize has followed its record (torch raises "Both events must be completed"
otherwise), and only events made with enable_timing=True can be timed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable


def ticks(seconds: float = 1e-3) -> Callable[[], float]:
    """A clock that advances `seconds` at each reading: every step of a loop that records the
    same events takes the same time, whatever the machine's load."""
    counter = itertools.count()
    return lambda: next(counter) * seconds


class FakeCuda:
    """torch.cuda's synchronize, Event and memory statistics, for a CPU process."""

    def __init__(
        self,
        peak_bytes: int = 0,
        allocated_bytes: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.calls: list[str] = []
        self.peak = peak_bytes
        self.allocated = allocated_bytes
        self.synced_at = 0  # events recorded before this count are complete
        self.recorded = 0
        self.reset_since_peak = False
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.timing = enable_timing
                self.index: int | None = None
                self.at = 0.0

            def record(self) -> None:
                cuda.calls.append("record")
                cuda.recorded += 1
                self.index, self.at = cuda.recorded, clock()

            def elapsed_time(self, end: Event) -> float:
                for e in (self, end):
                    if not e.timing or e.index is None or e.index > cuda.synced_at:
                        raise RuntimeError("Both events must be completed before elapsed_time")
                return (end.at - self.at) * 1e3

        self.Event = Event

    def synchronize(self) -> None:
        self.calls.append("synchronize")
        self.synced_at = self.recorded

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.reset_since_peak = True

    def max_memory_allocated(self) -> int:
        self.calls.append("max_memory_allocated")
        if not self.reset_since_peak:
            raise AssertionError("the peak was read without a reset before the step")
        return self.peak

    def memory_allocated(self) -> int:
        self.calls.append("memory_allocated")
        return self.allocated


def measure_with_fake_cuda(
    setups: list[dict], peak_bytes: int, allocated_bytes: int, min_timed_s: float = 0.0
) -> list[tuple[dict, list[str]]]:
    """In a spawned rank: each setup's profile fields measured by the CUDA meter over a
    FakeCuda on a tick clock (so the load of the machine does not move the spans), timing
    steps for `min_timed_s` of wall time, with the calls it made."""
    from ddptrain.plan.meter import CudaMeter
    from ddptrain.plan.profile import measure
    from ddptrain.plan.setup import Setup

    out = []
    for setup in setups:
        cuda = FakeCuda(peak_bytes, allocated_bytes, clock=ticks())
        out.append((measure(Setup(**setup), CudaMeter(cuda), min_timed_s), cuda.calls))
    return out

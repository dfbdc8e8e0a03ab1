"""How the planner times a step and takes its peak memory, on a CPU or a CUDA device.

    meter = meter_for("cuda")        # or "cpu"; CudaMeter(cuda=stand_in) in tests
    meter.start()                    # a step begins
    at = meter.stamp()               # anywhere in the step, on any thread (a hook's)
    meter.finish()                   # the step's work is done
    meter.seconds(at)                # seconds from start() to the stamp
    meter.reset_peak(); ...; meter.peak_bytes(); meter.allocated_bytes()

CPU: a stamp is the CPU clock of the thread that called start() (autograd runs a CPU backward
on it), so other programs' load inflates it less than wall time; `own_stamp` is the calling
thread's own CPU clock (a comm hook's own seconds). Memory is the process's RSS: the kernel's
high-water mark (VmHWM), reset through /proc/self/clear_refs.

CUDA: a stamp is an event recorded on the calling thread's current stream, so it marks when the
device has done the work launched before it (autograd's device thread records on the forward's
stream); nothing waits at a stamp. start() waits for the device to be idle and records the
origin; finish() synchronizes, after which the events can be read. A step's seconds are thus
the device's timeline, host launch gaps included. Memory is what torch's caching allocator
handed out (max_memory_allocated after reset_peak_memory_stats): the CUDA context, the
allocator's cached but free blocks and NCCL's own buffers are not in it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from ddptrain.bench.memory import reset_peak_rss, status_field

DEVICES = ("cpu", "cuda")


class Meter(Protocol):
    """A step's clock and the process's peak memory on one device (the module docstring)."""

    device: str

    def start(self) -> None: ...
    def stamp(self) -> Any: ...
    def own_stamp(self) -> Any: ...
    def finish(self) -> None: ...
    def seconds(self, stamp: Any) -> float: ...
    def sync(self) -> None: ...
    def reset_peak(self) -> bool: ...
    def peak_bytes(self) -> int: ...
    def allocated_bytes(self) -> int: ...


class CpuMeter:
    """CPU seconds of the step's thread; peak RSS."""

    device = "cpu"

    def __init__(self) -> None:
        self._clock = time.pthread_getcpuclockid(threading.get_ident())
        self._origin = 0.0
        self._reset = False

    def start(self) -> None:
        self._clock = time.pthread_getcpuclockid(threading.get_ident())
        self._origin = time.clock_gettime(self._clock)

    def stamp(self) -> float:
        return time.clock_gettime(self._clock)

    def own_stamp(self) -> float:
        return time.thread_time()

    def finish(self) -> None:
        pass

    def seconds(self, stamp: float) -> float:
        return stamp - self._origin

    def sync(self) -> None:
        pass

    def reset_peak(self) -> bool:
        self._reset = reset_peak_rss()
        return self._reset

    def peak_bytes(self) -> int:
        return status_field("VmHWM") if self._reset else 0

    def allocated_bytes(self) -> int:
        return status_field("VmRSS")


class CudaMeter:
    """Device seconds between CUDA events; the caching allocator's peak. `cuda`: the
    torch.cuda module, or a stand-in with its synchronize, Event, reset_peak_memory_stats,
    max_memory_allocated and memory_allocated."""

    device = "cuda"

    def __init__(self, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self.cuda = cuda
        self._origin: Any = None

    def _event(self) -> Any:
        event = self.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.cuda.synchronize()
        self._origin = self._event()

    def stamp(self) -> Any:
        return self._event()

    def own_stamp(self) -> Any:
        return self._event()

    def finish(self) -> None:
        self.cuda.synchronize()

    def seconds(self, stamp: Any) -> float:
        return self._origin.elapsed_time(stamp) / 1e3

    def sync(self) -> None:
        self.cuda.synchronize()

    def reset_peak(self) -> bool:
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()
        return True

    def peak_bytes(self) -> int:
        self.cuda.synchronize()
        return int(self.cuda.max_memory_allocated())

    def allocated_bytes(self) -> int:
        self.cuda.synchronize()
        return int(self.cuda.memory_allocated())


def meter_for(device: str) -> Meter:
    """The meter of `device` ("cpu" or "cuda")."""
    if device == "cuda":
        return CudaMeter()
    if device == "cpu":
        return CpuMeter()
    raise ValueError(f"device {device!r}: choose one of {', '.join(DEVICES)}")

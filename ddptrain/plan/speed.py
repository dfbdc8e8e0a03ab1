"""How fast the CPU ran: a fixed probe, timed beside the profile's steps and --check's blocks.

    probe = Probe()                        # its operands, allocated once
    probe.seconds()                        # this thread's CPU seconds for the same fixed work
    slowdown(profile_probes, run_probes)   # 1.12: the run's CPU ran 12% slower than the profile's

A virtual machine's vCPU runs at whatever pace its host gives it, and the guest cannot see it:
on a 2-vCPU KVM guest (AMD EPYC, Zen 3), one process pinned to a vCPU, with no communication,
took 96 to 171 ms of CPU for the same MLP step over 2-second windows of one 40 s run, while
the kernel counted almost no steal time. A spell like that between a profile and a run moves
the check's ratio though the plan did nothing wrong. The probe (products of matrices that stay
in L2, on one thread) slowed with the step: over 40 such windows, its log time correlated 0.79
with the step's (slope 0.93). So --check reports each run's probe against its profile's, and
the ratio at the profile's speed beside the measured one.
"""

from __future__ import annotations

import statistics
import time

import torch

# 5 products of 256 x 256 matrices: about 2 ms on one Zen 3 core, 768 KiB of operands.
SIZE = 256
REPEATS = 5


class Probe:
    """The fixed work, its operands allocated once (outside any peak a caller measures)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self._a = torch.randn(SIZE, SIZE, generator=generator)
        self._b = torch.randn(SIZE, SIZE, generator=generator)
        self._out = torch.empty(SIZE, SIZE)

    def seconds(self) -> float:
        """CPU seconds of the calling thread for the probe's work."""
        start = time.thread_time()
        for _ in range(REPEATS):
            torch.mm(self._a, self._b, out=self._out)
        return time.thread_time() - start


def slowdown(profile_s: list[float], run_s: list[float]) -> float | None:
    """The run's median probe over the profile's: above 1, the CPU ran slower during the run;
    None when either has no probes (a CUDA setup, or figures from before the probe)."""
    if not profile_s or not run_s:
        return None
    before = statistics.median(profile_s)
    return statistics.median(run_s) / before if before > 0 else None

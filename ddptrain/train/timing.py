"""Where a step's time goes: wall-clock marks summed over a log window (Tstep = Tcomp + Tsync).

    times = StepTimes()
    times.add("data_s", 0.001); times.add("step_s", 0.010)      # per step, on each rank
    record.update(split_record(times.values(), steps=10))      # means per step, comm share

Phases: data_s (next batch, moved to the device), compute_s (forward + backward, minus the
wait below), comm_s (the wrapper's wait for buckets after autograd is done: communication
that overlap did not hide), optim_s (unscale, clip or norm, optimizer step), step_s (the
whole step). They are host times: on CUDA, kernels still queued are not counted.
"""

from __future__ import annotations

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

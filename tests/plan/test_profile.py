"""The profile's timing of the sharded wrapper's own work, in alternation with the plain step."""

from __future__ import annotations

import pytest

from ddptrain.plan.profile import TIMED_STEPS, WARMUP_STEPS, profile, wrapper_excess_s
from ddptrain.plan.setup import Setup


class _Spells:
    """Steps whose seconds a machine's spells scale: 30 ms plain, the wrapped step 2 ms more;
    pairs 4-7 run 1.5x slower (a slow spell), and every call is recorded."""

    def __init__(self, excess_s: float = 0.002) -> None:
        self.calls: list[str] = []
        self.excess_s = excess_s

    def _factor(self) -> float:
        return 1.5 if 4 <= len(self.calls) // 2 < 8 else 1.0

    def plain(self) -> float:
        seconds = 0.030 * self._factor()
        self.calls.append("plain")
        return seconds

    def wrapped(self) -> float:
        seconds = 0.030 * self._factor() + self.excess_s
        self.calls.append("wrapped")
        return seconds


def test_the_wrappers_excess_is_timed_in_pairs_that_share_a_spell():
    """A 2 ms excess is found exactly though a spell slows pairs 1.5x; who goes first alternates."""
    steps = _Spells()
    assert wrapper_excess_s(steps.plain, steps.wrapped, 0.0) == pytest.approx(0.002, abs=1e-12)
    pairs = WARMUP_STEPS + TIMED_STEPS
    assert len(steps.calls) == 2 * pairs
    firsts = steps.calls[::2]
    assert firsts == ["plain" if n % 2 == 0 else "wrapped" for n in range(pairs)]


def test_a_wrapper_timed_faster_than_the_plain_step_adds_nothing():
    """Noise that makes the wrapped step the shorter gives an excess of 0, not a negative one."""
    steps = _Spells(excess_s=-0.001)
    assert wrapper_excess_s(steps.plain, steps.wrapped, 0.0) == 0.0


@pytest.mark.slow
def test_a_cpu_profile_of_zero3_times_the_wrappers_step_beyond_the_plain_one():
    """On CPU a ZeRO-3 profile's wrapper step exceeds its plain step, by less than the step."""
    prof = profile(Setup(model="lenet", strategy="zero3", device="cpu"), min_timed_s=0.5)
    assert prof.step_s < prof.wrapper_step_s < 2 * prof.step_s
    ddp = profile(Setup(model="lenet", strategy="ddp", device="cpu"), min_timed_s=0.5)
    assert ddp.wrapper_step_s == 0.0 and ddp.marks_scale == 1.0

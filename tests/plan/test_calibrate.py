"""The link calibration's split of a collective between its calling thread and gloo's."""

from __future__ import annotations

import ddptrain
from ddptrain.plan import calibrate


def _measure_one_size() -> dict:
    try:
        return calibrate._measure([64 << 10])
    finally:
        ddptrain.shutdown()


def test_gathers_and_reduce_scatters_report_their_calling_threads_share():
    """At one rank only all-gather and reduce-scatter report caller issue/finish seconds, < 1 s."""
    (result,) = ddptrain.spawn(_measure_one_size, 1, timeout_s=120)
    assert sorted(result["caller"]) == ["all_gather", "reduce_scatter"]
    for points in result["caller"].values():
        ((nbytes, issue, finish),) = points
        assert nbytes == 64 << 10
        assert 0.0 < issue < 1.0 and 0.0 <= finish < 1.0


def test_the_busiest_rank_gives_each_part():
    """Across ranks, each size's issue and finish seconds are the largest any rank spent."""
    ranks = [
        {"caller": {"reduce_scatter": [(8, 0.003, 0.001), (16, 0.004, 0.002)]}},
        {"caller": {"reduce_scatter": [(8, 0.002, 0.005), (16, 0.006, 0.001)]}},
    ]
    assert calibrate._busiest_callers(ranks) == {
        "reduce_scatter": [(8, 0.003, 0.005), (16, 0.006, 0.002)]
    }

"""The link calibration's split of a collective between its calling thread and gloo's."""

from __future__ import annotations

import pytest

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


def test_the_uneven_share_is_the_slowest_ranks_at_each_cycle():
    """Across ranks, each cycle's seconds lost are the most any rank lost."""
    ranks = [
        {"share": [(0.0075, 0.002), (0.12, 0.009)]},
        {"share": [(0.0075, 0.003), (0.12, 0.007)]},
    ]
    assert calibrate._slowest_share(ranks) == [(0.0075, 0.003), (0.12, 0.009)]


def _measure_with_cores(cores: int) -> dict:
    import functools

    from ddptrain.plan import meeting

    calibrate.usable_cores = lambda: cores
    calibrate.measure_uneven_share = functools.partial(
        meeting.measure_uneven_share, compute_s=(0.002, 0.004), seconds=0.05
    )
    return _measure_one_size()


def test_the_uneven_share_is_measured_where_ranks_outnumber_the_cores():
    """Two ranks on one core measure each cycle length's loss; on two cores, none is measured."""
    one_core = ddptrain.spawn(_measure_with_cores, 2, 1, timeout_s=180)
    cycles = [cycle for cycle, _ in one_core[0]["share"]]
    assert cycles == pytest.approx([0.004, 0.008])  # 2 and 4 ms of compute at half a core
    # Two real cores: a cycle takes about its compute, below the "even share" of one core.
    assert all(-0.01 < lost < 1.0 for rank in one_core for _, lost in rank["share"])
    two_cores = ddptrain.spawn(_measure_with_cores, 2, 2, timeout_s=180)
    assert all("share" not in rank for rank in two_cores)

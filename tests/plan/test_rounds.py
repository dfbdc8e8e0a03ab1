"""Profiles in rounds (plan/rounds.py): the strategies take turns, and a strategy's passes merge."""

from __future__ import annotations

import pytest

import ddptrain.plan
from ddptrain.plan.rounds import merge, pool_shared_compute, profile_in_rounds
from ddptrain.plan.setup import Setup
from support.plan_profiles import ddp_profile

MIB = 1 << 20


def test_merge_takes_the_mean_of_the_passes_and_keeps_every_step():
    """Merged passes take mean times and bytes, keep every step, and the first pass's buckets."""
    # Each pass's steps scale as its median (30 or 40 ms) is to the mean (35 ms).
    fast = ddp_profile(step_s=0.030, backward_s=0.018, bucket_ready_s=[0.004, 0.014],
                       peak_rss_bytes=200 * MIB, timed_steps=2,
                       step_samples_s=[0.03, 0.03])  # fmt: skip
    slow = ddp_profile(step_s=0.040, backward_s=0.024, bucket_ready_s=[0.006, 0.018],
                       peak_rss_bytes=202 * MIB, timed_steps=3,
                       step_samples_s=[0.04, 0.05, 0.04])  # fmt: skip
    both = merge([fast, slow])
    assert both.step_s == pytest.approx(0.035)
    assert both.backward_s == pytest.approx(0.021)
    assert both.bucket_ready_s == pytest.approx([0.005, 0.016])
    assert both.peak_rss_bytes == 201 * MIB
    assert both.timed_steps == 5
    assert sorted(both.step_samples_s) == pytest.approx([0.035] * 4 + [0.05 * 0.035 / 0.04])
    assert both.buckets == fast.buckets
    assert fast.step_s == 0.030  # the passes are left as they were


def test_merge_averages_each_units_forward_span():
    """A sharded profile's per-unit spans and activation bytes are averaged unit by unit."""
    a = ddp_profile(unit_forward_s=[[0.0, 0.002], [0.002, 0.006]], unit_activation_bytes=[10, 30])
    b = ddp_profile(unit_forward_s=[[0.0, 0.004], [0.004, 0.010]], unit_activation_bytes=[20, 50])
    both = merge([a, b])
    assert [pytest.approx(row) for row in both.unit_forward_s] == [[0.0, 0.003], [0.003, 0.008]]
    assert both.unit_activation_bytes == [15, 40]


def test_rounds_take_turns_reversing_the_order_and_merge_per_setup():
    """Two rounds profile setups a, b, c then c, b, a, and each setup merges its own two passes."""
    setups = [Setup(model="mlp", strategy=s) for s in ("ddp", "zero1", "powersgd")]
    order: list[str] = []

    def run(setup: Setup):
        order.append(setup.strategy)
        return ddp_profile(step_s=0.01 * len(order), step_samples_s=[0.01 * len(order)])

    profiles = profile_in_rounds(setups, rounds=2, run=run)
    assert order == ["ddp", "zero1", "powersgd", "powersgd", "zero1", "ddp"]
    # ddp: passes 1 and 6; powersgd: passes 3 and 4.
    assert profiles[0].step_s == pytest.approx(0.035)
    assert profiles[2].step_s == pytest.approx(0.035)
    # zero1's passes (20 and 50 ms, one step each) about their mean: no spread left.
    assert profiles[1].step_samples_s == pytest.approx([0.035, 0.035])


def test_plan_profiles_each_strategy_once_a_round_and_reuses_given_profiles(monkeypatch):
    """profile_rounds=2 profiles each strategy not given twice, given ones never; 0 is refused."""
    seen: list[str] = []

    def fake(setup: Setup):
        seen.append(setup.strategy)
        return ddp_profile(timed_steps=8)

    monkeypatch.setattr(ddptrain.plan, "profile", fake)
    result = ddptrain.plan.plan(
        "lenet",
        strategies=["ddp", "zero1", "powersgd"],
        world_sizes=[8],
        link="nccl-100g",
        profiles={"zero1": ddp_profile(timed_steps=8)},
        profile_rounds=2,
        device="cpu",
    )
    assert seen == ["ddp", "powersgd", "powersgd", "ddp"]
    assert [p.timed_steps for p in result.profiles] == [16, 8, 16]
    assert len(result.predictions) == 3
    with pytest.raises(ValueError, match="profile_rounds: at least 1, got 0"):
        ddptrain.plan.plan("lenet", link="nccl-100g", profile_rounds=0, device="cpu")


def _of(strategy: str, model: str = "lenet", **times: object):
    return ddp_profile(setup=Setup(model=model, strategy=strategy).as_dict(), **times)


def test_the_ddp_wrappers_strategies_share_one_forward_and_backward():
    """DDP, ZeRO-1 and PowerSGD of one model pool forward, backward and bucket-ready times."""
    # PowerSGD keeps its last hook (4 ms), each strategy its optimizer; others are left alone.
    ddp = _of("ddp", forward_s=0.010, backward_s=0.020, bucket_ready_s=[0.004, 0.014])
    zero1 = _of("zero1", forward_s=0.013, backward_s=0.026, bucket_ready_s=[0.006, 0.018],
                optimizer_s=0.003, step_s=0.042)  # fmt: skip
    powersgd = _of("powersgd", forward_s=0.010, backward_s=0.030, hook_s=[0.001, 0.004],
                   bucket_ready_s=[0.005, 0.016], step_s=0.042)  # fmt: skip
    zero3 = _of("zero3", forward_s=0.020)
    other = _of("ddp", model="mlp", forward_s=0.050)
    pooled = pool_shared_compute([ddp, zero1, powersgd, zero3, other])
    assert [p.forward_s for p in pooled[:3]] == pytest.approx([0.011] * 3)
    # Backward less PowerSGD's last hook: 20, 26 and 26 ms, a mean of 24.
    assert [p.backward_s for p in pooled[:3]] == pytest.approx([0.024, 0.024, 0.028])
    assert [p.bucket_ready_s for p in pooled[:3]] == [pytest.approx([0.005, 0.016])] * 3
    assert [p.optimizer_s for p in pooled[:3]] == [0.002, 0.003, 0.002]
    # Each step moves by its own forward and backward's change: +5, -4 and -1 ms.
    assert [p.step_s for p in pooled[:3]] == pytest.approx([0.037, 0.038, 0.041])
    assert pooled[3] is zero3 and pooled[4] is other
    assert ddp.forward_s == 0.010  # the profiles given are left as they were


def test_strategies_bucketed_differently_keep_their_bucket_times():
    """Where the buckets differ, forward and backward are pooled, bucket-ready times not."""
    ddp = _of("ddp", bucket_ready_s=[0.004, 0.014])
    zero1 = _of("zero1", buckets=[[0, 1]], bucket_ready_s=[0.016])
    pooled = pool_shared_compute([ddp, zero1])
    assert [p.bucket_ready_s for p in pooled] == [[0.004, 0.014], [0.016]]

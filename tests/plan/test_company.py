"""Profiles taken in company: copies of the step computing beside the profiled one, and which
world sizes are predicted from them."""

from __future__ import annotations

import time

import pytest

import ddptrain.plan
from ddptrain.plan import company_at
from ddptrain.plan.company import WARM_STEPS, beside
from ddptrain.plan.links import ShapedLink
from ddptrain.plan.predict import step_seconds
from ddptrain.plan.setup import Setup
from support.plan_profiles import bus, ddp_profile, local


def test_company_is_the_ranks_computing_at_once():
    """On two cores one rank computes alone, two or more have one beside them (at most one
    a core); two hosts made on this machine share its cores as one host's ranks do; GPU ranks
    share no CPU and are profiled alone."""
    two_cores = local(0.0, cores=2.0)
    assert [company_at(two_cores, n) for n in (1, 2, 3, 4)] == [1, 2, 2, 2]
    assert [company_at(local(0.0, cores=4.0), n) for n in (1, 3, 6)] == [1, 3, 4]
    shaped = ShapedLink(1e9, 1e-4, two_cores, name="1gbit")
    assert [company_at(shaped, n) for n in (1, 2)] == [1, 2]
    assert company_at(bus(), 8) == 1


def test_copies_compute_for_as_long_as_the_block_runs():
    """A copy beside the block is warm when the block starts and keeps stepping until it ends:
    it ran more steps than its warm-up by the block's end."""
    with beside(Setup(model="lenet"), copies=1, timeout_s=120) as company:
        time.sleep(1.0)
    (steps,) = company.steps
    assert steps > WARM_STEPS + 1


def test_a_copy_that_fails_fails_the_block():
    """A copy that cannot build its model fails the block before it runs, in one error naming
    the copy's failure, rather than timing a profile alone."""
    ran = []
    with pytest.raises(RuntimeError, match="failed before it was warm"):
        with beside(Setup(model="no-such-module:factory"), copies=1, timeout_s=120):
            ran.append(True)
    assert not ran


def test_plan_predicts_each_world_size_from_its_company(monkeypatch):
    """On two cores: world size 1 from the profile taken alone, 2 and 3 from the one taken as
    one of 2 copies (its forward twice as long here), each strategy profiled once in each."""
    seen: list[tuple[str, int]] = []

    def fake(setup: Setup, company: int = 1):
        seen.append((setup.strategy, company))
        return ddp_profile(setup=setup.as_dict(), forward_s=0.010 * company, company=company)

    monkeypatch.setattr(ddptrain.plan, "profile", fake)
    link = local(0.0, cores=2.0)
    result = ddptrain.plan.plan("lenet", strategies=["ddp", "zero1"], world_sizes=[1, 2, 3],
                                link=link, background=0.0, device="cpu")  # fmt: skip
    assert sorted(seen) == [("ddp", 1), ("ddp", 2), ("zero1", 1), ("zero1", 2)]
    ddp = result.predictions[0]
    assert ddp.at(1).step_s == pytest.approx(0.010 + 0.020 + 0.002)
    in_company = result.profile_for(0, 3)
    assert in_company.company == 2 and result.profile_for(0, 1).company == 1
    for n in (2, 3):
        expected, _ = step_seconds(Setup(model="lenet"), in_company, link, n)
        assert ddp.at(n).step_s == pytest.approx(expected)
    assert ddp.at(2).step_s > ddp.at(1).step_s + 0.009

"""The overlap simulation against timelines worked by hand."""

from __future__ import annotations

import dataclasses

import pytest

import ddptrain
from ddptrain.plan.links import BusLink, Cost, LocalLink, ShapedLink, ring_factor, ring_steps
from ddptrain.plan.predict import step_seconds, straggle_s
from ddptrain.plan.profile import Profile
from ddptrain.plan.setup import Setup
from ddptrain.plan.steps import ddp_ops, sharded_ops
from ddptrain.plan.timeline import Alloc, Compute, Free, Job, Launch, Wait, simulate
from support.plan_profiles import (
    MIB,
    bus,
    ddp_profile,
    local,
    meeting_of_a_sleep,
    uneven_share_of_a_sleep,
)

OPS = [Compute(0.010), Launch("comm", Job("b0", cpu_s=0.004)), Compute(0.010), Wait("b0")]


@pytest.mark.parametrize(
    ("cores", "peers", "background", "end_s"),
    [
        # No contention: the job hides under the second compute.
        (None, 1, 0.0, 0.020),
        # A core each: the same.
        (2.0, 1, 0.0, 0.020),
        # One core for two threads: 8 ms of both at half speed, then 6 ms of compute alone.
        (1.0, 1, 0.0, 0.024),
        # Two ranks' two threads on two cores: as one rank on one core.
        (2.0, 2, 0.0, 0.024),
        # Two busy threads of other programs on two cores: the first compute takes 15 ms (2/3
        # of a core), then 3 threads share: the job's 4 ms take 8 ms (1/2 each, 4 runnable
        # over 2 cores), compute runs 4 ms of its 10 there, its last 6 ms at 2/3: 9 ms.
        (2.0, 1, 2.0, 0.015 + 0.008 + 0.009),
    ],
)
def test_one_job_beside_compute(cores, peers, background, end_s):
    """A 4 ms job launched between two 10 ms computes ends the step when worked by hand."""
    result = simulate(OPS, cores, peers, background)
    assert result.end_s == pytest.approx(end_s, abs=1e-9)


def test_wire_time_bounds_a_job_and_the_wait_is_exposed():
    """A 1 ms CPU, 30 ms wire job launched at 10 ms ends at 40 ms, the main thread blocked 20 ms."""
    ops = [Compute(0.010), Launch("comm", Job("b0", 0.001, 0.030)), Compute(0.010), Wait("b0")]
    result = simulate(ops, 2.0)
    assert result.end_s == pytest.approx(0.040)
    assert result.jobs["b0"] == pytest.approx((0.010, 0.040))
    assert result.waited_s == pytest.approx(0.020)


def test_jobs_on_one_queue_run_one_after_another():
    """Two 10 ms wire jobs on the same thread: the second starts when the first ends."""
    ops = [Launch("q", Job("a", wire_s=0.010)), Launch("q", Job("b", wire_s=0.010)), Wait("b")]
    result = simulate(ops, None)
    assert result.jobs["a"] == pytest.approx((0.0, 0.010))
    assert result.jobs["b"] == pytest.approx((0.010, 0.020))


def test_memory_peak_follows_allocations():
    """The peak is the largest live sum over the step, from the bytes held at its start."""
    ops = [Alloc(5), Alloc(7), Free(5), Alloc(2), Free(7), Alloc(20), Free(22)]
    assert simulate(ops, None, start_bytes=100).peak_bytes == 100 + 5 + 7 + 2 - 5 + 20 - 7 + 0


def test_waiting_for_a_job_never_launched_is_an_error():
    """A Wait with no such job names it instead of hanging."""
    with pytest.raises(ValueError, match="'missing'"):
        simulate([Compute(0.001), Wait("missing")], None)


def test_ddp_step_with_two_buckets_on_a_bus():
    """DDP at ws 2 with two 10 MiB buckets on a bus: a 42 ms step, 10 ms of it exposed comm."""
    # Buckets ready at 5 and 15 ms of a 20 ms backward send 15-25 and 25-35 ms; backward
    # ends at 40 ms (forward 10 ms first), then the 2 ms optimizer.
    step, floor = step_seconds(Setup(strategy="ddp"), ddp_profile(), bus(), 2)
    assert step == pytest.approx(0.042)
    assert floor == pytest.approx(0.032)


def test_the_slowest_of_n_ranks_against_closed_forms():
    """Straggle on 1-4 ms steps: 0.625 ms at 2 ranks, near the slowest at many, 0 at 1 or steady."""
    # Slower of two: sum of x * (F(x)^2 - F(x-)^2) = 50/16 ms, 0.625 ms past the 2.5 ms median.
    samples = [0.004, 0.001, 0.003, 0.002]
    assert straggle_s(samples, 2) == pytest.approx(0.000625)
    assert straggle_s(samples, 3) > straggle_s(samples, 2)
    assert straggle_s(samples, 1000) == pytest.approx(0.0015, rel=1e-3)
    assert straggle_s(samples, 1) == 0.0 and straggle_s([0.002] * 9, 4) == 0.0
    assert straggle_s([], 4) == 0.0


def test_a_step_waits_for_the_slowest_rank():
    """At ws 2 the step, not the floor, adds the slower rank's expected wait from the samples."""
    plain = step_seconds(Setup(strategy="ddp"), ddp_profile(), bus(), 2)
    varied = ddp_profile(step_samples_s=[0.004, 0.001, 0.003, 0.002])
    step, floor = step_seconds(Setup(strategy="ddp"), varied, bus(), 2)
    assert (step, floor) == pytest.approx((plain[0] + 0.000625, plain[1]))


# Lost at the end of 10, 40 and 160 ms cycles at an even share: 2, 5 and 11 ms.
SHARE = [(0.010, 0.002), (0.040, 0.005), (0.160, 0.011)]


def test_the_uneven_share_grows_with_the_cycle_beyond_the_shortest():
    """Past the cores: 0 up to 10 ms, linear to 160 ms, the same fraction past it; 0 within."""
    link = LocalLink(local(0.0).table, 2.0, share_table={3: SHARE})
    assert link.uneven_share_s(3, 0.005) == 0.0
    assert link.uneven_share_s(3, 0.025) == pytest.approx(0.0035 - 0.002)
    assert link.uneven_share_s(3, 0.160) == pytest.approx(0.009)
    assert link.uneven_share_s(3, 0.320) == pytest.approx(0.018)
    assert link.uneven_share_s(5, 0.160) == pytest.approx(0.009)  # the nearest measured: 3
    assert link.uneven_share_s(2, 0.160) == 0.0  # a core each
    assert LocalLink.from_dict(link.as_dict()).share_table == link.share_table
    assert local(0.0).uneven_share_s(3, 0.160) == 0.0  # not measured
    assert ShapedLink(1e9, 0.0, link).uneven_share_s(3, 0.160) == pytest.approx(0.009)
    apart = ShapedLink(1e9, 0.0, link, ranks_per_host=1, shared_cores=False)
    assert apart.uneven_share_s(3, 0.160) == 0.0 and bus().uneven_share_s(3, 0.160) == 0.0


def test_ranks_of_one_machine_wait_for_its_uneven_share_not_independent_draws():
    """On one host a DDP step adds the uneven share of its simulated step, ZeRO-3 nothing, and
    neither the samples' straggle; on hosts of their own the straggle is added."""
    varied = ddp_profile(step_samples_s=[0.004, 0.001, 0.003, 0.002])
    shared = LocalLink(local(0.0).table, 2.0, share_table={3: SHARE})
    plain = LocalLink(local(0.0).table, 2.0)
    ddp, zero3 = Setup(strategy="ddp"), Setup(strategy="zero3")
    simulated = step_seconds(ddp, varied, plain, 3)[0]
    assert step_seconds(ddp, varied, shared, 3)[0] == pytest.approx(
        simulated + shared.uneven_share_s(3, simulated)
    )
    assert shared.uneven_share_s(3, simulated) > 0.0
    units = dataclasses.replace(_two_unit_profile(), step_samples_s=varied.step_samples_s)
    assert step_seconds(zero3, units, shared, 3) == step_seconds(zero3, units, plain, 3)
    apart = ShapedLink(1e9, 0.0, plain, ranks_per_host=1, shared_cores=False)
    together = ShapedLink(1e9, 0.0, plain)
    assert step_seconds(ddp, varied, apart, 2)[0] == pytest.approx(
        step_seconds(ddp, varied, together, 2)[0] + straggle_s(varied.step_samples_s, 2)
    )


def test_ddp_step_hides_a_fast_link():
    """With a link 10x faster each bucket takes 1 ms: only the last one, 1 ms, is exposed."""
    step, floor = step_seconds(Setup(strategy="ddp"), ddp_profile(), bus(10 * MIB / 0.001), 2)
    assert (step, floor) == pytest.approx((0.033, 0.032))


def test_bucket_cost_grows_with_the_ring():
    """At ws 4 a bucket moves 2(n-1)/n = 1.5 of its bytes plus 6 hops: 15 ms + 6 latencies."""
    link = BusLink(10 * MIB / 0.010, 1e-4)
    assert ring_factor("reduce", 4) == 1.5 and ring_steps("reduce", 4) == 6
    cost = link.cost("reduce", 10 * MIB, 4)
    assert cost.wire_s == pytest.approx(0.015 + 6e-4)
    ops = ddp_ops(ddp_profile(), link, 4, "ddp")
    assert simulate(ops, None).end_s == pytest.approx(0.015 + 0.015 + 6e-4 + 0.015 + 6e-4 + 0.007)


def test_zero1_adds_its_sharded_step_and_broadcasts():
    """ZeRO-1 at ws 2 on a free link steps on half the parameters: 10 + 20 + 1 ms."""
    free = BusLink(float("inf"), 0.0)
    step, floor = step_seconds(Setup(strategy="zero1"), ddp_profile(), free, 2)
    assert step == pytest.approx(0.031) and floor == pytest.approx(0.031)


def test_a_local_collective_lasts_at_least_its_measured_wall_time():
    """With 10 ms measured wall time per 10 MiB bucket a local DDP step is 42 ms; without, 32 ms."""
    prof, setup = ddp_profile(), Setup(strategy="ddp")
    waiting = local(0.0, wall_s_per_byte=0.010 / (10 * MIB))
    assert step_seconds(setup, prof, waiting, 2) == pytest.approx((0.042, 0.032))
    assert step_seconds(setup, prof, local(0.0), 2) == pytest.approx((0.032, 0.032))


@pytest.mark.parametrize("cores", [None, 1.0])
def test_a_meeting_takes_no_cpu_and_goes_faster_once_the_main_thread_waits(cores):
    """A meeting (2 ms idle, 4 ms busy) speeds up once the main thread waits: 16.5 ms, any cores."""
    # The main thread's 1 ms runs beside a quarter of the meeting, the rest takes 1.5 ms,
    # then the job's 4 ms of CPU.
    job = Job("b0", cpu_s=0.004, meet_s=0.002, meet_busy_s=0.004)
    ops = [Compute(0.010), Launch("comm", job), Compute(0.001), Wait("b0")]
    result = simulate(ops, cores)
    assert result.end_s == pytest.approx(0.0165)
    assert result.jobs["b0"] == pytest.approx((0.010, 0.0165))


def test_wire_time_counts_from_the_meetings_end():
    """2 ms of meeting, then 5 ms on the wire with no CPU: the job lasts 7 ms."""
    ops = [Launch("q", Job("a", wire_s=0.005, meet_s=0.002)), Wait("a")]
    assert simulate(ops, 2.0).end_s == pytest.approx(0.007)


def test_links_give_their_measured_meetings():
    """Meetings are the nearest measured world size's, none at 1 rank, a shaped link's own first."""
    # PowerSGD's bucket meets twice: once for each of its two messages.
    meetings = {"reduce": {2: (0.001, 0.003), 4: (0.002, 0.005)}}
    here = LocalLink(local(0.0).table, 2.0, wall_table=local(0.0).wall_table, meet_table=meetings)
    assert here.cost("reduce", MIB, 3).meet_s == 0.002  # nearest: 4 before 2
    assert here.cost("reduce", MIB, 2).meet_busy_s == 0.003
    assert here.cost("reduce", MIB, 1).meet_s == 0.0
    assert LocalLink.from_dict(here.as_dict()).meet_table == meetings
    shaped = ShapedLink(1e9, 0.0, here)
    assert shaped.cost("reduce", MIB, 2).meet_s == here.meeting_seconds("reduce_tcp", 2)[0] == 0
    own = ShapedLink(1e9, 0.0, here, meet_table={"reduce_tcp": (0.007, 0.009)})
    assert (own.cost("reduce", MIB, 2).meet_s, own.cost("reduce", MIB, 2).meet_busy_s) == (
        0.007,
        0.009,
    )
    prof = ddp_profile(hook_s=[0.001, 0.001], param_shapes=[[640, 1024], [640, 1024]])
    jobs = [op.job for op in ddp_ops(prof, here, 2, "powersgd") if isinstance(op, Launch)]
    assert [(j.meet_s, j.meet_busy_s) for j in jobs] == [(0.002, 0.006)] * 2


def test_a_powersgd_hook_computes_then_sends_its_two_messages():
    """PowerSGD at ws 2 runs each bucket's 4 ms hook, then sends P and Q in turn: a 37.2 ms step."""
    # Bucket 0 lasts 15-24.2 ms, bucket 1 25-34.2; overlapping hook and messages gave 33.2 ms.
    prof = ddp_profile(hook_s=[0.004, 0.004], param_shapes=[[640, 1024], [640, 1024]])
    ops = ddp_ops(prof, bus(bytes_per_s=10240 / 0.002), 2, "powersgd")
    assert simulate(ops, None).end_s == pytest.approx(0.0372)


def test_calibrated_meeting_is_the_operations_time_beyond_compute():
    """Both meetings of a 2 ms sleep after 8 ms of compute measure 1.9-6 ms, not the 10 ms whole."""
    # The 6 ms bound allows wake-ups up to 4 ms late on a loaded machine.
    idle, busy = ddptrain.spawn(meeting_of_a_sleep, 1, 0.008, 0.002, timeout_s=120)[0]
    assert 0.0019 <= busy <= 0.006
    assert 0.0019 <= idle <= 0.006


def test_calibrated_uneven_share_is_the_cycle_beyond_its_even_share():
    """Cycles of 4 and 12 ms of compute, then a 2 ms sleep: each loses 1.9-6 ms beyond it."""
    points = ddptrain.spawn(uneven_share_of_a_sleep, 1, (0.004, 0.012), 0.002, timeout_s=120)[0]
    assert [cycle for cycle, _ in points] == pytest.approx([0.004, 0.012])
    assert all(0.0019 <= lost <= 0.006 for _, lost in points)


def _two_unit_profile() -> Profile:
    """A root unit holding "a" around a unit holding "b": forward 10 ms (b's 2-8 ms), backward
    20 ms (b's gradient ready at 10 ms), optimizer 2 ms."""
    return ddp_profile(
        buckets=[],
        bucket_ready_s=[],
        hook_s=[],
        ready_s=[0.018, 0.010],
        units=[[0], [1]],
        unit_forward_s=[[0.0, 0.010], [0.002, 0.008]],
    )


def _reduce_scatter_link(issue_s: float, finish_s: float) -> LocalLink:
    """Two cores a rank; gathers free; a reduce-scatter 6 ms of CPU, `issue_s` and `finish_s`
    of it on the calling thread."""
    free = local(0.0, cores=4.0)
    table = dict(free.table, reduce_scatter={2: [(0, 0.006), (64 * MIB, 0.006)]})
    caller = {"reduce_scatter": {2: [(0, issue_s, finish_s), (64 * MIB, issue_s, finish_s)]}}
    return LocalLink(table, 4.0, wall_table=free.wall_table, caller_table=caller)


@pytest.mark.parametrize(
    ("issue_s", "finish_s", "end_s"),
    [
        # All 6 ms on gloo's thread: b's hides under the root's 10 ms of backward, a's is
        # waited for: 10 + 20 + 6 + 1 (the optimizer on half the parameters).
        (0.0, 0.0, 0.037),
        # 2 ms to start and 1 ms to finish each on the main thread, 3 on gloo's: 10 + 10 + 2
        # (b's start) + 10 + 1 (b's finish) + 2 (a's start) + 3 (its wait) + 1 + 1 = 40 ms.
        (0.002, 0.001, 0.040),
    ],
)
def test_a_reduce_scatters_calling_thread_share_is_the_main_threads(issue_s, finish_s, end_s):
    """A reduce-scatter's calling-thread work is charged to the main thread in a ZeRO-3 step."""
    ops = sharded_ops(_two_unit_profile(), _reduce_scatter_link(issue_s, finish_s), 2, True)
    assert simulate(ops, 4.0, 2).end_s == pytest.approx(end_s, abs=1e-9)


@pytest.mark.parametrize(
    ("wrapper_step_s", "end_s"),
    [
        # At one rank the main thread is modelled to do 10 + 20 + 2 ms and each unit's
        # reduce-scatter's 2 + 1 ms: 38 ms. Measured 41: 3 ms of its own, 1.5 as each unit's
        # forward starts, on the main thread of the 40 ms step at two ranks.
        (0.041, 0.043),
        # Measured within the modelled 38 ms: nothing of its own.
        (0.036, 0.040),
    ],
)
def test_the_sharded_wrappers_own_work_is_its_one_rank_step_beyond_the_modelled_one(
    wrapper_step_s, end_s
):
    """The wrapper's own work is its measured one-rank step less the modelled main thread's."""
    prof = _two_unit_profile()
    prof.wrapper_step_s = wrapper_step_s
    ops = sharded_ops(prof, _reduce_scatter_link(0.002, 0.001), 2, True)
    assert simulate(ops, 4.0, 2).end_s == pytest.approx(end_s, abs=1e-9)


def _caller(cost: Cost) -> tuple[float, float]:
    return cost.issue_s, cost.finish_s


def test_the_calling_threads_share_is_measured_here_and_fits_in_the_whole():
    """Caller seconds come from the nearest world size, survive the cache, and fit in the whole."""
    # A shaped link takes this machine's caller seconds: the copies are local memory's.
    link = _reduce_scatter_link(0.002, 0.001)
    assert _caller(link.cost("reduce_scatter", MIB, 3)) == pytest.approx((0.002, 0.001))
    assert LocalLink.from_dict(link.as_dict()).caller_table == link.caller_table
    assert _caller(link.cost("all_gather", MIB, 2)) == (0.0, 0.0)
    over = _reduce_scatter_link(0.006, 0.006)
    assert _caller(over.cost("reduce_scatter", MIB, 2)) == pytest.approx((0.003, 0.003))
    cpu = {"reduce_scatter": [(0, 0.012), (MIB, 0.012)]}
    for wall in ({}, {"reduce_scatter": [(0, 0.02), (MIB, 0.02)]}):
        shaped = ShapedLink(1e9, 0.0, link, cpu_table=cpu, wall_table=wall)
        assert _caller(shaped.cost("reduce_scatter", MIB, 2)) == pytest.approx((0.002, 0.001))


@pytest.mark.parametrize(
    ("world_size", "wrapper_step_s", "end_s"),
    [
        # Not measured: the plain step, 10 + 20 + 2 ms.
        (1, 0.0, 0.032),
        # The wrapper's step at one rank measured 4 ms longer than the plain model's: that one.
        (1, 0.036, 0.036),
        # Two ranks, sending free: 10 + 4 (2 ms as each unit's forward starts) + 20 + 1 (the
        # optimizer on half the parameters).
        (2, 0.036, 0.035),
        # Measured shorter than the plain step (noise): nothing taken off.
        (1, 0.030, 0.032),
    ],
)
def test_the_sharded_wrappers_own_work_on_a_gpu(world_size, wrapper_step_s, end_s):
    """A CUDA sharded wrapper's extra step time is the main thread's, split over unit forwards."""
    prof = _two_unit_profile()
    prof.wrapper_step_s = wrapper_step_s
    fast = bus(bytes_per_s=1e18)
    step, _ = step_seconds(Setup(strategy="zero3", device="cuda"), prof, fast, world_size)
    assert step == pytest.approx(end_s, abs=1e-9)

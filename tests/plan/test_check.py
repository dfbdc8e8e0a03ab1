"""One prediction against one real run on this machine's CPU, and the choice logic."""

from __future__ import annotations

import pytest

from ddptrain.bench.hosts import RunFailed
from ddptrain.plan import plan
from ddptrain.plan.check import (
    combine,
    compare,
    failure_cause,
    rounds_apart,
    run_local,
    run_twice_at_most,
)
from ddptrain.plan.predict import (
    Point,
    Prediction,
    close_to_pick,
    largest_efficient,
    pick,
    set_efficiency,
)
from ddptrain.plan.report import format_check, format_choice, format_picks, plot
from ddptrain.plan.run import MAX_BLOCK, Steps, block_steps
from ddptrain.plan.setup import Setup
from support.plan_profiles import ddp_profile


def _prediction(strategy: str, steps: dict[int, float], peak: int = 1) -> Prediction:
    points = [Point(n, s, s, n / s, peak, {}) for n, s in steps.items()]
    return Prediction({"strategy": strategy, "powersgd_rank": 4}, "toy", points)


def test_pick_and_largest_efficient_world_size():
    """The fastest fitting strategy is picked; the largest world size keeps efficiency >= 0.8."""
    # Efficiency is one-rank step / step: 1.0 / 1.25 = 0.8 exactly still counts.
    ddp = _prediction("ddp", {1: 1.0, 2: 1.1, 4: 1.4, 8: 2.0})
    zero3 = _prediction("zero3", {1: 1.2, 2: 1.2, 4: 1.25, 8: 1.9})
    set_efficiency([ddp, zero3], 1.0)
    assert pick([ddp, zero3], 4) is zero3
    zero3.at(4).fits = False
    assert pick([ddp, zero3], 4) is ddp
    n, chosen = largest_efficient([ddp, zero3], [1, 2, 4, 8])
    assert (n, chosen) == (2, ddp)
    zero3.at(4).fits = True
    assert largest_efficient([ddp, zero3], [1, 2, 4, 8]) == (4, zero3)


def test_picks_against_measured_best():
    """format_picks says where the predicted fastest strategy is not the measured fastest."""
    rows = [
        {"setup": {"model": "m", "strategy": s, "powersgd_rank": 4}, "link": "local",
         "world_size": 2, "predicted_step_s": p, "measured_step_s": m}
        for s, p, m in [("ddp", 1.0, 2.0), ("zero1", 1.5, 1.0)]
    ]  # fmt: skip
    text = format_picks(rows)
    assert "picked ddp" in text and "measured best zero1" in text and "DIFFERS" in text
    assert "best in 0 of 1 cases, measured within 5% of the best in 0 of 1" in text
    rows[0]["measured_step_s"] = 1.04
    assert "within 5% of the best in 1 of 1" in format_picks(rows)


def test_within_five_percent_of_the_fastest_the_simplest_strategy_is_picked():
    """Within 5% of the fastest prediction the simplest strategy is picked; past 5%, the fastest."""
    ddp = _prediction("ddp", {2: 1.03, 4: 1.07})
    zero1 = _prediction("zero1", {2: 1.04, 4: 1.02})
    zero3 = _prediction("zero3", {2: 1.20, 4: 1.00})
    powersgd = _prediction("powersgd", {2: 1.00, 4: 1.01})
    assert pick([powersgd, ddp], 2) is ddp
    assert pick([zero3, powersgd, zero1], 4) is zero1
    assert pick([powersgd, ddp], 4) is powersgd  # 1.07 > 1.01 * 1.05
    assert close_to_pick([powersgd, zero1, ddp], 2) == [powersgd, zero1]
    rows = [
        {"setup": {"model": "m", "strategy": s, "powersgd_rank": 4}, "link": "local",
         "world_size": 2, "predicted_step_s": p, "measured_step_s": m}
        for s, p, m in [("powersgd", 1.00, 1.10), ("ddp", 1.03, 1.00)]
    ]  # fmt: skip
    assert "picked ddp" in format_picks(rows) and "best in 1 of 1" in format_picks(rows)


def test_strategies_predicted_within_five_percent_of_the_pick_are_named():
    """Fitting strategies predicted at most 5% slower than the pick are named, and no others."""
    ddp = _prediction("ddp", {2: 1.00})
    zero1 = _prediction("zero1", {2: 1.05})
    zero3 = _prediction("zero3", {2: 1.06})
    powersgd = _prediction("powersgd", {2: 1.01})
    powersgd.at(2).fits = False
    everything = [zero3, zero1, ddp, powersgd]
    assert close_to_pick(everything, 2) == [zero1]
    assert "2: ddp (zero1 within 5%)" in format_choice(everything, [2])
    assert close_to_pick([zero3], 2) == [] and close_to_pick([], 2) == []


@pytest.mark.slow
def test_lenet_ddp_at_two_ranks_is_predicted_within_wide_bounds():
    """LeNet DDP at 2 ranks: predicted peak memory within 25% of measured, step time within 2x."""
    # The step bound is wide: other programs share the machine's cores.
    result = plan("lenet", strategies=["ddp"], world_sizes=[2], link="local", device="cpu")
    point = result.predictions[0].at(2)
    measured = run_local(Setup(model="lenet", strategy="ddp"), 2, Steps(2, 4, 2))
    row = compare(Setup(model="lenet"), point, measured, "local", result.background_threads)
    assert 0.75 <= row["peak_ratio"] <= 1.25, row
    assert 0.5 <= row["step_ratio"] <= 2.0, row
    assert measured["block_steps"] >= 10, measured  # half a second of ~15-40 ms steps


def test_a_block_takes_as_many_steps_as_fill_its_seconds():
    """A block is `block` steps or more to fill `block_s`, at most MAX_BLOCK; block_s 0 keeps it."""
    assert block_steps(Steps(3, 6, 2, 0.5), 0.015) == 34
    assert block_steps(Steps(3, 6, 2, 0.5), 0.4) == 2
    assert block_steps(Steps(3, 6, 4, 0.5), 0.2) == 4
    assert block_steps(Steps(3, 6, 2, 0.5), 1e-6) == MAX_BLOCK
    assert block_steps(Steps(3, 6, 2, 0.0), 0.015) == 2


def test_json_prints_each_configurations_numbers_and_the_tables_go_to_stderr(
    monkeypatch, tmp_path, capsys
):
    """`--json` prints each configuration's step seconds and peak bytes; the tables go to stderr."""
    import json

    import ddptrain.plan
    from ddptrain.plan.__main__ import main

    monkeypatch.setattr(ddptrain.plan, "profile", lambda setup: ddp_profile())
    argv = ["--model", "lenet", "--strategies", "ddp", "--link", "nccl-100g"]
    argv += ["--world-sizes", "8,64", "--background", "0", "--json", "--no-plot"]
    main([*argv, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    (found,) = json.loads(out)["plans"]
    points = found["predictions"][0]["points"]
    assert [p["world_size"] for p in points] == [8, 64]
    assert all(p["step_s"] > 0 and p["peak_bytes"] > 0 for p in points)
    assert "samples/s" in err and "largest world size" in err and "#" in err
    assert json.loads((tmp_path / "plan.json").read_text())["plans"] == json.loads(out)["plans"]


def test_the_chart_is_a_png_of_the_predictions(tmp_path):
    """plot() draws every strategy's step time and memory into a PNG and says it did."""
    pytest.importorskip("matplotlib")
    predictions = [_prediction("ddp", {1: 1.0, 2: 1.1}), _prediction("zero3", {1: 1.2, 2: 1.3})]
    set_efficiency(predictions, 1.0)
    path = tmp_path / "plan.png"
    assert plot(predictions, [], path, "toy")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# A launcher's output when gloo aborted its rank (shortened from a real one).
ABORT = """--- host a: ip netns exec ddpp-a sh -c ... python -m torch.distributed.run ...
[W1129 20:48:52.981607816 socket.cpp:207] [c10d] The hostname of the client socket ...
terminate called without an active exception
E1129 20:48:58.854000 2865 api.py:1002] failed (exitcode: -6) local_rank: 0 (pid: 2874)
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : -6 (pid: 2874)  (SIGABRT)"""


def test_a_failures_cause_is_the_ranks_own_line_not_the_launchers():
    """The cause is the abort or the rank's exception line; the launcher's own error is skipped."""
    assert failure_cause(ABORT) == "terminate called without an active exception"
    raised = "head\nTraceback (most recent call last):\nValueError: bad batch\nChildFailedError:"
    assert failure_cause(raised) == "ValueError: bad batch"
    assert failure_cause("head\nerror: --setup is not JSON") == "error: --setup is not JSON"
    assert failure_cause("head\nall fine\nChildFailedError: x") is None


def test_a_failed_run_is_run_once_more_and_a_second_failure_is_raised(capsys):
    """A run failing once is rerun and kept, with one line saying so; a second failure is raised."""
    calls = []

    def flaky() -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise RunFailed(f"two-host bench failed (launcher exit codes [1, None])\n{ABORT}")
        return {"step_s": 0.5}

    assert run_twice_at_most(flaky, "lenet zero3 ws2 1gbit") == {"step_s": 0.5}
    assert len(calls) == 2
    line = "lenet zero3 ws2 1gbit: two-host bench failed (launcher exit codes [1, None]) "
    line += "(terminate called without an active exception); running it once more"
    assert line in capsys.readouterr().err

    def broken() -> dict:
        calls.append(1)
        raise RunFailed(f"failure {len(calls)}")

    with pytest.raises(RunFailed, match="failure 4"):
        run_twice_at_most(broken, "x")


def test_rounds_of_a_run_pool_their_blocks():
    """Rounds pool into one measurement: median of all blocks (not of medians), largest peaks."""
    runs = [
        {"step_s": 1.0, "block_step_s": [1.0, 1.0, 5.0], "peak_bytes": 7,
         "rss_before_model_bytes": 3, "max_rss_bytes": 9},
        {"step_s": 3.0, "block_step_s": [3.0, 3.0, 3.0], "peak_bytes": 8,
         "rss_before_model_bytes": 2, "max_rss_bytes": 9},
    ]  # fmt: skip
    both = combine(runs)
    assert both["step_s"] == 3.0 and both["round_step_s"] == [1.0, 3.0]
    assert len(both["block_step_s"]) == 6
    assert (both["peak_bytes"], both["rss_before_model_bytes"]) == (8, 3)
    assert combine(runs[:1]) is runs[0]


def test_the_check_says_how_far_apart_the_rounds_of_one_configuration_measured():
    """Rounds measuring 1.0 s and 1.25 s are 25% apart; one round has no such figure."""
    rounds = [{"step_s": s, "block_step_s": [s], "peak_bytes": 1, "rss_before_model_bytes": 1,
               "max_rss_bytes": 1} for s in (1.25, 1.0)]  # fmt: skip
    assert rounds_apart(combine(rounds)) == pytest.approx(0.25)
    assert rounds_apart(combine(rounds[:1])) is None
    point = Point(2, 1.1, 1.0, 2 / 1.1, 1, {})
    rows = [compare(Setup(model="lenet"), point, combine(r), "local", 0.0)
            for r in (rounds, rounds[:1], [rounds[1], {**rounds[1], "step_s": 1.1}])]  # fmt: skip
    lines = format_check(rows).splitlines()
    assert lines[1].split()[-5] == "25%" and lines[2].split()[-5] == "-", lines
    assert lines[3].split()[-5] == "10%", lines
    assert lines[-1].startswith("apart: the rounds of one configuration measured up to 25% "
                                "apart (median 18%)"), lines[-1]  # fmt: skip
    assert not format_check(rows[1:2]).splitlines()[-1].startswith("apart"), "one round each"

"""The GPT bench (`python -m ddptrain.bench --gpt`): its pure tokens/s and summary, and a smoke
run of the Trainer against the plain loop (speed is judged by the benchmark itself)."""

from __future__ import annotations

import json

import pytest

from ddptrain.bench import gpt, gpt_report


def test_steady_rates_leave_out_warm_up_and_evaluations():
    """Steady rates are the median interval, leaving out the first `skip` steps and evaluations."""
    # Step k ends at ends[k - 1]; step 1 compiles (10 s), step 3's interval to 4 evaluates.
    wall = [10.0, 10.5, 11.0, 14.0, 14.5, 15.0, 18.0, 18.5, 18.9]
    ends = [(w, w / 2) for w in wall]
    assert gpt_report.steady_tokens_per_s(ends, 100, skip=1, eval_every=3) == pytest.approx(200.0)
    assert gpt_report.cpu_ms_per_step(ends, skip=1, eval_every=3) == pytest.approx(250.0)
    with pytest.raises(ValueError, match="raise --steps"):
        gpt_report.steady_tokens_per_s(ends[:2], 100, skip=1, eval_every=3)


def _run(seconds_per_step: float, curve: list) -> list[dict]:
    ends = [(i * seconds_per_step, i * seconds_per_step) for i in range(1, 9)]
    return [{"ends": ends, "tokens_per_step": 64, "curve": curve, "wall_s": 9.0}] * 2


def test_summary_pairs_the_loops_and_measures_the_curves_apart():
    """Pairs give median tokens/s ratios and the largest curve gap, as do the plain loop's seeds."""
    curve_a, curve_b = [(4, 3.0), (8, 2.5)], [(4, 3.1), (8, 2.45)]
    runs = [
        {
            "ddptrain": _run(0.5, curve_a),
            "plain": _run(1.0, curve_b),
            "plain_seed2": _run(1.0, [(4, 3.3), (8, 2.5)]),
        }
    ]
    settings = {"skip_steps": 1, "eval_every": 100}
    result = gpt_report.summarize(runs, settings)
    [pair] = result["pairs"]
    assert (pair["ddptrain"], pair["plain"]) == ("ddptrain", "plain")
    assert pair["ratio"] == pytest.approx(2.0) and pair["paired"] == pytest.approx(2.0)
    assert pair["cpu_ratio"] == pytest.approx(0.5)
    assert pair["max_curve_gap_bpb"] == pytest.approx(0.1)
    assert result["seed_gap_bpb"] == pytest.approx(0.2)
    assert result["variants"]["plain"]["final_bpb"] == 2.45


def test_mfu_is_the_models_flops_at_the_measured_rate_over_the_cards_peak():
    """MFU is flops_per_token x median tokens/s over the peak; H100/H200 bf16 known, CPU not."""
    runs = [{"ddptrain": _run(0.5, []), "plain": _run(0.25, [])}]
    settings = {"skip_steps": 1, "eval_every": 100, "flops_per_token": 1e9, "peak_flops": 1e12}
    v = gpt_report.summarize(runs, settings)["variants"]
    assert v["ddptrain"]["mfu"] == pytest.approx(64 / 0.5 * 1e9 / 1e12)
    assert v["plain"]["mfu"] == pytest.approx(2 * v["ddptrain"]["mfu"])
    assert gpt_report.peak_flops("NVIDIA H200", "bf16") == gpt_report.peak_flops(
        "NVIDIA H100 80GB HBM3", "bf16"
    )
    assert gpt_report.peak_flops("NVIDIA H200", "fp32") < gpt_report.peak_flops(
        "NVIDIA H200", "bf16"
    )
    assert gpt_report.peak_flops("cpu", "bf16") is None
    no_peak = gpt_report.summarize(runs, {"skip_steps": 1, "eval_every": 100, "peak_flops": None})
    assert "mfu" not in no_peak["variants"]["plain"]


@pytest.mark.slow
def test_quick_run_writes_the_comparison(tmp_path):
    """--quick at ws 2: Trainer and plain loop give tokens/s and the same eval steps in gpt.json."""
    result = gpt.main(["--gpt", "--quick", "--variants", "ddptrain,plain", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpt.json").read_text())
    assert saved == json.loads(json.dumps(result))
    v = saved["variants"]
    for name in ("ddptrain", "plain"):
        assert v[name]["tokens_per_s"] > 0 and v[name]["cpu_ms_per_step"] > 0, name
    assert [s for s, _ in v["ddptrain"]["curve"]] == [s for s, _ in v["plain"]["curve"]] == [12, 24]
    assert saved["pairs"][0]["max_curve_gap_bpb"] < 0.05

"""The deterministic mode's cost report (--deterministic): a smoke run and its summary."""

from __future__ import annotations

import json

import pytest

from ddptrain.bench import deterministic

pytestmark = pytest.mark.timeout(240)


def test_quick_run_times_both_modes_and_measures_their_memory(tmp_path):
    """--deterministic --quick times both modes; the exact mode holds 2 to 3 gradient copies."""
    # The exact mode holds int64 buckets (two gradient copies) and its .grad inside them.
    deterministic.main(["--deterministic", "--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "deterministic.json").read_text())
    (row,) = saved["rows"]
    assert (row["model"], row["world_size"]) == ("lenet-recipe", 2)
    assert row["micro_batches_per_rank"] == 4
    assert row["default_ms"] > 0 and row["deterministic_ms"] > 0 and row["ratio"] > 0
    assert row["default_train_peak_bytes"] > row["grad_bytes"] > 0
    assert row["deterministic_train_peak_bytes"] > row["grad_bytes"]
    for mode in ("default", "deterministic"):
        assert 0 < row[f"{mode}_train_peak_share_bytes"] <= row[f"{mode}_train_peak_bytes"]
    assert 2 * row["grad_bytes"] <= row["deterministic_held_bytes"] < 3 * row["grad_bytes"]
    assert row["default_held_bytes"] >= row["grad_bytes"]


def test_summary_pairs_rounds_and_counts_extra_memory_in_gradient_copies():
    """Ratio: median of per-round ratios; extra memory: worst rank's excess in gradient copies."""
    times = {"m": {2: {"default": [1.0, 2.0, 10.0], "deterministic": [1.5, 2.2, 10.5]}}}
    memory = {
        "m": {
            2: {
                mode: [
                    {
                        "train_peak_bytes": p,
                        "train_peak_share_bytes": s,
                        "held_bytes": h,
                        "grad_bytes": 100,
                    }
                    for p, s, h in zip(peaks, shares, held, strict=True)
                ]
                for mode, peaks, shares, held in (
                    ("default", [300, 320], [250, 240], [100, 110]),
                    ("deterministic", [480, 500], [400, 390], [300, 320]),
                )
            }
        }
    }
    (row,) = deterministic.summarize(times, memory, {"micro_batches": 8})["rows"]
    assert row["ratio"] == pytest.approx(1.1)  # per round: 1.5, 1.1, 1.05
    assert row["default_ms"] == 2000.0 and row["deterministic_ms"] == 2200.0
    assert row["extra_grad_copies"] == pytest.approx(1.8)
    assert row["extra_share_grad_copies"] == pytest.approx(1.5)
    assert row["extra_held_grad_copies"] == pytest.approx(2.1)
    assert row["micro_batches_per_rank"] == 4
    assert "1.100x" in deterministic.format_table({"rows": [row]})

"""Curves: metrics.jsonl records to series, legends, and the CLI's refusals."""

import json
from pathlib import Path

import pytest

from ddptrain.plot import curves
from ddptrain.plot.__main__ import main

START = {"event": "start", "step": 0, "time_s": 0.0, "world_size": 2, "precision": "bf16",
         "comm_hook": "default"}  # fmt: skip


def _train(step, loss, time_s):
    return {"step": step, "epoch": 0, "loss": loss, "lr": 0.1, "samples_per_s": 1000.0,
            "comm_share": 0.25, "time_s": time_s}  # fmt: skip


def _write_run(directory, records):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return directory


def test_series_split_training_and_eval_records():
    """Training fields come from loss records, eval_* from eval records, minus eval_samples."""
    records = [
        START,
        _train(10, 2.0, 1.0),
        _train(20, 1.0, 2.0),
        {"step": 20, "epoch": 0, "eval_accuracy": 0.5, "eval_samples": 100, "time_s": 2.5},
    ]
    series = curves.extract_series(records)
    assert set(series) == {"loss", "lr", "samples_per_s", "comm_share", "eval_accuracy"}
    assert series["loss"].steps == [10, 20] and series["loss"].values == [2.0, 1.0]
    assert series["loss"].times == [1.0, 2.0]
    assert series["eval_accuracy"].steps == [20] and series["eval_accuracy"].times == [2.5]


def test_resumed_run_keeps_wall_time_increasing():
    """A second start record (a resumed run) shifts later times by the last time seen."""
    records = [START, _train(10, 2.0, 5.0), {**START, "step": 10}, _train(20, 1.0, 1.0)]
    assert curves.extract_series(records)["loss"].times == [5.0, 6.0]


def test_a_run_resumed_from_an_earlier_step_replaces_the_steps_after_it():
    """Logged to step 30, resumed from the step-10 checkpoint: one curve, the resumed points."""
    records = [START, _train(10, 2.0, 1.0), _train(20, 1.5, 2.0), _train(30, 1.2, 3.0)]
    records += [{**START, "step": 10}, _train(20, 1.4, 1.0), _train(30, 1.1, 2.0)]
    loss = curves.extract_series(records)["loss"]
    assert (loss.steps, loss.values, loss.times) == ([10, 20, 30], [2.0, 1.4, 1.1], [1.0, 4.0, 5.0])


def test_a_non_finite_loss_is_written_as_json_null_and_skipped_by_the_plot(tmp_path):
    """MetricsLog writes NaN/inf as null (strict JSON); the curve leaves that point out."""
    from ddptrain.train.metrics import MetricsLog

    log = MetricsLog(tmp_path)
    for step, loss in [(1, 2.0), (2, float("nan")), (3, float("inf")), (4, 1.0)]:
        log.write(_train(step, loss, float(step)))
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert [json.loads(line)["loss"] for line in text.splitlines()] == [2.0, None, None, 1.0]
    assert curves.extract_series(curves.read_records(tmp_path))["loss"].steps == [1, 4]


def test_records_without_time_s_still_plot_against_step():
    """Old logs without time_s give curves against step, with no time."""
    series = curves.extract_series([{"step": 1, "loss": 1.0}])
    assert series["loss"].steps == [1] and series["loss"].times == [None]


def test_label_names_world_size_precision_and_hook():
    """The legend carries world size, precision and hook from the start record."""
    assert curves.run_label([START], "run") == "run (ws=2, bf16, hook=default)"
    assert curves.run_label([_train(1, 1.0, 1.0)], "run") == "run"


def test_cli_refuses_a_directory_without_metrics(tmp_path, capsys):
    """An empty directory, or one with only a start record, exits 2 with one line."""
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no metrics.jsonl" in err and len(err.splitlines()) == 1
    _write_run(tmp_path / "started", [START, "partial"])
    assert main([str(tmp_path / "started")]) == 2
    assert "no metric records" in capsys.readouterr().err


def test_cli_draws_overlaid_runs(tmp_path):
    """Two runs give one PNG with a panel row per field."""
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "a", [START, _train(10, 2.0, 1.0), _train(20, 1.0, 2.0)])
    b = _write_run(tmp_path / "b", [_train(10, 2.5, 1.5), _train(20, 1.5, 3.0)])
    out = tmp_path / "curves.png"
    assert main([str(a), str(b), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = [*curves.load_runs(a), *curves.load_runs(b)]
    assert curves.panel_names(runs) == ["loss", "lr", "samples_per_s", "comm_share"]


def test_without_o_the_curves_go_beside_the_runs(tmp_path, monkeypatch, capsys):
    """Without -o, curves.png goes in the runs' (common) folder, never the cwd; its path printed."""
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "runs" / "a", [START, _train(10, 2.0, 1.0), _train(20, 1.0, 2.0)])
    b = _write_run(tmp_path / "runs" / "b", [_train(10, 2.5, 1.5), _train(20, 1.5, 3.0)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(a)]) == 0
    assert (a / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert main([str(a), str(b)]) == 0
    assert (tmp_path / "runs" / "curves.png").is_file()
    assert list(elsewhere.iterdir()) == []
    printed = [Path(line).resolve() for line in capsys.readouterr().out.splitlines()]
    assert printed == [a / "curves.png", tmp_path / "runs" / "curves.png"]


def test_a_log_dir_reused_without_resuming_draws_each_run_apart(tmp_path):
    """Fresh starts (step 0) split a file into runs `name #1`, `name #2`; a resume does not."""
    resumed = {**START, "step": 10}
    records = [
        START, _train(10, 2.0, 1.0),
        resumed, _train(20, 1.0, 0.5),  # the same run, resumed
        START, _train(10, 3.0, 1.2),  # a fresh run in the same directory
        START,  # one more that stopped before its first record
    ]  # fmt: skip
    assert [len(run) for run in curves.split_runs(records)] == [4, 2]
    runs = curves.load_runs(_write_run(tmp_path / "dup", records))
    assert [run.label.split(" (")[0] for run in runs] == ["dup #1", "dup #2"]
    assert runs[0].series["loss"].steps == [10, 20] and runs[0].series["loss"].times == [1.0, 1.5]
    assert runs[1].series["loss"].values == [3.0]
    single = curves.load_runs(_write_run(tmp_path / "one", records[:4]))
    assert [run.label for run in single] == ["one (ws=2, bf16, hook=default)"]

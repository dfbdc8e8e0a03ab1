"""What a run records and shows: TensorBoard gets the same scalars as metrics.jsonl, a missing
package is one line; the start lines and the progress bar."""

import json

import pytest
import torch

from ddptrain.train import build, output
from ddptrain.train import metrics as logs
from ddptrain.train.config import TrainerConfig

RECORDS = [
    {"event": "start", "step": 0, "time_s": 0.0, "world_size": 2, "precision": "fp32"},
    {"step": 5, "epoch": 0, "loss": 0.75, "lr": 0.1, "comm_share": 0.25, "time_s": 1.5},
    {"step": 10, "epoch": 1, "eval_accuracy": 0.875, "eval_samples": 40, "time_s": 3.0},
]


def test_tensorboard_event_file_holds_the_records_scalars(tmp_path):
    """Read back with TensorBoard's EventAccumulator: one tag per numeric field, at its step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = logs.open_logs(("jsonl", "tensorboard"), tmp_path)
    for record in RECORDS:
        log.write(record)
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == RECORDS
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"loss", "lr", "comm_share", "time_s", "eval_accuracy", "eval_samples"}
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(5, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("eval_accuracy")] == [(10, 0.875)]
    assert [e.step for e in events.Scalars("time_s")] == [5, 10]


def test_a_half_written_last_line_is_ended_before_the_next_run_appends(tmp_path):
    """A metrics.jsonl left mid-record by a killed run: the next run's records stay whole lines."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(RECORDS[0]) + "\n" + '{"step": 5, "lo')
    log = logs.MetricsLog(tmp_path)
    log.write(RECORDS[1])
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"step": 5, "lo'
    assert [json.loads(line) for line in (lines[0], lines[2])] == RECORDS[:2]


def test_missing_tensorboard_says_how_to_install(tmp_path, monkeypatch):
    """Without the package, opening the log raises one line naming the pip command."""
    monkeypatch.setattr(logs.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'ddptrain\[tensorboard\]'") as info:
        logs.open_logs(("tensorboard",), tmp_path)
    assert "\n" not in str(info.value)


def test_metrics_line_prints_counts_whole_and_the_rest_to_four_places():
    """format_metrics: ints as they are, floats rounded to 4 places, in the dict's order."""
    shown = output.format_metrics({"eval_accuracy": 0.91437, "eval_samples": 10000, "loss": 2.5})
    assert shown == "eval_accuracy=0.9144, eval_samples=10000, loss=2.5000"


def test_progress_bar_setting_none_follows_the_terminal(monkeypatch):
    """progress_bar=None shows the bar only when stderr is a terminal; True/False always win."""
    for tty in (True, False):
        monkeypatch.setattr(output.sys.stderr, "isatty", lambda tty=tty: tty)
        assert output.want_progress_bar(None) is tty
        assert output.want_progress_bar(True) is True
        assert output.want_progress_bar(False) is False


def test_summary_counts_only_the_samples_trained_since_start_or_resume(monkeypatch):
    """Progress.summary's samples/s counts only this process's steps, not those before a resume."""
    monkeypatch.setattr(logs.time, "perf_counter", lambda: 104.0)
    progress = logs.Progress(window=None, first_step=10, saved_at=10, start=100.0)
    progress.last_loss, progress.metrics = 0.5, {"eval_accuracy": 0.9}
    summary = progress.summary(step=30, epoch=2, global_batch=64, world_size=2)
    assert summary["samples_per_s"] == (30 - 10) * 64 / 4.0
    assert summary["wall_s"] == 4.0
    assert (summary["step"], summary["epoch"], summary["world_size"]) == (30, 2, 2)
    assert summary["train_loss"] == 0.5 and summary["eval"] == {"eval_accuracy": 0.9}


def test_window_samples_per_s_leaves_out_evaluation_and_saving(monkeypatch):
    """LossWindow.report gives the mean loss per step; time in paused() is left out of samples/s."""
    clock = iter([0.0, 2.0, 10.0, 12.0, 12.0])
    monkeypatch.setattr(logs.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(logs.dist, "get_world_size", lambda: 1)
    window = logs.LossWindow(torch.device("cpu"))
    window.add(torch.tensor(3.0), samples=60)
    window.add(torch.tensor(1.0), samples=40)
    with window.paused():
        pass
    loss, samples_per_s, _ = window.report()
    assert loss == 2.0
    assert samples_per_s == 100 / (12.0 - 8.0)


def _banner(epochs, max_steps, total_steps, batches_per_epoch=235, accum=1):
    """describe_run's line for a ws=2 run whose sampler has no batches left in its epoch."""
    from types import SimpleNamespace as NS

    cfg = TrainerConfig(
        epochs=epochs, max_steps=max_steps, grad_accum_steps=accum, global_batch_size=256
    )
    info = NS(launcher="spawn", world_size=2, backend="gloo", device="cpu")
    # len() 0, like a sampler resumed at an epoch's end.
    sampler = type(
        "Sampler",
        (),
        {"batches_per_epoch": batches_per_epoch, "world_size": 2, "__len__": lambda s: 0},
    )()
    model = NS(bucket_sizes_bytes=[2**20])
    by_epochs = build.epoch_steps(cfg, sampler)
    return output.describe_run(cfg, info, sampler, model, total_steps, None, by_epochs)


def test_run_banner_says_when_max_steps_ends_the_run_early():
    """The banner names the epoch's batches (even with none left) and max_steps only if it cuts."""
    full = _banner(epochs=6, max_steps=None, total_steps=6 * 235)
    assert "1410 optimizer steps (6 epoch(s) of 235 micro-batches)" in full
    capped = _banner(epochs=5, max_steps=5, total_steps=5)
    assert (
        "5 optimizer steps (max_steps=5 ends it within 5 epoch(s) of 235 micro-batches)" in capped
    )
    exact = _banner(epochs=2, max_steps=470, total_steps=470)
    assert "max_steps" not in exact
    # 5 micro-batches in steps of 2: 3 steps an epoch, the last one short.
    accumulated = _banner(epochs=2, max_steps=None, total_steps=6, batches_per_epoch=5, accum=2)
    assert "6 optimizer steps (2 epoch(s) of 5 micro-batches)" in accumulated


def test_the_run_banner_is_short_lines():
    """The banner's first line names launcher, world size, backend, device, precision; all <= 80."""
    # 80 columns: a narrow terminal shows the banner whole.
    lines = _banner(epochs=6, max_steps=None, total_steps=6 * 235).splitlines()
    assert (
        lines[0] == "ddptrain: launcher=spawn world_size=2 backend=gloo device=cpu precision=fp32"
    )
    assert lines[1] == "  global_batch_size=256 = 2 ranks x 128 per rank x 1 accumulation step(s)"
    assert lines[3] == "  buckets (MiB, launch order): [1.00]"
    assert max(len(line) for line in lines) <= 80, lines


def test_lines_printed_during_a_progress_bar_go_above_it(capsys):
    """ProgressBar.print writes the same whole line on stdout with the bar on or off."""
    # With the bar on, tqdm clears and redraws it on stderr around the line.
    for enabled in (True, False):
        bar = output.ProgressBar(total=10, initial=0, enabled=enabled)
        bar.update(3, {"loss": 0.5, "samples_per_s": 100.0})
        bar.print("step 3 epoch 1/2: eval_accuracy=0.9000")
        bar.close()
        assert capsys.readouterr().out == "step 3 epoch 1/2: eval_accuracy=0.9000\n"


def test_the_progress_bar_shows_the_steps_epoch_of_the_runs(capsys):
    """The bar names the epoch its step belongs to, counted from 1, of the run's epochs."""
    bar = output.ProgressBar(total=10, initial=0, enabled=True, epochs=2)
    bar.update(6, {"epoch": 2, "loss": 0.5, "samples_per_s": 100.0})
    bar.close()
    drawn = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any(line.startswith("epoch 2/2:  60%") for line in drawn), drawn

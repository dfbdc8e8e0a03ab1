"""Seeing inside a run: per-rank traces of profile_steps, the step time split, TensorBoard."""

from __future__ import annotations

import json

import pytest
import torch

import ddptrain
from ddptrain import profiling
from ddptrain.plot import curves, timeline
from ddptrain.train.config import TrainerConfig
from ddptrain.train.metrics import PHASES
from support.toy_models import ToyTrainer

TRAINER_MARKS = {"ddptrain.data", "ddptrain.forward", "ddptrain.backward", "ddptrain.optimizer"}
WRAPPER_MARKS = {"ddptrain.fill", "ddptrain.launch", "ddptrain.wait", "ddptrain.finalize"}


def _fit(config):
    return ToyTrainer(config).fit()


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    """One ws=2 run: 6 steps, steps 2-3 profiled, TensorBoard on when installed."""
    log_dir = tmp_path_factory.mktemp("observe") / "logs"
    loggers = ("jsonl", "tensorboard")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        loggers = ("jsonl",)
    config = TrainerConfig(
        global_batch_size=12,
        max_steps=6,
        log_every_steps=2,
        eval_every_steps=3,
        log_dir=str(log_dir),
        progress_bar=False,
        profile_steps=(2, 3),
        loggers=loggers,
    )
    ddptrain.spawn(_fit, 2, config, timeout_s=180)
    records = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    return log_dir, records


def test_profile_steps_write_one_trace_per_rank_with_the_marks(observed_run):
    """Each rank's trace json-loads and holds the Trainer's and the wrapper's spans."""
    log_dir, _ = observed_run
    for rank in (0, 1):
        trace = json.loads((log_dir / f"trace-rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"] if e.get("ph") == "X"}
        prefixes = {n.split(" ", 1)[0] for n in names}
        assert TRAINER_MARKS | WRAPPER_MARKS <= prefixes, sorted(prefixes)
        assert sum(1 for n in names if n == "ddptrain.optimizer") == 1  # one name, 2 events
        assert timeline.trace_rank(trace, -1) == rank
        forward = [e for e in trace["traceEvents"] if e.get("name") == "ddptrain.forward"]
        assert len(forward) == 2  # steps 2 and 3 only


def test_every_record_has_time_and_training_records_the_split(observed_run):
    """time_s everywhere (eval too); phases nonnegative and summing to at most the step time."""
    _, records = observed_run
    assert records[0]["event"] == "start" and records[0]["world_size"] == 2
    assert all("time_s" in r for r in records)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in evals] == [3, 6]
    times = [r["time_s"] for r in records[1:]]
    assert times == sorted(times)
    for r in train:
        assert all(r[p] >= 0 for p in PHASES)
        parts = r["data_s"] + r["compute_s"] + r["comm_s"] + r["optim_s"]
        # Float sums of the same perf_counter marks: only rounding can push parts past step_s.
        assert 0 < parts <= r["step_s"] * (1 + 1e-9)
        assert 0 <= r["comm_share"] <= 1


def test_curves_read_the_trainer_log(observed_run):
    """The plot reader finds loss, eval metrics and the run's legend in a real log."""
    log_dir, _ = observed_run
    [run] = curves.load_runs(log_dir)
    assert run.label.endswith("(ws=2, fp32, hook=default)")
    assert run.series["loss"].steps == [2, 4, 6]
    assert run.series["eval_accuracy"].steps == [3, 6]


def test_tensorboard_gets_the_same_scalars(observed_run):
    """Read back with EventAccumulator: training and eval scalars at the logged steps."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, records = observed_run
    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "eval_accuracy", "comm_s", "comm_share", "time_s"} <= tags
    losses = [r["loss"] for r in records if "loss" in r]
    logged = events.Scalars("loss")
    assert [e.step for e in logged] == [2, 4, 6]
    assert [e.value for e in logged] == pytest.approx(losses, rel=1e-6)  # stored as float32


def test_config_names_the_fix_for_bad_observability_settings():
    """profile_steps must be an ordered pair with somewhere to write; loggers must be known."""
    with pytest.raises(ValueError, match="1 <= first <= last"):
        TrainerConfig(profile_steps=(3, 2), log_dir="x")
    with pytest.raises(ValueError, match="set log_dir"):
        TrainerConfig(profile_steps=(1, 2))
    with pytest.raises(ValueError, match="names among"):
        TrainerConfig(loggers=("wandb",))
    with pytest.raises(ValueError, match="use a tuple of"):
        TrainerConfig(loggers="jsonl")


def test_a_run_resumed_inside_the_profiled_range_traces_the_rest(tmp_path):
    """StepTracer(2..4) on a run whose first step is 3: it profiles 3..4 and writes the trace."""
    tracer = profiling.StepTracer((2, 4), tmp_path, rank=0)
    for step in range(3, 7):
        tracer.before_step(step)
        torch.ones(8).add_(1)
        tracer.after_step(step)
    tracer.close()
    assert (tmp_path / "trace-rank0.json").is_file()


def test_a_profile_range_outside_the_run_is_told_apart():
    """range_missed: true only when no profiled step is among the run's steps."""
    assert profiling.range_missed((50, 60), 1, 10)
    assert profiling.range_missed((2, 4), 7, 20)  # resumed past it
    assert not profiling.range_missed((5, 60), 1, 10)
    assert not profiling.range_missed((2, 4), 3, 20)
    assert not profiling.range_missed(None, 1, 10)

"""Training curves from metrics.jsonl: loss, eval metrics, lr, throughput vs step and wall time.

    runs = [*load_runs("runs/ws1"), *load_runs("runs/ws2")]  # NoMetricsError if empty
    draw_curves(runs, "curves.png")                          # needs matplotlib

load_runs reads one run directory (several runs when it was reused without resuming);
split_runs, extract_series and run_label are pure (records in, runs, series or text out) and
are what the tests check; draw_curves only draws.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddptrain.plot._mpl import pyplot

METRICS_FILE = "metrics.jsonl"
# Training-record fields drawn as curves, in panel order; eval_* metrics come after the loss.
TRAIN_FIELDS = ("loss", "lr", "samples_per_s", "comm_share")
TITLES = {
    "loss": "training loss",
    "lr": "learning rate",
    "samples_per_s": "samples/s (global)",
    "comm_share": "exposed communication / step time",
}
# Counts, not curves.
SKIPPED_EVAL_FIELDS = ("eval_samples",)


class NoMetricsError(ValueError):
    """A run directory holds no metrics records."""


@dataclass
class Series:
    """One quantity over a run: parallel lists of step, seconds since start, value."""

    steps: list[int] = field(default_factory=list)
    times: list[float | None] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def truncate_after(self, step: int) -> None:
        """Drop the points after `step`."""
        keep = sum(1 for s in self.steps if s <= step)
        del self.steps[keep:], self.times[keep:], self.values[keep:]


@dataclass
class Run:
    """A run directory's records, its legend label and its curves."""

    path: Path
    label: str
    series: dict[str, Series]


def read_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON records of `run_dir`/metrics.jsonl; NoMetricsError if there are none."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise NoMetricsError(
            f"{run_dir}: no {METRICS_FILE} (a run writes one with TrainerConfig(log_dir=...) "
            "or the recipe's --log-dir)"
        )
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves a partial last line
        if isinstance(record, dict):
            records.append(record)
    if not any("step" in r and "event" not in r for r in records):
        raise NoMetricsError(f"{path}: no metric records (the run stopped before its first log)")
    return records


def run_label(records: list[dict[str, Any]], name: str) -> str:
    """Legend text: the run's world size, precision and comm hook from its start record."""
    start = next((r for r in records if r.get("event") == "start"), None)
    if start is None:
        return name
    parts = [f"ws={start['world_size']}"] if "world_size" in start else []
    parts += [str(start[k]) for k in ("precision",) if k in start]
    if "comm_hook" in start:
        parts.append(f"hook={start['comm_hook']}")
    return f"{name} ({', '.join(parts)})" if parts else name


def extract_series(records: list[dict[str, Any]]) -> dict[str, Series]:
    """Curves keyed by field: training fields from training records, eval_* from eval records.

    A resumed run appends to the same file and restarts its clock: later times are shifted by
    the last time seen before the new start record, so wall time keeps increasing. It resumes
    from its checkpoint's step, which may be earlier than the last one logged: the points after
    that step are replaced by the resumed run's, as the run's history now goes.
    """
    series: dict[str, Series] = {}
    offset, last_time = 0.0, 0.0
    for record in records:
        if record.get("event") == "start":
            offset = last_time
            if isinstance(record.get("step"), int):
                for s in series.values():
                    s.truncate_after(record["step"])
            continue
        if "step" not in record:
            continue
        time = record.get("time_s")
        if isinstance(time, (int, float)):
            time = offset + time
            last_time = time
        if "loss" in record:
            names = [k for k in TRAIN_FIELDS if k in record]
        else:
            names = [k for k in record if k.startswith("eval_") and k not in SKIPPED_EVAL_FIELDS]
        for name in names:
            value = record[name]
            if not isinstance(value, (int, float)):
                continue
            s = series.setdefault(name, Series())
            s.steps.append(int(record["step"]))
            s.times.append(time)
            s.values.append(float(value))
    return series


def panel_names(runs: list[Run]) -> list[str]:
    """Fields to draw, one panel row each: loss, eval metrics, then the other training fields."""
    present = {name for run in runs for name in run.series}
    evals = sorted(name for name in present if name.startswith("eval_"))
    order = ["loss", *evals, *TRAIN_FIELDS[1:]]
    return [name for name in order if name in present]


def split_runs(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The records of each run a metrics.jsonl holds, in order, runs without metrics left out.

    A start record at step 0 begins a fresh run (the same log_dir reused without resuming); a
    resumed run's start record carries the step it resumed at and continues the run before it.
    """
    runs: list[list[dict[str, Any]]] = []
    for record in records:
        if not runs or (record.get("event") == "start" and record.get("step") == 0):
            runs.append([])
        runs[-1].append(record)
    return [run for run in runs if any("step" in r and "event" not in r for r in run)]


def load_runs(run_dir: str | os.PathLike) -> list[Run]:
    """Read a run directory into one Run per run its metrics.jsonl holds (`name #k` when it
    holds several); NoMetricsError if it has no metrics."""
    parts = split_runs(read_records(run_dir))
    name = Path(run_dir).resolve().name
    names = [name] if len(parts) == 1 else [f"{name} #{k}" for k in range(1, len(parts) + 1)]
    return [
        Run(Path(run_dir), run_label(part, label), extract_series(part))
        for label, part in zip(names, parts, strict=True)
    ]


def draw_curves(runs: list[Run], out: str | os.PathLike) -> None:
    """One row per field, against step (left) and wall time (right); runs overlaid."""
    plt = pyplot()
    names = panel_names(runs)
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 2.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        for col, against in enumerate(("step", "wall time (s)")):
            ax = axes[row][col]
            for i, run in enumerate(runs):
                s = run.series.get(name)
                if s is None:
                    continue
                # Markers where points are few (evals; a run that logged once): a lone point
                # drawn as a line is invisible.
                style = "o-" if name.startswith("eval_") or len(s.values) < 3 else "-"
                color = f"C{i}"
                if col == 0:
                    ax.plot(s.steps, s.values, style, color=color, label=run.label, ms=3)
                else:
                    timed = [
                        (t, v) for t, v in zip(s.times, s.values, strict=True) if t is not None
                    ]
                    if timed:
                        ts, vs = zip(*timed, strict=True)
                        ax.plot(ts, vs, style, color=color, label=run.label, ms=3)
            ax.set_title(TITLES.get(name, name.replace("_", " ")), fontsize=10)
            ax.set_xlabel(against, fontsize=9)
            ax.grid(alpha=0.3)
            if name == "loss":
                ax.set_yscale("log")
            if row == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)

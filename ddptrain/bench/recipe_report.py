"""What `python -m ddptrain.bench --recipe` reports: samples/s per variant, the ratios, the
floor's lockstep bound, the table and the chart (pure, but for the chart's file)."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path
from typing import Any


def lockstep_bound(step_ends: list[list[float]]) -> float:
    """The share of free-running processes' summed rate they would keep in lockstep through a
    meeting that costs nothing, each step as long as the slowest process's (pure).

    step_ends: each process's optimizer-step end times, the same per-step work in all of them.
    Steps past the shortest trace are left out; NaN without two steps in every trace.
    """
    durations = [[b - a for a, b in itertools.pairwise(ends)] for ends in step_ends]
    n = min(len(d) for d in durations)
    if n == 0:
        return math.nan
    durations = [d[:n] for d in durations]
    free_rate = sum(1 / sum(d) for d in durations)
    lockstep_rate = len(durations) / sum(map(max, zip(*durations, strict=True)))
    return lockstep_rate / free_rate


def summarize(runs: list[dict[str, list[dict]]], settings: dict[str, Any]) -> dict[str, Any]:
    """Per-run, per-rank (samples, wall_s, the floor's step_ends) in; samples/s per variant,
    the ratios and the floor's lockstep bound out (pure)."""
    per_run: dict[str, list[float]] = {v: [] for v in runs[0]}
    for run in runs:
        for v, ranks in run.items():
            if v == "floor":
                # Independent processes: each keeps its own pace; their rates add up.
                rate = sum(r["samples"] / r["wall_s"] for r in ranks)
            else:
                # Synchronous: every rank waits for the slowest at each step.
                rate = sum(r["samples"] for r in ranks) / max(r["wall_s"] for r in ranks)
            per_run[v].append(rate)
    variants = {
        v: {
            "samples_per_s": statistics.median(rates),
            "runs": rates,
            "per_rank": [[_without_steps(rank) for rank in r[v]] for r in runs],
        }
        for v, rates in per_run.items()
    }
    rate = {v: row["samples_per_s"] for v, row in variants.items()}
    ratios, paired = {}, {}
    for other in ("standard", "floor"):
        if "ddptrain" in rate and other in rate:
            ratios[f"ddptrain_vs_{other}"] = rate["ddptrain"] / rate[other]
            # Each repeat's two runs were taken minutes apart at most, under that repeat's load.
            per_repeat = zip(per_run["ddptrain"], per_run[other], strict=True)
            paired[f"ddptrain_vs_{other}"] = statistics.median(d / o for d, o in per_repeat)
    result = {"settings": settings, "variants": variants, "ratios": ratios, "paired": paired}
    if (
        "floor" in per_run
        and not oversubscribed(settings)
        and all("step_ends" in rank for run in runs for rank in run["floor"])
    ):
        bounds = [lockstep_bound([rank["step_ends"] for rank in run["floor"]]) for run in runs]
        result["floor_lockstep_bound"] = {"median": statistics.median(bounds), "runs": bounds}
    return result


def oversubscribed(settings: dict[str, Any]) -> bool:
    """More ranks than cores: the scheduler's time slices, which lockstep changes, set the
    floor's step times rather than jitter, so its lockstep bound would say nothing."""
    cores = settings.get("machine", {}).get("cpu_count") or math.inf
    return settings.get("world_size", 1) > cores


def _without_steps(rank: dict) -> dict:
    """A rank's figures for the JSON: its step times are summed up in the lockstep bound."""
    return {k: v for k, v in rank.items() if k != "step_ends"}


def format_table(result: dict[str, Any]) -> str:
    """The table printed at the end of a run."""
    lines = [f"{'variant':<10} {'samples/s':>10}  runs"]
    for v, row in result["variants"].items():
        runs = ", ".join(f"{r:.0f}" for r in row["runs"])
        lines.append(f"{v:<10} {row['samples_per_s']:>10.0f}  {runs}")
    paired = result.get("paired", {})
    lines += [
        f"{name}: {value:.3f} (paired: median of each repeat's ratio {paired[name]:.3f})"
        if name in paired
        else f"{name}: {value:.3f}"
        for name, value in result["ratios"].items()
    ]
    settings = result.get("settings", {})
    if bound := result.get("floor_lockstep_bound"):
        runs = ", ".join(f"{b:.3f}" for b in bound["runs"])
        lines.append(
            f"floor_lockstep_bound: {bound['median']:.3f} ({runs}): the floor's rate kept if its "
            "processes met at every step at no cost (the most any synchronous run reaches here)"
        )
    elif oversubscribed(settings):
        lines.append(
            f"floor_lockstep_bound: not given, {settings['world_size']} ranks share "
            f"{settings['machine']['cpu_count']} cores (time slices, not jitter, set the floor's "
            "steps)"
        )
    return "\n".join(lines)


def chart_title(result: dict[str, Any]) -> str:
    """What was run (model, data, world size, steps, the recipe flags given), then the ratios."""
    s = result["settings"]
    flags = " ".join(s.get("recipe_args") or [])
    model = {"lenet": "LeNet", "mlp": "MLP"}[s.get("model", "lenet")]  # older JSON: LeNet only
    run = f"{model}, {s['data']}, world size {s['world_size']}, {s['steps']} steps"
    ratios = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in result["ratios"].items())
    return f"{run}{f' ({flags})' if flags else ''}\n{ratios}"


def plot(result: dict[str, Any], path: Path) -> bool:
    """Bar chart of samples/s (median; a dot per repeat) with the ratios in the title; False when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(result["variants"])
    rates = [result["variants"][v]["samples_per_s"] for v in names]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(names, rates, color=["tab:blue", "tab:orange", "tab:gray"][: len(names)])
    ax.bar_label(bars, fmt="%.0f", label_type="center", color="white")
    # Each repeat as a dot: the spread between repeats is what a ratio here must be read against.
    for i, name in enumerate(names):
        runs = result["variants"][name]["runs"]
        label = "each repeat" if i == 0 and len(runs) > 1 else None
        ax.scatter([i] * len(runs), runs, s=14, color="black", zorder=3, label=label)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    ax.margins(y=0.08)
    ax.set_ylabel("training samples/s (higher is better)")
    ax.set_title(chart_title(result), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

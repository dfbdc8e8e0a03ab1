"""What `python -m ddptrain.plan` shows: the table, the choice, the chart, predicted vs measured.

print(format_table(predictions))            # per strategy and world size
print(format_choice(predictions, [1, 2, 4])) # the largest efficient world size, its strategy
print(text_chart(predictions))              # step time and memory against world size, as bars
print(format_check(rows))                   # predicted, measured, ratio, rounds apart
print(format_picks(rows))                   # the plan's pick against the measured fastest
plot(predictions, rows, Path("plan.png"))   # step time and memory against world size
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ddptrain.plan.predict import (
    NEAR,
    Prediction,
    close_to_pick,
    largest_efficient,
    pick,
    simplest_near,
)
from ddptrain.plot._mpl import MissingMatplotlib, pyplot

MIB = 2**20


def _strategy(pred: Prediction) -> str:
    s = pred.setup
    return f"powersgd-r{s['powersgd_rank']}" if s["strategy"] == "powersgd" else s["strategy"]


def format_table(predictions: list[Prediction]) -> str:
    """One row per strategy and world size."""
    head = (
        f"{'strategy':<12} {'ranks':>5} {'step ms':>9} {'samples/s':>10} {'efficiency':>10} "
        f"{'exposed comm ms':>15} {'peak MiB':>9} {'fits':>5}"
    )
    lines = [head]
    for pred in predictions:
        for p in pred.points:
            eff = "-" if p.efficiency is None else f"{p.efficiency:.2f}"
            fits = "-" if p.fits is None else ("yes" if p.fits else "NO")
            lines.append(
                f"{_strategy(pred):<12} {p.world_size:>5} {1e3 * p.step_s:>9.1f} "
                f"{p.samples_per_s:>10.0f} {eff:>10} {1e3 * p.exposed_comm_s:>15.1f} "
                f"{p.peak_bytes / MIB:>9.1f} {fits:>5}"
            )
    return "\n".join(lines)


def format_choice(predictions: list[Prediction], world_sizes: list[int]) -> str:
    """The strategy picked at each world size, and the largest one keeping 80% efficiency."""
    picks = []
    for n in world_sizes:
        chosen = pick(predictions, n)
        close = ", ".join(_strategy(p) for p in close_to_pick(predictions, n))
        also = f" ({close} within {NEAR:.0%})" if close else ""
        picks.append(f"{n}: {_strategy(chosen)}{also}" if chosen else f"{n}: none fits")
    best = largest_efficient(predictions, world_sizes)
    if best is None:
        verdict = "no world size keeps scaling efficiency >= 80%"
    else:
        n, chosen = best
        eff = chosen.at(n).efficiency
        verdict = (
            f"largest world size keeping scaling efficiency >= 80%: {n}, with {_strategy(chosen)} "
            f"(efficiency {eff:.2f})"
        )
    head = f"picked (the simplest within {NEAR:.0%} of the fastest that fit)"
    return f"{head}: {', '.join(picks)}\n{verdict}"


def text_chart(predictions: list[Prediction], width: int = 40) -> str:
    """Step time and peak memory against world size as bars, one block per strategy: step
    bars from zero, memory bars from the smallest peak (the header says which)."""
    points = [p for pred in predictions for p in pred.points]
    if not points:
        return ""
    longest = max(p.step_s for p in points)
    least, most = min(p.peak_bytes for p in points), max(p.peak_bytes for p in points)
    step_head = f"step time, 0-{1e3 * longest:.1f} ms"
    lines = [f"{'':<12} {'ranks':>5}  {step_head:<{width}}  "
             f"peak memory, {least / MIB:.0f}-{most / MIB:.0f} MiB"]  # fmt: skip
    for pred in predictions:
        for p in pred.points:
            step = "#" * max(1, round(width * p.step_s / longest))
            share = (p.peak_bytes - least) / (most - least) if most > least else 1.0
            peak = "=" * max(1, round(width * share))
            lines.append(f"{_strategy(pred):<12} {p.world_size:>5}  {step:<{width}}  {peak}")
    return "\n".join(lines)


def format_check(rows: list[dict[str, Any]]) -> str:
    """Predicted against measured, with the ratio, one row per configuration run; with rounds,
    how far apart they measured (check.rounds_apart)."""
    head = (
        f"{'configuration':<34} {'step ms: pred':>13} {'meas':>8} {'ratio':>6} {'apart':>6}   "
        f"{'peak MiB: pred':>14} {'meas':>7} {'ratio':>6}  {'bg':>4}"
    )
    lines = [head]
    for r in rows:
        apart = r.get("rounds_apart")
        lines.append(
            f"{r['configuration']:<34} {1e3 * r['predicted_step_s']:>13.1f} "
            f"{1e3 * r['measured_step_s']:>8.1f} {r['step_ratio']:>6.2f} "
            f"{'-' if apart is None else f'{100 * apart:.0f}%':>6}   "
            f"{r['predicted_peak_bytes'] / MIB:>14.1f} {r['measured_peak_bytes'] / MIB:>7.1f} "
            f"{r['peak_ratio']:>6.2f}  {r['background_threads']:>4.1f}"
        )
    if rows:
        within_time = sum(abs(r["step_ratio"] - 1) <= 0.15 for r in rows)
        within_mem = sum(abs(r["peak_ratio"] - 1) <= 0.10 for r in rows)
        lines.append(
            f"step time within 15%: {within_time} of {len(rows)}; peak memory within 10%: "
            f"{within_mem} of {len(rows)} (bg: busy threads of other programs before the run)"
        )
    aparts = [r["rounds_apart"] for r in rows if r.get("rounds_apart") is not None]
    if aparts:
        lines.append(
            f"apart: the rounds of one configuration measured up to {100 * max(aparts):.0f}% "
            f"apart (median {100 * statistics.median(aparts):.0f}%); no prediction can be "
            "judged closer to a run than that"
        )
    return "\n".join(lines)


def format_picks(rows: list[dict[str, Any]]) -> str:
    """Per model, link and world size run: the strategy the plan picks (predict.pick's rule)
    against the one measured fastest, among the strategies --check ran."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["setup"]["model"], r["link"], r["world_size"]), []).append(r)
    lines, agree, close = [], 0, 0
    for (model, link, n), group in groups.items():
        predicted = simplest_near(
            group, lambda r: r["predicted_step_s"], lambda r: r["setup"]["strategy"]
        )
        measured = min(group, key=lambda r: r["measured_step_s"])
        same = predicted is measured
        agree += same
        name = f"{model} ws{n} {link}"
        slower = predicted["measured_step_s"] / measured["measured_step_s"]
        close += slower <= 1.0 + NEAR
        verdict = "same" if same else f"DIFFERS: the pick measured {slower:.2f}x the best"
        lines.append(
            f"{name:<22} picked {_label(predicted):<12} measured best {_label(measured):<12} "
            f"{verdict}"
        )
    if groups:
        lines.append(
            f"picked strategy is the measured best in {agree} of {len(groups)} cases, "
            f"measured within {NEAR:.0%} of the best in {close} of {len(groups)}"
        )
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    s = row["setup"]
    return f"powersgd-r{s['powersgd_rank']}" if s["strategy"] == "powersgd" else s["strategy"]


def plot(predictions: list[Prediction], rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Step time and peak memory against world size, per strategy; measured points where
    --check ran. False when matplotlib (extra "plot") is missing."""
    try:
        plt = pyplot()
    except MissingMatplotlib:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, pred in enumerate(predictions):
        color = f"C{i}"
        sizes = [p.world_size for p in pred.points]
        label = _strategy(pred)
        left.plot(sizes, [1e3 * p.step_s for p in pred.points], "o-", color=color, label=label)
        right.plot(sizes, [p.peak_bytes / MIB for p in pred.points], "o-", color=color, label=label)
        mine = [r for r in rows if r["setup"] == pred.setup]
        if mine:
            ws = [r["world_size"] for r in mine]
            left.plot(ws, [1e3 * r["measured_step_s"] for r in mine], "x", color=color, ms=9)
            right.plot(ws, [r["measured_peak_bytes"] / MIB for r in mine], "x", color=color, ms=9)
    left.set_ylabel("step time, ms (lines: predicted; x: measured)")
    right.set_ylabel("peak memory per rank, MiB")
    for ax in (left, right):
        ax.set_xlabel("world size")
        if max((p.world_size for pr in predictions for p in pr.points), default=1) > 16:
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

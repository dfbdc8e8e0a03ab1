"""A compute/communication timeline from the Chrome traces that profile_steps writes.

    spans = load_spans(["runs/x/trace-rank0.json", "runs/x/trace-rank1.json"])
    draw_timeline(spans, "timeline.png")                  # needs matplotlib

Each rank gets a lane of two rows: its training thread (data, forward, backward, optimizer,
and the exposed wait for buckets drawn over the backward it ends) and its communication in
flight (the shared-memory reductions, on whichever thread ran them; with the backend's
all_reduce, each bucket from its launch to the end of its wait). Ranks on one host share a
clock, so traces are aligned on absolute time. trace_spans is pure and unit-tested.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ddptrain.plot._mpl import pyplot

# record_function names (see ddptrain.profiling) -> what they are on the training thread.
STEP_KINDS = {
    "ddptrain.data": "data",
    "ddptrain.forward": "forward",
    "ddptrain.backward": "backward",
    "ddptrain.optimizer": "optimizer",
    "ddptrain.wait bucket": "exposed comm (wait)",
}
COMM_KIND = "reduction in flight"
# The wrapper's reduction of a bucket through its comm hook, on the thread that runs it
# (ddp/reducer.py).
REDUCTION_MARKS = ("ddptrain.reduce bucket",)
COLORS = {
    "data": "#9e9e9e",
    "forward": "#4c9be8",
    "backward": "#1f5fa8",
    "optimizer": "#7fbf7f",
    "exposed comm (wait)": "#d62728",
    COMM_KIND: "#ff9f40",
}
ROWS = ("step", "comm")


@dataclass(frozen=True)
class Span:
    """One interval of one rank's timeline, in seconds of absolute (host) time."""

    rank: int
    row: str
    kind: str
    start_s: float
    dur_s: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


def read_trace(path: str | os.PathLike) -> dict[str, Any]:
    """A Chrome trace file as a dict; ValueError naming the file if it is not one."""
    with open(path, encoding="utf-8") as f:
        try:
            trace = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}: not a Chrome trace (invalid JSON: {e}); pass the trace-rank<r>.json "
                "files profile_steps wrote, from a run that finished its profiled steps"
            ) from None
    if not isinstance(trace, dict):
        raise ValueError(f"{path}: not a Chrome trace (a JSON {type(trace).__name__})")
    return trace


def trace_rank(trace: dict[str, Any], fallback: int) -> int:
    """The rank the profiler recorded in the trace, else `fallback`."""
    info = trace.get("distributedInfo") or {}
    return int(info["rank"]) if "rank" in info else fallback


def trace_spans(trace: dict[str, Any], rank: int) -> list[Span]:
    """ddptrain's marked spans of one trace as Spans (pure)."""
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    marks = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ddptrain.")
    ]
    spans: list[Span] = []
    launches: dict[int, list[float]] = {}
    waits: dict[int, list[float]] = {}
    reductions = False
    for e in marks:
        name = e["name"]
        start, dur = (base_us + float(e["ts"])) / 1e6, float(e.get("dur", 0)) / 1e6
        kind = STEP_KINDS.get(name.rsplit(" ", 1)[0] if name[-1].isdigit() else name)
        if kind is not None:
            spans.append(Span(rank, "step", kind, start, dur))
        if name.startswith(REDUCTION_MARKS):
            reductions = True
            spans.append(Span(rank, "comm", COMM_KIND, start, dur))
        elif name.startswith(("ddptrain.launch bucket", "ddptrain.wait bucket")):
            bucket = int(name.rsplit(" ", 1)[1])
            table = launches if "launch" in name else waits
            table.setdefault(bucket, []).append(start if table is launches else start + dur)
    if not reductions:
        # A trace without reduction marks: a bucket is in flight from its launch to its wait's end.
        for bucket, starts in launches.items():
            for start, end in zip(sorted(starts), sorted(waits.get(bucket, [])), strict=False):
                spans.append(Span(rank, "comm", COMM_KIND, start, max(0.0, end - start)))
    return spans


def load_spans(paths: list[str | os.PathLike]) -> list[Span]:
    """Spans of every trace file, ranks taken from the traces."""
    spans: list[Span] = []
    for i, path in enumerate(paths):
        trace = read_trace(path)
        spans += trace_spans(trace, trace_rank(trace, i))
    return spans


def draw_timeline(spans: list[Span], out: str | os.PathLike, title: str = "") -> None:
    """One lane per rank (training thread above, communication below), time from 0 in ms."""
    if not spans:
        raise ValueError("no ddptrain spans in the traces (were they written by profile_steps?)")
    plt = pyplot()
    t0 = min(s.start_s for s in spans)
    ranks = sorted({s.rank for s in spans})
    # Drawn in this order so the exposed wait lands on top of the backward it ends.
    order = [*STEP_KINDS.values(), COMM_KIND]
    fig, ax = plt.subplots(figsize=(12, 1.1 + 1.0 * len(ranks)))
    labels, ticks = [], []
    for lane, rank in enumerate(ranks):
        for r, row in enumerate(ROWS):
            y = -(lane * 2.6 + r)
            ticks.append(y)
            labels.append(f"rank {rank} {'step' if row == 'step' else 'comm'}")
            for kind in order:
                bars = [
                    ((s.start_s - t0) * 1e3, s.dur_s * 1e3)
                    for s in spans
                    if s.rank == rank and s.row == row and s.kind == kind
                ]
                if bars:
                    ax.broken_barh(bars, (y - 0.4, 0.8), color=COLORS[kind], label=kind)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(
        unique.values(),
        unique.keys(),
        fontsize=8,
        ncol=len(unique),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25),
    )
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "ddptrain timeline: compute vs communication per rank", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)

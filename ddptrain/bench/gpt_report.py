"""The GPT bench's numbers from its runs (pure): steady-state tokens/s and CPU per step, MFU
against a datasheet peak, the paired ratios, and the table (gpt.py runs the variants).
"""

from __future__ import annotations

import statistics
from typing import Any

# Dense peak FLOP/s per GPU by the recipe's --precision (bf16 on tensor cores; fp32 without
# TF32, torch's default for matrix products), from NVIDIA's datasheets for the SXM parts.
PEAK_FLOPS = {
    "H100": {"bf16": 989.4e12, "fp32": 66.9e12},
    "H200": {"bf16": 989.4e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
}
PEAK_SOURCE = "NVIDIA datasheets (H100/H200 SXM, A100 SXM), dense"

# (ddptrain's variant, the plain loop's): the rows of the table.
PAIRS = (
    ("ddptrain", "plain"),
    ("ddptrain_compiled", "plain_compiled"),
    ("ddptrain_zero3", "fully_shard"),
)


def steady_intervals(
    ends: list[tuple[float, float]], skip: int, eval_every: int
) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds between consecutive optimizer steps, after the first `skip` and
    leaving out each interval that holds an evaluation (pure)."""
    pairs = [
        (b[0] - a[0], b[1] - a[1])
        for step, (a, b) in enumerate(zip(ends, ends[1:], strict=False), start=1)
        if step > skip and step % eval_every != 0
    ]
    if not pairs:
        raise ValueError(f"no step interval left after --skip-steps {skip}; raise --steps")
    return [w for w, _ in pairs], [c for _, c in pairs]


def steady_tokens_per_s(
    ends: list[tuple[float, float]], tokens_per_step: int, skip: int, eval_every: int
) -> float:
    """Tokens a step over the median wall-clock interval of steady_intervals (pure). The
    median, not the mean: on a machine shared with other jobs, their bursts land on a few
    steps of one run."""
    wall, _ = steady_intervals(ends, skip, eval_every)
    return tokens_per_step / statistics.median(wall)


def cpu_ms_per_step(ends: list[tuple[float, float]], skip: int, eval_every: int) -> float:
    """The median CPU milliseconds of a step on one rank, every thread's (pure): the work a
    loop costs, which other jobs on the machine inflate far less than its wall time."""
    return 1e3 * statistics.median(steady_intervals(ends, skip, eval_every)[1])


def peak_flops(device: str, precision: str) -> float | None:
    """The datasheet's dense peak FLOP/s of a GPU named `device` at `precision` (pure); None
    where the table has no such GPU (a CPU, another card: --peak-tflops gives it)."""
    for name, peaks in PEAK_FLOPS.items():
        if name in device:
            return peaks.get(precision)
    return None


def summarize(runs: list[dict[str, dict]], settings: dict[str, Any]) -> dict[str, Any]:
    """Per-repeat raw runs in, tokens/s, ratios and validation curves out (pure). With
    settings' peak_flops, each variant's MFU: flops_per_token x tokens/s over that peak."""
    skip, every = settings["skip_steps"], settings["eval_every"]
    rates: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for run in runs:
        for v, per_rank in run.items():
            # A step is as slow as the slowest rank: each rank's rate, the lowest one.
            rate = min(
                steady_tokens_per_s(r["ends"], r["tokens_per_step"], skip, every) for r in per_rank
            )
            rates.setdefault(v, []).append(rate)
            ms = statistics.fmean(cpu_ms_per_step(r["ends"], skip, every) for r in per_rank)
            cpu.setdefault(v, []).append(ms)
    variants = {}
    for v, rs in rates.items():
        last = runs[-1][v][0]
        variants[v] = {
            "tokens_per_s": statistics.median(rs),
            "tokens_per_s_runs": rs,
            "cpu_ms_per_step": statistics.median(cpu[v]),
            "cpu_ms_per_step_runs": cpu[v],
            "wall_s": last["wall_s"],
            "curve": last["curve"],
            "final_bpb": last["curve"][-1][1] if last["curve"] else None,
        }
        if settings.get("peak_flops"):
            achieved = settings["flops_per_token"] * statistics.median(rs)
            variants[v]["mfu"] = achieved / settings["peak_flops"]
    pairs = []
    for ours, theirs in PAIRS:
        if ours in variants and theirs in variants:
            a, b = variants[ours], variants[theirs]
            paired = statistics.median(
                x / y for x, y in zip(rates[ours], rates[theirs], strict=True)
            )
            gap = (
                max(abs(p[1] - q[1]) for p, q in zip(a["curve"], b["curve"], strict=False))
                if a["curve"] and b["curve"]
                else None
            )
            pairs.append(
                {
                    "ddptrain": ours,
                    "plain": theirs,
                    "ratio": a["tokens_per_s"] / b["tokens_per_s"],
                    "paired": paired,
                    "cpu_ratio": a["cpu_ms_per_step"] / b["cpu_ms_per_step"],
                    "max_curve_gap_bpb": gap,
                }
            )
    noise = None
    if "plain" in variants and "plain_seed2" in variants:
        a, b = variants["plain"]["curve"], variants["plain_seed2"]["curve"]
        noise = max(abs(p[1] - q[1]) for p, q in zip(a, b, strict=False)) if a and b else None
    return {"settings": settings, "variants": variants, "pairs": pairs, "seed_gap_bpb": noise}


def format_table(result: dict[str, Any]) -> str:
    """The tables printed at the end of a run."""
    v = result["variants"]
    lines = [
        f"{'ddptrain':>18} {'tokens/s':>9} {'plain loop':>14} {'tokens/s':>9} {'ratio':>6} "
        f"{'paired':>6} {'cpu ms/step':>12} {'cpu':>6} {'bpb':>6} {'bpb':>6} {'max gap':>7}"
    ]
    for p in result["pairs"]:
        a, b = v[p["ddptrain"]], v[p["plain"]]
        gap = "-" if p["max_curve_gap_bpb"] is None else f"{p['max_curve_gap_bpb']:.3f}"
        cpu_ms = f"{a['cpu_ms_per_step']:.0f}/{b['cpu_ms_per_step']:.0f}"
        lines.append(
            f"{p['ddptrain']:>18} {a['tokens_per_s']:>9.0f} {p['plain']:>14} "
            f"{b['tokens_per_s']:>9.0f} {p['ratio']:>6.3f} {p['paired']:>6.3f} {cpu_ms:>12} "
            f"{p['cpu_ratio']:>6.3f} {_bpb(a):>6} {_bpb(b):>6} {gap:>7}"
        )
    if result["seed_gap_bpb"] is not None:
        lines.append(
            f"run-to-run: plain vs plain_seed2 (next seed) curves differ by up to "
            f"{result['seed_gap_bpb']:.3f} bits per byte"
        )
    if any("mfu" in x for x in v.values()):
        s = result["settings"]
        lines += ["", f"MFU against {s['peak_flops'] / 1e12:.1f} TFLOP/s ({s['peak_source']}):"]
        lines += [f"{name:<33} {x['mfu']:>6.1%}" for name, x in v.items() if "mfu" in x]
    steps = sorted({s for x in v.values() for s, _ in x["curve"]})
    lines += ["", "validation bits per byte at step " + " ".join(f"{s:>6}" for s in steps)]
    for name, x in v.items():
        at = dict(x["curve"])
        cells = " ".join(f"{at[s]:>6.3f}" if s in at else f"{'-':>6}" for s in steps)
        lines.append(f"{name:<33} {cells}")
    s = result["settings"]
    load = ", ".join(f"{x:.2f}" for x in s["load_avg_1m_before_after"])
    lines.append(
        f"world size {s['world_size']}, {s['steps']} steps, {s['repeats']} repeat(s), "
        f"load average (1 min) before/after: {load}"
    )
    return "\n".join(lines)


def _bpb(variant: dict) -> str:
    return "-" if variant["final_bpb"] is None else f"{variant['final_bpb']:.3f}"

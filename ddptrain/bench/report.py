"""Reporting for `python -m ddptrain.bench`: raw per-rank timings to medians, tables, a chart.

result = summarize(raw_per_rank, settings)   # pure: medians, ratios, exposed comm, GB/s
print(format_table(result))
plot(result, Path("bench.png"))             # needs matplotlib (extra "plot")
plot_throughput(result, Path("bench.png"), "two hosts, 1gbit")   # samples/s per variant
"""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch


def summarize(raw: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """Per-rank raw timings in, medians/ratios/bandwidths out (pure)."""
    models = {}
    for name in raw[0]["models"]:
        per_rank = [r["models"][name]["timings"] for r in raw]
        # A step is as slow as its slowest rank: the others wait for it at the next collective.
        step_s = {
            v: [max(ts) for ts in zip(*(t[v] for t in per_rank), strict=True)] for v in per_rank[0]
        }
        med_ms = {v: 1e3 * statistics.median(ts) for v, ts in step_s.items()}
        per_rank_cpu = [r["models"][name]["cpu"] for r in raw]
        cpu_ms = {
            v: 1e3
            * statistics.median(
                statistics.fmean(c) for c in zip(*(t[v] for t in per_rank_cpu), strict=True)
            )
            for v in per_rank_cpu[0]
        }
        floor, official = med_ms.get("local"), med_ms.get("torch_ddp")
        batch = settings.get("batch_size_per_rank", {}).get(name)
        samples = batch * settings["world_size"] if batch else None
        variants = {}
        for v, ms in med_ms.items():
            if v == "comm_alone":
                continue
            variants[v] = {
                "median_ms": ms,
                "samples_per_s": samples / (ms / 1e3) if samples else None,
                "p25_ms": 1e3 * _quantile(step_s[v], 0.25),
                "p75_ms": 1e3 * _quantile(step_s[v], 0.75),
                "cpu_ms": cpu_ms[v],
                "vs_torch_ddp": ms / official if official else None,
                # Median of step-by-step ratios: each pair ran back to back, under the same load.
                "vs_torch_ddp_paired": _paired(step_s[v], step_s["torch_ddp"])
                if official
                else None,
                "vs_local": ms / floor if floor else None,
                "exposed_comm_ms": ms - floor if floor is not None and v != "local" else None,
            }
        entry: dict[str, Any] = {
            "params": raw[0]["models"][name]["params"],
            "bucket_bytes": raw[0]["models"][name]["bucket_bytes"],
            "variants": variants,
        }
        if raw[0]["models"][name].get("powersgd_elements"):
            # Per variant: (gradient elements, elements sent) per step.
            entry["powersgd_elements"] = raw[0]["models"][name]["powersgd_elements"]
        if "torch_fsdp" in step_s:
            # The sharded variants against torch's fully_shard, step by step as above.
            theirs = step_s["torch_fsdp"]
            entry["vs_torch_fsdp_paired"] = {
                v: _paired(step_s[v], theirs) for v in ("zero2", "zero3") if v in step_s
            }
        if "comm_alone" in med_ms and "ddptrain" in variants:
            exposed = variants["ddptrain"]["exposed_comm_ms"]
            entry["comm_alone_ms"] = med_ms["comm_alone"]
            entry["hidden_fraction"] = 1 - exposed / med_ms["comm_alone"]
        models[name] = entry
    out: dict[str, Any] = {"settings": settings, "models": models}
    if "ring" in raw[0]:
        out["ring"] = _summarize_ring([r["ring"] for r in raw])
    return out


def _summarize_ring(per_rank: list[dict[str, dict[int, list[float]]]]) -> list[dict[str, Any]]:
    rows = []
    for mb in per_rank[0]["ring"]:
        row: dict[str, Any] = {"size_mb": int(mb)}
        for kind in per_rank[0]:
            seconds = statistics.median(
                max(ts) for ts in zip(*(r[kind][mb] for r in per_rank), strict=True)
            )
            row[f"{kind}_ms"] = 1e3 * seconds
            # Algorithm bandwidth: tensor bytes / time, the number nccl-tests call algbw.
            row[f"{kind}_gbps"] = mb * 2**20 / seconds / 1e9
        row["ring_vs_backend"] = row["ring_gbps"] / row["backend_gbps"]
        if "shm_ms" in row and "add_copy_ms" in row:
            row["shm_vs_bound"] = row["shm_ms"] / row["add_copy_ms"]
        rows.append(row)
    return rows


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def format_table(result: dict[str, Any]) -> str:
    """The human-readable tables printed at the end of a run."""
    width = max([14] + [len(v) for e in result["models"].values() for v in e["variants"]])
    lines = [
        f"{'model':<8} {'variant':<{width}} {'ms/step':>8} {'p25-p75':>13} {'vs DDP':>7} "
        f"{'paired':>7} {'vs local':>8} {'exposed ms':>10} {'cpu ms':>7} {'samples/s':>9}"
    ]
    for name, entry in result["models"].items():
        for v, row in entry["variants"].items():
            spread = f"{row['p25_ms']:.1f}-{row['p75_ms']:.1f}"
            paired = _fmt(row["vs_torch_ddp_paired"], ".3f")
            lines.append(
                f"{name:<8} {v:<{width}} {row['median_ms']:>8.2f} {spread:>13} "
                f"{_fmt(row['vs_torch_ddp'], '.3f'):>7} {paired:>7} "
                f"{_fmt(row['vs_local'], '.2f'):>8} {_fmt(row['exposed_comm_ms'], '.2f'):>10} "
                f"{row['cpu_ms']:>7.1f} {_fmt(row['samples_per_s'], '.0f'):>9}"
            )
        for v, (total, sent) in entry.get("powersgd_elements", {}).items():
            lines.append(
                f"{name:<8} {v} sends {sent:,} of {total:,} gradient elements a step "
                f"({total / sent:.0f}x fewer)"
            )
        if "comm_alone_ms" in entry:
            hidden = entry["hidden_fraction"]
            if hidden > 1:
                verdict = "all of it (exposed <= 0, within noise)"
            elif hidden < 0:
                verdict = "none: exposed > comm alone (filling buckets, CPU contention)"
            else:
                verdict = f"{100 * hidden:.0f}%"
            lines.append(
                f"{name:<8} ddptrain comm alone {entry['comm_alone_ms']:.2f} ms over "
                f"{len(entry['bucket_bytes'])} buckets; hidden behind backward: {verdict}"
            )
        for v, ratio in entry.get("vs_torch_fsdp_paired", {}).items():
            lines.append(f"{name:<8} {v} / torch_fsdp step time, paired median: {ratio:.3f}")
    if "ring" in result:
        kinds = [k[:-3] for k in result["ring"][0] if k.endswith("_ms")]
        lines += ["", f"{'size MB':>7} " + " ".join(f"{k + ' GB/s':>12}" for k in kinds)]
        lines[-1] += f" {'ring/backend':>12} {'shm/add_copy':>12}"
        for r in result["ring"]:
            cells = " ".join(f"{r[k + '_gbps']:>12.3f}" for k in kinds)
            bound = _fmt(r.get("shm_vs_bound"), ".2f")
            lines.append(f"{r['size_mb']:>7} {cells} {r['ring_vs_backend']:>12.2f} {bound:>12}")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plot(result: dict[str, Any], path: Path) -> bool:
    """Write the chart; False when matplotlib (extra "plot") is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = 2 if "ring" in result else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    names = list(result["models"])
    variants = list(result["models"][names[0]]["variants"])
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ratios = [result["models"][m]["variants"][v]["vs_torch_ddp"] or 0 for m in names]
        ax.bar([j + i * width for j in range(len(names))], ratios, width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("median step time / official DDP's (lower is better)")
    s = result["settings"]
    ax.set_title(f"world size {s['world_size']}, {s['backend']}, medians of blocks of steps")
    ax.legend(fontsize=7, ncol=2)
    if panels == 2:
        ax = axes[0][1]
        sizes = [r["size_mb"] for r in result["ring"]]
        labels = {
            "ring": "hand-written ring",
            "backend": "backend all_reduce",
            "shm": "shared memory",
            "add_copy": "bound: one thread's add + copy",
        }
        for kind, label in labels.items():
            if f"{kind}_gbps" in result["ring"][0]:
                ax.plot(sizes, [r[f"{kind}_gbps"] for r in result["ring"]], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(mb) for mb in sizes])
        ax.set_xlabel("tensor size (MiB, float32)")
        ax.set_ylabel("algorithm bandwidth (GB/s)")
        ax.set_title("all_reduce bandwidth")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_throughput(result: dict[str, Any], path: Path, title: str) -> bool:
    """Write a chart of samples/s per variant, one panel per model, the no-communication floor
    ("local") drawn as a line; False when matplotlib (extra "plot") is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(result["models"])
    fig, axes = plt.subplots(len(names), 1, figsize=(7.5, 0.6 + 0.45 * 12 * len(names)))
    for ax, name in zip([axes] if len(names) == 1 else axes, names, strict=True):
        rows = result["models"][name]["variants"]
        variants = [v for v in rows if v not in ("local", "comm_alone")]
        rates = [rows[v]["samples_per_s"] or 0 for v in variants]
        ax.barh(variants, rates, color="tab:blue")
        floor = rows.get("local", {}).get("samples_per_s")
        if floor:
            ax.axvline(floor, color="black", linestyle="--")
            ax.text(floor, len(variants) - 0.5, "no-communication floor ", ha="right", fontsize=8)
            ax.set_xlim(0, 1.12 * max([floor, *rates]))
        for y, rate in enumerate(rates):
            ax.text(rate, y, f" {rate:.0f}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("samples/s (median step; higher is better)")
        ax.set_title(f"{name}: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# CPU flags that decide which kernels torch runs: the same model name ("AMD EPYC") covers VMs
# whose step times differ by 3x, so the JSON keeps what tells them apart.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_description(cpuinfo: str) -> dict[str, Any]:
    """Model name, family/model/stepping and kernel-relevant flags of the first CPU listed in
    /proc/cpuinfo's text (pure; absent fields are None)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: a VM's vCPUs are alike
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    family, model, stepping = (fields.get(k) for k in ("cpu family", "model", "stepping"))
    return {
        "cpu": fields.get("model name"),
        "cpu_id": f"family {family} model {model} stepping {stepping}" if family else None,
        "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
    }


def machine() -> dict[str, Any]:
    """The CPU (model, family, flags and the kernels torch picked), core count, platform and
    library versions the numbers were taken on."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = cpu_description(f.read())
    except OSError:
        cpu = cpu_description("")
    cpu["cpu"] = cpu["cpu"] or platform.processor()
    return {
        **cpu,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }

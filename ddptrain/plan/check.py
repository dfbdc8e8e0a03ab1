"""The prediction against the run: the same setup trained for real, where this machine can.

    measured = run_local(setup, world_size=4)          # ranks spawned on this host
    measured = run_two_hosts(setup, "1gbit")           # two network namespaces, tc-shaped (root)
    row = compare(setup, point, measured, "local", background=0.4)

One host: ddptrain.spawn starts the ranks (run.py's loop): CPU ranks with gloo, CUDA ranks with
NCCL, one GPU each, so a CUDA check runs at most as many ranks as there are GPUs
(`beyond_gpus`). Two hosts (CPU ranks): as `python -m
ddptrain.bench --two-hosts --link RATE` does (bench/hosts.py, bench/link.py, ddptrain.netns):
two network namespaces joined by a veth pair, each with a /dev/shm of its own, the veth shaped
both ways with tc tbf and probed, one torchrun a host running `python -m ddptrain.plan.run`.
Measured: the median over blocks of the slowest rank's seconds per step, and the largest peak
RSS (on CUDA: max_memory_allocated) of any rank while training; `combine` makes rounds of
one setup (--check --rounds) one measurement. `wait_for_quiet` holds a run
back while other programs keep the cores busy, up to a limit, and says how busy they were.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ddptrain
from ddptrain.bench import link as bench_link
from ddptrain.bench.hosts import RunFailed, run_launchers, terminate_as_exit
from ddptrain.launch.spawn import WorkerError
from ddptrain.netns import torchrun, two_hosts
from ddptrain.plan.load import background_threads
from ddptrain.plan.predict import Point
from ddptrain.plan.profile import start_method
from ddptrain.plan.run import Steps, run_rank
from ddptrain.plan.setup import Setup, rank_env


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank results in; the step (median of each block's slowest rank) and the peak out."""
    blocks = [max(s) for s in zip(*(r["step_s"] for r in ranks), strict=True)]
    return {
        "step_s": statistics.median(blocks),
        "peak_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "rss_before_model_bytes": max(r["rss_before_model_bytes"] for r in ranks),
        "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks),
        "block_step_s": blocks,
        "block_steps": ranks[0].get("block_steps"),
        "devices": sorted({r.get("device", "cpu") for r in ranks}),
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one setup as one measurement: the median over all their blocks, the largest
    peaks, each round's step under "round_step_s"; one run is itself."""
    if len(runs) == 1:
        return runs[0]
    blocks = [b for r in runs for b in r["block_step_s"]]
    out = {**runs[0], "step_s": statistics.median(blocks), "block_step_s": blocks}
    out["round_step_s"] = [r["step_s"] for r in runs]
    for key in ("peak_bytes", "rss_before_model_bytes", "max_rss_bytes"):
        out[key] = max(r[key] for r in runs)
    return out


def rounds_apart(measured: dict[str, Any]) -> float | None:
    """How far apart the rounds of one setup measured: the slowest round's step over the
    fastest's, less 1 (0.2: 20% apart); None for a single round. A prediction cannot be judged
    closer to the run than the runs come to each other."""
    steps = measured.get("round_step_s") or []
    if len(steps) < 2 or min(steps) <= 0:
        return None
    return max(steps) / min(steps) - 1


def beyond_gpus(world_sizes: list[int], gpus: int) -> list[int]:
    """The world sizes a CUDA check cannot run on `gpus` GPUs: NCCL wants a GPU per rank."""
    return [n for n in world_sizes if n > gpus]


def run_local(
    setup: Setup, world_size: int, steps: Steps | None = None, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Train `setup` on `world_size` spawned ranks of this host; summarize()'s figures."""
    if setup.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if beyond_gpus([world_size], gpus):
            raise ValueError(
                f"world size {world_size} on cuda needs {world_size} GPUs (NCCL, one per rank); "
                f"this machine has {gpus}"
            )
    ranks = ddptrain.spawn(
        run_rank,
        world_size,
        setup.as_dict(),
        steps or Steps(),
        timeout_s=timeout_s,
        start_method=start_method(setup.device),
        env=rank_env(setup.device),
    )
    return summarize(ranks)


def run_two_hosts(
    setup: Setup, rate: str, steps: Steps | None = None, timeout_s: float = 1200.0
) -> dict[str, Any]:
    """Train `setup` on two fake hosts, one rank each, joined by a link shaped to `rate`."""
    steps = steps or Steps()
    scratch = Path(tempfile.mkdtemp(prefix="ddptrain-plan-"))
    try:
        args = ["-m", "ddptrain.plan.run", "--setup", json.dumps(setup.as_dict())]
        args += ["--steps", json.dumps(asdict(steps)), "--out", str(scratch)]
        with terminate_as_exit(), two_hosts("ddpp") as (a, b):
            shaping = bench_link.shape_link(a, b, rate)
            rdzv_id = f"ddptrain-plan-{os.getpid()}-{time.monotonic_ns()}"
            commands = [
                torchrun(host, a, nnodes=2, nproc_per_node=1, rdzv_id=rdzv_id, args=args)
                for host in (a, b)
            ]
            run_launchers(commands, [host.env() for host in (a, b)], timeout_s)
        ranks = json.loads((scratch / "run.json").read_text())["ranks"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**summarize(ranks), "link_probe": shaping["probe"]}


def run_twice_at_most(run: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    """`run()`, and once more if its ranks fail: gloo on this CPU build sometimes aborts a rank
    (SIGABRT) in a run that passes the next time. A second failure is raised."""
    try:
        return run()
    except (RunFailed, WorkerError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        cause = failure_cause(str(e))
        first += f" ({cause})" if cause and cause != first else ""
        print(f"{what}: {first}; running it once more", file=sys.stderr, flush=True)
        return run()


# A rank's own words for why it stopped, ahead of its launcher's traceback.
_CAUSE = re.compile(r"terminate called|^\s*(\w+\.)*\w*(Error|Exception)(: .*)?$|^error: ")


def failure_cause(output: str) -> str | None:
    """The first line of a failed run's output that says why: a C++ abort, an exception's last
    line, an `error:` line; None if none does."""
    for line in output.splitlines()[1:]:
        if _CAUSE.search(line) and "ChildFailedError" not in line:
            return line.strip()[:200]
    return None


def wait_for_quiet(threshold: float | None, max_wait_s: float) -> float:
    """Busy threads of other programs now; with a threshold, wait (up to max_wait_s) until
    there are at most that many. Returns the last count."""
    busy = background_threads()
    deadline = time.monotonic() + max_wait_s
    while threshold is not None and busy > threshold and time.monotonic() < deadline:
        time.sleep(2.0)
        busy = background_threads()
    return busy


def compare(
    setup: Setup,
    point: Point,
    measured: dict[str, Any],
    link: str,
    background: float,
) -> dict[str, Any]:
    """One row of the check: predicted, measured, their ratio (predicted / measured)."""
    return {
        "configuration": f"{setup.label} ws{point.world_size} {link}",
        "setup": setup.as_dict(),
        "world_size": point.world_size,
        "link": link,
        "predicted_step_s": point.step_s,
        "measured_step_s": measured["step_s"],
        "step_ratio": point.step_s / measured["step_s"],
        "predicted_peak_bytes": point.peak_bytes,
        "measured_peak_bytes": measured["peak_bytes"],
        "peak_ratio": point.peak_bytes / measured["peak_bytes"],
        "rounds_apart": rounds_apart(measured),
        "background_threads": background,
        "load_avg_1m": os.getloadavg()[0],
        "measured": measured,
    }

"""Company for a profile: copies of the same step computing beside it, each in a world of one.

    with beside(setup, copies=1):       # a copy trains, untimed, until the block ends
        prof = profile(setup)            # ... so this one is timed in its company

Ranks on one machine share more than its cores: the memory bus and the last-level cache. A rank
that computes while others do takes more CPU for the same work than a lone one (a Zen 3 guest,
2 vCPUs, profiled as one of 2 copies: the MLP's DDP step +14%, the GPT's +12%, PowerSGD's
hooks 49.6 ms a step against 40.0 alone), and the timeline, which shares the cores out by
CPU seconds, cannot see that. So a world size's step is profiled beside as many copies as
ranks compute at once there (`plan.company_at`). The copies run the setup as --check builds it,
each in its own world of one: they contend for the machine as ranks do, and send nothing.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ddptrain
from ddptrain.plan.setup import Setup, batch, build, rank_device, rank_env, start_method

# A copy counts as computing once it has run this many steps (the first allocate and warm up).
WARM_STEPS = 2


@dataclass
class Company:
    """The copies beside a block: after it, the steps each ran."""

    steps: list[int] = field(default_factory=list)


@contextlib.contextmanager
def beside(setup: Setup, copies: int, timeout_s: float = 600.0) -> Iterator[Company]:
    """Run the block while `copies` worlds of one train `setup`, each past WARM_STEPS steps
    before it starts and stopped when it ends; a copy that fails before then fails the block
    (it would not have been timed in company)."""
    company = Company()
    if copies < 1:
        yield company
        return
    folder = Path(tempfile.mkdtemp(prefix="ddptrain-company-"))
    stop = folder / "stop"
    errors: list[BaseException] = []
    steps = [0] * copies

    def run(i: int) -> None:
        try:
            (steps[i],) = ddptrain.spawn(
                _copy_rank,
                1,
                setup.as_dict(),
                str(folder / f"warm-{i}"),
                str(stop),
                timeout_s=timeout_s,
                start_method=start_method(setup.device),
                env=rank_env(setup.device),
            )
        except BaseException as e:  # reported by the block's end
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(copies)]
    for t in threads:
        t.start()
    try:
        _wait_warm(folder, threads, errors, timeout_s)
        yield company
        if errors or not all(t.is_alive() for t in threads):
            raise RuntimeError(f"a copy beside the profile stopped before it ended: {_why(errors)}")
    finally:
        stop.touch()
        for t in threads:
            t.join(timeout_s)
        shutil.rmtree(folder, ignore_errors=True)
    company.steps = steps


def _wait_warm(
    folder: Path, threads: list[threading.Thread], errors: list[BaseException], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((folder / f"warm-{i}").exists() for i in range(len(threads))):
        if errors or not all(t.is_alive() for t in threads):
            raise RuntimeError(
                f"a copy beside the profile failed before it was warm: {_why(errors)}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"copies beside the profile not warm after {timeout_s:.0f} s")
        time.sleep(0.05)


def _why(errors: list[BaseException]) -> str:
    return f"{type(errors[0]).__name__}: {errors[0]}" if errors else "it exited"


def _copy_rank(setup_dict: dict[str, Any], warm_path: str, stop_path: str) -> int:
    """A world of one training the setup, untimed, until `stop_path` exists; `warm_path`
    written after WARM_STEPS steps. Returns the steps it ran."""
    setup = Setup(**setup_dict)
    device = rank_device(setup)
    model, optimizer = build(setup, device)
    x, y = batch(setup, device, seed=0)
    stop, steps = Path(stop_path), 0
    while not stop.exists():
        optimizer.zero_grad(set_to_none=True)
        setup.workload.loss(model(x), y).backward()
        optimizer.step()
        steps += 1
        if steps == WARM_STEPS:
            Path(warm_path).touch()
    return steps

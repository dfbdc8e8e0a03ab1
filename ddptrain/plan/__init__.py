"""Before the launch: a data-parallel run's step time and peak memory per rank, predicted.

    python -m ddptrain.plan --model mlp          # DDP, ZeRO-1, ZeRO-3, PowerSGD at 1-4 ranks
    python -m ddptrain.plan --model mlp --link 1gbit --world-sizes 2,4,8,16
    python -m ddptrain.plan --models lenet,mlp --links local,1gbit --world-sizes 2,3,4 --check
    python -m ddptrain.plan --model mypkg.nets:build --batch-size 64   # your model (workloads.py)
    python -m ddptrain.plan --device cuda --world-sizes 1 --check      # one GPU: profile, run

    from ddptrain.plan import plan
    result = plan("mlp", strategies=["ddp", "zero3"], world_sizes=[1, 2, 4])
    result.predictions[0].at(4).step_s, result.predictions[0].at(4).peak_bytes
    result.largest_efficient          # (world size, strategy) keeping efficiency >= 80%

It profiles the model's step on one process (profile.py, its hooks and timers in marks.py; in
turns, rounds.py), measures this machine's collectives once (calibrate.py, cached), and models the
rest: each rank's step as threads sharing its cores (timeline.py, steps.py), the link's cost per
collective (links.py), the bytes a rank holds (memory.py, predict.py). `--check` trains the same
setups for real (check.py) and prints predicted against measured. `device`: where the profile and
the check run, "cuda" (the default where torch sees a GPU: device seconds and bytes, a GPU link) or
"cpu" (meter.py). scaling.py writes docs/scaling.md (GPU ranks on paper). docs/plan.md states the
formulas and what they assume.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ddptrain.netns import HostsUnavailable
from ddptrain.plan.calibrate import local_link, measured_shaped_link
from ddptrain.plan.links import (
    NAMED,
    BusLink,
    Link,
    LocalLink,
    ShapedLink,
    named_link,
    shaped_link,
)
from ddptrain.plan.load import background_threads, usable_cores
from ddptrain.plan.predict import (
    Prediction,
    close_to_pick,
    largest_efficient,
    pick,
    predict,
    set_efficiency,
)
from ddptrain.plan.profile import Profile, profile
from ddptrain.plan.rounds import profile_in_rounds
from ddptrain.plan.setup import STRATEGIES, Setup, default_device, require_device

__all__ = ["Plan", "Prediction", "Profile", "Setup", "plan", "profile", "resolve_link"]

DEFAULT_STRATEGIES = ("ddp", "zero1", "zero3", "powersgd")
# The link a device's ranks are planned on unless told: this machine's for CPU ranks; for GPU
# ranks a named NCCL profile (at world size 1 no link matters).
DEFAULT_LINKS = {"cpu": "local", "cuda": "nccl-100g"}


@dataclass
class Plan:
    """Predictions of every strategy on one link, and what they say."""

    link: str
    world_sizes: list[int]
    background_threads: float
    predictions: list[Prediction]
    profiles: list[Profile] = field(default_factory=list)

    @property
    def largest_efficient(self) -> tuple[int, str] | None:
        """The largest world size whose fastest fitting strategy keeps efficiency >= 80%."""
        found = largest_efficient(self.predictions, self.world_sizes)
        return None if found is None else (found[0], found[1].setup["strategy"])

    def picked(self, world_size: int) -> str | None:
        """The fastest strategy that fits at `world_size`."""
        chosen = pick(self.predictions, world_size)
        return None if chosen is None else chosen.setup["strategy"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "link": self.link,
            "world_sizes": self.world_sizes,
            "background_threads": self.background_threads,
            "predictions": [p.as_dict() for p in self.predictions],
            "picked": {n: self.picked(n) for n in self.world_sizes},
            "close_to_pick": {
                n: [p.setup["strategy"] for p in close_to_pick(self.predictions, n)]
                for n in self.world_sizes
            },
            "largest_efficient": self.largest_efficient,
            # What the predictions were made from: with the link's figures, they can be
            # remade (predict.predict) after the model changes.
            "profiles": [p.as_dict() for p in self.profiles],
        }


def resolve_link(name: str, world_sizes: list[int], device: str = "cpu") -> Link:
    """ "local" (this machine), a rate as tc writes it ("1gbit": two hosts made on this
    machine, as --check runs them), or a named GPU profile (links.NAMED); CUDA ranks take a
    GPU profile only."""
    if device == "cuda" and name not in NAMED:
        raise ValueError(
            f"link {name!r} is for CPU ranks; GPU ranks (--device cuda) take one of "
            f"{', '.join(NAMED)}"
        )
    on_host = [n for n in world_sizes if n <= 4 * usable_cores()]
    if name == "local":
        return local_link(on_host or [1, 2])
    if name in NAMED:
        return named_link(name)
    try:
        return measured_shaped_link(name)
    except HostsUnavailable:
        # Not root here: the rate's formula (links.ShapedLink) over the measured loopback CPU.
        return shaped_link(name, local_link([1, 2]))


def memory_per_rank(link: Link, world_size: int) -> int | None:
    """This machine's memory shared by the ranks it holds (None for a GPU link)."""
    if not isinstance(link, LocalLink | ShapedLink):
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return total // max(1, world_size)


def plan(
    model: str = "mlp",
    *,
    strategies: list[str] | tuple[str, ...] = DEFAULT_STRATEGIES,
    world_sizes: list[int] | tuple[int, ...] = (1, 2, 3, 4),
    link: str | Link | None = None,
    batch_size: int | None = None,
    precision: str = "fp32",
    optimizer: str = "sgd",
    powersgd_rank: int = 4,
    background: float | None = None,
    memory_per_rank_bytes: int | None = None,
    profiles: dict[str, Profile] | None = None,
    device: str | None = None,
    profile_rounds: int = 1,
) -> Plan:
    """Predict every strategy at every world size (the module docstring); `link`: None for
    the device's default (DEFAULT_LINKS); `background`: busy threads of other programs to
    share the cores with (None: counted now, 0 for an idle machine); `profiles`: by strategy,
    to reuse; `device`: None for cuda where torch sees a GPU, else cpu; `profile_rounds`:
    passes of each profile, the strategies taking turns (rounds.py)."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}: choose from {', '.join(STRATEGIES)}")
    if profile_rounds < 1:
        raise ValueError(f"profile_rounds: at least 1, got {profile_rounds}")
    device = device or default_device()
    if profiles is None or set(strategies) - set(profiles):
        require_device(device)
    sizes = sorted(set(world_sizes))
    link = DEFAULT_LINKS[device] if link is None else link
    if isinstance(link, str):
        resolved = resolve_link(link, sizes, device)
    elif device == "cuda" and not isinstance(link, BusLink):
        raise ValueError(f"link {link.name!r} is for CPU ranks; GPU ranks take a BusLink")
    else:
        resolved = link
    busy = 0.0
    if isinstance(resolved, LocalLink | ShapedLink):
        busy = background_threads() if background is None else background
    setups = [
        Setup(
            model=model,
            batch_size=batch_size,
            precision=precision,
            optimizer=optimizer,
            strategy=strategy,
            powersgd_rank=powersgd_rank,
            device=device,
        )
        for strategy in strategies
    ]
    given = profiles or {}
    missing = [setup for setup in setups if setup.strategy not in given]
    made = dict(zip(missing, profile_in_rounds(missing, profile_rounds, profile), strict=True))
    predictions, used = [], []
    for setup in setups:
        prof = given.get(setup.strategy) or made[setup]
        used.append(prof)
        points = sorted(set(sizes) | {1})
        pred = predict(setup, prof, resolved, points, background=busy)
        for p in pred.points:
            budget = memory_per_rank_bytes or memory_per_rank(resolved, p.world_size)
            p.fits = None if budget is None else p.peak_bytes <= budget
        predictions.append(pred)
    one_rank = min(pred.at(1).step_s for pred in predictions)
    set_efficiency(predictions, one_rank)
    if 1 not in sizes:
        for pred in predictions:
            pred.points = [p for p in pred.points if p.world_size != 1]
    name = getattr(resolved, "name", str(link))
    return Plan(name, sizes, busy, predictions, used)

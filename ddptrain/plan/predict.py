"""Step time and peak memory per rank at each world size, from one profile and a link.

    prof = profile(setup)                                   # one process, a few steps
    pred = predict(setup, prof, local_link(), [1, 2, 4])    # a Prediction per world size
    pred.points[2].step_s, pred.points[2].peak_bytes
    pick([pred_ddp, pred_zero1, ...], world_size=4)         # the simplest of the fastest that fit
    close_to_pick([pred_ddp, pred_zero1, ...], 4)           # the others within NEAR (5%)

Step time: the rank's operations (steps.py) simulated with its CPU shared among its threads
(timeline.py), plus the wait for the slowest rank: a step ends when every rank's does. Ranks on
machines of their own vary independently (the profile's samples), so n ranks wait for the
expected slowest of n (`straggle_s`). Ranks on one machine share its slow spells; where they
outnumber its cores, the kernel shares the cores unevenly within a step, and ranks that meet
once a step (the DDP wrapper's) wait for the least served: the link's measured `uneven_share_s`
for a cycle of the simulated step. The simulation with every communication free is the floor,
and the difference the exposed communication. Samples/s: world_size * per-rank batch / step.
Scaling efficiency: the one-rank step (the fastest strategy's at world size 1) over this step:
1.0 is linear. The pick: of the strategies that fit, those predicted within NEAR (5%) of the
fastest are ties (one run on a shared machine cannot tell them apart, nor can the profiles),
and the simplest of them is picked, in STRATEGIES' order: DDP, then ZeRO-1, 2 and 3 (more
collectives a step), then PowerSGD (lossy: it changes what the model learns).

Peak RSS per rank, with glibc returning freed blocks (what --check sets): the DDP strategies'
measured peak at world size 1 plus what changes with the world size: the pages of the other
ranks' shared bucket rows its sums touch (one host; for PowerSGD the rows it stages buckets in
before it compresses), minus the optimizer state ZeRO-1 no longer holds, plus the TCP
transport's receive chunk (across hosts). The sharded strategies' peak is the RSS before the
model, the runtime's own growth while training (the plain model's measured peak at world
size 1 less its tensors) and the largest sum of live tensors in their simulated step: shards,
optimizer state, gathered units, whole gradients, send and receive buffers, activations.

On CUDA (a profile of device="cuda", a GPU link) the same parts are device memory, the
caching allocator's bytes: "runtime" is what was allocated before the model (no interpreter
or library baseline: max_memory_allocated leaves out the CUDA context), "runtime_growth" the
measured one-rank peak beyond parameters, gradients (the buckets they are views of), optimizer
state and activations (cuBLAS workspaces, autograd's temporaries, a comm hook's buffers), and
NCCL needs no staging copies.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ddptrain.plan import memory
from ddptrain.plan.links import Link, LocalLink, ShapedLink
from ddptrain.plan.profile import SHARDED, Profile
from ddptrain.plan.setup import STRATEGIES, Setup
from ddptrain.plan.steps import (
    bucket_bytes,
    ddp_ops,
    plain_memory_ops,
    sharded_ops,
    sharded_start_bytes,
)
from ddptrain.plan.timeline import Compute, Job, Launch, Op, simulate


@dataclass
class Point:
    """One world size's prediction (seconds, bytes)."""

    world_size: int
    step_s: float
    floor_s: float
    samples_per_s: float
    peak_bytes: int
    memory: dict[str, int]
    efficiency: float | None = None
    fits: bool | None = None

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.step_s - self.floor_s)


@dataclass
class Prediction:
    """A setup's predictions over world sizes on one link."""

    setup: dict[str, Any]
    link: str
    points: list[Point] = field(default_factory=list)

    def at(self, world_size: int) -> Point:
        return next(p for p in self.points if p.world_size == world_size)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for p, d in zip(self.points, out["points"], strict=True):
            d["exposed_comm_s"] = p.exposed_comm_s
        return out


def step_ops(setup: Setup, prof: Profile, link: Link, world_size: int) -> list[Op]:
    """The rank's operations for this setup's strategy (steps.py)."""
    if setup.strategy in SHARDED:
        return sharded_ops(prof, link, world_size, reshard=setup.strategy == "zero3")
    return ddp_ops(prof, link, world_size, setup.strategy, setup.powersgd_rank)


def _free_comm(ops: list[Op]) -> list[Op]:
    return [Launch(op.queue, Job(op.job.name)) if isinstance(op, Launch) else op for op in ops]


def step_seconds(
    setup: Setup, prof: Profile, link: Link, world_size: int, background: float = 0.0
) -> tuple[float, float]:
    """(step, floor): the simulated step plus the wait for the slowest rank, and the simulated
    step with every communication free (module docstring); `background`: busy threads of other
    programs on the same cores."""
    ops = step_ops(setup, prof, link, world_size)
    cpu = link.cpu(world_size)
    cores, peers = cpu if cpu is not None else (None, 1)
    run = [simulate(o, cores, peers, background).end_s for o in (ops, _free_comm(ops))]
    return run[0] + slowest_rank_s(setup, prof, link, world_size, run[0]), run[1]


def slowest_rank_s(
    setup: Setup, prof: Profile, link: Link, world_size: int, simulated_s: float
) -> float:
    """What a step of `simulated_s` waits for its slowest rank. Ranks on one machine: the
    uneven share of its cores over the step, for the DDP wrapper's strategies, whose ranks
    meet once a step after computing all of it (the sharded ones meet at every unit, and the
    meetings carry that); a slow spell falls on every rank at once. Ranks on machines of their
    own: the slowest of their independent steps (straggle_s)."""
    if link.one_machine:
        if setup.strategy in SHARDED:
            return 0.0
        return link.uneven_share_s(world_size, simulated_s)
    return straggle_s(prof.step_samples_s, world_size)


def straggle_s(samples: list[float], world_size: int) -> float:
    """How much longer than the median step the slowest of `world_size` ranks takes, each
    drawing its step from `samples` (one rank's profiled steps) independently: E[max of n
    draws] - median, from the samples' empirical distribution. 0 for one rank or no samples."""
    if world_size <= 1 or not samples:
        return 0.0
    xs, m = sorted(samples), len(samples)
    expected_max = sum(x * ((i / m) ** world_size - ((i - 1) / m) ** world_size)
                       for i, x in enumerate(xs, start=1))  # fmt: skip
    return max(0.0, expected_max - statistics.median(xs))


def peak_memory(setup: Setup, prof: Profile, link: Link, world_size: int) -> dict[str, int]:
    """Peak memory per rank (RSS; device memory for a CUDA profile) and its parts (module
    docstring), in bytes; "peak" is the total."""
    n = world_size
    state = prof.optimizer_state_bytes
    parts = {"runtime": prof.rss_before_model_bytes}
    parts.update(memory.held(setup.strategy, prof.param_bytes, state, n))
    parts["activations"] = prof.activation_bytes
    if setup.strategy in SHARDED:
        tensors = simulate(plain_memory_ops(prof), None).peak_bytes
        grown = prof.peak_rss_bytes - prof.rss_before_model_bytes - prof.param_bytes - state
        parts["runtime_growth"] = max(0, grown - tensors)
        start = sharded_start_bytes(prof, n, state)
        ops = sharded_ops(prof, link, n, setup.strategy == "zero3", tensors_only=True)
        tensor_ops = [op for op in ops if not isinstance(op, Compute)]
        peak_tensors = simulate(tensor_ops, None, start_bytes=start)
        others = sum(parts[k] for k in ("params", "optimizer", "activations"))
        parts["buffers"] = max(0, peak_tensors.peak_bytes - others)
        parts["grads"] = 0  # whole and sharded gradients are among the buffers at the peak
        parts["peak"] = parts["runtime"] + parts["runtime_growth"] + peak_tensors.peak_bytes
        return parts
    buckets = bucket_bytes(prof)
    extra = 0
    if isinstance(link, LocalLink) and n > 1:
        extra += memory.shared_rows_touched(buckets, n)
    elif isinstance(link, ShapedLink) and n > 1 and setup.strategy != "powersgd":
        extra += max(buckets, default=0) // n
    if setup.strategy == "zero1":
        extra -= state - state // n
    held_at_1 = sum(memory.held(setup.strategy, prof.param_bytes, state, 1).values())
    parts["buffers"] = max(0, extra) if setup.strategy != "zero1" else 0
    parts["runtime_growth"] = max(
        0,
        prof.peak_rss_bytes - prof.rss_before_model_bytes - held_at_1 - prof.activation_bytes,
    )
    parts["peak"] = prof.peak_rss_bytes + extra
    return parts


def predict(
    setup: Setup,
    prof: Profile,
    link: Link,
    world_sizes: list[int],
    budget_bytes: int | None = None,
    background: float = 0.0,
) -> Prediction:
    """Step time and peak memory at each world size (module docstring); `background`: busy
    threads of other programs sharing the cores (load.background_threads)."""
    batch = setup.workload.batch_size
    out = Prediction(setup.as_dict(), getattr(link, "name", "link"))
    for n in world_sizes:
        step, floor = step_seconds(setup, prof, link, n, background)
        parts = peak_memory(setup, prof, link, n)
        peak = parts.pop("peak")
        fits = None if budget_bytes is None else peak <= budget_bytes
        out.points.append(Point(n, step, floor, n * batch / step, peak, parts, fits=fits))
    return out


def set_efficiency(predictions: list[Prediction], one_rank_s: float) -> None:
    """Each point's scaling efficiency against `one_rank_s`, one rank's step."""
    for pred in predictions:
        for p in pred.points:
            p.efficiency = one_rank_s / p.step_s


# Strategies predicted this close cannot be told apart by a run on a shared machine: the same
# run, repeated, spreads by more (docs/plan.md, "Assumptions"), so the plan names them too.
NEAR = 0.05


def _fitting(predictions: list[Prediction], world_size: int) -> list[Prediction]:
    return [
        pred
        for pred in predictions
        if any(p.world_size == world_size and p.fits is not False for p in pred.points)
    ]


def pick(predictions: list[Prediction], world_size: int) -> Prediction | None:
    """The strategy to run at `world_size`: of those that fit (fits None counts as fitting),
    the simplest predicted within NEAR of the fastest (module docstring)."""
    return simplest_near(
        _fitting(predictions, world_size),
        lambda pred: pred.at(world_size).step_s,
        lambda pred: pred.setup["strategy"],
    )


T = TypeVar("T")


def simplest_near(
    candidates: list[T],
    step_s: Callable[[T], float],
    strategy: Callable[[T], str],
    margin: float = NEAR,
) -> T | None:
    """Of `candidates`, those whose step is within `margin` of the fastest, the first in
    STRATEGIES' order (the faster of two of one strategy); None if there are none."""
    near = _near(candidates, step_s, margin)
    return min(near, key=lambda c: (STRATEGIES.index(strategy(c)), step_s(c)), default=None)


def _near(candidates: list[T], step_s: Callable[[T], float], margin: float) -> list[T]:
    """The candidates whose step is within `margin` of the fastest's."""
    if not candidates:
        return []
    limit = min(step_s(c) for c in candidates) * (1.0 + margin)
    return [c for c in candidates if step_s(c) <= limit]


def close_to_pick(
    predictions: list[Prediction], world_size: int, margin: float = NEAR
) -> list[Prediction]:
    """The other fitting strategies predicted within `margin` of the fastest: those the pick
    was made among."""
    chosen = pick(predictions, world_size)
    if chosen is None:
        return []
    near = _near(_fitting(predictions, world_size), lambda p: p.at(world_size).step_s, margin)
    return [pred for pred in near if pred is not chosen]


def largest_efficient(
    predictions: list[Prediction], world_sizes: list[int], threshold: float = 0.8
) -> tuple[int, Prediction] | None:
    """The largest world size whose picked strategy keeps efficiency >= threshold, and it."""
    best = None
    for n in sorted(world_sizes):
        chosen = pick(predictions, n)
        if chosen is not None and (chosen.at(n).efficiency or 0.0) >= threshold:
            best = (n, chosen)
    return best

"""Profiles in rounds: each strategy profiled R times, the strategies taking turns, merged.

    profiles = profile_in_rounds([setup_ddp, setup_zero1], rounds=2)   # a Profile per setup
    merge([pass_1, pass_2])                                            # one Profile of both
    pool_shared_compute(profiles)       # the DDP wrapper's strategies share their compute

A guest's CPU runs slower for seconds at a time. One profile can sit inside such a spell and
its strategy then looks slower than the others (a GPT's PowerSGD profile, 8 steps of 0.4-0.6 s,
once came out 1.3-1.4x its runs). Profiled in turns, the strategies share the spells, as the
check's runs do in its rounds (check.combine); a strategy's passes are merged, the mean of
their medians.

Strategies that run one forward and backward, the DDP wrapper's (ddp, zero1, powersgd) on one
model, batch, precision, optimizer and device, then share it: each takes the mean of their
forward, backward and bucket-ready times, keeping its own hooks' and optimizer's. Profiled
minutes apart they differ by the machine's spells alone (LeNet's three once spread 15.0-17.7
ms a step), and that difference decided between strategies the runs measured within a few
percent of each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from ddptrain.plan.profile import Profile, profile
from ddptrain.plan.setup import Setup

_SECONDS = (
    "step_s",
    "wall_step_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "wrapper_step_s",
    "marks_scale",
)
_PER_ITEM_SECONDS = ("ready_s", "bucket_ready_s", "hook_s")
_BYTES = ("activation_bytes", "rss_before_model_bytes", "peak_rss_bytes")


def profile_in_rounds(
    setups: list[Setup], rounds: int = 1, run: Callable[[Setup], Profile] = profile
) -> list[Profile]:
    """A profile per setup, each the merge of `rounds` passes; odd rounds go through the
    setups in reverse; `run`: profiles one setup (profile.profile)."""
    passes: list[list[Profile]] = [[] for _ in setups]
    for i in turns(len(setups), rounds):
        passes[i].append(run(setups[i]))
    return pool_shared_compute([merge(p) for p in passes])


def turns(count: int, rounds: int) -> Iterator[int]:
    """Indices 0..count-1, `rounds` times over, every other round in reverse: the order
    profiles and --check's runs take their turns in."""
    for r in range(rounds):
        yield from range(count)[:: -1 if r % 2 else 1]


def merge(passes: list[Profile]) -> Profile:
    """One profile of a setup from passes of it: each time the mean of the passes' medians,
    each byte count the mean, every timed step kept, scaled as its pass's median is to the
    mean."""
    if len(passes) == 1:
        return passes[0]
    out = Profile(**passes[0].as_dict())
    for name in _SECONDS:
        setattr(out, name, _mean([getattr(p, name) for p in passes]))
    for name in _PER_ITEM_SECONDS:
        setattr(out, name, _mean_rows([getattr(p, name) for p in passes]))
    out.unit_forward_s = [_mean_rows(list(unit)) for unit in _columns(passes, "unit_forward_s")]
    for name in _BYTES:
        setattr(out, name, round(_mean([getattr(p, name) for p in passes])))
    per_unit = _mean_rows([p.unit_activation_bytes for p in passes])
    out.unit_activation_bytes = [round(b) for b in per_unit]
    out.timed_steps = sum(p.timed_steps for p in passes)
    # Each pass's steps about the merged median: a slow spell of the machine moves all of a
    # pass's steps, and ranks running at once share it; ranks drawing their steps
    # independently (predict.straggle_s) draw from within one spell, not across spells.
    out.step_samples_s = [s * out.step_s / p.step_s if p.step_s > 0 else s
                          for p in passes for s in p.step_samples_s]  # fmt: skip
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _mean_rows(rows: list[list[float]]) -> list[float]:
    return [_mean(list(column)) for column in zip(*rows, strict=True)]


def _columns(passes: list[Profile], name: str) -> list[tuple[list[float], ...]]:
    return list(zip(*(getattr(p, name) for p in passes), strict=True))


# Strategies whose step at world size 1 is the DDP wrapper's forward and backward.
SHARED_COMPUTE = ("ddp", "zero1", "powersgd")


def pool_shared_compute(profiles: list[Profile]) -> list[Profile]:
    """The profiles, those of strategies that share one forward and backward (SHARED_COMPUTE,
    the rest of the setup equal) given the mean of theirs (module docstring); PowerSGD's last
    hook, run on the training thread at the end of backward, stays its own."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(profiles):
        if p.setup.get("strategy") in SHARED_COMPUTE:
            rest = {k: v for k, v in p.setup.items() if k not in ("strategy", "powersgd_rank")}
            groups.setdefault(tuple(sorted(rest.items())), []).append(i)
    out = list(profiles)
    for members in groups.values():
        if len(members) < 2:
            continue
        group = [profiles[i] for i in members]
        forward = _mean([p.forward_s for p in group])
        backward = _mean([p.backward_s - _own(p) for p in group])
        same_buckets = all(p.buckets == group[0].buckets for p in group)
        ready = _mean_rows([p.bucket_ready_s for p in group]) if same_buckets else None
        for i, p in zip(members, group, strict=True):
            new_backward = backward + _own(p)
            delta = forward + new_backward - p.forward_s - p.backward_s
            out[i] = dataclasses.replace(
                p,
                forward_s=forward,
                backward_s=new_backward,
                step_s=p.step_s + delta,
                wall_step_s=p.wall_step_s + delta,
                bucket_ready_s=p.bucket_ready_s if ready is None else list(ready),
            )
    return out


def _own(p: Profile) -> float:
    """What of a profile's backward is its strategy's own (PowerSGD's last hook)."""
    return p.hook_in_backward_s(p.setup.get("strategy", ""))

"""Profiles in rounds: each strategy profiled R times, the strategies taking turns, merged.

    profiles = profile_in_rounds([setup_ddp, setup_zero1], rounds=2)   # a Profile per setup
    merge([pass_1, pass_2])                                            # one Profile of both

A guest's CPU runs slower for seconds at a time. One profile can sit inside such a spell and
its strategy then looks slower than the others (a GPT's PowerSGD profile, 8 steps of 0.4-0.6 s,
once came out 1.3-1.4x its runs). Profiled in turns, the strategies share the spells, as the
check's runs do in its rounds (check.combine); a strategy's passes are merged, the mean of
their medians.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ddptrain.plan.profile import Profile, profile
from ddptrain.plan.setup import Setup

_SECONDS = ("step_s", "wall_step_s", "forward_s", "backward_s", "optimizer_s")
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
    return [merge(p) for p in passes]


def turns(count: int, rounds: int) -> Iterator[int]:
    """Indices 0..count-1, `rounds` times over, every other round in reverse: the order
    profiles and --check's runs take their turns in."""
    for r in range(rounds):
        yield from range(count)[:: -1 if r % 2 else 1]


def merge(passes: list[Profile]) -> Profile:
    """One profile of a setup from passes of it: each time the mean of the passes' medians,
    each byte count the mean, every timed step kept."""
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
    out.step_samples_s = [s for p in passes for s in p.step_samples_s]
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _mean_rows(rows: list[list[float]]) -> list[float]:
    return [_mean(list(column)) for column in zip(*rows, strict=True)]


def _columns(passes: list[Profile], name: str) -> list[tuple[list[float], ...]]:
    return list(zip(*(getattr(p, name) for p in passes), strict=True))

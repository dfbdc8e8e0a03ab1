"""One spawned world runs many test cases: process starts dominate the suite's time.

    CASES = {"sum": _case_sum, ...}           # module-level; each fn(info) -> picklable result

    def _run_cases(names):
        return worlds.run_cases(CASES, names)

    results = ddptrain.spawn(_run_cases, 3, list(CASES), timeout_s=120)
    per_rank = worlds.outcome(results, "sum")  # [rank 0's result, ...]; fails with the traceback

A case that raises is recorded with its traceback and the next case runs, so one broken case
fails its own test, not the whole module. A case that breaks a collective on some ranks only
still hangs the world: spawn's timeout reports it.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import pytest

import ddptrain


def run_cases(cases: dict[str, Callable[[Any], Any]], names: list[str]) -> dict[str, tuple]:
    """Inside a spawned rank: run each named case; return {name: (ok, result or traceback)}."""
    info = ddptrain.init_distributed()
    out = {}
    for name in names:
        try:
            out[name] = (True, cases[name](info))
        except Exception as e:  # noqa: BLE001 - reported by outcome() in the test that owns it
            out[name] = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    return out


def run_cases_in_shared_memory(
    cases: dict[str, Callable[[Any], Any]], names: list[str]
) -> dict[str, tuple]:
    """run_cases, with the shared-memory transport taking buckets of any size."""
    # The test buckets are a few KB: without the 256 MB headroom a 64 MB container /dev/shm
    # still takes the shared path these tests are about.
    from ddptrain.cpu import shm

    shm._SHM_HEADROOM_BYTES = 0
    return run_cases(cases, names)


def outcome(results: list[dict[str, tuple]], name: str) -> list[Any]:
    """Each rank's result of case `name`, by rank; fails the test with a rank's traceback."""
    for rank, per_case in enumerate(results):
        ok, value = per_case[name]
        if not ok:
            pytest.fail(f"case {name!r} failed on rank {rank}: {value}", pytrace=False)
    return [per_case[name][1] for per_case in results]


def spawner(
    run: Callable[[list[str]], dict], cases_by_world: dict[int, list[str]], timeout_s: float
) -> Callable[[int], list[dict]]:
    """world(ws) -> every rank's results of cases_by_world[ws], spawned once per world size."""

    @functools.cache
    def results(world_size: int) -> list[dict]:
        return ddptrain.spawn(run, world_size, cases_by_world[world_size], timeout_s=timeout_s)

    return results

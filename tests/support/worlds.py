"""One spawned world runs many test cases: process starts dominate the suite's time.

    CASES = {"sum": _case_sum, ...}               # module-level; each fn(info) -> picklable result
    world = worlds.fixture(CASES, {2: ["sum"], 3: ["sum"]})   # a module-scoped pytest fixture

    def test_sum(world):
        per_rank = worlds.outcome(world(2), "sum")   # [rank 0's result, ...]; fails with traceback

A case that raises is recorded with its traceback; the cases after it in that world are not
run (a failed collective may leave the ranks out of step) and their tests fail saying so. A
failed case's test shows every failing rank's error, root causes first: a rank whose peer
failed usually fails too, with a closed connection or a timeout that says nothing of why.
Collectives time out after COLLECTIVE_TIMEOUT_S, so a broken collective fails its test in well
under a minute instead of hanging until the world's timeout.
"""

from __future__ import annotations

import functools
import re
import socket
import traceback
from collections.abc import Callable
from typing import Any

import pytest

import ddptrain

# A rank waiting for a peer longer than this raises: far above what a case's collective waits
# on a loaded 2-core machine, well below a minute.
COLLECTIVE_TIMEOUT_S = 30.0
# A whole world (every case of a module): the last resort, if a case hangs outside collectives.
WORLD_TIMEOUT_S = 540.0
# What a rank raises when a peer failed first (gloo's and the store's words for a peer gone or
# silent, and run_cases' own for a case skipped), matched in the error's first lines only: a
# traceback may quote code that says "timeout".
_CONSEQUENCE = re.compile(
    r"closed by peer|reset by peer|broken pipe|connection refused|timed out|timeout"
    r"|^not run: case",
    re.IGNORECASE | re.MULTILINE,
)
_TRACEBACK = "\nTraceback (most recent call last):"


def run_cases(cases: dict[str, Callable[[Any], Any]], names: list[str]) -> dict[str, tuple]:
    """Inside a spawned rank: run each named case; return {name: (ok, result or traceback)}."""
    info = ddptrain.init_distributed(timeout_s=COLLECTIVE_TIMEOUT_S)
    out: dict[str, tuple] = {}
    failed = None
    for name in names:
        if failed is not None:
            out[name] = (False, f"not run: case {failed!r} failed before it in this world")
            continue
        try:
            out[name] = (True, cases[name](info))
        except Exception as e:  # noqa: BLE001 - reported by outcome() in the test that owns it
            out[name] = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            failed = name
    return out


def share_small_buckets() -> None:
    """Inside a rank: the shared-memory transport takes buckets whatever room the tmpfs has."""
    # The test buckets are a few KB: without the 256 MB headroom a 64 MB container /dev/shm
    # still takes the shared path these tests are about.
    from ddptrain.cpu import shm

    shm.SHM_HEADROOM_BYTES = 0


def _setup_and_run(
    setup: Callable[[], None], cases: dict[str, Callable[[Any], Any]], names: list[str]
) -> dict[str, tuple]:
    setup()
    return run_cases(cases, names)


def outcome(results: list[dict[str, tuple]], name: str) -> list[Any]:
    """Each rank's result of case `name`, by rank; fails the test with every failing rank's
    traceback, root causes first (failure_report)."""
    failed = failures(results, name)
    if failed:
        pytest.fail(failure_report(name, failed), pytrace=False)
    return [per_case[name][1] for per_case in results]


def is_consequence(error: str) -> bool:
    """Whether a rank's error reads as the result of a peer's failure (a connection closed or
    reset by the peer, a timeout, a case not run) rather than a cause of its own."""
    return bool(_CONSEQUENCE.search(error.split(_TRACEBACK, 1)[0]))


def failures(results: list[dict[str, tuple]], name: str) -> list[tuple[int, str]]:
    """(rank, error) of every rank whose case `name` failed: the errors of their own first,
    then the consequences of a peer's failure; by rank within each."""
    failed = [
        (rank, per_case[name][1]) for rank, per_case in enumerate(results) if not per_case[name][0]
    ]
    return sorted(failed, key=lambda f: is_consequence(f[1]))


def failure_report(name: str, failed: list[tuple[int, str]]) -> str:
    """The failure message of a test whose case `name` failed on the ranks of `failed`."""
    ranks = ", ".join(str(rank) for rank, _ in failed)
    lines = [f"case {name!r} failed on rank{'s' if len(failed) > 1 else ''} {ranks}:"]
    for rank, error in failed:
        lines.append(f"--- rank {rank} ---\n{error}")
    return "\n".join(lines)


def spawner(
    run: Callable[[list[str]], dict], cases_by_world: dict[int, list[str]], timeout_s: float
) -> Callable[[int], list[dict]]:
    """world(ws) -> every rank's results of cases_by_world[ws], spawned once per world size."""

    @functools.cache
    def results(world_size: int) -> list[dict]:
        return ddptrain.spawn(run, world_size, cases_by_world[world_size], timeout_s=timeout_s)

    return results


def fixture(
    cases: dict[str, Callable[[Any], Any]],
    cases_by_world: dict[int, list[str]],
    *,
    timeout_s: float = WORLD_TIMEOUT_S,
    setup: Callable[[], None] | None = None,
) -> Any:
    """A module-scoped fixture `world`: world(ws) spawns (once) the world of ws ranks that runs
    cases_by_world[ws]; `setup` (module-level, e.g. share_small_buckets) runs in each rank
    first."""
    run = functools.partial(run_cases, cases)
    if setup is not None:
        run = functools.partial(_setup_and_run, setup, cases)

    @pytest.fixture(scope="module")
    def world() -> Callable[[int], list[dict]]:
        return spawner(run, cases_by_world, timeout_s)

    return world


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""How a failed case of a spawned world is reported (support/worlds.py), without spawning."""

from __future__ import annotations

import pytest

from support import worlds


def _error(first_line: str, code: str = "    run(info)") -> str:
    """A case's error as run_cases records it: the message, then its traceback."""
    return (
        f"{first_line}\nTraceback (most recent call last):\n"
        f'  File "tests/ddp/test_x.py", line 7, in _case\n{code}\n{first_line}\n'
    )


OWN = _error("AssertionError: rank 1 holds 12 elements, expected 10")
# What peers of a failed rank raise, as gloo, the store and run_cases word it.
CONSEQUENCES = [
    _error("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1"),
    _error(
        "RuntimeError: [../gloo/transport/tcp/pair.cc:598] Read error: Connection reset by peer"
    ),
    _error("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms"),
    _error("DistStoreError: wait timeout after 30000ms, keys: /default_pg/0//cpu//0"),
    "not run: case 'sum' failed before it in this world",
]


@pytest.mark.parametrize(
    "consequence", CONSEQUENCES, ids=["closed", "reset", "timed_out", "store_timeout", "not_run"]
)
def test_the_root_cause_comes_first_whatever_rank_raised_it(consequence):
    """A rank's own error is listed before the one it caused on another; passed ranks are not."""
    results = [{"c": (False, consequence)}, {"c": (False, OWN)}, {"c": (True, 3)}]
    assert worlds.failures(results, "c") == [(1, OWN), (0, consequence)]
    with pytest.raises(pytest.fail.Exception) as failed:
        worlds.outcome(results, "c")
    report = str(failed.value)
    assert report.startswith("case 'c' failed on ranks 1, 0:"), report
    assert report.index(OWN) < report.index(consequence), report
    assert "rank 2" not in report


def test_errors_of_the_same_kind_keep_rank_order():
    """Two ranks failing on their own, and two timing out: by rank within each kind."""
    own = [_error(f"ValueError: bad shard on rank {r}") for r in range(4)]
    results = [
        {"c": (False, CONSEQUENCES[2])},
        {"c": (False, own[1])},
        {"c": (False, CONSEQUENCES[0])},
        {"c": (False, own[3])},
    ]
    assert [rank for rank, _ in worlds.failures(results, "c")] == [1, 3, 0, 2]


def test_a_traceback_quoting_timeout_does_not_make_an_error_a_consequence():
    """Only the message counts: a timeout in the traceback's code does not demote an error."""
    error = _error("KeyError: 'weight'", code="    dist.barrier(timeout=timeout_s)")
    assert not worlds.is_consequence(error)
    assert all(worlds.is_consequence(c) for c in CONSEQUENCES)


def test_a_case_that_passed_everywhere_gives_each_ranks_result():
    """No failure: the results by rank."""
    results = [{"c": (True, 0)}, {"c": (True, 1)}]
    assert worlds.outcome(results, "c") == [0, 1]
    assert worlds.failures(results, "c") == []

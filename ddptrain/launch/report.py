"""How a worker tells ddptrain-run why it ended, and what ddptrain-run makes of it.

    # in a worker (ddptrain.cli.run_main and the Trainer's stop do this for you):
    if not report.worker_exit(2, "error: --lr: must be > 0", same_on_every_rank=True):
        print("error: --lr: must be > 0", file=sys.stderr)     # not under ddptrain-run
    # in ddptrain-run, once torchrun's agent is done:
    outcomes = report.read_outcomes(folder)                     # {rank: Outcome}
    ending = report.failed_job(outcomes, failures, root)        # or signalled_job(...)
    print(*ending.lines, sep="\\n"); sys.exit(ending.exit_code)

ddptrain-run names a fresh folder in each worker's DDPTRAIN_REPORT_DIR (one per round of
workers, so a restarted round never reads its predecessor's files); a worker writes
`rank-<RANK>.json` there as it ends. Under any other launcher the variable is absent and the
worker prints its own line, as before. The functions that turn outcomes into the last lines
and the exit status are pure, so they are tested without processes.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

REPORT_DIR_ENV = "DDPTRAIN_REPORT_DIR"
USER_EXIT_CODE = 1  # a failure that names no exit code of its own (a rank killed by a signal)


@dataclass(frozen=True)
class Outcome:
    """How one worker ended, as it reported it."""

    rank: int
    exit_code: int
    line: str | None = None  # an `error: ...` line for ddptrain-run to print; None: said it all
    same_on_every_rank: bool = False  # the line is the job's, not this rank's alone
    follows_peer: bool = False  # caused by another rank's failure, which that rank reports


@dataclass(frozen=True)
class Failure:
    """A failed worker as torchrun's agent saw it (ChildFailedError's ProcessFailure)."""

    exit_code: int  # negative: killed by that signal
    message: str | None = None  # `Type: message` from its error file (torch's @record)


@dataclass(frozen=True)
class Ending:
    """What ddptrain-run prints last, and the status it exits with."""

    lines: list[str]
    exit_code: int


def under_ddptrain_run() -> bool:
    """Whether ddptrain-run started this process (it then prints the error lines)."""
    return REPORT_DIR_ENV in os.environ


def worker_exit(
    exit_code: int,
    line: str | None = None,
    *,
    same_on_every_rank: bool = False,
    follows_peer: bool = False,
) -> bool:
    """Tell ddptrain-run how this worker ends; False when not under it, or the folder is gone
    (the caller then prints `line` itself)."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return False
    rank = int(os.environ.get("RANK", "0"))
    outcome = Outcome(rank, int(exit_code), line, same_on_every_rank, follows_peer)
    path = Path(folder) / f"rank-{rank}.json"
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(asdict(outcome)))
        os.replace(partial, path)  # whole or absent: the launcher may read at any moment
    except OSError:
        return False
    return True


def read_outcomes(folder: str | os.PathLike) -> dict[int, Outcome]:
    """{rank: Outcome} of the reports in `folder`; unreadable ones are skipped."""
    outcomes = {}
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            outcome = Outcome(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        outcomes[outcome.rank] = outcome
    return outcomes


def error_lines(outcomes: Mapping[int, Outcome]) -> list[str]:
    """The `error:` lines of `outcomes`, each once, naming the ranks that reported it unless it
    is the whole job's (a flag, a setting: the same on every rank)."""
    alike: dict[str, list[Outcome]] = {}
    for outcome in sorted(outcomes.values(), key=lambda o: o.rank):
        if outcome.line:
            alike.setdefault(outcome.line, []).append(outcome)
    return [
        line if all(o.same_on_every_rank for o in group) else f"{line} ({rank_names(group)})"
        for line, group in alike.items()
    ]


def own_failures(outcomes: Mapping[int, Outcome]) -> dict[int, Outcome]:
    """The outcomes that are not a consequence of another rank's failure (which that rank
    reports), or all of them when every one is."""
    own = {rank: o for rank, o in outcomes.items() if not o.follows_peer}
    return own or dict(outcomes)


def rank_names(outcomes: list[Outcome]) -> str:
    """`rank 1` or `ranks 0, 1`."""
    ranks = [str(o.rank) for o in outcomes]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"


def failed_job(
    outcomes: Mapping[int, Outcome], failures: Mapping[int, Failure], root: int
) -> Ending:
    """The workers failed (torchrun's ChildFailedError; `root`: the rank it saw fail first):
    the reported lines, or one made from torchrun's record when that rank reported nothing;
    the root rank's exit code (1 when a signal killed it)."""
    failure = failures[root]
    reported = outcomes.get(root)
    # A line that follows another rank's failure is shown only when it is the first failure.
    shown = {r: o for r, o in outcomes.items() if not o.follows_peer or r == root}
    lines = error_lines(shown)
    if reported is None:
        lines.append(_failure_line(root, failure))
    code = reported.exit_code if reported is not None else failure.exit_code
    return Ending(lines, code if code > 0 else USER_EXIT_CODE)


def _failure_line(rank: int, failure: Failure) -> str:
    """torchrun's record of a rank that said nothing through ddptrain, in one line."""
    if failure.exit_code < 0:
        return f"error: rank {rank} was killed by {_signal_name(-failure.exit_code)}"
    if failure.message:
        first = failure.message.strip().splitlines()[0] if failure.message.strip() else ""
        return f"error: rank {rank} exited with code {failure.exit_code}: {first} (traceback above)"
    return f"error: rank {rank} exited with code {failure.exit_code}"


def signalled_job(outcomes: Mapping[int, Outcome], signum: int) -> Ending:
    """ddptrain-run got `signum` and torchrun stopped the workers with it: the lowest reporting
    rank's exit code (every rank agrees on it when the Trainer saved), and its error lines;
    with no report, 128 + signum (what a shell shows for a job the signal ended) and one line."""
    if outcomes:
        shown = {r: o for r, o in outcomes.items() if not o.follows_peer}
        return Ending(error_lines(shown), outcomes[min(outcomes)].exit_code)
    code = 128 + signum
    name = _signal_name(signum)
    return Ending([f"ddptrain-run: stopped the workers on {name}; exiting with code {code}"], code)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

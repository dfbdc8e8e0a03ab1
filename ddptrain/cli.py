"""Command-line entry points: one `error: <message>` line for mistakes a user made.

    parser = ddptrain.cli.ArgumentParser(description=__doc__)   # bad or abbreviated flags raise
    parser.add_argument("--epochs", type=int, default=6)         # UsageError: --epoch 3 is refused
    parser.add_argument("--lr", type=positive(float), default=0.05)

    def main(argv: list[str] | None = None) -> int: ...

    if __name__ == "__main__":
        sys.exit(ddptrain.cli.run_main(main))

`run_main` turns the exceptions in USER_ERRORS (bad flags and settings, data files, downloads,
checkpoints, launcher variables and ports, another rank's failure) into one line on stderr and
exit status 2 (flags and settings) or 1 (the rest), without a traceback. `--debug` or
DDPTRAIN_DEBUG=1 shows it. Any other exception is a bug: it propagates with its traceback and
torchrun's `@record` report. Under ddptrain-run (ddptrain.launch.runner) each rank hands its line
and exit status to the launcher instead, which prints each line once, after everything else.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddptrain.data.download import DownloadError
from ddptrain.data.idx import IDXFormatError
from ddptrain.dist import LaunchError, parse_env
from ddptrain.flags import in_flags
from ddptrain.launch import report
from ddptrain.train.checkpoint import CheckpointError
from ddptrain.train.config import ConfigError
from ddptrain.train.health import PeerFailedError
from ddptrain.train.metrics import LogDirError

DEBUG_ENV = "DDPTRAIN_DEBUG"
USAGE_EXIT_CODE = 2
USER_EXIT_CODE = 1
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a job stopped by Ctrl-C
# A rank other than 0 waits this long before printing an error that it may have seen alone:
# when rank 0 failed too, the launcher stops this process meanwhile. Generous, because a loaded
# machine can take seconds to tear rank 0 down; it delays only a message no other rank prints.
PEER_GRACE_S = 30.0
# Under ddptrain-run the line is not printed twice whatever the order; the wait only lets the
# failing peer leave first, so that the launcher names it as the first failure.
PEER_GRACE_UNDER_LAUNCHER_S = 5.0
T = TypeVar("T")


class UsageError(Exception):
    """A bad command-line flag or combination of flags."""


# Settings follow from the flags and the world size alone, so every rank sees the same ones.
USAGE_ERRORS: tuple[type[BaseException], ...] = (UsageError, ConfigError)
# Raised alike on every rank: flags and settings are the same everywhere, and the Trainer
# broadcasts every checkpoint verdict from rank 0. Other ranks leave these to rank 0.
SAME_ON_EVERY_RANK: tuple[type[BaseException], ...] = (*USAGE_ERRORS, CheckpointError)
USER_ERRORS: tuple[type[BaseException], ...] = (
    *USAGE_ERRORS,
    LaunchError,
    IDXFormatError,
    DownloadError,
    FileNotFoundError,
    CheckpointError,
    LogDirError,
    # Names the peer's error, which that rank reports itself (with its traceback if a bug).
    PeerFailedError,
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise UsageError instead of printing usage and exiting, and which
    takes only whole flag names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Abbreviations let a typo (`--epoch 3`) pass as a real flag, and turn a working command
        # line into an error the day a flag with the same prefix is added.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message}{self._did_you_mean(message)} (see {self.prog} --help)")

    def _did_you_mean(self, message: str) -> str:
        if not message.startswith("unrecognized arguments: "):
            return ""
        known = [s for action in self._actions for s in action.option_strings]
        guesses = []
        for word in message.removeprefix("unrecognized arguments: ").split():
            flag = word.split("=", 1)[0]
            if flag.startswith("--"):
                guesses += difflib.get_close_matches(flag, known, n=1)
        return f"; did you mean {' or '.join(dict.fromkeys(guesses))}?" if guesses else ""


def positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse `type` accepting values of `kind` that are > 0."""
    return _bounded(kind, lambda v: v > 0, "> 0")


def non_negative(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse `type` accepting values of `kind` that are >= 0."""
    return _bounded(kind, lambda v: v >= 0, ">= 0")


def probability(text: str) -> float:
    """An argparse `type` accepting a float in [0, 1) (a dropout rate)."""
    return _bounded(float, lambda v: 0 <= v < 1, "in [0, 1)")(text)


def _bounded(kind, ok: Callable[[float], bool], bound: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def run_alike(fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if a user error stops it on any, raise that one on every rank.

    The ranks meet in an all_gather afterwards (so it is also a barrier: e.g. local rank 0
    downloads inside `fn` while the others wait), and rank 0 alone prints the shared error.
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except USER_ERRORS as e:
        error = e
    if dist.is_initialized():
        errors: list[tuple[type[BaseException], str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, (type(error), str(error)) if error else None)
        first = next((e for e in errors if e is not None), None)
        if error is None and first is not None:
            error = first[0](first[1])
    if error is not None:
        error.same_on_every_rank = True  # type: ignore[attr-defined]
        raise error
    return result


def format_error(e: BaseException) -> str:
    """`error: <message>` on one line, whatever whitespace the message holds."""
    return "error: " + (" ".join(str(e).split()) or type(e).__name__)


def exit_code(e: BaseException) -> int:
    """2 for flags and settings, 1 for other mistakes (data, checkpoints, launch)."""
    return USAGE_EXIT_CODE if isinstance(e, USAGE_ERRORS) else USER_EXIT_CODE


def run_main(
    main: Callable[[list[str]], int],
    argv: Sequence[str] | None = None,
    settings: Sequence[type] = (),
) -> int:
    """Run `main(argv)` under torchrun's `@record`; a user error or Ctrl-C prints one line and
    returns the exit status. Under ddptrain-run the line goes to the launcher instead, which
    prints each rank's once, after everything else. `settings`: the dataclasses the flags
    were made from (ddptrain/flags.py), so that an error about a setting names its flag."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")

    @record
    def guarded() -> int:
        try:
            code = main(argv)
        except USER_ERRORS as e:
            if debug:
                raise
            return _user_error(e, settings)
        except KeyboardInterrupt:
            if debug:
                raise
            # Ctrl-C reaches every rank of the terminal's job: one line for the job, from rank 0.
            if _rank() == 0:
                print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
            report.worker_exit(INTERRUPTED_EXIT_CODE)
            return INTERRUPTED_EXIT_CODE
        except SystemExit as e:  # a Preempted stop, or sys.exit(n) inside main
            report.worker_exit(e.code if isinstance(e.code, int) else USER_EXIT_CODE)
            raise
        report.worker_exit(code or 0)
        return code

    return guarded()


def _user_error(e: BaseException, settings: Sequence[type]) -> int:
    """Print (or hand to ddptrain-run) the one line for a user error, a setting named by its
    flag; its exit status."""
    line, code, same = in_flags(format_error(e), *settings), exit_code(e), _same_on_every_rank(e)
    follows_peer = isinstance(e, PeerFailedError)
    rank = _rank()
    if report.worker_exit(code, line, same_on_every_rank=same, follows_peer=follows_peer):
        if follows_peer:
            # The peer's own failure is the one to report: let the launcher see it first. Short,
            # and cut short by a signal, so that it stays inside torchrun's shutdown timeout.
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(PEER_GRACE_UNDER_LAUNCHER_S)
        return code
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    elif not same:
        # Only this rank may have seen it (a file on its host, its LOCAL_RANK).
        time.sleep(PEER_GRACE_S)
        print(f"{line} (rank {rank})", file=sys.stderr, flush=True)
    return code


def _same_on_every_rank(e: BaseException) -> bool:
    return isinstance(e, SAME_ON_EVERY_RANK) or getattr(e, "same_on_every_rank", False)


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    try:
        return parse_env(os.environ).rank
    except (LaunchError, ValueError):  # ValueError: a SLURM node list only scontrol expands
        return 0

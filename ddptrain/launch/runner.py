"""ddptrain-run: torchrun, with the workers' own `error:` line last and their exit code.

    ddptrain-run --standalone --nproc_per_node=2 recipes/mnist.py --epochs 2
    ddptrain-run --nnodes=1:2 --nproc_per_node=2 --max-restarts=10 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=mnist-1 recipes/mnist.py --checkpoint-dir ckpt
    python -m ddptrain.run ...                  # the same, without the console script
    ddptrain-run --verbose ...                  # torchrun's own logs and FAILED report as well

It takes torchrun's arguments (torch.distributed.run's parser, plus --verbose) and runs torch's
own elastic agent in this process (torch.distributed.launcher.elastic_launch): rendezvous,
restarts, elastic membership, signal forwarding and --shutdown-timeout are torchrun's. What
differs is what the terminal shows at the end and the exit status:

- A failed job ends with the failing ranks' `error:` lines, each once (a line several ranks
  report is printed once, naming them), and exits with the workers' code: 2 for a bad flag or
  setting, 1 for other mistakes and bugs, 75 for a lost rank or launcher, 76 when they saved and
  stopped on a signal. torchrun's traceback, ChildFailedError and FAILED block are not shown.
- Ctrl-C or SIGTERM: torchrun forwards it and waits for the workers; the Trainer saves the step
  and rank 0 prints `stopped at step N ...; exiting with code 76`, and ddptrain-run exits 76,
  adding nothing. Workers that report nothing (not ddptrain's) end it with 128 + the signal
  (130 for SIGINT) and one line saying so.
- OMP_NUM_THREADS=1 is set where torchrun would set it (several workers, the variable unset),
  without torchrun's banner.

The workers report through DDPTRAIN_REPORT_DIR (ddptrain.launch.report), set in each worker's
environment by a LogsSpecs around torchrun's own (the hook torchrun gives each round of workers
its log files and error files by): a fresh folder per round, so a restart never reads its
predecessor's reports; it also prints one line when a new round starts. Under plain torchrun
the same workers print their lines themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import elastic_launch

from ddptrain.launch import report

PROG = "ddptrain-run"
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a job Ctrl-C stopped
# torchrun's log records that the end of a ddptrain-run job replaces (the summary is shorter,
# and names the workers' own error); any other record of torchrun's is shown as usual.
_REPLACED_RECORDS = (
    "Sending process %s closing signal %s",
    "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
    "Received %s death signal, shutting down workers",
)


class ReportingLogsSpecs(LogsSpecs):
    """torchrun's LogsSpecs, plus a fresh report folder in each round of workers' environment."""

    def __init__(self, inner: LogsSpecs, root: Path) -> None:
        super().__init__()
        self.inner, self.root = inner, root
        self.rounds = 0
        self._restart_count: str | None = None

    @property
    def root_log_dir(self) -> str:
        """torchrun's log folder (its --log-dir)."""
        return self.inner.root_log_dir

    @property
    def folder(self) -> Path | None:
        """The report folder of the latest round of workers (None before the first)."""
        return self.root / f"round-{self.rounds}" if self.rounds else None

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Called by torchrun's agent as it starts a round of workers (`envs`: their variables)."""
        first = envs[min(envs)] if envs else {}
        if self.rounds:
            self._announce_round(first)
        self._restart_count = first.get("TORCHELASTIC_RESTART_COUNT")
        self.rounds += 1
        self.folder.mkdir(parents=True)
        for env in envs.values():
            env[report.REPORT_DIR_ENV] = str(self.folder)
        return self.inner.reify(envs)

    def _announce_round(self, env: dict[str, str]) -> None:
        """The previous round's error lines (its workers left them to this process), then why
        the workers start again: a failure (one restart spent) or a change of membership."""
        for line in report.error_lines(report.own_failures(report.read_outcomes(self.folder))):
            _say(line)
        count = env.get("TORCHELASTIC_RESTART_COUNT")
        size = env.get("WORLD_SIZE", "?")
        if count != self._restart_count:
            most = env.get("TORCHELASTIC_MAX_RESTARTS")
            _say(f"{PROG}: restarting the workers (restart {count} of {most}, world_size {size})")
        else:
            _say(
                f"{PROG}: the job's membership changed; restarting the workers (world_size {size})"
            )


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser, named ddptrain-run, with --verbose."""
    parser = torchrun.get_args_parser()
    parser.prog = PROG
    parser.description = (
        "torchrun (torch.distributed.run) that ends a failed job with the workers' own error "
        "line and exits with their exit code"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show torchrun's own report: its log lines, traceback and FAILED block",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run torchrun's agent on the arguments; return the workers' exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    _one_thread_per_worker(args.nproc_per_node)
    root = Path(tempfile.mkdtemp(prefix="ddptrain-run-"))
    try:
        with contextlib.ExitStack() as stack:
            if not args.verbose:
                stack.enter_context(_quiet_torchrun())
            return _launch(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _launch(args: argparse.Namespace, root: Path) -> int:
    _prepare_rendezvous(args)
    config, entrypoint, entrypoint_args = torchrun.config_from_args(args)
    specs = ReportingLogsSpecs(config.logs_specs, root)
    config.logs_specs = specs
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*entrypoint_args)
        return 0
    except ChildFailedError as e:
        if args.verbose:
            traceback.print_exc()
        root_rank, _ = e.get_first_failure()
        failures = {rank: _failure(f) for rank, f in e.failures.items()}
        ending = report.failed_job(_outcomes(specs), failures, root_rank)
    except SignalException as e:
        if args.verbose:
            traceback.print_exc()
        ending = report.signalled_job(_outcomes(specs), int(e.sigval))
    except KeyboardInterrupt:
        # Ctrl-C before torchrun started any worker (during the rendezvous): nothing to stop.
        ending = report.Ending(
            [f"{PROG}: interrupted before the workers started"], INTERRUPTED_EXIT_CODE
        )
    except Exception as e:  # noqa: BLE001 - the agent's own failure (rendezvous, a bad flag)
        if args.verbose:
            traceback.print_exc()
        message = " ".join(str(e).split()) or "no details"
        ending = report.Ending([f"error: {PROG}: {type(e).__name__}: {message}"], 1)
    for line in ending.lines:
        _say(line)
    return ending.exit_code


def _prepare_rendezvous(args: argparse.Namespace) -> None:
    """What torch.distributed.run.run does to the arguments before config_from_args."""
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _one_thread_per_worker(nproc_per_node: str) -> None:
    """OMP_NUM_THREADS=1 where torchrun would set it, so its banner is not printed."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        nproc = torchrun.determine_local_world_size(nproc_per_node)
    except ValueError:
        return  # torchrun's own check reports it
    if nproc > 1:
        os.environ["OMP_NUM_THREADS"] = "1"


def _outcomes(specs: ReportingLogsSpecs) -> dict[int, report.Outcome]:
    return report.read_outcomes(specs.folder) if specs.folder else {}


def _failure(failure: ProcessFailure) -> report.Failure:
    message = failure.message
    if isinstance(message, dict):  # an error file written by torch's @record
        message = message.get("message")
    has_error_file = failure.error_file_data.get("message") not in (None, "<NONE>")
    return report.Failure(failure.exitcode, str(message) if has_error_file and message else None)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Replaced(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("torch.distributed") and record.msg in _REPLACED_RECORDS)


@contextlib.contextmanager
def _quiet_torchrun() -> Iterator[None]:
    """Leave out torchrun's log records that the job's end replaces, while inside."""
    handlers = {
        h for name in ("torch.distributed", "torch", "") for h in logging.getLogger(name).handlers
    }
    quiet = _Replaced()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)

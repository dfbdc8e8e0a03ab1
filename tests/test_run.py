"""ddptrain-run: torchrun's engine, ending a job with the workers' own `error:` line and code.

The outcome rules are pure (ddptrain.launch.report) and tested without processes; the
end-to-end tests launch 2 workers under ddptrain-run (and torchrun, for what differs).
The signal tests with a training job are in tests/train/test_launcher_faults.py.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

from ddptrain.launch import report, runner
from support.child_env import child_env
from support.launch_cmds import DDPTRAIN_RUN, TORCHRUN

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "mnist.py"
TWO = ["--standalone", "--nproc_per_node=2", "--monitor-interval=0.2"]


def _outcome(rank: int, code: int, line: str | None = None, **flags: bool) -> report.Outcome:
    return report.Outcome(rank, code, line, **flags)


def test_a_line_several_ranks_report_is_printed_once():
    """A line several ranks report prints once; different lines stay apart, each naming its rank."""
    setting = {r: _outcome(r, 2, "error: bad lr", same_on_every_rank=True) for r in (0, 1)}
    assert report.error_lines(setting) == ["error: bad lr"]
    local = {r: _outcome(r, 1, "error: no file") for r in (1, 0)}
    assert report.error_lines(local) == ["error: no file (ranks 0, 1)"]
    apart = {0: _outcome(0, 1, "error: a"), 1: _outcome(1, 1, "error: b"), 2: _outcome(2, 76)}
    assert report.error_lines(apart) == ["error: a (rank 0)", "error: b (rank 1)"]


def test_a_failed_job_exits_with_the_first_failing_ranks_code():
    """A failed job exits with its first failure's code; a rank killed by a signal gives 1."""
    flag = {r: _outcome(r, 2, "error: bad flag", same_on_every_rank=True) for r in (0, 1)}
    failures = {0: report.Failure(-15), 1: report.Failure(2)}
    assert report.failed_job(flag, failures, root=1) == report.Ending(["error: bad flag"], 2)
    lost = {0: _outcome(0, 75)}
    assert report.failed_job(lost, {0: report.Failure(75)}, root=0) == report.Ending([], 75)
    killed = report.failed_job({}, {1: report.Failure(-9)}, root=1)
    assert killed == report.Ending(["error: rank 1 was killed by SIGKILL"], 1)
    bug = report.failed_job({}, {0: report.Failure(1, "ValueError: boom\nmore")}, root=0)
    assert bug.lines == ["error: rank 0 exited with code 1: ValueError: boom (traceback above)"]
    plain = report.failed_job({}, {0: report.Failure(3)}, root=0)
    assert plain == report.Ending(["error: rank 0 exited with code 3"], 3)


def test_a_line_that_follows_a_peers_failure_is_shown_only_as_the_first_failure():
    """A `rank 0 left` line is shown only when its rank failed first."""
    follows = _outcome(1, 1, "error: rank 1: rank 0 left", follows_peer=True)
    own = _outcome(0, 1, "error: disk full")
    both = {0: own, 1: follows}
    failures = {0: report.Failure(1), 1: report.Failure(1)}
    assert report.failed_job(both, failures, root=0).lines == ["error: disk full (rank 0)"]
    unreported = report.failed_job({1: follows}, failures, root=0)
    assert unreported.lines == ["error: rank 0 exited with code 1"]
    first = report.failed_job({1: follows}, failures, root=1)
    assert first.lines == ["error: rank 1: rank 0 left (rank 1)"]


def test_a_signalled_job_exits_with_the_workers_code_else_128_plus_the_signal():
    """A signalled job exits with its workers' code, else 128 + the signal and one line."""
    saved = {r: _outcome(r, 76) for r in (0, 1)}
    assert report.signalled_job(saved, signal.SIGINT) == report.Ending([], 76)
    early = {
        0: _outcome(0, 130),
        1: _outcome(1, 1, "error: rank 1: rank 0 left", follows_peer=True),
    }
    assert report.signalled_job(early, signal.SIGINT) == report.Ending([], 130)
    silent = report.signalled_job({}, signal.SIGTERM)
    assert silent.exit_code == 143
    assert silent.lines == ["ddptrain-run: stopped the workers on SIGTERM; exiting with code 143"]


def test_a_worker_reports_only_under_ddptrain_run(tmp_path, monkeypatch):
    """A worker writes its outcome only under DDPTRAIN_REPORT_DIR, and it reads back whole."""
    monkeypatch.delenv(report.REPORT_DIR_ENV, raising=False)
    assert not report.worker_exit(2, "error: x")
    monkeypatch.setenv(report.REPORT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    assert report.worker_exit(1, "error: y", follows_peer=True)
    assert report.read_outcomes(tmp_path) == {3: _outcome(3, 1, "error: y", follows_peer=True)}
    assert [p.name for p in tmp_path.iterdir()] == ["rank-3.json"]


def _round(count: str, world_size: str) -> dict[int, dict[str, str]]:
    return {
        local_rank: {
            "RANK": str(local_rank),
            "TORCHELASTIC_RUN_ID": "test",
            "TORCHELASTIC_RESTART_COUNT": count,
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "WORLD_SIZE": world_size,
        }
        for local_rank in range(2)
    }


def test_each_round_of_workers_reports_into_its_own_folder(tmp_path, capsys):
    """Each round gets its own report folder; the next prints the last one's errors and why."""
    specs = runner.ReportingLogsSpecs(DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), tmp_path)
    first = _round("0", "2")
    specs.reify(first)
    folder = first[0][report.REPORT_DIR_ENV]
    assert first[1][report.REPORT_DIR_ENV] == folder and Path(folder).is_dir()
    assert first[0]["TORCHELASTIC_ERROR_FILE"].startswith(str(tmp_path / "logs"))
    (Path(folder) / "rank-1.json").write_text(
        '{"rank": 1, "exit_code": 1, "line": "error: no data", "same_on_every_rank": false, '
        '"follows_peer": false}'
    )
    assert capsys.readouterr().err == ""
    restarted = _round("1", "2")
    specs.reify(restarted)
    assert restarted[0][report.REPORT_DIR_ENV] != folder
    assert capsys.readouterr().err.splitlines() == [
        "error: no data (rank 1)",
        "ddptrain-run: restarting the workers (restart 1 of 3, world_size 2)",
    ]
    specs.reify(_round("1", "4"))
    assert capsys.readouterr().err.splitlines() == [
        "ddptrain-run: the job's membership changed; restarting the workers (world_size 4)"
    ]
    assert specs.root_log_dir == str(tmp_path / "logs")


@pytest.mark.parametrize(
    ("preset", "nproc", "expected"), [(None, "2", "1"), (None, "1", None), ("4", "2", "4")]
)
def test_omp_num_threads_is_set_where_torchrun_would_set_it(monkeypatch, preset, nproc, expected):
    """Several workers and no OMP_NUM_THREADS: 1, as torchrun sets; otherwise it is left alone."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if preset is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    runner._one_thread_per_worker(nproc)
    assert os.environ.get("OMP_NUM_THREADS") == expected


def test_torchruns_shutdown_records_are_left_out_and_its_other_records_kept():
    """torchrun's closing-signal and exitcode records are left out; a forced SIGKILL still shows."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    collect = Collect()
    target = logging.getLogger("torch.distributed")
    target.addHandler(collect)
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    try:
        with runner._quiet_torchrun():
            log.warning("Sending process %s closing signal %s", 12, "SIGINT")
            log.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 0, 1, "py")
            log.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 1, 2, 9)
        log.warning("Sending process %s closing signal %s", 13, "SIGTERM")
    finally:
        target.removeHandler(collect)
    assert seen == [
        "Unable to shutdown process 1 via 2, forcefully exiting via 9",
        "Sending process 13 closing signal SIGTERM",
    ]


def _launch(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in child_env(**env).items() if k != "OMP_NUM_THREADS"}
    return subprocess.run(
        cmd, cwd=cwd, env=environment, capture_output=True, text=True, timeout=240
    )


def test_a_bad_flag_ends_with_its_line_once_and_exit_status_2(tmp_path):
    """A flag both ranks refuse is one stderr line and nothing else, with exit status 2."""
    done = _launch([*DDPTRAIN_RUN, *TWO, str(RECIPE), "--lr", "-1"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: argument --lr: must be > 0, got -1 (see mnist.py --help)"
    ]
    assert done.stdout == ""


_BUG = """
import os, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("boom on rank 1")
    time.sleep(60)

main()
"""


def test_a_bug_on_one_rank_ends_with_that_rank_and_its_exception(tmp_path):
    """A bug keeps its traceback and ends with one line naming the rank and exception, status 1."""
    # The script has no ddptrain reporting: the exception comes from torchrun's error file.
    (tmp_path / "bug.py").write_text(_BUG)
    done = _launch([*DDPTRAIN_RUN, *TWO, "bug.py"], tmp_path)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert (
        lines[-1]
        == "error: rank 1 exited with code 1: ValueError: boom on rank 1 (traceback above)"
    )
    assert lines[-2] == "ValueError: boom on rank 1"
    assert "ChildFailedError" not in done.stderr


_FAILS_ONCE = """
import os, sys
from ddptrain.cli import run_main

def main(argv):
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        raise FileNotFoundError("shard-1.bin is missing")
    print("rank", os.environ["RANK"], "done at restart", os.environ["TORCHELASTIC_RESTART_COUNT"])
    return 0

sys.exit(run_main(main))
"""


@pytest.mark.slow
def test_a_restart_shows_the_failed_rounds_line_then_the_restart(tmp_path):
    """--max-restarts=1: the failed round's error line, then the counted restart; exit status 0."""
    (tmp_path / "job.py").write_text(_FAILS_ONCE)
    done = _launch([*DDPTRAIN_RUN, *TWO, "--max-restarts=1", "job.py"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "error: shard-1.bin is missing (rank 1)",
        "ddptrain-run: restarting the workers (restart 1 of 1, world_size 2)",
    ]
    finished = {f"rank {r} done at restart 1" for r in (0, 1)}
    assert finished <= set(done.stdout.splitlines()), done.stdout


_SLEEPER = """
import os, pathlib, time
pathlib.Path(f"{os.environ['LAUNCH']}-up-{os.environ['RANK']}").touch()
time.sleep(600)
"""


@pytest.mark.slow
def test_sigterm_to_workers_that_report_nothing_exits_128_plus_it(tmp_path):
    """SIGTERM to ddptrain-run over silent workers ends with one line and 143, torchrun's with 1."""
    (tmp_path / "sleep.py").write_text(_SLEEPER)
    ends = {}
    for name, launcher in (("ddptrain-run", DDPTRAIN_RUN), ("torchrun", TORCHRUN)):
        environment = {k: v for k, v in child_env(LAUNCH=name).items() if k != "OMP_NUM_THREADS"}
        proc = subprocess.Popen(
            [*launcher, *TWO, "sleep.py"],
            cwd=tmp_path,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while len(list(tmp_path.glob(f"{name}-up-*"))) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        ends[name] = (proc.returncode, err.splitlines())
    code, lines = ends["ddptrain-run"]
    assert (code, lines) == (
        143,
        ["ddptrain-run: stopped the workers on SIGTERM; exiting with code 143"],
    )
    code, lines = ends["torchrun"]
    assert code == 1, lines
    assert re.fullmatch(r".*SignalException: Process \d+ got signal: 15", lines[-1]), lines

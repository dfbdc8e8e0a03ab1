"""Faults under torchrun and ddptrain-run: after a killed rank's restart, a forwarded signal,
Ctrl-C or a dead torchrun agent, the run resumes bitwise equal to a run never stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import ddptrain
from ddptrain.train import checkpoint as ckpt
from support.child_env import child_env
from support.fault_runs import DETECTED_WITHIN_S, JOB
from support.launch_cmds import LAUNCHERS


def _launch_cmd(launcher: str, args: list[str], torchrun_flags: list[str] = ()) -> list[str]:
    return [
        *LAUNCHERS[launcher],
        *("--standalone", "--nproc_per_node=2", "--monitor-interval=0.5", *torchrun_flags),
        *(str(JOB), *args),
    ]


def _run_job(
    args: list[str], tmp_path: Path, restarts: int, launcher: str = "torchrun"
) -> subprocess.CompletedProcess:
    return subprocess.run(
        _launch_cmd(launcher, args, [f"--max-restarts={restarts}"]),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "ddptrain-run"])
def test_a_restart_resumes_to_bitwise_equal_parameters(tmp_path, launcher):
    """With --max-restarts=1 a SIGKILLed rank restarts, resumes and ends bitwise equal."""
    straight = _run_job(["--ckpt-dir", "a", "--out", "a.pt"], tmp_path, 0, launcher)
    assert straight.returncode == 0, straight.stderr[-3000:]
    faulty = _run_job(
        ["--ckpt-dir", "b", "--out", "b.pt", "--fault", "kill:1:7"], tmp_path, 1, launcher
    )
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    assert "resuming from" in faulty.stdout and "ckpt-00000006.pt" in faulty.stdout
    if launcher == "ddptrain-run":
        assert "ddptrain-run: restarting the workers (restart 1 of 1" in faulty.stderr
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a["summary"]["step"] == b["summary"]["step"] == 24
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def _job(tmp_path: Path, name: str, extra: list[str]) -> list[str]:
    """fault_job arguments of a slowed run (0.2 s a step, 24 steps) that logs every step and
    checkpoints only when stopped and at its end."""
    at = f"{tmp_path}/{name}"
    return [
        *("--ckpt-dir", f"{at}-ckpt", "--checkpoint-every", "100", "--out", f"{at}.pt"),
        *("--log-dir", f"{at}-logs", "--log-every", "1", "--sleep-per-step", "0.2", *extra),
    ]


def _steps_logged(tmp_path: Path, name: str) -> list[int]:
    path = tmp_path / f"{name}-logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r["step"] for r in lines if "loss" in r]


def _signal_mid_run(
    tmp_path: Path,
    name: str,
    number: int,
    torchrun_flags: list[str] = (),
    launcher: str = "torchrun",
    to_group: bool = False,
) -> tuple[subprocess.Popen, str, float]:
    """Start the slowed job under the launcher, send it `number` once step 3 is logged (to its
    whole process group when `to_group`, as a terminal's Ctrl-C does); return the finished
    process, its output and the seconds from the signal to its exit."""
    proc = subprocess.Popen(
        _launch_cmd(launcher, _job(tmp_path, name, []), torchrun_flags),
        cwd=tmp_path,
        env=child_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=to_group,
    )
    try:
        deadline = time.monotonic() + DETECTED_WITHIN_S
        while not any(s >= 3 for s in _steps_logged(tmp_path, name)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        signalled = time.monotonic()
        if to_group:
            os.killpg(proc.pid, number)
        else:
            proc.send_signal(number)
        # The output pipe closes when the last worker exits, torchrun or not.
        out, _ = proc.communicate(timeout=DETECTED_WITHIN_S)
        return proc, out, time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _resumes_bitwise(tmp_path: Path, name: str) -> bool:
    """Whether the stopped run `name`, started again, ends with the parameters of a run never
    stopped (both on 2 ranks started by ddptrain.spawn: the same world as torchrun's, without
    an interpreter start per rank; no sleeping, which changes no number)."""
    from support import fault_job

    fast = ["--sleep-per-step", "0"]
    for run in (name, "straight"):
        ddptrain.spawn(fault_job.main, 2, _job(tmp_path, run, fast), timeout_s=240)
    resumed, straight = (
        torch.load(tmp_path / f"{run}.pt", weights_only=True)["params"]
        for run in (name, "straight")
    )
    return all(torch.equal(x, y) for x, y in zip(resumed, straight, strict=True))


# torchrun dies on SIGUSR1 unless told to forward it.
FORWARD_SIGUSR1 = ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]


@pytest.mark.parametrize(
    ("launcher", "number", "torchrun_flags"),
    [
        # torchrun forwards SIGTERM by default (the elastic test meets it too): the same path.
        pytest.param("torchrun", signal.SIGTERM, [], marks=pytest.mark.slow, id="SIGTERM"),
        pytest.param("torchrun", signal.SIGINT, [], marks=pytest.mark.slow, id="SIGINT"),
        pytest.param(
            "torchrun",
            signal.SIGUSR1,
            FORWARD_SIGUSR1,
            marks=pytest.mark.slow,
            id="SIGUSR1-forwarded",
        ),
        # ddptrain-run runs torchrun's agent: the same forwarding (its Ctrl-C test below runs
        # by default).
        pytest.param(
            "ddptrain-run",
            signal.SIGUSR1,
            FORWARD_SIGUSR1,
            marks=pytest.mark.slow,
            id="ddptrain-run-SIGUSR1-forwarded",
        ),
    ],
)
def test_a_forwarded_signal_saves_the_last_step_and_the_rerun_is_bitwise(
    tmp_path, launcher, number, torchrun_flags
):
    """A forwarded signal saves the step reached, trains none after it, and the rerun is bitwise."""
    # The workers must exit 76 well before torchrun's SIGKILL, 30 s after the signal.
    proc, out, seconds = _signal_mid_run(tmp_path, "b", number, torchrun_flags, launcher)
    saved = ckpt.latest_checkpoint(tmp_path / "b-ckpt")
    assert saved is not None, out
    step = ckpt.parse_step(saved.name)
    lost = max(_steps_logged(tmp_path, "b")) - step
    print(
        f"{signal.Signals(number).name}: saved step {step}, {lost} step(s) lost, exit "
        f"{seconds:.2f} s after the signal"
    )
    assert lost == 0 and step >= 3, out
    assert f"stopped at step {step} on {signal.Signals(number).name}" in out, out
    assert "exiting with code 76" in out, out
    # torchrun ends on its own SignalException (status 1); ddptrain-run with the workers' 76.
    assert proc.returncode == (76 if launcher == "ddptrain-run" else 1), out
    assert seconds < DETECTED_WITHIN_S
    assert _resumes_bitwise(tmp_path, "b")


def test_ctrl_c_under_ddptrain_run_is_one_story_and_exit_status_76(tmp_path):
    """Ctrl-C saves the step, rank 0's stop line comes last, exit status is 76; rerun is bitwise."""
    proc, out, seconds = _signal_mid_run(
        tmp_path, "c", signal.SIGINT, launcher="ddptrain-run", to_group=True
    )
    saved = ckpt.latest_checkpoint(tmp_path / "c-ckpt")
    assert saved is not None, out
    step = ckpt.parse_step(saved.name)
    print(f"Ctrl-C under ddptrain-run: saved step {step}, exit {seconds:.2f} s after the signal")
    assert proc.returncode == 76, out
    last = out.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"ddptrain: stopped at step {step} on SIGINT"), out
    assert "exiting with code 76" in last, out
    assert last.endswith("Run the same command again to continue from there."), out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert max(_steps_logged(tmp_path, "c")) == step, out
    assert _resumes_bitwise(tmp_path, "c")


def test_workers_orphaned_by_torchrun_stop_at_the_next_step_with_one_line(tmp_path):
    """Workers whose torchrun died save their step, say so in one line and resume bitwise."""
    _, out, seconds = _signal_mid_run(tmp_path, "o", signal.SIGUSR1)
    saved = ckpt.latest_checkpoint(tmp_path / "o-ckpt")
    assert saved is not None, out
    step = ckpt.parse_step(saved.name)
    print(f"orphans: saved step {step}, exited {seconds:.2f} s after torchrun died")
    assert max(_steps_logged(tmp_path, "o")) == step, out
    assert out.count("its torchrun agent (pid") == 1, out
    assert f"stopped at step {step} on its torchrun agent" in out, out
    assert "lost rank" not in out and "Broken pipe" not in out, out
    assert seconds < DETECTED_WITHIN_S
    assert _resumes_bitwise(tmp_path, "o")

"""Fault tolerance: dead or frozen ranks, restarts, non-finite steps, replica desync, bad disks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ddptrain
from ddptrain.train import checkpoint as ckpt
from support.child_env import child_env
from support.launch_cmds import LAUNCHERS

JOB = Path(__file__).resolve().parents[1] / "support" / "fault_job.py"
# A missed detection waits for the collective timeout (TrainerConfig.timeout_s, 300 s); a caught
# one takes seconds (a dead peer resets gloo's connections; a frozen one misses heartbeats).
# The bound sits far from both, so a loaded 2-core machine that starts processes slowly still
# passes while a hang still fails.
DETECTED_WITHIN_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_ranks(world_size: int, args: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    """Start each rank as its own process (no launcher that would kill the survivors for us)."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOB), *args],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> tuple[list[float], list[str]]:
    """Wait for every process; return each one's exit time and output (kill all on timeout)."""
    deadline = time.monotonic() + timeout_s
    exit_times: dict[int, float] = {}
    try:
        while len(exit_times) < len(procs):
            for i, p in enumerate(procs):
                if i not in exit_times and p.poll() is not None:
                    exit_times[i] = time.time()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(set(range(len(procs))) - set(exit_times))} "
                    f"still running after {timeout_s} s"
                )
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [exit_times[i] for i in range(len(procs))], [p.stdout.read() for p in procs]


@pytest.mark.parametrize("hook", ["default", pytest.param("tcp", marks=pytest.mark.slow)])
def test_survivors_exit_fast_naming_a_killed_rank(tmp_path, hook):
    """SIGKILL of rank 2 mid-epoch: ranks 0 and 1 exit non-zero long before a timeout, naming 2
    (shared memory, the default on one host, and the TCP ring, the default across hosts)."""
    stamp = tmp_path / "killed_at"
    args = ["--fault", "kill:2:5", "--stamp", str(stamp), "--comm-hook", hook]
    procs = _launch_ranks(3, args, tmp_path)
    exit_times, outputs = _wait_all(procs, timeout_s=240)
    assert procs[2].returncode == -signal.SIGKILL
    killed_at = float(stamp.read_text())
    for rank in (0, 1):
        assert procs[rank].returncode != 0, outputs[rank]
        assert "lost rank(s) [2]" in outputs[rank], outputs[rank]
        seconds = exit_times[rank] - killed_at
        print(f"rank {rank} exited {seconds:.2f} s after rank 2 was killed")
        assert seconds < DETECTED_WITHIN_S


@pytest.mark.parametrize("hook", ["default", pytest.param("allreduce", marks=pytest.mark.slow)])
def test_a_rank_leaving_with_an_error_is_named_by_the_others(tmp_path, hook):
    """Rank 1 raises mid-run: rank 0, blocked on it (at a shared-memory barrier or in gloo),
    stops at once with PeerFailedError naming rank 1's error, not a backend traceback."""
    procs = _launch_ranks(2, ["--fault", "raise:1:3", "--comm-hook", hook], tmp_path)
    _, outputs = _wait_all(procs, timeout_s=DETECTED_WITHIN_S)
    assert procs[1].returncode != 0 and "CrashAt: simulated crash at step 3" in outputs[1]
    assert procs[0].returncode != 0, outputs[0]
    assert (
        "PeerFailedError: rank 0: rank 1 left at step 3 with CrashAt: simulated crash at step 3"
        in outputs[0]
    ), outputs[0]


def test_frozen_rank_is_detected_by_the_heartbeat(tmp_path):
    """A rank frozen by SIGSTOP is declared lost after heartbeat_timeout_s; survivors exit 75."""
    stamp = tmp_path / "frozen_at"
    procs = _launch_ranks(
        2, ["--fault", "freeze:1:5", "--stamp", str(stamp), "--heartbeat-timeout", "4"], tmp_path
    )
    try:
        deadline = time.monotonic() + 2 * DETECTED_WITHIN_S
        while procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        exited_at = time.time()
    finally:
        procs[1].kill()
    _, outputs = _wait_all(procs, timeout_s=30)
    assert procs[0].returncode == 75, outputs[0]
    assert "lost rank 1" in outputs[0]
    seconds = exited_at - float(stamp.read_text())
    print(f"rank 0 exited {seconds:.2f} s after rank 1 froze (heartbeat_timeout_s=4)")
    # Never before the 4-s heartbeat timeout (that would be a false alarm), never a hang.
    assert 3 < seconds < DETECTED_WITHIN_S


_STORE_SERVER = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("up", flush=True)
time.sleep(600)
"""


def _watch_a_store_that_goes(port: int, server_pid: int) -> dict:
    """Heartbeats on an outside store (an agent's) whose process rank 0 kills once both beat."""
    import datetime

    import torch.distributed as dist

    from ddptrain.train.health import Heartbeat

    ddptrain.init_distributed()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    lost: list[str] = []
    heartbeat = Heartbeat(timeout_s=10, interval_s=0.2, store=store, on_launcher_lost=lost.append)
    heartbeat.start()
    dist.barrier()
    if dist.get_rank() == 0:
        os.kill(server_pid, signal.SIGKILL)
    killed = time.monotonic()
    while not lost and time.monotonic() < killed + DETECTED_WITHIN_S:
        time.sleep(0.05)
    seconds = time.monotonic() - killed
    heartbeat.stop()
    return {"lost": lost, "seconds": seconds, "stored_after": heartbeat.failed_peers()}


def test_a_dead_store_is_named_once_and_no_live_peer_is_called_lost(capfd):
    """The store's process dies (the agent hosting it): each rank's heartbeat stops calling it
    after one failed beat (its port refuses connections), logging one C++ trace, not one per
    beat, and reports "the launcher's store is unreachable" instead of declaring its live peer
    lost (which would exit 75 once heartbeat_timeout_s passed)."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _STORE_SERVER, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "up"
        # Fresh interpreters ("spawn"): they write to this test's captured stderr, where a
        # forkserver started by an earlier test would not.
        results = ddptrain.spawn(
            _watch_a_store_that_goes, 2, port, server.pid, timeout_s=240, start_method="spawn"
        )
    finally:
        server.kill()
        server.wait()
    logged = capfd.readouterr().err
    traces = logged.count("recvValue failed") + logged.count("sendBytes failed")
    assert traces <= 2, logged[-3000:]
    for r in results:
        print(f"store loss noticed after {r['seconds']:.2f} s")
        assert len(r["lost"]) == 1, r
        assert r["lost"][0].startswith("the launcher's store is unreachable"), r
        # Timing bound only against the 10-s heartbeat timeout that would call the peer lost.
        assert r["seconds"] < 10 and r["stored_after"] == {}


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
    """--max-restarts=1: a SIGKILLed rank restarts, resumes, ends bitwise equal (under torchrun,
    and under ddptrain-run, which says that it restarts)."""
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


def test_nonfinite_gradients_stop_every_rank_and_keep_the_last_checkpoint(tmp_path):
    """A NaN loss on rank 1 at step 4 stops both ranks with step and rank named; ckpt 3 kept."""
    procs = _launch_ranks(2, ["--ckpt-dir", "ck", "--fault", "nan:1:4"], tmp_path)
    _, outputs = _wait_all(procs, timeout_s=120)
    for out, p in zip(outputs, procs, strict=True):
        assert p.returncode != 0
        assert "step 5: non-finite gradients (non-finite local loss on rank(s) [1])" in out, out
        assert "ckpt-00000003.pt" in out
    assert sorted(f.name for f in (tmp_path / "ck").glob("*.pt")) == ["ckpt-00000003.pt"]


def test_nonfinite_skip_policy_skips_the_step_and_finishes(tmp_path):
    """With nonfinite='skip' the bad step is skipped on every rank and training completes."""
    procs = _launch_ranks(
        2, ["--nonfinite", "skip", "--fault", "nan:0:4", "--out", "o.pt"], tmp_path
    )
    _, outputs = _wait_all(procs, timeout_s=120)
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "step 5 skipped: non-finite gradients" in outputs[0]
    final = torch.load(tmp_path / "o.pt", weights_only=True)
    assert all(torch.isfinite(p).all() for p in final["params"])


def test_replica_desync_is_detected_with_rank_and_parameter(tmp_path):
    """A rank-local weight change is caught by the periodic checksum, naming rank and parameter."""
    procs = _launch_ranks(2, ["--fault", "perturb:1:3", "--check-replicas-every", "2"], tmp_path)
    _, outputs = _wait_all(procs, timeout_s=120)
    for out, p in zip(outputs, procs, strict=True):
        assert p.returncode != 0
        assert "replicas diverged: rank 1 differs from rank 0 first at parameter '0.weight'" in out


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


def _launch_cmd(launcher: str, args: list[str], torchrun_flags: list[str] = ()) -> list[str]:
    return [
        *LAUNCHERS[launcher],
        *("--standalone", "--nproc_per_node=2", "--monitor-interval=0.5", *torchrun_flags),
        *(str(JOB), *args),
    ]


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


@pytest.mark.parametrize(
    ("launcher", "number", "torchrun_flags"),
    [
        # torchrun forwards SIGTERM by default (the elastic test meets it too): the same path.
        pytest.param("torchrun", signal.SIGTERM, [], marks=pytest.mark.slow, id="SIGTERM"),
        pytest.param("torchrun", signal.SIGINT, [], marks=pytest.mark.slow, id="SIGINT"),
        pytest.param(
            "torchrun",
            signal.SIGUSR1,
            ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"],
            marks=pytest.mark.slow,
            id="SIGUSR1-forwarded",
        ),
        # ddptrain-run runs torchrun's agent: the same forwarding (its Ctrl-C test below runs
        # by default).
        pytest.param(
            "ddptrain-run",
            signal.SIGUSR1,
            ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"],
            marks=pytest.mark.slow,
            id="ddptrain-run-SIGUSR1-forwarded",
        ),
    ],
)
def test_a_forwarded_signal_saves_the_last_step_and_the_rerun_is_bitwise(
    tmp_path, launcher, number, torchrun_flags
):
    """torchrun forwards SIGTERM and SIGINT (and SIGUSR1 when told to): the workers save the
    step they are at, no step after the checkpoint was trained, they exit with 76 long before
    torchrun's 30-s SIGKILL; started again, the run ends bitwise equal to a run never stopped."""
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
    """SIGINT to the whole job (a terminal's Ctrl-C reaches ddptrain-run and every worker): the
    step is saved, rank 0's `stopped at step N ... exiting with code 76` is the last line, with
    no launcher traceback after it, and the job's status is that 76; started again, the run
    ends bitwise equal to a run never stopped."""
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
    """SIGUSR1 kills torchrun outright (not in its --signals-to-handle): its workers see their
    agent gone, save the step they are at and exit, saying so in one line; no trace of the
    dead store floods the output, no live rank is called lost; the run resumes bitwise."""
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

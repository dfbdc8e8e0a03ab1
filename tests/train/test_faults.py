"""Fault tolerance: dead or frozen ranks, a dead store, non-finite steps and replica desync are
detected and named on every rank, long before a collective timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

import ddptrain
from support import forked
from support.fault_runs import DETECTED_WITHIN_S, JOB
from support.forked import ForkedProcess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_ranks(world_size: int, args: list[str], tmp_path: Path) -> list[ForkedProcess]:
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
        procs.append(forked.popen([str(JOB), *args], env=env, cwd=tmp_path))
    return procs


def _wait_all(procs: list[ForkedProcess], timeout_s: float) -> tuple[list[float], list[str]]:
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
    """After SIGKILL of rank 2, ranks 0 and 1 exit non-zero within DETECTED_WITHIN_S, naming 2."""
    # default: shared memory, the default on one host; tcp: the ring, the default across hosts.
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
    """When rank 1 raises, rank 0 stops at once with PeerFailedError naming its error."""
    # Rank 0 is blocked on rank 1, at a shared-memory barrier or in gloo.
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
    """A dead store is reported as unreachable with one C++ trace per rank; no peer is lost."""
    # Its port refuses connections, so each heartbeat stops calling it after one failed beat.
    port = _free_port()
    server = forked.popen(["-c", _STORE_SERVER, str(port)])
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

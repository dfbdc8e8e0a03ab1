"""An elastic torchrun job (--nnodes=1:2, c10d rendezvous) shrinks to one agent when the other
dies and grows back when it returns, losing no step either way (two agents on this host, one
under ddptrain-run and one under torchrun: the same agent).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc_per_node=1 \\
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=elastic --max-restarts=5 \\
        tests/support/fault_job.py ...                      # agent A, then agent B

The environment variable works around torch's shared rendezvous store, which a scale-up finds
without the new round's address (the agent that joins waits for it forever).
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

from support import worlds
from support.child_env import child_env
from support.launch_cmds import LAUNCHERS

JOB = Path(__file__).resolve().parent / "support" / "fault_job.py"
# Each phase waits for the next log record it needs; a working job gets there in seconds (a few
# torch imports and rendezvous rounds), a broken one (a hang) fails by this bound.
PHASE_S = 150
EPOCHS, STEPS = 6, 48  # 8 steps an epoch: 96 samples, a global batch of 12 at any world size
# Slow (about a minute): three rendezvous rounds, each starting interpreters, and a dead agent
# noticed by missed keep-alives. The store keys it depends on are also tested quickly, in
# tests/test_rendezvous.py; the saving on a lost agent and on SIGTERM in tests/train/.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * PHASE_S + 60)]


def _agent(
    port: int, tmp_path: Path, name: str, hosts_store: bool, launcher: str
) -> subprocess.Popen:
    cmd = [
        *LAUNCHERS[launcher],
        "--nnodes=1:2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=elastic-test",
        # Quick to notice a dead agent (5 missed keep-alives of 1 s: with 2, a loaded machine
        # delays a live agent's and a returning one forms a world of its own), and to close a
        # round. On one host either agent could host the c10d store (the first to bind): A.
        "--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,"
        f"is_host={int(hosts_store)}",
        "--max-restarts=5",
        "--monitor-interval=0.5",
        str(JOB),
        *("--ckpt-dir", "ckpt", "--checkpoint-every", "100", "--log-dir", "logs"),
        *("--log-every", "1", "--sleep-per-step", "0.25", "--epochs", str(EPOCHS)),
        *("--out", "final.pt"),
    ]
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / f"{name}.out", "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for(tmp_path: Path, what: str, ready, agents: list) -> list[dict]:
    deadline = time.monotonic() + PHASE_S
    while time.monotonic() < deadline:
        records = _records(tmp_path)
        if ready(records):
            return records
        if any(a.poll() not in (None, 0) for a in agents):
            break
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {PHASE_S} s:\n{_outputs(tmp_path)}")


def _outputs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.out"))
    )


def _starts(records: list[dict]) -> list[tuple[int, int]]:
    return [(r["world_size"], r["step"]) for r in records if r.get("event") == "start"]


def _trained(records: list[dict], after: int = 0) -> int:
    """The last step logged after the `after`-th start record."""
    seen, last = 0, -1
    for r in records:
        seen += r.get("event") == "start"
        if seen == after + 1 and "loss" in r:
            last = r["step"]
    return last


def _stop(*agents: subprocess.Popen) -> None:
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


def test_an_agent_leaves_and_returns_and_the_job_loses_no_step(tmp_path):
    """An agent SIGKILLed and started again: every step is trained once, and the model learns."""
    # Both ranks save when B's orphaned worker sees its agent gone; A goes on alone (same global
    # batch) until B returns, then saves on torchrun's SIGTERM and both go on at world size 2.
    port = worlds.free_port()
    # ddptrain-run runs torchrun's own agent: A under it, B under torchrun, B's return under it.
    a = _agent(port, tmp_path, "agent-a", hosts_store=True, launcher="ddptrain-run")
    b = _agent(port, tmp_path, "agent-b", hosts_store=False, launcher="torchrun")
    agents = [a, b]
    try:
        _wait_for(tmp_path, "step 3 at world size 2", lambda r: _trained(r) >= 3, agents)
        os.kill(b.pid, signal.SIGKILL)  # the agent only: its worker is left behind
        agents = [a]
        # B's return takes seconds (an interpreter, a rendezvous round): A trains meanwhile.
        _wait_for(tmp_path, "a start at world size 1", lambda r: len(_starts(r)) >= 2, agents)
        b = _agent(port, tmp_path, "agent-b-again", hosts_store=False, launcher="ddptrain-run")
        agents = [a, b]
        records = _wait_for(tmp_path, "the run's end", lambda r: _trained(r, 2) == STEPS, agents)
        for agent in agents:
            assert agent.wait(timeout=PHASE_S) == 0, _outputs(tmp_path)
    finally:
        _stop(a, b)
    starts = _starts(records)
    print(
        "elastic starts (world size, step):",
        starts,
        "| trained to:",
        _trained(records, 0),
        _trained(records, 1),
        _trained(records, 2),
    )
    assert [ws for ws, _ in starts] == [2, 1, 2], _outputs(tmp_path)
    # No step lost: each round starts at the step the previous one had trained to.
    assert starts[1][1] == _trained(records, 0) >= 3
    assert starts[2][1] == _trained(records, 1) > starts[1][1]
    # The schedule (StepLR: x0.7 every 4 steps) went on by step, whatever the world size.
    for r in records:
        if "loss" in r:
            assert r["lr"] == pytest.approx(0.1 * 0.7 ** (r["step"] // 4)), r
    assert {r["global_batch_size"] for r in records if r.get("event") == "start"} == {12}
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    print("final:", final["summary"]["eval"])
    for line in _outputs(tmp_path).splitlines():
        if "stopped at step" in line or "resuming from" in line:
            print(line)
    assert final["summary"]["step"] == STEPS
    assert final["summary"]["eval"]["eval_accuracy"] > 0.6, final["summary"]
    assert "its torchrun agent" in _outputs(tmp_path)
    # ddptrain-run says why its workers started again: B's loss failed the round (a restart
    # spent), then B joined (a change of membership).
    said = (tmp_path / "agent-a.out").read_text()
    assert "ddptrain-run: restarting the workers (restart 1 of 5, world_size 1)" in said, said
    joined = "ddptrain-run: the job's membership changed; restarting the workers (world_size 2)"
    assert joined in said, said

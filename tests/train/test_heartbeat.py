"""The heartbeat names the real cause when a torchrun agent dies (the agent, not its store), and
does not call lost a peer that stopped beating on purpose."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

import ddptrain
from ddptrain.train import health


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one(tmp_path):
    """A process group of 1, torn down after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_store_failing_as_the_agent_exits_is_reported_as_the_agent(world_of_one, monkeypatch):
    """A beat failing on the dying agent's closed store names the agent, not the store."""
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5)
    )
    agent = 4242
    gone = threading.Event()
    checks_since_gone = []

    def getppid() -> int:
        # The agent while its store serves, and for the first check after it closed.
        if gone.is_set():
            checks_since_gone.append(1)
            if len(checks_since_gone) > 1:
                return 1
        return agent

    monkeypatch.setattr(health.os, "getppid", getppid)
    lost = threading.Event()
    causes: list[str] = []

    def on_lost(why: str) -> None:
        causes.append(why)
        lost.set()

    heartbeat = health.Heartbeat(
        timeout_s=30, interval_s=0.05, store=client, agent_pid=agent, on_launcher_lost=on_lost
    )
    heartbeat.world_size = 2  # beat through the store, as in a world of 2
    heartbeat.start()
    del server  # the agent's store closes before its workers are reparented
    gone.set()
    assert lost.wait(20)
    heartbeat.stop()
    assert causes == [f"its torchrun agent (pid {agent}) is gone"], causes


def _peer_stops(error: str | None) -> dict:
    """Rank 1 stops its heartbeat (cleanly, or telling why it leaves) and stays alive without
    beating; rank 0 then asks which peers are lost and which left with an error."""
    import ddptrain

    info = ddptrain.init_distributed(timeout_s=60)
    heartbeat = health.Heartbeat(timeout_s=30, interval_s=0.05).start()
    dist.barrier()
    if info.rank == 1:
        heartbeat.stop(error=error)
    dist.barrier()
    out = None
    if info.rank == 0:
        # Ten beats of silence: a peer still counted would be lost by then.
        out = {"lost": heartbeat.lost_ranks(wait_s=0.5), "failed": heartbeat.failed_peers()}
    dist.barrier()
    heartbeat.stop()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", [None, "ValueError: bad batch"])
def test_a_peer_that_stopped_beating_on_purpose_is_not_lost(error):
    """A peer that stopped its heartbeat is never lost; one that left with an error is named."""
    lost_and_failed = ddptrain.spawn(_peer_stops, 2, error, timeout_s=90)[0]
    assert lost_and_failed["lost"] == [], lost_and_failed
    assert lost_and_failed["failed"] == ({1: error} if error else {}), lost_and_failed

"""The env:// rendezvous: missing ranks, mismatched WORLD_SIZE and Ctrl-C end it with one clear
error instead of torch's 300-second C++ wait and traceback (each rank its own process)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import torch.distributed as dist

from support import forked
from support.child_env import child_env
from support.forked import ForkedProcess

# Each child sets up a world with this collective timeout; a rendezvous that waits it out fails
# the test by its message (the wait is the bug), a rendezvous that hangs fails it by HANG_S.
TIMEOUT_S = 2
HANG_S = 120
CHILD = """
import signal
import sys
# A terminal's Ctrl-C: a suite started as a background job hands its children SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
import ddptrain
print("ready", flush=True)
try:
    ddptrain.init_distributed(timeout_s=float(sys.argv[1]))
except ddptrain.dist.LaunchError as e:
    print("LaunchError:", e, flush=True)
    sys.exit(3)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    sys.exit(130)
ddptrain.shutdown()
print("joined", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    rank: int, world_size: int, port: int, timeout_s: float = TIMEOUT_S, **extra: str
) -> ForkedProcess:
    env = child_env(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )
    return forked.popen(["-c", CHILD, str(timeout_s)], env=env)


def _finish(proc: ForkedProcess, within_s: float = HANG_S) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still waiting after {within_s} s:\n{out}") from None
    return proc.returncode, out


def test_ranks_that_all_arrive_join():
    """Two ranks with the same WORLD_SIZE: both join (the check-in adds no failure)."""
    port = _free_port()
    # Ample: the peer may still be importing torch on a busy machine when the first one waits.
    procs = [_start(rank, 2, port, timeout_s=60) for rank in range(2)]
    for proc in procs:
        code, out = _finish(proc)
        assert code == 0 and "joined" in out, out


def test_a_missing_rank_is_named_after_the_timeout_not_a_store_traceback():
    """Rank 0 alone with WORLD_SIZE=2: LaunchError saying 1 of 2 arrived and how to fix it."""
    code, out = _finish(_start(0, 2, _free_port()))
    assert code == 3, out
    assert "only 1 of WORLD_SIZE=2 ranks reached the rendezvous at 127.0.0.1:" in out
    assert f"within {TIMEOUT_S} s: start 2 processes" in out


def test_an_unreachable_rank_0_is_named_after_the_timeout():
    """Rank 1 with no rank 0 listening: LaunchError naming the address and the fix."""
    port = _free_port()
    code, out = _finish(_start(1, 2, port))
    assert code == 3, out
    assert f"rank 1 could not reach the rendezvous store at 127.0.0.1:{port}" in out
    assert "start rank 0 too" in out


def test_ranks_launched_with_different_world_sizes_are_refused_on_both():
    """WORLD_SIZE=2 on rank 0 and 3 on rank 1: both refuse at once, naming the two values."""
    port = _free_port()
    first = _start(0, 2, port, timeout_s=HANG_S)
    second = _start(1, 3, port, timeout_s=HANG_S)
    for proc in (first, second):
        code, out = _finish(proc)
        assert code == 3, out
        assert "ranks were launched with different WORLD_SIZE values" in out
        assert "every process must get the same one" in out


def test_ctrl_c_stops_a_rank_waiting_for_its_peers():
    """SIGINT while rank 0 waits for a rank that never comes: KeyboardInterrupt, not a hang."""
    # The rendezvous would last 2 x HANG_S: ending within HANG_S means the signal stopped it.
    proc = _start(0, 2, _free_port(), timeout_s=2 * HANG_S)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(3)  # well into the wait (a signal before it is a KeyboardInterrupt all the same)
    proc.send_signal(signal.SIGINT)
    code, out = _finish(proc)
    assert code == 130 and "KeyboardInterrupt" in out, out


def test_ranks_meet_on_fresh_keys_in_an_agent_store_holding_a_dead_rounds_keys():
    """Ranks meet in an agent store holding a dead round's keys, with restart counts 0 and 1."""
    # torchrun's agent store outlives rounds; the counts differ as after an elastic scale-up.
    port = _free_port()
    agent_store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True
    )
    dead = dist.PrefixStore("ddptrain/rendezvous", agent_store)
    dead.set("token", "0123456789abcdef 2")
    dead.add("0123456789abcdef/answered", 1)
    dead.set("0123456789abcdef/answer/1", "fedcba9876543210 2")
    dead.set("0123456789abcdef/go/1", "fedcba9876543210")
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "elastic"}
    # Generous: rank 1 waits for rank 0's interpreter to start; a mismatch waits all of it.
    second = _start(1, 2, port, timeout_s=60, TORCHELASTIC_RESTART_COUNT="0", **agent)
    assert second.stdout.readline().strip() == "ready"
    first = _start(0, 2, port, timeout_s=60, TORCHELASTIC_RESTART_COUNT="1", **agent)
    for proc in (first, second):
        code, out = _finish(proc)
        assert code == 0 and "joined" in out, out
    assert dead.get("token").decode() != "0123456789abcdef 2"

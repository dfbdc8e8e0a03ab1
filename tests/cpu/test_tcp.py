"""The direct TCP transport (cpu/tcp.py): sums, defaults, fallbacks and failures.

One spawned world per world size runs every multi-process case of this module
(worlds.run_cases); the tests read their case's results from it.
"""

from __future__ import annotations

import copy
import functools
import os
import resource
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddptrain.compress.half import HalfPrecision
from ddptrain.cpu import shm, tcp
from ddptrain.cpu.tcp import Socket
from ddptrain.ddp.hooks import default_transport
from ddptrain.ddp.wrapper import DistributedDataParallel
from support import toy_models, worlds
from support.sums import ATOL, NUMELS, RTOL, backend_sum, reduce_with

WORLD_TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)

# The edge cases, and 32 MiB: far more than the socket buffers hold, so both directions must
# flow at once or the ring deadlocks.
SIZES = [*NUMELS, 8 * 2**20]
# Files a rank opens first, so that its sockets get descriptors above select()'s 1023.
HIGH_FD = 1100
# An address no rank listens at (TEST-NET-1, RFC 5737): connecting fails or times out.
UNREACHABLE = "192.0.2.1"


def _case_vs_backend(info) -> list:
    hook = Socket()
    out = []
    for numel in SIZES:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + info.rank))
        bucket = x.clone()
        reduce_with(hook, bucket)
        expected = backend_sum(x)
        # Every rank must end with the same bits: compare with rank 0's result.
        first = bucket.clone()
        dist.broadcast(first, src=0)
        exact = torch.equal(bucket, expected)
        close = torch.allclose(bucket, expected, rtol=RTOL, atol=ATOL)
        out.append((numel, exact, close, torch.equal(bucket, first)))
    hook.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_sums_equal_the_backend_and_agree_across_ranks(world, world_size):
    """Ring sums over sockets match gloo's all_reduce (bitwise at ws 2) on every rank, any size."""
    for per_numel in worlds.outcome(world(world_size), "vs_backend"):
        assert [n for n, *_ in per_numel] == SIZES
        for numel, exact, close, same_as_rank0 in per_numel:
            assert same_as_rank0, numel
            assert exact if world_size == 2 else close, numel


def _case_high_descriptors(info) -> tuple[bool, int] | None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = HIGH_FD + 64
    if hard != resource.RLIM_INFINITY and hard < wanted:
        dist.barrier()
        return None
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(HIGH_FD)]
    try:
        hook = Socket()
        x = torch.randn(4 * 2**20, generator=torch.Generator().manual_seed(info.rank))
        bucket = x.clone()
        reduce_with(hook, bucket)
        lowest = min(hook._ring._left.fileno(), hook._ring._right.fileno())
        hook.close()
        return torch.equal(bucket, backend_sum(x)), lowest
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_sockets_numbered_above_1023_still_work(world):
    """Sockets numbered above 1023, past select()'s limit, still reduce to equal results."""
    # Loader workers and logs can leave a process with over a thousand open files.
    results = worlds.outcome(world(2), "high_fds")
    if results[0] is None:
        pytest.skip(f"the hard limit on open files is below {HIGH_FD + 64}")
    for equal, lowest in results:
        assert equal and lowest > 1023


def _case_bf16_inside_cast_hook(info) -> tuple[bool, bool]:
    hook = HalfPrecision(torch.bfloat16, Socket())
    x = torch.randn(3000, generator=torch.Generator().manual_seed(info.rank))
    bucket = x.clone()
    reduce_with(hook, bucket)
    expected = backend_sum(x.bfloat16()).float()
    hook.inner.close()
    return torch.equal(bucket, expected), bucket.dtype == torch.float32


def test_carries_bf16_buckets_inside_a_cast(world):
    """Inside HalfPrecision the sockets carry bf16 bytes: the sum equals gloo's bf16 all_reduce."""
    assert worlds.outcome(world(2), "bf16") == [(True, True)] * 2


def _case_default_across_hosts(info) -> dict:
    # No shared tmpfs in common, as for ranks on two hosts: the default must be TCP.
    shm.SHM_DIR = "/nonexistent-ddptrain-test"
    try:
        torch.manual_seed(3)
        base = toy_models.make("lenet_nodrop")
        ours = DistributedDataParallel(copy.deepcopy(base))
        theirs = TorchDDP(copy.deepcopy(base))
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
        g = torch.Generator().manual_seed(info.rank)
        for _ in range(4):
            x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
            for model, opt in zip((ours, theirs), opts, strict=True):
                opt.zero_grad()
                F.nll_loss(model(x), y).backward()
                opt.step()
        equal = all(
            torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        )
        transport = default_transport()
        used = ours.comm_hook[0]
        used.close()
        transport.close()
        name = type(transport).__name__
        return {"hook": type(used).__name__, "equal": equal, "default": name}
    finally:
        shm.SHM_DIR = "/dev/shm"


def test_default_without_shared_memory_is_tcp_and_trains_like_official_ddp(world):
    """Ranks sharing no memory get the TCP transport by default; it trains bitwise as torch DDP."""
    for r in worlds.outcome(world(2), "default_across_hosts"):
        assert r["hook"] == "Socket"
        assert r["equal"]
        assert r["default"] == "Socket"


def _connect_advertising(info, address: str, hide_stack: bool) -> dict:
    """Rank 1 advertises `address`; hide_stack: as if it were on another host."""
    real_stack = tcp._network_stack
    if info.rank == 1:
        tcp.os.environ[tcp.HOST_ENV] = address
        if hide_stack:
            tcp._network_stack = lambda: None
    try:
        started = time.monotonic()
        hook = Socket.connect(connect_timeout_s=1.0)
        waited = time.monotonic() - started
    finally:
        tcp.os.environ.pop(tcp.HOST_ENV, None)
        tcp._network_stack = real_stack
    connected = hook is not None
    if connected:
        ones = torch.ones(5)
        reduce_with(hook, ones)
        hook.close()
    else:
        ones = torch.ones(5)
        dist.all_reduce(ones)  # the process group is intact afterwards
    return {"connected": connected, "waited": waited, "sum": ones.tolist()}


def test_ranks_that_cannot_connect_all_fall_back_without_hanging(world):
    """One unreachable rank: every rank's connect() gives None within the timeout, group intact."""
    for r in worlds.outcome(world(2), "unreachable"):
        assert not r["connected"]
        assert r["waited"] < 30
        assert r["sum"] == [2.0] * 5


def test_ranks_in_one_network_stack_connect_over_loopback(world):
    """A rank in this very kernel and namespace is reached on 127.0.0.1, whatever it advertises."""
    for r in worlds.outcome(world(2), "same_stack"):
        assert r["connected"]
        assert r["sum"] == [2.0] * 5


def _case_cannot_listen(info) -> list:
    real = tcp.socket.create_server

    def refuse(*args, **kwargs):
        raise OSError("no port for you")

    if info.rank == 1:
        tcp.socket.create_server = refuse
    try:
        hook = Socket.connect(connect_timeout_s=5.0)
    finally:
        tcp.socket.create_server = real
    retry = Socket.connect()
    if retry is not None:
        retry.close()
    return [hook is None, retry is not None]


def test_a_rank_that_cannot_listen_makes_every_rank_fall_back(world):
    """One rank unable to open its port: no rank hangs, all get None, and a retry connects."""
    assert worlds.outcome(world(2), "cannot_listen") == [[True, True]] * 2


def _case_peer_closed(info) -> str:
    hook = Socket()
    dist.barrier()
    if info.rank == 1:
        hook.close()
        dist.barrier()
        return "closed"
    dist.barrier()
    try:
        reduce_with(hook, torch.ones(100_000))
    except RuntimeError as e:
        return str(e)
    finally:
        hook.close()
    return "no error"


def test_a_peer_that_closes_its_connections_is_named_not_waited_for(world):
    """When a peer's sockets close (it exited), the reducing rank raises, naming that rank."""
    message, closed = worlds.outcome(world(2), "peer_closed")
    assert closed == "closed"
    assert "rank 1 closed its TCP connection" in message


def _case_stalled_peer(info) -> str:
    hook = Socket(timeout_s=0.5)
    result = "no error"
    if info.rank == 0:
        try:
            reduce_with(hook, torch.ones(10))
        except RuntimeError as e:
            result = str(e)
    dist.barrier()  # rank 1 never reduces: it waits here until rank 0 gave up
    hook.close()
    return result


def test_a_peer_that_never_sends_times_out_with_a_message(world):
    """A peer that is alive but never reduces makes the waiting rank raise after timeout_s."""
    message = worlds.outcome(world(2), "stalled_peer")[0]
    assert "no bytes moved" in message and "rank 1" in message


def _case_closed_hook(info) -> str:
    hook = Socket()
    hook.close()
    try:
        reduce_with(hook, torch.ones(3))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_closed_transport_refuses_work(world):
    """After close() (shutdown), using it raises instead of reducing on closed sockets."""
    assert all("closed" in m for m in worlds.outcome(world(2), "closed_hook"))


def test_advertised_address_follows_the_user_then_gloo_then_the_route(monkeypatch):
    """DDPTRAIN_SOCKET_HOST wins, then GLOO_SOCKET_IFNAME's address, then the route to master."""
    monkeypatch.delenv(tcp.HOST_ENV, raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert tcp.advertised_host() == "127.0.0.1"  # loopback's own route
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,eth0")
    assert tcp.advertised_host() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")
    assert tcp.advertised_host() == "127.0.0.1"  # unknown interface: the route decides
    monkeypatch.setenv(tcp.HOST_ENV, "10.9.8.7")
    assert tcp.advertised_host() == "10.9.8.7"


CASES = {
    "vs_backend": _case_vs_backend,
    "bf16": _case_bf16_inside_cast_hook,
    "high_fds": _case_high_descriptors,
    "default_across_hosts": _case_default_across_hosts,
    "unreachable": functools.partial(_connect_advertising, address=UNREACHABLE, hide_stack=True),
    "same_stack": functools.partial(_connect_advertising, address=UNREACHABLE, hide_stack=False),
    "cannot_listen": _case_cannot_listen,
    "peer_closed": _case_peer_closed,
    "stalled_peer": _case_stalled_peer,
    "closed_hook": _case_closed_hook,
}
CASES_BY_WORLD = {2: list(CASES), 3: ["vs_backend"]}


world = worlds.fixture(CASES, CASES_BY_WORLD, timeout_s=WORLD_TIMEOUT_S)

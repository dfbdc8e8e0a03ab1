"""Direct TCP all-reduce for CPU ranks that cannot share memory (ranks on several hosts).

    tcp = Socket()                           # collective: every rank connects to its ring
    tcp.reduce(GradBucket(0, bucket, [], [], True))   # bucket now holds the SUM over ranks
    tcp.close()                              # ddptrain.shutdown() does it
    Socket.connect()                         # the same, or None on every rank if they cannot

Gloo runs every collective on worker threads of its own; inside a training step, handing a
small bucket to them and being woken when it is done costs more than sending its bytes
(docs/benchmarks.md, "Across two hosts"). Here the thread that reduces a bucket sends and
receives it itself: each rank keeps one TCP connection to the next rank of a ring and one from
the previous, and the ring schedule (ring.py) sends through one while it receives from the
other, with non-blocking sockets, so neither direction waits for the other and no bucket is
too large for the socket buffers. At world size 2 the sums are bitwise the backend's. A peer
that exits closes its sockets, and the waiting rank raises, naming it; one that hangs raises
after `timeout_s` without progress (init_distributed's timeout by default).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.cpu.ring import ring_reduce, scratch_for
from ddptrain.ddp import hooks
from ddptrain.ddp.hooks import GradBucket, Transport, close_at_shutdown, global_rank

# The address peers connect to, when set (else see advertised_host).
HOST_ENV = "DDPTRAIN_SOCKET_HOST"
# A connecting rank introduces itself: the ring's token and its rank.
_HELLO = struct.Struct("!32sq")
# Bytes handed to one send() call: large enough to fill the socket buffer, small enough that
# sending never stalls receiving for long.
_SEND_CHUNK = 1 << 20
# ioctl: an interface's IPv4 address (Linux, <linux/sockios.h>).
_SIOCGIFADDR = 0x8915


class Socket(Transport):
    """Buckets summed over a ring of TCP connections by the thread that reduces. CPU only.

    Collective to construct (every rank of `process_group`, same order): each rank listens
    on an ephemeral port, learns the others' addresses through the group, and connects to
    the next rank within `connect_timeout_s`; if any rank cannot, every rank raises
    ConnectionError (`connect()` returns None instead).
    """

    def __init__(
        self,
        process_group: Any = None,
        timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
    ) -> None:
        if dist.get_backend(process_group) != "gloo":
            raise ValueError("the TCP transport reduces CPU buckets beside a gloo process group")
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.timeout_s = hooks.timeout_s() if timeout_s is None else timeout_s
        self._ring = _connect_ring(process_group, connect_timeout_s)
        self._scratch: torch.Tensor | None = None
        self._closed = False
        close_at_shutdown(self.close)

    @classmethod
    def connect(cls, process_group: Any = None, **kwargs: Any) -> Socket | None:
        """Collective: a Socket transport, or None on every rank where ranks cannot connect."""
        try:
            return cls(process_group, **kwargs)
        except ConnectionError:
            return None

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed CPU bucket."""
        if device.type != "cpu":
            raise ValueError(
                f"the TCP transport reduces CPU buckets, not {device}; use "
                "comm_hook=ddptrain.named_hook('allreduce') (the backend's all_reduce) for this "
                "model"
            )
        return torch.zeros(numel, dtype=dtype)

    def reduce(self, bucket: GradBucket) -> None:
        """Sum the bucket over the ring of connections, in place."""
        if self._closed:
            raise RuntimeError(
                "this TCP transport was closed (ddptrain.shutdown() closes it); build the "
                "model's wrapper again after init_distributed()"
            )
        if self.world_size == 1:
            return
        flat = bucket.buffer().view(-1)
        self._scratch = scratch_for(flat, self.world_size, self._scratch)
        ring_reduce(flat, self.rank, self.world_size, self._scratch, self._exchange)

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self._ring.exchange(_bytes(send), _bytes(recv), self.timeout_s)

    def close(self) -> None:
        """Close the connections; ddptrain.shutdown() calls it. It reduces nothing afterwards."""
        self._closed = True
        if self._ring is not None:
            self._ring.close()


class _Ring:
    """This rank's two connections: to the next rank (sends) and from the previous (receives)."""

    def __init__(self, right: socket.socket, left: socket.socket, next_: int, previous: int):
        # The neighbours' global ranks, for error messages.
        self._right, self._left = right, left
        self._next, self._previous = next_, previous
        for s in (right, left):
            s.setblocking(False)

    def exchange(self, out: memoryview, into: memoryview, timeout_s: float) -> None:
        """Send `out` to the next rank while receiving `into` from the previous one."""
        sent = got = 0
        stalled_since = None
        while sent < len(out) or got < len(into):
            moved = False
            if sent < len(out):
                try:
                    sent += self._right.send(out[sent : sent + _SEND_CHUNK])
                    moved = True
                except BlockingIOError:
                    pass
                except OSError as e:
                    raise self._lost(self._next, e) from e
            if got < len(into):
                try:
                    n = self._left.recv_into(into[got:])
                except BlockingIOError:
                    n = -1
                except OSError as e:
                    raise self._lost(self._previous, e) from e
                if n == 0:
                    raise self._lost(self._previous, None)
                if n > 0:
                    got += n
                    moved = True
            if moved:
                stalled_since = None
                continue
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > timeout_s:
                raise RuntimeError(
                    f"no bytes moved to rank {self._next} or from rank {self._previous} for "
                    f"{timeout_s:.0f} s (a rank hangs, or runs a different model or step)"
                )
            _wait_ready(
                self._left if got < len(into) else None,
                self._right if sent < len(out) else None,
            )

    @staticmethod
    def _lost(peer: int, error: OSError | None) -> RuntimeError:
        why = f": {error}" if error is not None else ""
        return RuntimeError(
            f"rank {peer} closed its TCP connection mid-reduction (it exited, or stopped on an "
            f"error of its own){why}"
        )

    def close(self) -> None:
        for s in (self._right, self._left):
            s.close()


def _wait_ready(reader: socket.socket | None, writer: socket.socket | None) -> None:
    """Sleep until `reader` can receive or `writer` can send, for at most a second."""
    if not hasattr(select, "poll"):  # Windows
        select.select([reader] if reader else [], [writer] if writer else [], [], 1.0)
        return
    # poll, not select: select fails on descriptors above 1023, which a process with many
    # open files (loader workers, logs) reaches.
    poller = select.poll()
    if reader is not None:
        poller.register(reader, select.POLLIN)
    if writer is not None:
        poller.register(writer, select.POLLOUT)
    poller.poll(1000)


def _connect_ring(group: Any, connect_timeout_s: float) -> _Ring | None:
    """Collective: connect every rank to the next; ConnectionError on every rank if any fails."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return None
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    token = box[0].encode()
    listener = right = left = None
    error, mine = "", None
    try:
        listener = socket.create_server(("0.0.0.0", 0), backlog=world_size)
        mine = (advertised_host(), listener.getsockname()[1], _network_stack())
    except OSError as e:
        error = f"rank {rank} cannot listen: {e}"
    # Every rank reaches every collective here, whatever failed: an error only skips work.
    addresses: list[Any] = [None] * world_size
    dist.all_gather_object(addresses, mine, group=group)
    try:
        if None not in addresses:
            deadline = time.monotonic() + connect_timeout_s
            host, port, stack = addresses[(rank + 1) % world_size]
            # A peer in this very network stack is reached over loopback, whatever the
            # host's name resolves to.
            if stack is not None and stack == mine[2]:
                host = "127.0.0.1"
            right = socket.create_connection((host, port), connect_timeout_s)
            right.sendall(_HELLO.pack(token, rank))
            left = _accept(listener, token, (rank - 1) % world_size, deadline)
            for s in (right, left):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as e:
        error = f"rank {rank} -> {addresses[(rank + 1) % world_size][:2]}: {e}"
    finally:
        if listener is not None:
            listener.close()
    errors: list[Any] = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e]
    if failed:
        for s in (right, left):
            if s is not None:
                s.close()
        raise ConnectionError(
            f"ranks could not open TCP connections to each other ({failed[0]}); set "
            f"{HOST_ENV} to an address the other ranks reach this one at"
        )
    neighbours = (
        global_rank(group, (rank + 1) % world_size),
        global_rank(group, (rank - 1) % world_size),
    )
    return _Ring(right, left, *neighbours)


def _accept(listener: socket.socket, token: bytes, expected: int, deadline: float) -> socket.socket:
    """The connection from rank `expected` that presents `token`; strangers are dropped."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"rank {expected} did not connect in time")
        listener.settimeout(remaining)
        conn, _ = listener.accept()
        conn.settimeout(max(deadline - time.monotonic(), 0.1))
        try:
            hello = _recv_exactly(conn, _HELLO.size)
        except OSError:
            conn.close()
            continue
        if _HELLO.unpack(hello) == (token, expected):
            conn.settimeout(None)
            return conn
        conn.close()


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError("closed during the handshake")
        data += more
    return data


def advertised_host() -> str:
    """The address other ranks reach this one at: $DDPTRAIN_SOCKET_HOST, else the IPv4 address
    of the first interface in $GLOO_SOCKET_IFNAME (what gloo is told to use), else this host's
    address on its route to $MASTER_ADDR, else the address its hostname resolves to."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        address = _interface_address(interface)
        if address is not None:
            return address
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                # Connecting a UDP socket sends nothing: it only picks the route and source.
                probe.connect((master, 9))
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _network_stack() -> tuple[str, str] | None:
    """Which kernel and network namespace this process is in: equal for two processes iff
    each can reach the other's listening port on 127.0.0.1 (None where it cannot be read)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.readlink("/proc/self/ns/net")
    except OSError:
        return None


def _interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux), or None."""
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("256s", name[:15].encode())
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        return socket.inet_ntoa(reply[20:24])
    except (ImportError, OSError):
        return None


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())

"""Two hosts inside one machine: network namespaces joined by a veth pair (root, iproute2).

    with two_hosts("ddpt") as (a, b):             # deleted afterwards, whatever happens
        proc = subprocess.Popen(a.command(["python", "job.py"]), env=a.env())
        cmd = torchrun(a, a, nnodes=2, nproc_per_node=2, rdzv_id="job-1", args=["job.py"])
        ...
        kill_tree(proc)                           # the process and all its descendants
        shape(a, "1gbit", 65536, 16 << 20)        # a's sends leave at 1 Gbit/s (tc tbf)
        cap_segments(a, 16384)                    # TCP hands a's qdisc at most 16 KiB at once

Each host is a network namespace with one end of the veth pair on the private
10.231.77.0/24 (addresses that exist only inside the two namespaces) and, for each command,
a /dev/shm of its own: real hosts share no memory, and a shared tmpfs would let ddptrain's
same-host shortcut (cpu/shm.py) hide the network. Used by tests/test_multinode.py and
`python -m ddptrain.bench --two-hosts` (bench/hosts.py); docs/multinode.md has the commands.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.77"
RDZV_PORT = 29400
# `ip netns exec` runs each command in a mount namespace of its own, so this tmpfs is private
# to one command on one fake host and vanishes with its last process.
_PRIVATE_SHM = 'mount -t tmpfs ddpt-shm /dev/shm && exec "$@"'
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class HostsUnavailable(RuntimeError):
    """This machine cannot make fake hosts (not root, no iproute2, `ip netns` refused)."""


@dataclass(frozen=True)
class Host:
    """One fake host: a network namespace, its end of the veth pair, and that end's address."""

    netns: str
    ifname: str
    addr: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host, with a /dev/shm of its own."""
        return ["ip", "netns", "exec", self.netns, "sh", "-c", _PRIVATE_SHM, "sh", *argv]

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment for a launcher on this host: no launcher variables left
        over, one thread per process unless `extra` says otherwise, and gloo on the veth."""
        # Without GLOO_SOCKET_IFNAME gloo advertises the address the hostname resolves to
        # (loopback here), which the other host cannot reach.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": self.ifname}
        for key in _LAUNCHER_VARS:
            env.pop(key, None)
        return {**env, **extra}


def check_available() -> None:
    """Raise HostsUnavailable, naming the reason, unless this process may create namespaces."""
    if os.geteuid() != 0:
        raise HostsUnavailable(f"needs root and ip netns: running as uid {os.geteuid()}, not root")
    if shutil.which("ip") is None:
        raise HostsUnavailable("needs root and ip netns: the `ip` command (iproute2) is missing")


@contextmanager
def two_hosts(tag: str = "ddpt") -> Iterator[tuple[Host, Host]]:
    """Hosts a (10.231.77.1) and b (10.231.77.2), namespaces `<tag>-a-<pid>`, `<tag>-b-<pid>`."""
    check_available()
    if not 1 <= len(tag) <= 4 or not tag.isalnum():
        raise ValueError(f"tag must be 1-4 letters or digits, got {tag!r}")
    pid = os.getpid()
    # Interface names are limited to 15 characters; the pid keeps concurrent runs apart.
    a = Host(f"{tag}-a-{pid}", f"{tag}a{pid}", f"{SUBNET}.1")
    b = Host(f"{tag}-b-{pid}", f"{tag}b{pid}", f"{SUBNET}.2")
    created: list[str] = []
    try:
        try:
            for host in (a, b):
                _ip("netns", "add", host.netns)
                created.append(host.netns)
            veth_a = ["link", "add", a.ifname, "netns", a.netns, "type", "veth"]
            _ip(*veth_a, "peer", "name", b.ifname, "netns", b.netns)
            for host in (a, b):
                _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", host.netns, "link", "set", host.ifname, "up")
        except subprocess.CalledProcessError as exc:
            message = f"`{' '.join(exc.cmd)}` failed: {exc.stderr.strip()}"
            raise HostsUnavailable(f"needs root and ip netns: {message}") from None
        yield a, b
    finally:
        # Deleting a namespace also deletes the veth pair, both of whose ends live in them.
        for netns in created:
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30)


def shape(host: Host, rate: str, burst_bytes: int, limit_bytes: int) -> list[str]:
    """Shape what `host` sends over the veth with a token bucket (tc tbf; tc's rate syntax,
    e.g. "100mbit", "1gbit"): `burst_bytes` may leave at once, the rest at `rate`, up to
    `limit_bytes` queued. Returns the tc command."""
    command = ["tc", "-n", host.netns, "qdisc", "replace", "dev", host.ifname, "root", "tbf"]
    command += ["rate", rate, "burst", str(burst_bytes), "limit", str(limit_bytes)]
    if shutil.which("tc") is None:
        raise HostsUnavailable("shaping the link needs the `tc` command (iproute2)")
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)
    except subprocess.CalledProcessError as exc:
        raise HostsUnavailable(f"`{' '.join(command)}` failed: {exc.stderr.strip()}") from None
    return command


def cap_segments(host: Host, nbytes: int) -> list[str] | None:
    """Cap the segments TCP hands `host`'s end of the veth (GSO, 64 KiB by default) at `nbytes`.
    Returns the ip command, or None where the kernel or iproute2 refuses it (segments stay
    64 KiB)."""
    command = ["ip", "-n", host.netns, "link", "set", "dev", host.ifname]
    command += ["gso_max_size", str(nbytes)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    return command if done.returncode == 0 else None


def torchrun(
    host: Host,
    rendezvous: Host,
    *,
    nnodes: int,
    nproc_per_node: int,
    rdzv_id: str,
    args: list[str],
    rdzv_port: int = RDZV_PORT,
    launcher: str = "torch.distributed.run",
) -> list[str]:
    """The command that starts torchrun's agent for this host's ranks, inside `host`; the
    c10d rendezvous store lives on `rendezvous`. Run it with `host.env()`. `launcher`: the
    module that runs the agent, torchrun's or ddptrain-run's (`ddptrain.run`)."""
    # A fake host cannot recognize its veth address as itself (the hostname resolves to
    # loopback), so who hosts the store is said explicitly, and each agent advertises its veth
    # address rather than the hostname. c10d numbers nodes in sorted order of --local-addr.
    is_host = int(host == rendezvous)
    return host.command(
        [
            sys.executable,
            "-m",
            launcher,
            "--max-restarts=0",
            f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous.addr}:{rdzv_port}",
            f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=is_host={is_host},join_timeout=120",
            f"--local-addr={host.addr}",
            *args,
        ]
    )


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now (`ip netns list`)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and all its descendants, then reap it."""
    # torchrun starts each worker in a new session, so killing torchrun's process group would
    # orphan the workers; every descendant is killed by pid instead.
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

"""Failure detection: peer heartbeats and replica checksums.

    watchdog = Heartbeat(timeout_s=30).start()     # every rank: a dead or frozen peer noticed
    Heartbeat(agent_pid=info.agent_pid, on_launcher_lost=stop.launcher_lost)   # and a launcher
    check_replicas(model.module)                   # every rank: identical parameters or raise
    watchdog.stop()                                # a clean exit is not a lost rank

Why heartbeats: a collective blocked on a dead peer may only fail at the backend timeout
(30 minutes by default for NCCL). Each rank increments its own counter in the c10d store every
`interval_s`; a peer whose counter has not moved for `timeout_s` (on this rank's own clock, so
clock skew between hosts does not matter) is declared lost, and this process exits non-zero
at once with the lost rank named instead of waiting.

Why the launcher too: torchrun's agent hosts the store, and when the agent dies its workers
live on as orphans. A worker watches its agent (its parent process), and stops beating once the
store's port refuses a plain connection after a failed beat (or after STORE_FAILURES failed
beats in a row) instead of calling a dead store twice a second (each call logs a C++ trace)
and mistaking the silence for lost peers. Either way it calls `on_launcher_lost` (the Trainer
then saves and stops at the next step boundary) and, if the process is still running
`timeout_s` later, exits with LOST_RANK_EXIT_CODE itself.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.launch import report

LOST_RANK_EXIT_CODE = 75
# Failed beats in a row (every interval_s) after which the store counts as gone: one failure
# can be a hiccup; a few cost a few C++ log lines, not one every half second forever.
STORE_FAILURES = 3
AGENT_EXIT_S = 1.0  # how long a failed beat waits for the agent's exit to show


class RankLostError(RuntimeError):
    """Another rank died or stopped responding; raised on the survivors."""


class PeerFailedError(RuntimeError):
    """Another rank left fit() with an error while this one waited for it; names that error."""


class ReplicaDesyncError(RuntimeError):
    """Ranks hold different parameters although they must be identical replicas."""


class LauncherLostError(RuntimeError):
    """This rank's launcher or the store it hosts is gone; names which."""


# Heartbeats built in this process so far: each takes the next number as its key prefix.
_HEARTBEATS = itertools.count(1)


class Heartbeat:
    """A daemon thread that beats for this rank and exits the process if a peer goes silent."""

    def __init__(
        self,
        timeout_s: float = 30.0,
        interval_s: float = 0.5,
        store: Any = None,
        *,
        agent_pid: int | None = None,
        on_launcher_lost: Callable[[str], None] | None = None,
    ) -> None:
        if not timeout_s > interval_s > 0:
            raise ValueError(f"need timeout_s > interval_s > 0, got {timeout_s}, {interval_s}")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.agent_pid, self.on_launcher_lost = agent_pid, on_launcher_lost
        # Why this rank's launcher or store is gone, once it is: no store call after that.
        self.launcher_lost: str | None = None
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        # A key prefix per Heartbeat: a second fit() in the same group must not read the first
        # one's done/<rank> marks, or it would never watch its peers. Every rank builds its
        # Heartbeats in the same order, so the numbers agree.
        self._store = dist.PrefixStore(f"ddptrain/heartbeat/{next(_HEARTBEATS)}", base)
        self._store_address = _tcp_address(base)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ddptrain-heartbeat", daemon=True)
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in range(self.world_size) if r != self.rank}

    def start(self) -> Heartbeat:
        """Start beating and watching (at world size 1 only the agent, if any)."""
        if self.world_size > 1:
            self._store.add(f"beat/{self.rank}", 1)
        if self.world_size > 1 or self.agent_pid is not None:
            self._thread.start()
        return self

    def stop(self, error: str | None = None) -> None:
        """Stop the thread and tell peers why (they stop watching this rank): finished
        cleanly, or left with `error`, which a peer blocked on this rank reports."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            if self.launcher_lost:
                return
            key, value = (f"failed/{self.rank}", error) if error else (f"done/{self.rank}", "1")
            try:
                self._store.set(key, value)
            except Exception:  # noqa: BLE001 - the store may be gone at shutdown
                pass

    def failed_peers(self) -> dict[int, str]:
        """{rank: its error} for the peers that left with an error (see stop)."""
        failed: dict[int, str] = {}
        if self.launcher_lost:
            return failed
        for peer in self._seen:
            try:
                if self._store.check([f"failed/{peer}"]):
                    failed[peer] = self._store.get(f"failed/{peer}").decode(errors="replace")
            except Exception:  # noqa: BLE001 - an unreachable store knows of no failure
                pass
        return failed

    def lost_ranks(self, wait_s: float | None = None) -> list[int]:
        """Peers silent for longer than `wait_s` (default: 3 beats) as seen from here."""
        wait_s = 3 * self.interval_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        while True:
            silent = self._silent_for()
            lost = [r for r, s in silent.items() if s >= wait_s]
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(self.interval_s / 2)

    def _agent_gone(self, within_s: float) -> bool:
        """Whether this worker's torchrun agent has exited, waiting up to within_s for it."""
        deadline = time.monotonic() + within_s
        while self.agent_pid is not None and os.getppid() == self.agent_pid:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return self.agent_pid is not None

    def _silent_for(self) -> dict[int, float]:
        with self._lock:
            return self._poll_peers()

    def _poll_peers(self) -> dict[int, float]:
        now = time.monotonic()
        silent = {}
        for peer in self._seen:
            try:
                if self._store.check([f"done/{peer}"]) or self._store.check([f"failed/{peer}"]):
                    continue
                count = self._store.add(f"beat/{peer}", 0)
            except Exception:  # noqa: BLE001 - an unreachable store: treat peers as silent
                count = self._seen[peer][0]
            last_count, since = self._seen[peer]
            if count != last_count:
                self._seen[peer] = (count, now)
                since = now
            silent[peer] = now - since
        return silent

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval_s):
            if self._agent_gone(0.0):
                self._lose_launcher(f"its torchrun agent (pid {self.agent_pid}) is gone")
                return
            if self.world_size == 1:
                continue
            try:
                self._store.add(f"beat/{self.rank}", 1)
                failures = 0
            except Exception as e:  # noqa: BLE001 - the store's host may be gone
                # A dying agent closes its store a moment before its workers are reparented:
                # name the agent, the cause, rather than the store.
                if self._agent_gone(AGENT_EXIT_S):
                    self._lose_launcher(f"its torchrun agent (pid {self.agent_pid}) is gone")
                    return
                failures += 1
                if failures >= STORE_FAILURES or not self._store_listens():
                    self._lose_launcher(f"the launcher's store is unreachable ({one_line(e, 120)})")
                    return
                # Peers' counts cannot be read either: their silence would be this rank's.
                continue
            lost = {r: s for r, s in self._silent_for().items() if s >= self.timeout_s}
            if lost and not self._stop.is_set():
                names = ", ".join(f"rank {r} (silent {s:.0f} s)" for r, s in sorted(lost.items()))
                print(
                    f"ddptrain: rank {self.rank}: lost {names}: the process died, froze or lost "
                    f"its network. Exiting with code {LOST_RANK_EXIT_CODE} instead of waiting "
                    "for the collective timeout; restart the job (torchrun --max-restarts) and "
                    "it resumes from the latest checkpoint with resume='auto'.",
                    file=sys.stderr,
                    flush=True,
                )
                report.worker_exit(LOST_RANK_EXIT_CODE)
                os._exit(LOST_RANK_EXIT_CODE)

    def _store_listens(self) -> bool:
        """Whether the store's port takes a plain connection (True when its address is
        unknown): one more store call would log another C++ trace."""
        if self._store_address is None:
            return True
        try:
            socket.create_connection(self._store_address, timeout=self.interval_s).close()
        except OSError:
            return False
        return True

    def _lose_launcher(self, why: str) -> None:
        """Stop calling the store; let the Trainer save and stop, else exit after timeout_s."""
        self.launcher_lost = why
        if self.on_launcher_lost is not None:
            self.on_launcher_lost(why)
            if self._stop.wait(self.timeout_s):
                return  # the process stopped training by itself
        print(
            f"ddptrain: rank {self.rank}: {why}: the launcher died or lost its network. Exiting "
            f"with code {LOST_RANK_EXIT_CODE}; start the job again and it resumes from the "
            "latest checkpoint with resume='auto'.",
            file=sys.stderr,
            flush=True,
        )
        report.worker_exit(LOST_RANK_EXIT_CODE)
        os._exit(LOST_RANK_EXIT_CODE)


def _tcp_address(store: Any) -> tuple[str, int] | None:
    """(host, port) of the TCPStore under `store`'s prefixes, or None for another kind."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def replica_checksums(module: nn.Module) -> torch.Tensor:
    """Per parameter (sum, sum of squares) in float64: cheap, and equal iff replicas agree."""
    params = [p.detach() for p in module.parameters()]
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    sums = torch.stack([p.double().sum() for p in params])
    squares = torch.stack([p.double().square().sum() for p in params])
    return torch.stack([sums, squares], dim=1)


def check_replicas(module: nn.Module, group: Any = None) -> None:
    """Raise ReplicaDesyncError on every rank if any rank's parameters differ from rank 0's."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    mine = replica_checksums(module)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=group)
    names = [n for n, _ in module.named_parameters()]
    for rank, theirs in enumerate(everyone[1:], start=1):
        differs = (theirs != everyone[0]).any(dim=1).nonzero()
        if len(differs):
            i = int(differs[0])
            raise ReplicaDesyncError(
                f"replicas diverged: rank {rank} differs from rank 0 first at parameter "
                f"'{names[i]}' ({int(len(differs))} parameter(s) differ). Something changed "
                "weights outside the synchronized step (a rank-local update, non-deterministic "
                "kernel, or a bad node); restart from the last checkpoint"
            )


@contextlib.contextmanager
def watching(
    timeout_s: float | None, agent_pid: int | None, on_launcher_lost: Any = None
) -> Iterator[Heartbeat | None]:
    """Run the block with a Heartbeat watching the peers (none when timeout_s is None);
    stopped when the block ends (explain_failure says why it ended, on an error)."""
    heartbeat = (
        Heartbeat(timeout_s=timeout_s, agent_pid=agent_pid, on_launcher_lost=on_launcher_lost)
        if timeout_s
        else None
    )
    if heartbeat is not None:
        heartbeat.start()
    try:
        yield heartbeat
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def explain_failure(
    error: BaseException, heartbeat: Heartbeat | None, rank: int, step: int
) -> BaseException:
    """The error to raise for `error`: the peer's, when a peer caused it; peers blocked on
    this rank are told why it left."""
    peer = peer_error(error, heartbeat, rank, step)
    if heartbeat is not None:
        # Before the group goes: a peer blocked on this rank reports why it left.
        heartbeat.stop(error=one_line(peer or error))
    return peer or error


def one_line(error: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first}"[:limit] if first else type(error).__name__


def peer_error(
    error: BaseException, heartbeat: Heartbeat | None, rank: int, step: int
) -> RuntimeError | None:
    """If `error` is a collective failing because of a peer: a PeerFailedError naming the
    peer's own error, or a RankLostError naming the silent peers; else None."""
    # Backends report a dead peer as a plain RuntimeError (gloo, shared memory) or a DistError.
    comm_failure = type(error) is RuntimeError or isinstance(error, dist.DistError)
    if heartbeat is None or not comm_failure:
        return None
    if heartbeat.launcher_lost:
        return LauncherLostError(
            f"rank {rank}: stopped at step {step}: {heartbeat.launcher_lost}; start the job "
            "again and it resumes from the latest checkpoint with resume='auto'"
        )
    failed = heartbeat.failed_peers()
    if failed:
        peer, why = min(failed.items())
        return PeerFailedError(
            f"rank {rank}: rank {peer} left at step {step} with {why}; the others stop with "
            f"it (fix that error: rank {peer}'s own output has the details)"
        )
    lost = heartbeat.lost_ranks()
    if not lost:
        return None
    first_line = one_line(error, 200).removeprefix("RuntimeError: ")
    return RankLostError(
        f"rank {rank}: lost rank(s) {lost} at step {step} (they stopped heartbeating; the "
        f"collective failed with: {first_line}). Restart the job (torchrun "
        "--max-restarts=N) with resume='auto' to continue from the latest checkpoint"
    )

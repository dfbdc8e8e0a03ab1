"""A barrier for the ranks of one host: a counter per rank in shared memory, polled.

    barrier = SharedBarrier(counters, rank, world_size, timeout_s)   # counters: shared int64
    barrier.wait()                  # every rank arrives, then all go on
    barrier.wait(spin=True, value=3)    # poll longer; publish a value the ranks sum
    barrier.total()                 # the sum of the values given to that wait

Used by the shared-memory transport (shm.py), whose rows it separates: rows full, chunks
summed, results written.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import torch

# Counters sit 64 bytes apart, so two ranks never write the same cache line. A rank's line
# holds its arrivals, its process id and a value the ranks sum (SharedMemory.reduce_finished).
COUNTER_STRIDE = 8
_PID_WORD = 1
_VALUE_WORD = 2
# A waiting rank polls this many times (yielding the core in between) before it sleeps. At the
# end of backward, with no more ranks than cores, it goes on polling for up to _SPIN_S: waking
# from a sleep costs the timer's slack, which every rank waiting behind it would pay too.
# Reductions while backward runs, and ranks that outnumber the cores, sleep sooner: their
# polling would take the core from work that is waited for.
_SPIN_POLLS = 200
_SPIN_S = 2e-3
_SLEEP_S = 50e-6
# While sleeping, a waiting rank checks this often that the peers it waits for still exist.
_LIVENESS_CHECK_S = 0.2


def announce(counters: torch.Tensor, rank: int) -> None:
    """Write this process's id into its line of `counters`: every rank does, before any builds a
    SharedBarrier over them, so that waiting ranks can tell a peer that died."""
    counters[rank * COUNTER_STRIDE + _PID_WORD] = os.getpid()


class SharedBarrier:
    """All ranks of one host meet here: a counter per rank in shared memory, polled.

    A rank that dies leaves no error on a socket for the others to see, so a waiting rank
    checks, while it sleeps, that the peers it waits for still exist (by process id, when
    the ranks share a process namespace) and raises at once, naming the rank, if one is gone.
    """

    def __init__(self, counters: torch.Tensor, rank: int, world_size: int, timeout_s: float):
        self._counters = counters  # keeps the memory that _words reads alive
        # The counters as machine words, read and written from Python directly: a torch op's
        # dispatch costs more than the read, and a barrier reads them at least once.
        self._words = (ctypes.c_int64 * counters.numel()).from_address(counters.data_ptr())
        self._mine = rank * COUNTER_STRIDE
        self._others = [r * COUNTER_STRIDE for r in range(world_size) if r != rank]
        pids = counters[_PID_WORD::COUNTER_STRIDE].tolist()
        # Peers in another process namespace are invisible from the start: no liveness check.
        self._pids = {r: pid for r, pid in enumerate(pids) if r != rank and _alive(pid)}
        self._timeout_s = timeout_s
        self._spin_s = _SPIN_S if world_size <= (os.cpu_count() or 1) else 0.0
        self._arrivals = 0
        # Acquiring and releasing a lock is a full memory fence on every platform: the row
        # writes before it are visible to peers before the counter that announces them.
        self._fence = threading.Lock()

    def wait(self, spin: bool = False, value: int | None = None) -> None:
        """Arrive and wait for every rank; spin: poll for up to _SPIN_S before sleeping;
        `value`: this rank's term of total(), read until the next wait with a value."""
        self._arrivals += 1
        words, arrivals = self._words, self._arrivals
        with self._fence:
            if value is not None:
                words[self._mine + _VALUE_WORD] = value
            words[self._mine] = arrivals
        polls = 0
        began = None
        while any(words[i] < arrivals for i in self._others):
            polls += 1
            if polls < _SPIN_POLLS:
                os.sched_yield()
                continue
            now = time.monotonic()
            if began is None:
                began, deadline, next_check = now, now + self._timeout_s, now
            if now > next_check:
                self._check_peers()
                next_check = now + _LIVENESS_CHECK_S
            if now > deadline:
                raise RuntimeError(
                    f"a rank did not reach shared-memory barrier #{self._arrivals} within "
                    f"{self._timeout_s:.0f} s (it hangs, or runs a different model or step)"
                )
            if spin and now - began < self._spin_s:
                os.sched_yield()
            else:
                time.sleep(_SLEEP_S)
        with self._fence:
            pass

    def total(self) -> int:
        """The sum over ranks of the values given to the last wait with one."""
        step = COUNTER_STRIDE
        return sum(self._words[k + _VALUE_WORD] for k in range(0, len(self._words), step))

    def _check_peers(self) -> None:
        for rank, pid in self._pids.items():
            if self._words[rank * COUNTER_STRIDE] < self._arrivals and not _alive(pid):
                raise RuntimeError(
                    f"rank {rank} (pid {pid}) exited while the others waited for it at "
                    f"shared-memory barrier #{self._arrivals}"
                )


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (visible in this namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")

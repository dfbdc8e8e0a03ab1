"""How much of this machine's CPU a run gets: the cores it may use, the busy threads of others.

    usable_cores()          # cores this process may run on
    background_threads()    # other programs' busy threads on those cores, now

The plan shares the cores among a step's threads, its peers' and these (timeline.py).
"""

from __future__ import annotations

import os
import statistics
import time


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def background_threads(seconds: float = 0.2, samples: int = 3) -> float:
    """Busy threads of other programs on this machine's cores, now: as many spinning processes
    as cores each get a share s of a core; C / s - C threads compete with them (CFS shares the
    cores equally among runnable threads). The median of `samples`: one sample can catch a
    process exiting or the hypervisor taking the vCPU."""
    return statistics.median(_busy_threads(seconds) for _ in range(samples))


def _busy_threads(seconds: float) -> float:
    cores = usable_cores()
    pipes = []
    for _ in range(cores):
        read, write = os.pipe()
        if os.fork() == 0:
            os.close(read)
            start, start_cpu = time.perf_counter(), time.process_time()
            while time.perf_counter() - start < seconds:
                pass
            share = (time.process_time() - start_cpu) / (time.perf_counter() - start)
            os.write(write, f"{share}".encode())
            os._exit(0)
        os.close(write)
        pipes.append(read)
    shares = []
    for read in pipes:
        shares.append(float(os.read(read, 64).decode() or 1.0))
        os.close(read)
    for _ in pipes:
        os.wait()
    share = min(1.0, statistics.fmean(shares))
    return max(0.0, cores / share - cores) if share > 0 else 0.0

"""This machine's link, measured: the collectives the wrappers issue, per world size and size.

    link = local_link()                          # cached in ~/.cache/ddptrain, else measured
    link = calibrate(world_sizes=[1, 2, 3, 4])   # measure now (tens of seconds)

Each world size gets one spawned world that times, from a barrier, every operation at every
size (median of REPEATS of the CPU seconds of every thread of the process, the busiest rank),
as the wrappers run them: "reduce" is the shared
memory transport's (cpu/shm.py) on a bucket it allocated, "reduce_tcp" the TCP transport's
(cpu/tcp.py, the default across hosts, here over loopback), "all_gather" gloo's into a freshly
allocated output (the sharded wrapper gathers each unit into memory it just mapped),
"reduce_scatter" and "broadcast" gloo's. One process also times a pass over fresh and over
mapped memory (the sharded wrapper's packing). glibc returns freed blocks at once, as in
--check. The cache is keyed by host name, CPU model, core count and torch version; delete the
file, or pass --calibrate, to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ddptrain
from ddptrain.bench.memory import return_freed_memory
from ddptrain.plan.links import LocalLink

SIZES = (4 << 10, 256 << 10, 2 << 20, 8 << 20, 32 << 20)
REPEATS = 5
CACHE = Path.home() / ".cache" / "ddptrain" / "plan-local-link.json"
CALIBRATION_VERSION = 2


def machine_key() -> str:
    """Host name, CPU model, usable cores and torch version: what the figures depend on."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{socket.gethostname()}|{model}|{usable_cores()}|{torch.__version__}"


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def local_link(world_sizes: list[int] | None = None, refresh: bool = False) -> LocalLink:
    """This machine's link: from the cache when it holds every world size asked, else measured
    (and cached)."""
    wanted = sorted(set(world_sizes or [1, 2]) | {1, 2})
    key = machine_key()
    if not refresh and CACHE.exists():
        cached = json.loads(CACHE.read_text())
        if cached.get("machine_key") == key and cached.get("version") == CALIBRATION_VERSION:
            link = LocalLink.from_dict(cached)
            if all(w in link.table["reduce"] for w in wanted):
                return link
    link = calibrate(wanted)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(
        json.dumps({**link.as_dict(), "machine_key": key, "version": CALIBRATION_VERSION})
    )
    return link


def calibrate(world_sizes: list[int]) -> LocalLink:
    """Measure every operation at every size at each world size (module docstring)."""
    table: dict[str, dict[int, list[tuple[int, float]]]] = {}
    load = os.getloadavg()[0]
    for ws in world_sizes:
        per_rank = ddptrain.spawn(_measure, ws, list(SIZES), timeout_s=900)
        for op in per_rank[0]["ops"]:
            rows = [r["ops"][op] for r in per_rank]
            table.setdefault(op, {})[ws] = [
                (size, max(row[i][1] for row in rows)) for i, (size, _) in enumerate(rows[0])
            ]
    fresh, mapped = ddptrain.spawn(_passes, 1, timeout_s=300)[0]
    source = (
        f"measured {time.strftime('%Y-%m-%d %H:%M')} on {machine_key()}, load before "
        f"{load:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    return LocalLink(
        table,
        float(usable_cores()),
        source=source,
        fresh_pass_s_per_byte=fresh,
        pass_s_per_byte=mapped,
    )


def _timed(fn: Any) -> tuple[float, float]:
    """Median (wall, CPU) seconds of `fn`, CPU of every thread of the process."""
    fn()
    wall, cpu = [], []
    for _ in range(REPEATS):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def _measure(sizes: list[int]) -> dict[str, Any]:
    from ddptrain.cpu.shm import SharedMemory
    from ddptrain.cpu.tcp import Socket

    return_freed_memory()
    info = ddptrain.init_distributed()
    ws = info.world_size
    shm = SharedMemory() if ws > 1 else None
    tcp = Socket() if ws > 1 else None
    ops: dict[str, list[tuple[int, float]]] = {}
    walls: dict[str, list[tuple[int, float]]] = {}
    for nbytes in sizes:
        n = max(ws, nbytes // 4 // ws * ws)
        for op, fn in _operations(n, ws, shm, tcp).items():
            wall, cpu_s = _timed(fn)
            ops.setdefault(op, []).append((n * 4, cpu_s))
            walls.setdefault(op, []).append((n * 4, wall))
    if ws == 1:
        ops["reduce"] = [(s, 0.0) for s, _ in ops["broadcast"]]
        ops["reduce_tcp"] = list(ops["reduce"])
    ddptrain.shutdown()
    return {"ops": ops, "wall": walls}


def _operations(n: int, ws: int, shm: Any, tcp: Any) -> dict[str, Any]:
    """Each operation on n float32 elements, as the wrappers run it (module docstring)."""
    from ddptrain.ddp.hooks import GradBucket
    from ddptrain.fsdp.unit import all_gather_single, reduce_scatter_single

    shard, whole, part = torch.ones(n // ws), torch.ones(n), torch.empty(n // ws)
    runs = {
        "all_gather": lambda: all_gather_single(torch.empty(n), shard),
        "reduce_scatter": lambda: reduce_scatter_single(part, whole),
        "broadcast": lambda: dist.broadcast(whole, 0),
    }
    if ws > 1:
        bucket = shm.allocate(n, torch.float32, torch.device("cpu"))
        private = torch.ones(n)
        runs["reduce"] = lambda: shm.reduce(GradBucket(0, bucket, [], [], True))
        runs["reduce_tcp"] = lambda: tcp.reduce(GradBucket(0, private, [], [], True))
    return runs


def _passes() -> tuple[float, float]:
    """CPU seconds per byte of a scaled copy into fresh memory, and into mapped memory."""
    return_freed_memory()
    n = 8 << 20
    source, mapped = torch.ones(n), torch.empty(n)
    fresh = _cpu_median(lambda: torch.mul(source, 0.5, out=torch.empty(n)))
    into = _cpu_median(lambda: torch.mul(source, 0.5, out=mapped))
    return fresh / (n * 4), into / (n * 4)


def _cpu_median(fn: Any) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def background_threads(seconds: float = 0.5) -> float:
    """Busy threads of other programs on this machine's cores, now: as many spinning processes
    as cores each get a share s of a core; C / s - C threads compete with them (CFS shares the
    cores equally among runnable threads)."""
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

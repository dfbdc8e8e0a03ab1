"""The links this machine can reach, measured: the collectives the wrappers issue, per size.

    link = local_link([1, 2, 3, 4])     # one host: cached in ~/.cache/ddptrain, else measured
    link = measured_shaped_link("1gbit")  # two network namespaces joined by a shaped veth (root)

One host: each world size gets one spawned world that times, from a barrier, every operation at
every size (the median of REPEATS, or of as many as fill TIMED_S, up to MAX_REPEATS; the CPU
seconds of every thread of the process, and the wall seconds, of the busiest rank), as the
wrappers run them: "reduce" is the shared-memory
transport's (cpu/shm.py) on a bucket it allocated, "reduce_tcp" the TCP transport's (cpu/tcp.py,
the default across hosts; here over loopback), "all_gather" gloo's into a freshly allocated
output (the sharded wrapper gathers each unit into memory it just mapped), "reduce_scatter"
gloo's into a fresh receive buffer, both started and waited for as the wrapper does, with the
calling thread's own CPU at each (gloo copies into and out of its buffers there), and
"broadcast" gloo's. One process also times a pass over fresh and over mapped memory (the
sharded wrapper's packing). Meetings: what ranks that arrive at a collective from their own
compute lose waiting for each other, beyond its time from a barrier (meeting.py), and where
the ranks outnumber the cores, what they lose meeting at the last bucket's reduction after
cycles of compute of several lengths (the uneven share, meeting.py). Two hosts:
the same at world size 2, one rank in each namespace, the veth shaped as `python -m
ddptrain.bench --two-hosts --link RATE` shapes it (bench/link.py), sizes up to what the link
carries in about a second. glibc returns freed blocks at once, as in
--check. The cache is keyed by host name, CPU model, core count and torch version; delete it,
or pass refresh=True, to measure again.
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
from ddptrain.bench import link as bench_link
from ddptrain.bench.memory import return_freed_memory
from ddptrain.plan.links import LocalLink, ShapedLink, rate_bits
from ddptrain.plan.load import usable_cores
from ddptrain.plan.meeting import measure_meeting, measure_uneven_share

SIZES = (4 << 10, 256 << 10, 2 << 20, 8 << 20, 32 << 20)
REPEATS = 5
# Small operations repeat until this long is spent: one wake-up late skews a median of five.
TIMED_S = 0.25
MAX_REPEATS = 41
CACHE = Path.home() / ".cache" / "ddptrain" / "plan-links.json"
CALIBRATION_VERSION = 5
# A shaped link is measured up to the size it carries in about this long.
SHAPED_SECONDS = 0.8


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


def _cached(name: str) -> dict[str, Any] | None:
    if not CACHE.exists():
        return None
    entry = json.loads(CACHE.read_text()).get(name)
    if entry and entry.get("machine_key") == machine_key():
        if entry.get("version") == CALIBRATION_VERSION:
            return entry
    return None


def _store(name: str, entry: dict[str, Any]) -> None:
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    everything = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    everything[name] = {**entry, "machine_key": machine_key(), "version": CALIBRATION_VERSION}
    CACHE.write_text(json.dumps(everything))


def local_link(world_sizes: list[int] | None = None, refresh: bool = False) -> LocalLink:
    """This machine's link: from the cache when it holds every world size asked, else measured
    (and cached)."""
    wanted = sorted(set(world_sizes or [1, 2]) | {1, 2})
    cached = None if refresh else _cached("local")
    if cached is not None:
        link = LocalLink.from_dict(cached)
        measured = all(w in link.table["reduce"] for w in wanted)
        shared = all(w in link.share_table for w in wanted if w > link.cores)
        if link.wall_table and link.caller_table and measured and shared:
            return link
    link = calibrate(wanted)
    _store("local", link.as_dict())
    return link


def measured_shaped_link(rate: str, refresh: bool = False) -> ShapedLink:
    """Two hosts of this machine joined by a link shaped to `rate`, its collectives measured
    at world size 2 (cached)."""
    name = f"shaped:{rate}"
    cached = None if refresh else _cached(name)
    # A link the emulator now shapes differently (its token bucket) is measured again; a
    # kernel that refuses the segment cap gets the bucket of 64 KiB segments every time.
    buckets = {bench_link.burst_bytes(rate), bench_link.burst_bytes(rate, bench_link.GSO_BYTES)}
    if cached is not None and cached.get("burst_bytes") not in buckets:
        cached = None
    local = local_link([1, 2])
    if cached is None:
        cached = _calibrate_two_hosts(rate)
        _store(name, cached)
    table = {op: [tuple(p) for p in pts] for op, pts in cached["cpu"].items()}
    walls = {op: [tuple(p) for p in pts] for op, pts in cached["wall"].items()}
    meetings = {op: (m[0], m[1]) for op, m in cached["meet"].items()}
    return ShapedLink(
        rate_bits(rate),
        cached["round_trip_s"] / 2,
        local,
        name=rate,
        description=f"two hosts, tc tbf {rate}",
        cpu_table=table,
        wall_table=walls,
        meet_table=meetings,
        source=cached["source"],
    )


def _calibrate_two_hosts(rate: str) -> dict[str, Any]:
    import tempfile

    from ddptrain.bench.hosts import run_launchers, terminate_as_exit
    from ddptrain.netns import torchrun, two_hosts

    largest = rate_bits(rate) / 8 * SHAPED_SECONDS
    sizes = [s for s in SIZES if s <= max(largest, SIZES[1])]
    with tempfile.TemporaryDirectory(prefix="ddptrain-plan-link-") as out:
        args = ["-m", "ddptrain.plan.calibrate", "--out", out]
        args += ["--sizes", ",".join(map(str, sizes))]
        with terminate_as_exit(), two_hosts("ddpc") as (a, b):
            shaping = bench_link.shape_link(a, b, rate)
            rdzv = f"ddptrain-plan-link-{os.getpid()}"
            commands = [
                torchrun(h, a, nnodes=2, nproc_per_node=1, rdzv_id=rdzv, args=args) for h in (a, b)
            ]
            run_launchers(commands, [h.env() for h in (a, b)], 1800)
        ranks = json.loads((Path(out) / "calibration.json").read_text())
    cpu, wall = _busiest(ranks, "ops"), _busiest(ranks, "wall")
    probe = shaping["probe"]
    return {
        "cpu": cpu,
        "wall": wall,
        "meet": _slowest_meetings(ranks),
        "round_trip_s": probe["round_trip_us"] * 1e-6,
        "burst_bytes": shaping["burst_bytes"],
        "source": f"measured {time.strftime('%Y-%m-%d %H:%M')} over two namespaces, tc tbf "
        f"{rate}, burst {shaping['burst_bytes']} B; probe {probe['mbit_per_s']:.0f} Mbit/s",
    }


def _busiest(ranks: list[dict[str, Any]], key: str) -> dict[str, list[tuple[int, float]]]:
    """Per operation, (bytes, seconds) of the rank that took longest at each size."""
    out = {}
    for op, points in ranks[0][key].items():
        out[op] = [
            (size, max(r[key][op][i][1] for r in ranks)) for i, (size, _) in enumerate(points)
        ]
    return out


def _busiest_callers(ranks: list[dict[str, Any]]) -> dict[str, list[tuple[int, float, float]]]:
    """Per operation, (bytes, issue seconds, finish seconds) of the calling thread, each the
    most any rank spent."""
    out = {}
    for op, points in ranks[0].get("caller", {}).items():
        out[op] = [
            (size, *(max(r["caller"][op][i][k] for r in ranks) for k in (1, 2)))
            for i, (size, *_) in enumerate(points)
        ]
    return out


def _slowest_meetings(ranks: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per operation, the (idle, busy) meeting seconds of the rank that lost most."""
    out = {}
    for op in ranks[0].get("meet", {}):
        idle, busy = zip(*(r["meet"][op] for r in ranks), strict=True)
        out[op] = (max(idle), max(busy))
    return out


def _slowest_share(ranks: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Per cycle length, (its even-share cycle, the most seconds any rank lost beyond it)."""
    return [
        (cycle, max(r["share"][i][1] for r in ranks))
        for i, (cycle, _) in enumerate(ranks[0]["share"])
    ]


def calibrate(world_sizes: list[int]) -> LocalLink:
    """Measure every operation at every size at each world size (module docstring)."""
    table: dict[str, dict[int, list[tuple[int, float]]]] = {}
    walls: dict[str, dict[int, list[tuple[int, float]]]] = {}
    meetings: dict[str, dict[int, tuple[float, float]]] = {}
    callers: dict[str, dict[int, list[tuple[int, float, float]]]] = {}
    shares: dict[int, list[tuple[float, float]]] = {}
    load = os.getloadavg()[0]
    for ws in world_sizes:
        per_rank = ddptrain.spawn(_measure_rank, ws, list(SIZES), timeout_s=900)
        for op, points in _busiest(per_rank, "ops").items():
            table.setdefault(op, {})[ws] = points
        for op, points in _busiest(per_rank, "wall").items():
            walls.setdefault(op, {})[ws] = points
        for op, seconds in _slowest_meetings(per_rank).items():
            meetings.setdefault(op, {})[ws] = seconds
        for op, split in _busiest_callers(per_rank).items():
            callers.setdefault(op, {})[ws] = split
        if "share" in per_rank[0]:
            shares[ws] = _slowest_share(per_rank)
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
        wall_table=walls,
        meet_table=meetings,
        caller_table=callers,
        share_table=shares,
    )


def _timed(fn: Any) -> tuple[float, float, tuple[float, float] | None]:
    """Median (wall, CPU, caller) seconds of `fn`, CPU of every thread of the process; caller:
    the calling thread's CPU issuing and finishing the operation, where `fn` returns them."""
    fn()
    wall: list[float] = []
    cpu: list[float] = []
    caller: list[tuple[float, float]] = []
    while True:
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        marks = fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if isinstance(marks, tuple):
            caller.append(marks)
        more = len(wall) < REPEATS or (sum(wall) < TIMED_S and len(wall) < MAX_REPEATS)
        # Rank 0 decides for every rank: all must meet at as many barriers.
        decided = torch.tensor([more])
        dist.broadcast(decided, 0)
        if not decided.item():
            break
    split = None
    if caller:
        issue, finish = zip(*caller, strict=True)
        split = (statistics.median(issue), statistics.median(finish))
    return statistics.median(wall), statistics.median(cpu), split


def _measure(sizes: list[int]) -> dict[str, Any]:
    from ddptrain.cpu.shm import SharedMemory
    from ddptrain.cpu.tcp import Socket

    return_freed_memory()
    info = ddptrain.init_distributed()
    ws = info.world_size
    # Across hosts there is no shared memory: only the TCP transport and gloo are measured.
    shm = SharedMemory() if ws > 1 and SharedMemory.available() else None
    tcp = Socket() if ws > 1 else None
    ops: dict[str, list[tuple[int, float]]] = {}
    walls: dict[str, list[tuple[int, float]]] = {}
    callers: dict[str, list[tuple[int, float, float]]] = {}
    for nbytes in sizes:
        n = max(ws, nbytes // 4 // ws * ws)
        for op, fn in _operations(n, ws, shm, tcp).items():
            wall, cpu_s, caller = _timed(fn)
            ops.setdefault(op, []).append((n * 4, cpu_s))
            walls.setdefault(op, []).append((n * 4, wall))
            if caller is not None:
                callers.setdefault(op, []).append((n * 4, *caller))
    if ws == 1:
        ops["reduce"] = [(s, 0.0) for s, _ in ops["broadcast"]]
        ops["reduce_tcp"] = list(ops["reduce"])
        return {"ops": ops, "wall": walls, "caller": callers}
    n = max(ws, sizes[0] // 4 // ws * ws)
    share = min(1.0, usable_cores() / ws)
    meet = {
        op: measure_meeting(fn, walls[op][0][1], share=share)
        for op, fn in _operations(n, ws, shm, tcp, last=False).items()
    }
    out = {"ops": ops, "wall": walls, "caller": callers, "meet": meet}
    if ws > usable_cores() and shm is not None:
        # Where the DDP wrapper's ranks meet once a step: its last bucket's reduction.
        last_bucket = _operations(n, ws, shm, None)["reduce"]
        out["share"] = measure_uneven_share(last_bucket, walls["reduce"][0][1], share)
    return out


def _measure_rank(sizes: list[int]) -> dict[str, Any]:
    try:
        return _measure(sizes)
    finally:
        ddptrain.shutdown()


def _operations(n: int, ws: int, shm: Any, tcp: Any, last: bool = True) -> dict[str, Any]:
    """Each operation on n float32 elements, as the wrappers run it (module docstring); `last`:
    a reduction is of the last bucket of a backward (its barriers poll longer)."""
    from ddptrain.ddp.hooks import GradBucket
    from ddptrain.fsdp.unit import all_gather_single, reduce_scatter_single

    shard, whole = torch.ones(n // ws), torch.ones(n)

    def gather() -> tuple[float, float]:
        # As the sharded wrapper gathers a unit: into memory it just mapped, freed after use.
        start = time.thread_time()
        out = torch.empty(n)
        work = all_gather_single(out, shard, async_op=True)
        issued = time.thread_time()
        work.wait()
        del work, out  # the work holds the output too
        return issued - start, time.thread_time() - issued

    def reduce_scatter() -> tuple[float, float]:
        # As the wrapper reduces a unit's gradients: into a fresh receive buffer.
        start = time.thread_time()
        part = torch.empty(n // ws)
        work = reduce_scatter_single(part, whole, async_op=True)
        issued = time.thread_time()
        work.wait()
        del work, part
        return issued - start, time.thread_time() - issued

    runs: dict[str, Any] = {
        "all_gather": gather,
        "reduce_scatter": reduce_scatter,
        "broadcast": lambda: dist.broadcast(whole, 0),
    }
    if shm is not None:
        bucket = shm.allocate(n, torch.float32, torch.device("cpu"))
        runs["reduce"] = lambda: shm.reduce(GradBucket(0, bucket, [], [], last))
    if tcp is not None:
        private = torch.ones(n)
        runs["reduce_tcp"] = lambda: tcp.reduce(GradBucket(0, private, [], [], last))
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


def main(argv: list[str] | None = None) -> None:
    """Under a launcher (two hosts): measure this world's collectives; rank 0 writes JSON."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ddptrain.plan.calibrate")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    info = ddptrain.init_distributed()
    mine = _measure([int(s) for s in args.sizes.split(",")])
    gathered: list[Any] | None = [None] * info.world_size if info.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    ddptrain.shutdown()
    if gathered is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "calibration.json").write_text(json.dumps(gathered))


if __name__ == "__main__":
    main()

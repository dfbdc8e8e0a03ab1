"""What a collective costs one rank on a link: CPU seconds, the least time on the wire, and
the wait for its peers to arrive.

    link = local_link()                       # this machine: measured once (calibrate.py), cached
    link = shaped_link("1gbit", local)        # two hosts joined by a link of that rate
    link = link_from_rate(25e9, 20e-6)        # any bandwidth (bits/s) and latency (s), on GPUs
    link = named_link("nccl-100g")            # a profile whose figures cite their source
    cost = link.cost("reduce", 64 << 20, world_size=4)  # Cost(cpu_s, wire_s, meet_s, meet_busy_s)

Operations, with `nbytes` as NCCL's tests count S (nccl-tests doc/PERFORMANCE.md): "reduce"
(the wrapper's bucket all-reduce: S is the bucket), "all_gather" (S is the gathered output),
"reduce_scatter" (S is the input), "broadcast" (S is the message). On a ring of n ranks each
rank moves factor * S bytes: 2(n-1)/n for reduce, (n-1)/n for all_gather and reduce_scatter,
1 for broadcast (all of it leaves the root), in `steps` hops of one latency each.

- This machine (`LocalLink`): CPU ranks on one host, where a collective is memory copies and
  sums (shared memory) or loopback TCP (gloo): no wire. Its figures are CPU seconds per rank
  (every thread of the process, the kernel's copies included) and, as the least it lasts, its
  wall seconds, measured per world size and size (calibrate.py) and interpolated linearly in
  size; a world size not measured takes the nearest one's scaled by the ring factor. `cpu()`
  says which cores the ranks share. Its meetings: the seconds ranks arriving from their own
  compute lose waiting for each other, measured per operation and world size with the main
  threads waiting and computing (calibrate.py). Of gloo's all-gather and reduce-scatter, the
  part spent on the thread that starts and waits for them is measured apart (`issue_s`,
  `finish_s` of a Cost, within its `cpu_s`); a shaped link takes this machine's. Where ranks
  outnumber the cores, its uneven share (`uneven_share_s`): what ranks that compute a cycle and
  then meet lose beyond the meeting after the shortest cycle, measured for cycles of several
  lengths per world size (meeting.py); linear between them, the same fraction of a cycle past
  the longest.
- A shaped link between hosts (`ShapedLink`): the CPU a collective costs here (the TCP
  transport's for "reduce", gloo's for the rest), and factor * S / (rate * efficiency) + steps
  * latency on the wire; TCP/IP headers leave 1448 payload bytes of each 1514-byte frame. Its
  meetings are those measured over it, else this machine's.
- A GPU link (`BusLink`): NCCL's bus bandwidth B per rank: factor * S / B + steps * latency;
  no CPU (the GPU computes, the NIC and NCCL's kernels move the bytes), no meetings modelled.

`one_machine`: every rank runs on this machine's cores (one host, or the fake hosts of
ddptrain.netns), so a slow spell of the machine falls on every rank in the same step.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any

OPS = ("reduce", "all_gather", "reduce_scatter", "broadcast")
# gloo's all-gather and reduce-scatter take longer than a ring's bytes over a shaped link
# (measured over two namespaces: docs/plan.md); used where the link was not measured itself.
GLOO_EXCESS = {"all_gather": 1.8, "reduce_scatter": 2.3}
TCP_PAYLOAD_EFFICIENCY = 1448 / 1514
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True)
class Cost:
    """One rank's share of a collective: CPU seconds at a full core; least seconds it lasts."""

    cpu_s: float = 0.0
    wire_s: float = 0.0
    # Waiting for the peers to arrive: while the rank's main thread waits too, and computes.
    meet_s: float = 0.0
    meet_busy_s: float = 0.0
    # Of cpu_s, what the thread that starts the collective spends starting it and waiting for
    # it (gloo's copies into and out of its own buffers); the rest runs on gloo's threads.
    issue_s: float = 0.0
    finish_s: float = 0.0


def ring_factor(op: str, world_size: int) -> float:
    """Bytes each rank moves, per byte of S, on a ring (NCCL's bus-bandwidth factors)."""
    n = world_size
    if n <= 1:
        return 0.0
    return {"reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def ring_steps(op: str, world_size: int) -> int:
    """Hops of one latency each on a ring."""
    n = world_size
    return 0 if n <= 1 else (2 * (n - 1) if op == "reduce" else n - 1)


def rate_bits(rate: str) -> float:
    """Bits per second of a rate written as tc writes it: 100mbit, 1gbit, 2.5gbit."""
    match = _RATE.match(rate)
    if match is None:
        raise ValueError(f"link rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit, 10gbit")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class LocalLink:
    """This machine's CPU ranks on one host: measured seconds per (op, world size, bytes)."""

    table: dict[str, dict[int, list[tuple[int, float]]]]
    cores: float
    name: str = "local"
    description: str = "this machine, shared memory"
    source: str = ""
    # Seconds per byte of a pass into freshly allocated memory, and into memory already mapped.
    fresh_pass_s_per_byte: float = 0.0
    pass_s_per_byte: float = 0.0
    # Wall seconds of the same operations (the least a collective lasts: a rank waits for its
    # peers' copies and the loopback's wake-ups, not only for its own CPU); empty: CPU alone.
    wall_table: dict[str, dict[int, list[tuple[int, float]]]] = field(default_factory=dict)
    # Seconds ranks arriving from their own compute wait for each other at a collective, beyond
    # its wall time from a barrier: (main threads waiting too, main threads computing), per
    # operation and world size (calibrate.py); empty: none.
    meet_table: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    # The calling thread's CPU seconds starting and finishing gloo's all-gather and
    # reduce-scatter: (bytes, issue, finish) per operation and world size; empty: none.
    caller_table: dict[str, dict[int, list[tuple[int, float, float]]]] = field(default_factory=dict)
    # Where ranks outnumber the cores: per world size, (cycle at an even share of the cores,
    # seconds lost beyond it) for cycles of compute of several lengths (meeting.py); empty: none.
    share_table: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    one_machine = True

    def uneven_share_s(self, world_size: int, cycle_s: float) -> float:
        """Seconds ranks that compute a `cycle_s` cycle (at an even share) lose meeting at its
        end beyond the loss of the shortest cycle measured (which the meetings carry): linear
        between measured cycles, the longest's fraction of a cycle past it; a world size not
        measured takes the nearest one's; 0 where the ranks have a core each."""
        if world_size <= self.cores or not self.share_table:
            return 0.0
        points = self.share_table[min(self.share_table, key=lambda w: (abs(w - world_size), -w))]
        (first, base), (last, lost) = points[0], points[-1]
        if cycle_s <= first:
            return 0.0
        if cycle_s >= last:
            return max(0.0, (lost - base) * cycle_s / last)
        return max(0.0, _interpolate(points, cycle_s) - base)  # type: ignore[arg-type]

    def caller_seconds(self, op: str, nbytes: int, world_size: int) -> tuple[float, float]:
        """Measured (interpolated) seconds the calling thread spends starting `op` and
        finishing it; a world size not measured takes the nearest one's."""
        by_ws = self.caller_table.get(op)
        if not by_ws:
            return 0.0, 0.0
        points = by_ws[min(by_ws, key=lambda w: (abs(w - world_size), -w))]
        return tuple(  # type: ignore[return-value]
            _interpolate([(p[0], p[k]) for p in points], nbytes) for k in (1, 2)
        )

    def meeting_seconds(self, op: str, world_size: int) -> tuple[float, float]:
        """Measured seconds (main thread waiting, main thread computing) ranks lose meeting at
        `op`; a world size not measured takes the nearest one's."""
        by_ws = self.meet_table.get(op)
        if not by_ws or world_size <= 1:
            return 0.0, 0.0
        return by_ws[min(by_ws, key=lambda w: (abs(w - world_size), -w))]

    def cpu_seconds(self, op: str, nbytes: int, world_size: int) -> float:
        """Measured (interpolated) CPU seconds one rank spends on `op` of `nbytes`."""
        return self._lookup(self.table, op, nbytes, world_size)

    def _lookup(
        self,
        table: dict[str, dict[int, list[tuple[int, float]]]],
        op: str,
        nbytes: int,
        world_size: int,
    ) -> float:
        if world_size <= 1 and op.startswith("reduce") and op != "reduce_scatter":
            return 0.0
        by_ws = table[op]
        if world_size in by_ws:
            return _interpolate(by_ws[world_size], nbytes)
        near = min(by_ws, key=lambda w: (abs(w - world_size), -w))
        scale = 1.0
        if near > 1 and world_size > 1:
            scale = ring_factor(op, world_size) / ring_factor(op, near)
        return _interpolate(by_ws[near], nbytes) * scale

    def cost(self, op: str, nbytes: int, world_size: int) -> Cost:
        cpu = self.cpu_seconds(op, nbytes, world_size)
        issue, finish = _within(cpu, self.caller_seconds(op, nbytes, world_size))
        if op not in self.wall_table or world_size <= 1:
            return Cost(cpu_s=cpu, issue_s=issue, finish_s=finish)
        wall = self._lookup(self.wall_table, op, nbytes, world_size)
        return Cost(cpu, wall, *self.meeting_seconds(op, world_size), issue, finish)

    def cpu(self, world_size: int) -> tuple[float, int] | None:
        """(cores, ranks sharing them)."""
        return self.cores, world_size

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": "local",
            "name": self.name,
            "cores": self.cores,
            "source": self.source,
            "fresh_pass_s_per_byte": self.fresh_pass_s_per_byte,
            "pass_s_per_byte": self.pass_s_per_byte,
            "table": {op: {str(w): pts for w, pts in t.items()} for op, t in self.table.items()},
            "wall_table": {
                op: {str(w): pts for w, pts in t.items()} for op, t in self.wall_table.items()
            },
            "meet_table": {
                op: {str(w): list(s) for w, s in t.items()} for op, t in self.meet_table.items()
            },
            "caller_table": {
                op: {str(w): pts for w, pts in t.items()} for op, t in self.caller_table.items()
            },
            "share_table": {str(w): pts for w, pts in self.share_table.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LocalLink:
        def tables(key: str) -> dict[str, dict[int, list[tuple[int, float]]]]:
            return {
                op: {int(w): [tuple(p) for p in pts] for w, pts in t.items()}
                for op, t in d.get(key, {}).items()
            }

        return cls(
            tables("table"),
            d["cores"],
            source=d.get("source", ""),
            fresh_pass_s_per_byte=d.get("fresh_pass_s_per_byte", 0.0),
            pass_s_per_byte=d.get("pass_s_per_byte", 0.0),
            wall_table=tables("wall_table"),
            meet_table={
                op: {int(w): (s[0], s[1]) for w, s in t.items()}
                for op, t in d.get("meet_table", {}).items()
            },
            caller_table=tables("caller_table"),  # type: ignore[arg-type]
            share_table={
                int(w): [(p[0], p[1]) for p in pts] for w, pts in d.get("share_table", {}).items()
            },
        )


@dataclass(frozen=True)
class ShapedLink:
    """Hosts joined by a link of `rate_bits_per_s`; the CPU side measured here (`local`).

    `shared_cores`: every rank of every host shares the local machine's cores (the fake hosts
    of ddptrain.netns); else each host has `local.cores` of its own for `ranks_per_host`."""

    rate_bits_per_s: float
    latency_s: float
    local: LocalLink
    ranks_per_host: int = 1
    shared_cores: bool = True
    name: str = "shaped"
    description: str = ""
    # Measured over the shaped link itself at world size 2 (calibrate.measured_shaped_link):
    # per operation, (bytes, CPU seconds) and (bytes, wall seconds); empty: the formula.
    cpu_table: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    wall_table: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # Per operation, (idle, busy) meeting seconds measured over the link itself; else this
    # machine's at the world size (LocalLink.meet_table), where every rank shares its cores.
    meet_table: dict[str, tuple[float, float]] = field(default_factory=dict)
    source: str = ""

    def cost(self, op: str, nbytes: int, world_size: int) -> Cost:
        if world_size <= 1:
            return Cost()
        local_op = "reduce_tcp" if op == "reduce" else op
        # A ring's CPU and wire time grow with the bytes each rank moves.
        scale = ring_factor(op, world_size) / ring_factor(op, 2)
        hops = (ring_steps(op, world_size) - ring_steps(op, 2)) * self.latency_s
        if local_op in self.cpu_table:
            cpu = _interpolate(self.cpu_table[local_op], nbytes)
        else:
            cpu = self.local.cpu_seconds(local_op, nbytes, 2)
        meet = self.meet_table.get(local_op)
        if meet is None:
            shared = self.shared_cores
            meet = self.local.meeting_seconds(local_op, world_size) if shared else (0.0, 0.0)
        # The calling thread's copies are this machine's memory's, whatever the link.
        caller = _within(cpu * scale, self.local.caller_seconds(local_op, nbytes, world_size))
        if local_op in self.wall_table:
            wire = _interpolate(self.wall_table[local_op], nbytes) * scale + hops
            return Cost(cpu * scale, wire, *meet, *caller)
        rate = self.rate_bits_per_s / 8 * TCP_PAYLOAD_EFFICIENCY
        wire = (
            GLOO_EXCESS.get(op, 1.0) * ring_factor(op, world_size) * nbytes / rate
            + ring_steps(op, world_size) * self.latency_s
        )
        return Cost(cpu * scale, wire, *meet, *caller)

    def cpu(self, world_size: int) -> tuple[float, int] | None:
        """(cores, ranks sharing them)."""
        return self.local.cores, world_size if self.shared_cores else self.ranks_per_host

    @property
    def one_machine(self) -> bool:
        return self.shared_cores

    def uneven_share_s(self, world_size: int, cycle_s: float) -> float:
        """This machine's (LocalLink.uneven_share_s) where every rank shares its cores; else
        the ranks of one host's."""
        ranks = world_size if self.shared_cores else self.ranks_per_host
        return self.local.uneven_share_s(ranks, cycle_s)


@dataclass(frozen=True)
class BusLink:
    """GPU ranks over NCCL: bus bandwidth per rank (bytes/s) and a latency per ring hop."""

    bus_bytes_per_s: float
    latency_s: float
    name: str = "bus"
    description: str = ""
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def cost(self, op: str, nbytes: int, world_size: int) -> Cost:
        wire = ring_factor(op, world_size) * nbytes / self.bus_bytes_per_s
        return Cost(wire_s=wire + ring_steps(op, world_size) * self.latency_s)

    one_machine = False

    def cpu(self, world_size: int) -> tuple[float, int] | None:
        """None: compute and communication do not contend for a CPU."""
        return None

    def uneven_share_s(self, world_size: int, cycle_s: float) -> float:
        """0: a GPU is no shared core."""
        return 0.0


Link = LocalLink | ShapedLink | BusLink

# Per ring hop on an InfiniBand fabric: an assumption of the order of NCCL's small-message
# all-reduce time between two nodes (~46 us for 4 bytes, NVIDIA/nccl#1244) over its hops.
NCCL_HOP_LATENCY_S = 10e-6
# NCCL bus bandwidth per NIC for large all-reduces, as NCCL's maintainers quote it.
NAMED = {
    "nccl-25g": BusLink(
        3.0e9,
        NCCL_HOP_LATENCY_S,
        "nccl-25g",
        "25 Gbit/s per GPU, NCCL ring",
        "derived: 96% of line rate, the ratio of the 100G figure (12 of 12.5 GB/s); no measured "
        "25G figure cited",
    ),
    "nccl-100g": BusLink(
        12.0e9,
        NCCL_HOP_LATENCY_S,
        "nccl-100g",
        "100 Gbit/s per GPU, NCCL ring",
        "NVIDIA/nccl-tests#119: 'we usually consider 24GB/s is the peak performance per 200G "
        "NIC (12 GB/s for 100G NICs)'; #29: '12.2 GB/s (for a 100Gbps card) is as good as you "
        "can get'",
    ),
    "nccl-400g": BusLink(
        48.0e9,
        NCCL_HOP_LATENCY_S,
        "nccl-400g",
        "400 Gbit/s per GPU, NCCL ring",
        "NVIDIA/nccl-tests#267: 'CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s "
        "per NIC'",
    ),
}


def named_link(name: str) -> BusLink:
    """A named GPU link profile (NAMED), its figures' sources in `.source`."""
    if name not in NAMED:
        raise ValueError(f"unknown link profile {name!r}: choose one of {', '.join(NAMED)}")
    return NAMED[name]


def link_from_rate(bits_per_s: float, latency_s: float) -> BusLink:
    """GPU ranks over a link of this rate, at NCCL's efficiency on the cited NICs (96%)."""
    return BusLink(
        bits_per_s / 8 * 0.96,
        latency_s,
        f"{bits_per_s / 1e9:g}gbit",
        f"{bits_per_s / 1e9:g} Gbit/s per rank, 96% of it as bus bandwidth",
        "the efficiency of NAMED['nccl-100g']",
    )


def shaped_link(rate: str, local: LocalLink, latency_s: float = 50e-6) -> ShapedLink:
    """The two fake hosts of `python -m ddptrain.bench --two-hosts --link RATE` (one machine's
    cores shared by both); `latency_s`: the veth's one-way time (its probe measures ~0.1 ms
    round trips)."""
    return ShapedLink(
        rate_bits(rate), latency_s, local, name=rate, description=f"two hosts, tc tbf {rate}"
    )


def _within(cpu: float, caller: tuple[float, float]) -> tuple[float, float]:
    """The calling thread's (issue, finish) seconds, scaled down to fit in `cpu`, the whole
    operation's CPU (two measurements of one operation: the parts can exceed the whole)."""
    issue, finish = caller
    if issue + finish <= cpu or issue + finish == 0:
        return issue, finish
    share = cpu / (issue + finish)
    return issue * share, finish * share


def _interpolate(points: list[tuple[int, float]], nbytes: int) -> float:
    """Seconds at `nbytes` from (bytes, seconds) points sorted by bytes: linear between them,
    the smallest below, the last two's line above."""
    sizes = [p[0] for p in points]
    if nbytes <= sizes[0]:
        return points[0][1]
    i = bisect.bisect_left(sizes, nbytes)
    if i >= len(points):
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0))

"""One rank's step as threads sharing its CPU: the overlap of communication with compute.

    ops = [Compute(0.010), Launch("comm", Job("b0", cpu_s=0.004)), Compute(0.010), Wait("b0")]
    result = simulate(ops, cores=1.0)      # result.end_s == 0.024: the job took half the core
    simulate(ops, cores=2.0).end_s         # 0.020: a core each, the job hidden
    simulate(ops, cores=2.0, peers=2)      # two ranks on two cores: 0.024 again
    simulate(ops, cores=2.0, background=2) # two busy threads of other programs beside it
    simulate(ops, cores=None)              # no contention (a GPU computes, a NIC sends)

The main thread runs `ops` in order: Compute (seconds of work at a full core), Launch (a job to
the FIFO queue of a thread: the wrapper's communication thread, a process group's worker),
Wait (until a job is done), Alloc/Free (bytes, for the memory peak). A job first meets its
peers: no CPU, `meet_s` long while the main thread waits and `meet_busy_s` while it computes,
at the pace of whichever holds at each moment. Then it needs `cpu_s` of CPU (copies, sums, a
kernel's TCP) and lasts at least `wire_s` (bytes on the wire / rate + latencies): it ends once
both are spent, the CPU first or along the way. Threads with CPU work
share the `cores` equally, each at most one core (processor sharing, as the kernel's scheduler
gives runnable threads equal time), with the same threads of the `peers` ranks on those cores
and `background` threads of other programs; `cores=None` runs every thread at full speed.
Every rank is taken to run the same timeline at the same time, save the meetings' measured
mean waits (predict.py adds the wait for the slowest rank; docs/plan.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Job:
    """A communication on this rank: first its meeting, seconds waiting for the peers with no
    CPU (`meet_s` while the main thread waits, `meet_busy_s` while it computes; None: the same),
    then CPU seconds at a full core, lasting at least `wire_s` from the meeting's end."""

    name: str
    cpu_s: float = 0.0
    wire_s: float = 0.0
    meet_s: float = 0.0
    meet_busy_s: float | None = None

    def meeting_rate(self, main_busy: bool) -> float:
        """The share of its meeting done per second."""
        busy = self.meet_s if self.meet_busy_s is None else self.meet_busy_s
        seconds = busy if main_busy else self.meet_s
        return 1.0 / seconds if seconds > _EPS else float("inf")


@dataclass(frozen=True)
class Compute:
    seconds: float


@dataclass(frozen=True)
class Launch:
    queue: str
    job: Job


@dataclass(frozen=True)
class Wait:
    name: str


@dataclass(frozen=True)
class Alloc:
    nbytes: int


@dataclass(frozen=True)
class Free:
    nbytes: int


Op = Compute | Launch | Wait | Alloc | Free


@dataclass
class Result:
    """When the main thread finished, each job's start and end, and the memory peak."""

    end_s: float
    jobs: dict[str, tuple[float, float]] = field(default_factory=dict)
    peak_bytes: int = 0
    waited_s: float = 0.0  # seconds the main thread spent blocked in Wait


_EPS = 1e-12


@dataclass
class _Running:
    job: Job
    start: float
    cpu_left: float
    meeting_left: float = 1.0  # the share of its meeting still to go
    met: float = 0.0  # when the meeting ended: its wire time counts from there

    def computing(self) -> bool:
        return self.cpu_left > _EPS and self.meeting_left <= _EPS


def simulate(
    ops: list[Op],
    cores: float | None,
    peers: int = 1,
    background: float = 0.0,
    start_bytes: int = 0,
) -> Result:
    """Run the main thread's ops against its queues' threads (see the module docstring);
    `peers` ranks run the same timeline on the same `cores`, beside `background` busy threads
    of other processes."""
    queues: dict[str, list[Job]] = {}
    running: dict[str, _Running] = {}
    done: dict[str, tuple[float, float]] = {}
    now, waited, live, peak = 0.0, 0.0, start_bytes, start_bytes
    pc, compute_left = 0, None

    def start_next(queue: str) -> None:
        if queue not in running and queues.get(queue):
            job = queues[queue].pop(0)
            running[queue] = _Running(job, now, job.cpu_s)

    while True:
        # Advance the main thread through ops that take no time.
        while pc < len(ops) and compute_left is None:
            op = ops[pc]
            if isinstance(op, Compute):
                if op.seconds > _EPS:
                    compute_left = op.seconds
                    break
            if isinstance(op, Launch):
                queues.setdefault(op.queue, []).append(op.job)
                start_next(op.queue)
            elif isinstance(op, Wait):
                if op.name not in done:
                    break
            elif isinstance(op, Alloc):
                live += op.nbytes
                peak = max(peak, live)
            elif isinstance(op, Free):
                live -= op.nbytes
            pc += 1
        if pc >= len(ops) and not running:
            break
        main_busy = compute_left is not None
        blocked = not main_busy and pc < len(ops)
        if not running and blocked:
            raise ValueError(f"Wait for {ops[pc].name!r}: no such job was launched")
        meeting = {}
        for q, r in running.items():
            pace = r.job.meeting_rate(main_busy) if r.meeting_left > 0 else 0.0
            if pace == float("inf"):
                r.meeting_left, r.met = 0.0, now
            elif pace:
                meeting[q] = pace
        busy = [q for q, r in running.items() if r.computing()]
        active = len(busy) + (1 if main_busy else 0)
        demand = peers * active + background
        rate = 1.0 if cores is None or active == 0 else min(1.0, cores / demand)
        # The next event: the main thread's compute ends, or a job's CPU or wire time ends.
        steps = []
        if main_busy:
            steps.append(compute_left / rate)
        for q, r in running.items():
            if q in meeting:
                steps.append(r.meeting_left / meeting[q])
            elif r.cpu_left > _EPS:
                steps.append(r.cpu_left / rate)
            else:
                steps.append(max(0.0, r.met + r.job.wire_s - now))
        dt = min(steps) if steps else 0.0
        now += dt
        if blocked:
            waited += dt
        if main_busy:
            compute_left -= dt * rate
            if compute_left <= _EPS:
                compute_left = None
                pc += 1
        for queue in list(running):
            r = running[queue]
            if queue in meeting:
                r.meeting_left -= dt * meeting[queue]
                if r.meeting_left <= _EPS:
                    r.meeting_left, r.met = 0.0, now
                continue
            if queue in busy:
                r.cpu_left -= dt * rate
            if r.cpu_left <= _EPS and now >= r.met + r.job.wire_s - _EPS:
                done[r.job.name] = (r.start, now)
                del running[queue]
                start_next(queue)
    return Result(now, done, peak, waited)

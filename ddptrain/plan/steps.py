"""A profiled step as the operations of one rank at a world size: what timeline.py simulates.

    ops = ddp_ops(profile, link, world_size=4)            # ddp, zero1, powersgd
    ops = sharded_ops(profile, link, world_size=4, reshard=True)   # zero3 (False: zero2)
    ops = plain_memory_ops(profile)                       # the plain step's tensors (world of 1)

DDP strategies: the profiled forward; backward up to each bucket's ready time (the latest of
its parameters', in launch order), the bucket's reduction launched on the communication thread
there; after the last, the rest of backward once every bucket is reduced; the optimizer step
(ZeRO-1: on 1/n of the parameters, then its broadcasts, one after another, as
optim/broadcast.py plans them). A bucket's reduction is the link's "reduce" of its bytes, or
for PowerSGD the hook's own measured seconds plus its two messages, which it sends after it
computes: the bucket lasts at least the hook's CPU and then the messages' time.

Sharded strategies, from the plain model's profile: each unit's gather ("all_gather" of its
padded bytes, on the gather group's thread) is waited for when its forward starts, the next
unit's started then (prefetch); with ZeRO-3 a unit is freed after its forward and gathered
again before its backward (two ahead). A unit's backward ends when its last gradient is ready;
then its gradients are packed (a pass into a fresh send buffer) and reduce-scattered on the
reduce group's thread, one in flight at a time. Of each gather and reduce-scatter, the part
gloo does on the calling thread (copies into and out of its own buffers, measured apart:
calibrate.py) is the main thread's, when it starts the collective and when it waits for it.
The optimizer steps 1/n of the parameters. The wrapper's own work (hooks, views, its host
launches on CUDA): its step measured at world size 1 (profile.py's `wrapper_step_s`) less what
these operations give its main thread there, in equal parts as each unit's forward starts.
Allocations and frees of tensors ride along for the memory peak.
"""

from __future__ import annotations

import torch

from ddptrain.optim.broadcast import plan_broadcasts
from ddptrain.optim.partition import shard_ranges
from ddptrain.plan.links import Link, LocalLink, ShapedLink
from ddptrain.plan.memory import powersgd_messages, unit_bytes
from ddptrain.plan.profile import Profile
from ddptrain.plan.timeline import Alloc, Compute, Free, Job, Launch, Op, Wait


def bucket_bytes(profile: Profile) -> list[int]:
    """Gradient bytes of each bucket, in launch order."""
    return [
        sum(profile.param_numels[i] for i in b) * profile.element_bytes for b in profile.buckets
    ]


def _job(name: str, link: Link, op: str, nbytes: int, world_size: int) -> Job:
    cost = link.cost(op, nbytes, world_size)
    return Job(name, cost.cpu_s, cost.wire_s, cost.meet_s, cost.meet_busy_s)


def ddp_ops(
    profile: Profile, link: Link, world_size: int, strategy: str, powersgd_rank: int = 4
) -> list[Op]:
    """The main thread's operations of a DDP, ZeRO-1 or PowerSGD step (module docstring)."""
    ops: list[Op] = [Compute(profile.forward_s)]
    ready, launch_at = [], 0.0
    for t in profile.bucket_ready_s:
        launch_at = max(launch_at, t)
        ready.append(launch_at)
    jobs = []
    for b, members in enumerate(profile.buckets):
        if strategy == "powersgd":
            shapes = [profile.param_shapes[i] for i in members]
            p_bytes, q_bytes = powersgd_messages(shapes, powersgd_rank, profile.element_bytes)
            p, q = (
                link.cost("reduce", p_bytes, world_size),
                link.cost("reduce", q_bytes, world_size),
            )
            hook = profile.hook_s[b] if b < len(profile.hook_s) else 0.0
            # The hook computes before it sends P, and P's sum before Q: the bucket lasts at
            # least the hook's CPU and then the two messages' time, whatever the CPU is shared.
            cpu, wire = hook + p.cpu_s + q.cpu_s, hook + p.wire_s + q.wire_s
            meet, busy = p.meet_s + q.meet_s, p.meet_busy_s + q.meet_busy_s
            jobs.append(Job(f"bucket {b}", cpu, wire, meet, busy))
        else:
            nbytes = sum(profile.param_numels[i] for i in members) * profile.element_bytes
            jobs.append(_job(f"bucket {b}", link, "reduce", nbytes, world_size))
    at = 0.0
    for job, t in zip(jobs, ready, strict=True):
        ops += [Compute(t - at), Launch("comm", job)]
        at = t
    if jobs:
        ops.append(Wait(jobs[-1].name))
    # The hook that ran on this thread at world size 1 is the last bucket's job now.
    rest = profile.backward_s - at - profile.hook_in_backward_s(strategy)
    ops.append(Compute(max(0.0, rest)))
    if strategy != "zero1":
        return [*ops, Compute(profile.optimizer_s)]
    ops.append(Compute(profile.optimizer_s / world_size))
    for k, nbytes in enumerate(zero1_broadcast_bytes(profile.param_numels, world_size)):
        job = _job(f"broadcast {k}", link, "broadcast", nbytes * profile.element_bytes, world_size)
        ops += [Launch("broadcast", job), Wait(job.name)]
    return ops


def zero1_broadcast_bytes(numels: list[int], world_size: int) -> list[int]:
    """Elements of each broadcast ZeroRedundancyOptimizer's step makes, in order."""
    if world_size == 1:
        return []
    by_owner = [
        [torch.empty(b - a, device="meta") for _, a, b in pieces]
        for pieces in shard_ranges(numels, world_size)
    ]
    return [sum(t.numel() for t in tensors) for _, tensors in plan_broadcasts(by_owner)]


def _unit_order(profile: Profile) -> tuple[list[int], list[float]]:
    """Units in the order their forwards start, and when each unit's backward ends (the root's:
    at the end of backward)."""
    order = sorted(range(len(profile.units)), key=lambda k: profile.unit_forward_s[k][0])
    ends = [
        max((profile.ready_s[i] for i in members), default=0.0) if k else profile.backward_s
        for k, members in enumerate(profile.units)
    ]
    return order, ends


def sharded_ops(
    profile: Profile, link: Link, world_size: int, reshard: bool, *, tensors_only: bool = False
) -> list[Op]:
    """The main thread's operations of a ZeRO-3 (reshard) or ZeRO-2 step (module docstring);
    `tensors_only`: every gather and reduction free, for the memory timeline alone."""
    builder = _Sharded(profile, link, world_size, reshard, tensors_only)
    if not tensors_only and profile.units:
        builder.own_s = own_work_s(profile, link, reshard) / len(profile.units)
    return builder.ops()


class _Sharded:
    """Builds a sharded step's operations unit by unit (see sharded_ops)."""

    def __init__(
        self, profile: Profile, link: Link, world_size: int, reshard: bool, tensors_only: bool
    ) -> None:
        self.p, self.link, self.n, self.reshard = profile, link, world_size, reshard
        self.tensors_only = tensors_only
        eb = profile.element_bytes
        self.sizes = [unit_bytes([profile.param_numels[i] for i in m], world_size, eb)
                      for m in profile.units]  # fmt: skip
        local = link if isinstance(link, LocalLink) else getattr(link, "local", None)
        self.fresh_s_per_byte = local.fresh_pass_s_per_byte if local is not None else 0.0
        # gloo stages a whole gather's output, and a reduce-scatter's input, in buffers of its
        # own (measured: +1 unit each); NCCL works in place.
        self.staged = local is not None
        self.out: list[Op] = []
        self.gathers: dict[int, int] = {}  # unit -> gathers started
        self.gathered: set[int] = set()
        self.own_s = 0.0  # the wrapper's own work as each unit's forward starts
        self.finishing: dict[str, float] = {}  # job -> the main thread's seconds finishing it

    def _job(self, name: str, op: str, nbytes: int) -> tuple[Job, float, float]:
        """The collective's job on its queue's thread, and the seconds the main thread spends
        starting it and finishing it (gloo's copies on the calling thread)."""
        if self.tensors_only:
            return Job(name), 0.0, 0.0
        c = self.link.cost(op, nbytes, self.n)
        rest = max(0.0, c.cpu_s - c.issue_s - c.finish_s)
        return Job(name, rest, c.wire_s, c.meet_s, c.meet_busy_s), c.issue_s, c.finish_s

    def start_gather(self, k: int) -> None:
        self.gathers[k] = self.gathers.get(k, 0) + 1
        full = self.sizes[k][0]
        name = f"gather {k}.{self.gathers[k]}"
        job, issue, finish = self._job(name, "all_gather", full)
        self.finishing[name] = finish
        self.out += [Alloc(full * (2 if self.staged else 1)), Compute(issue)]
        self.out.append(Launch("gather", job))

    def wait_gather(self, k: int) -> None:
        name = f"gather {k}.{self.gathers[k]}"
        self.out += [Wait(name), Compute(self.finishing.pop(name))]
        if self.staged:
            self.out.append(Free(self.sizes[k][0]))
        self.gathered.add(k)

    def free_unit(self, k: int) -> None:
        if k in self.gathered:
            self.out.append(Free(self.sizes[k][0]))
            self.gathered.discard(k)

    def activations(self, k: int) -> int:
        return self.p.unit_activation_bytes[k] if self.p.unit_activation_bytes else 0

    def ops(self) -> list[Op]:
        p, out = self.p, self.out
        order, ends = _unit_order(p)
        # Forward: unit spans as they nest, in time order; each gather waited for where its
        # forward starts, the next unit's started there.
        events = sorted([(p.unit_forward_s[k][0], 0, k) for k in order]
                        + [(p.unit_forward_s[k][1], 1, k) for k in order])  # fmt: skip
        following = dict(zip(order, order[1:], strict=False))
        at = 0.0
        for t, leaving, k in events:
            out.append(Compute(max(0.0, t - at)))
            at = max(at, t)
            if not leaving:
                out.append(Compute(self.own_s))
                if k not in self.gathers:
                    self.start_gather(k)
                self.wait_gather(k)
                if k in following and following[k] not in self.gathers:
                    self.start_gather(following[k])
            else:
                out.append(Alloc(self.activations(k)))
                if self.reshard and k != 0:
                    self.free_unit(k)
        out.append(Compute(max(0.0, p.forward_s - at)))
        # Backward: units in the order their backward ends, the root's last; ZeRO-3 gathers
        # each again before its backward, two ahead.
        backward = sorted((k for k in order if k != 0), key=lambda k: ends[k]) + [0]
        regather = [k for k in backward if k not in self.gathered]
        issued, at, in_flight = 0, 0.0, None
        for position, k in enumerate(backward):
            start = ends[backward[position - 1]] if position else 0.0
            out.append(Compute(max(0.0, start - at)))
            at = max(at, start)
            if k in regather:
                target = min(regather.index(k) + 2, len(regather))
                while issued < target:
                    self.start_gather(regather[issued])
                    issued += 1
                self.wait_gather(k)
            whole, shard = self.sizes[k]
            out += [Alloc(whole), Compute(max(0.0, ends[k] - at))]  # autograd's whole gradients
            at = max(at, ends[k])
            self.free_unit(k)
            if in_flight is not None:
                out += self.finish(in_flight)
            # Packing: a pass into a fresh send buffer, then the whole gradients go.
            pack = 0.0 if self.tensors_only else self.fresh_s_per_byte * whole
            out += [Alloc(whole), Compute(pack), Free(whole), Alloc(shard)]
            out.append(Free(self.activations(k)))
            if self.staged:
                out.append(Alloc(whole))
            job, issue, self.finishing[job.name] = self._job(f"reduce {k}", "reduce_scatter", whole)
            out += [Compute(issue), Launch("reduce", job)]
            in_flight = k
        out += self.finish(in_flight)
        out.append(Compute(p.optimizer_s / self.n))
        return out

    def finish(self, k: int) -> list[Op]:
        """Wait for unit k's reduce-scatter; its send (and staging) buffer goes."""
        whole = self.sizes[k][0]
        finish = self.finishing.pop(f"reduce {k}")
        return [Wait(f"reduce {k}"), Compute(finish), Free(whole * (2 if self.staged else 1))]


def own_work_s(profile: Profile, link: Link, reshard: bool) -> float:
    """The sharded wrapper's own work a step, on its main thread: its step measured at world
    size 1 (profile.py's `wrapper_step_s`) beyond what the main thread is modelled to do there
    (compute, and on CPU gloo's copies on the calling thread and the packing passes), at
    least 0; 0 when not measured."""
    if not profile.wrapper_step_s:
        return 0.0
    # A world of one is on this machine: across hosts, the local link's figures.
    one = link.local if isinstance(link, ShapedLink) else link
    ops = _Sharded(profile, one, 1, reshard, tensors_only=False).ops()
    modelled = sum(op.seconds for op in ops if isinstance(op, Compute))
    return max(0.0, profile.wrapper_step_s - modelled)


def sharded_start_bytes(profile: Profile, world_size: int, state_bytes: int) -> int:
    """Bytes held between sharded steps: every unit's shard and the optimizer state's share."""
    eb = profile.element_bytes
    shards = sum(
        unit_bytes([profile.param_numels[i] for i in m], world_size, eb)[1] for m in profile.units
    )
    return shards + state_bytes // world_size


def plain_memory_ops(profile: Profile) -> list[Op]:
    """The plain step's tensors at world size 1: activations as each unit's forward ends,
    each parameter's gradient when it is ready, activations freed as units' backward ends."""
    eb = profile.element_bytes
    ops: list[Op] = []
    acts = profile.unit_activation_bytes or [profile.activation_bytes]
    ops += [Alloc(a) for a in acts]
    order, ends = _unit_order(profile)
    grads = sorted(range(len(profile.param_numels)), key=lambda i: profile.ready_s[i])
    freed = sorted(range(len(acts)), key=lambda k: ends[k] if profile.units else 0.0)
    for i in grads:
        ops.append(Alloc(profile.param_numels[i] * eb))
        for k in list(freed):
            if not profile.units or ends[k] <= profile.ready_s[i]:
                ops.append(Free(acts[k]))
                freed.remove(k)
    ops += [Free(acts[k]) for k in freed]
    return ops

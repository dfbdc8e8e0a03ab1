"""Shared-memory all-reduce for ranks on one host: the wrapper's default on CPU under gloo.

    shm = SharedMemory()                          # collective: every rank, same order
    bucket = shm.allocate(numel, torch.float32, torch.device("cpu"))   # a row of a shared file
    bucket.copy_(values)
    shm.reduce(GradBucket(0, bucket, [], [], True))   # bucket now holds the SUM over ranks
    shm.broadcast(tensors, 0)                     # rank 0's tensors everywhere (buffers)
    shm.close()                                   # ddptrain.shutdown() does it

Gloo sends every byte through loopback TCP, copied into and out of the kernel on both sides,
which costs milliseconds even for a small bucket inside a training step. Instead, the wrapper's
buckets are rows of one shared file per bucket: rank r sums chunk r of every row (its own row
first, then the others by rank: at world size 2 bitwise the backend's a + b) and writes the
sum into every row. Ranks meet at two barriers per bucket (rows full; chunks summed), counters
in shared memory that a waiting rank polls, then sleeps on (barrier.py); after the second
barrier no rank touches another's row, so the next backward may overwrite its own. The
deterministic mode's large buckets take `reduce_finished`: rank r turns its summed chunk into
means and, after a third barrier, writes those into every row. The wrapper runs reductions
one at a time in bucket order, on its communication thread while backward goes on, and a
backward's last bucket on the thread that waits for it.
"""

from __future__ import annotations

import os
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.cpu.barrier import COUNTER_STRIDE, SharedBarrier, announce
from ddptrain.ddp import hooks
from ddptrain.ddp.hooks import (
    GradBucket,
    Transport,
    close_at_shutdown,
    global_rank,
    new_group_like,
    release_group,
)

SHM_DIR = "/dev/shm"
# Room left free in SHM_DIR: a full tmpfs kills a process with SIGBUS, not an exception.
SHM_HEADROOM_BYTES = 256 * 1024 * 1024
# Buckets smaller than this stay private and use the backend's all_reduce (0: share all).
SHM_MIN_BYTES = 0


class SharedMemory(Transport):
    """Buckets allocated as rows of shared files, summed chunk by chunk in place.

    A bucket not allocated here (small, or when the tmpfs is short of room) falls back to the
    backend's all_reduce on a group of the transport's own. CPU buckets only.
    """

    def __init__(
        self,
        process_group: Any = None,
        min_bytes: int = SHM_MIN_BYTES,
        timeout_s: float | None = None,
    ) -> None:
        self.min_bytes = min_bytes
        # Its own gloo group: allocation collectives never interleave with the wrapper's.
        self.group = new_group_like(process_group, backend="gloo")
        close_at_shutdown(self.close)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        box = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=global_rank(self.group, 0), group=self.group)
        self._prefix = os.path.join(SHM_DIR, f"ddptrain-{box[0]}")
        self._allocations = 0
        # Per shared bucket (by its row's address), while that row lives: the rows to sum.
        self._shared: dict[int, _SharedRows] = {}
        self._barrier: SharedBarrier | None = None
        # broadcast(): per tensor layout, a shared file of two byte slots and the calls so far.
        self._staging: dict[tuple, torch.Tensor | None] = {}
        self._broadcasts = 0
        self._plan: _BroadcastPlan | None = None
        if self.world_size > 1:
            size = self.world_size * COUNTER_STRIDE
            counters = self._map(size, torch.int64)
            if counters is not None:
                announce(counters, self.rank)
                dist.barrier(group=self.group)
                wait_s = hooks.timeout_s() if timeout_s is None else timeout_s
                self._barrier = SharedBarrier(counters, self.rank, self.world_size, wait_s)

    @staticmethod
    def available(process_group: Any = None) -> bool:
        """Collective: True on every rank iff all ranks see the same SHM_DIR (one host)."""
        world_size = dist.get_world_size(process_group)
        token = uuid.uuid4().hex if world_size > 1 and os.path.isdir(SHM_DIR) else None
        box = [token]
        dist.broadcast_object_list(box, src=global_rank(process_group, 0), group=process_group)
        probe = os.path.join(SHM_DIR, f"ddptrain-probe-{box[0]}")
        rank = dist.get_rank(process_group)
        if box[0] is not None and rank == 0:
            with open(probe, "w") as f:
                f.write(box[0])
        dist.barrier(group=process_group)
        seen = box[0] is not None and _read(probe) == box[0]
        everyone = torch.tensor([int(seen)])
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=process_group)
        if rank == 0 and box[0] is not None:
            os.unlink(probe)
        return bool(everyone.item())

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Collective: a zeroed bucket of `numel` elements, this rank's row of a shared file."""
        if device.type != "cpu":
            raise ValueError(
                f"the shared-memory transport reduces CPU buckets, not {device}; use "
                "comm_hook=ddptrain.named_hook('allreduce') (the backend's all_reduce) for this "
                "model"
            )
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if self._barrier is None or nbytes < max(1, self.min_bytes):
            return torch.zeros(numel, dtype=dtype)
        flat = self._map(self.world_size * numel, dtype)
        if flat is None:
            return torch.zeros(numel, dtype=dtype)
        row = flat[self.rank * numel : (self.rank + 1) * numel]
        self._shared[row.data_ptr()] = _SharedRows(flat, self.rank, self.world_size)
        # Forgotten with the row: the file is unmapped once no bucket uses it.
        weakref.finalize(row, self._shared.pop, row.data_ptr(), None)
        return row

    def _map(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Collective: map a new zeroed shared file of `numel` elements on every rank."""
        path = f"{self._prefix}-{self._allocations}"
        self._allocations += 1
        room = torch.tensor([0])
        if self.rank == 0:
            stat = os.statvfs(SHM_DIR)
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            if stat.f_bavail * stat.f_frsize >= nbytes + SHM_HEADROOM_BYTES:
                room[0] = 1
                torch.from_file(path, shared=True, size=numel, dtype=dtype)
        dist.broadcast(room, src=global_rank(self.group, 0), group=self.group)
        if not room.item():
            return None
        flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        dist.barrier(group=self.group)
        if self.rank == 0:
            os.unlink(path)  # the mappings stay valid; nothing is left behind in the tmpfs
        return flat

    def reduce(self, bucket: GradBucket) -> None:
        """Sum the bucket over ranks in place: through shared memory when it was allocated
        here, else with the backend's all_reduce."""
        self._check_open()
        if self.world_size == 1:
            return
        rows = self._rows_of(bucket)
        if rows is None:
            dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=self.group)
            return
        # The last bucket is reduced by the thread that waits for it: poll, do not sleep.
        spin = bucket.is_last()
        self._barrier.wait(spin)
        if rows.sum_mine():
            for other in rows.others:
                other.copy_(rows.mine)
        self._barrier.wait(spin)

    def _rows_of(self, bucket: GradBucket) -> _SharedRows | None:
        """The shared rows of a bucket allocated here, else None (a private bucket)."""
        flat = bucket.buffer()
        rows = self._shared.get(flat.data_ptr())
        return rows if rows is not None and rows.numel == flat.numel() else None

    def reduce_finished(self, bucket: GradBucket, finish: hooks.Finish, value: int) -> bool:
        """Sum a shared bucket and finish it chunk by chunk: rank r finishes the chunk it
        summed, then, once every rank has read its sum (the ranges written may lie in other
        chunks), writes the result into every row. Three barriers, and each chunk finished
        once, instead of two and every rank finishing the whole bucket."""
        self._check_open()
        rows = self._rows_of(bucket)
        if self.world_size == 1 or rows is None:
            return False
        spin = bucket.is_last()
        self._barrier.wait(spin, value)
        total = self._barrier.total()
        writes: list[tuple[int, torch.Tensor]] = []
        if rows.sum_mine():
            writes = finish(rows.start, rows.mine, total)
        self._barrier.wait(spin)
        if writes:
            places = [row[o : o + data.numel()] for row in rows.as_bytes for o, data in writes]
            torch._foreach_copy_(places, [data for _ in rows.as_bytes for _, data in writes])
        self._barrier.wait(spin)
        return True

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> bool:
        """Collective: copy rank `src`'s `tensors` into every rank's, through shared memory.

        False, having done nothing, where it cannot (no shared memory, a tensor not a
        contiguous CPU one, no room in the tmpfs): the caller then uses the backend. One
        barrier per call: the file has two slots, used alternately, and a rank reads the slot
        of call k before it reaches any barrier of call k + 1, so `src` can only overwrite it
        (at call k + 2) once every rank has read it.
        """
        self._check_open()
        if self._barrier is None or not tensors:
            return False
        plan = self._plan
        if plan is None or not plan.serves(tensors):
            plan = self._plan = self._plan_broadcast(tensors)
        if plan is None:
            return False
        parity = self._broadcasts % 2
        self._broadcasts += 1
        # One op each way, not one per tensor: a model has a few buffers per norm layer.
        if self.rank == src:
            torch.cat(plan.as_bytes, out=plan.slots[parity])
        self._barrier.wait(spin=True)
        if self.rank != src:
            torch._foreach_copy_(plan.as_bytes, plan.parts[parity])
        return True

    def _plan_broadcast(self, tensors: list[torch.Tensor]) -> _BroadcastPlan | None:
        if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            return None
        key = tuple((t.dtype, t.numel()) for t in tensors)
        if key not in self._staging:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self._staging[key] = self._map(2 * nbytes, torch.uint8)
        staging = self._staging[key]
        return None if staging is None else _BroadcastPlan(tensors, staging)

    def _check_open(self) -> None:
        if self.group is None:
            raise RuntimeError(
                "this shared-memory transport was closed (ddptrain.shutdown() closes it); build "
                "the model's wrapper again after init_distributed()"
            )

    def close(self) -> None:
        """Destroy the transport's group and forget its memory; ddptrain.shutdown() calls it.
        It reduces nothing afterwards."""
        self._barrier = None
        self._plan = None
        release_group(self.group)
        self.group = None


class _SharedRows:
    """A shared bucket's file as one row per rank, and the slices of chunk `rank` that this
    rank sums: its own row's first, then the others' by rank (at world size 2 bitwise the
    backend's a + b). Sliced once per bucket: slicing each step costs more dispatch than
    summing a small bucket."""

    def __init__(self, flat: torch.Tensor, rank: int, world_size: int) -> None:
        self.numel = numel = flat.numel() // world_size
        rows = flat.view(world_size, numel)
        lo, hi = numel * rank // world_size, numel * (rank + 1) // world_size
        self.start = lo
        # None: a bucket smaller than the world leaves some ranks no chunk to sum.
        self.mine = rows[rank, lo:hi] if hi > lo else None
        self.others = [rows[k, lo:hi] for k in range(world_size) if k != rank]
        self.as_bytes = list(rows.view(torch.uint8))

    def sum_mine(self) -> bool:
        """Add the others' chunks into this rank's; False where this rank has no chunk."""
        if self.mine is None:
            return False
        for other in self.others:
            self.mine.add_(other)
        return True


class _BroadcastPlan:
    """A list of tensors as bytes and the two staging slots split to match, made once and
    reused while the same tensors come back: a wrapper's buffers, every step. Making the views
    costs ~0.1 ms of dispatch a call on a slow CPU, more than copying a model's buffers."""

    def __init__(self, tensors: list[torch.Tensor], staging: torch.Tensor) -> None:
        self.tensors = list(tensors)
        # A tensor given new memory (`.data = ...`, a resize) must not be served stale views.
        self.places = [(t.data_ptr(), t.numel()) for t in tensors]
        self.as_bytes = [t.view(-1).view(torch.uint8) for t in tensors]
        self.slots = list(staging.view(2, -1))
        sizes = [b.numel() for b in self.as_bytes]
        self.parts = [slot.split(sizes) for slot in self.slots]

    def serves(self, tensors: list[torch.Tensor]) -> bool:
        """Whether `tensors` are this plan's, in the same memory."""
        return len(tensors) == len(self.tensors) and all(
            t is mine and (t.data_ptr(), t.numel()) == place
            for t, mine, place in zip(tensors, self.tensors, self.places, strict=True)
        )


def shared_memory_usable(process_group: Any = None) -> bool:
    """Collective: whether SharedMemory can serve this group (gloo, one host)."""
    # The transport builds a group of its own, which every rank of the default group must join.
    whole_world = process_group is None or (
        dist.get_world_size(process_group) == dist.get_world_size()
    )
    gloo = dist.get_backend(process_group) == "gloo"
    return gloo and whole_world and SharedMemory.available(process_group)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None

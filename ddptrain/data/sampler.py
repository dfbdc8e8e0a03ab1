"""Resumable distributed samplers and evaluation shards.

    train_set = ddptrain.data.mnist("data", train=True)            # offline, whole split in memory
    sampler = ShardedSampler(len(train_set), global_batch_size=256, seed=0)
    loader = DataLoader(train_set, batch_size=sampler.per_rank_batch_size, sampler=sampler)
    if resuming:
        sampler.load_state_dict(checkpoint["sampler"])              # any world size, same 256
    for epoch in range(sampler.epoch, num_epochs):
        sampler.set_epoch(epoch)             # the resumed epoch keeps its position
        for x, y in loader:
            ...                              # forward, backward, optimizer step
            sampler.mark_consumed()          # after the step: this global batch is trained on
            checkpoint["sampler"] = sampler.state_dict()

    test_set = ddptrain.data.mnist("data", train=False)
    loader = DataLoader(test_set, batch_size=500, sampler=EvalSampler(len(test_set)))
    # sum (correct, count) locally, then all_reduce_sum once: every sample counted once

Global batch k is the same set of samples at every world size; rank r takes its every
`world_size`-th element, so one rank's stream is `order[r::world_size]`, as in
`torch.utils.data.DistributedSampler`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


def global_order(
    dataset_len: int,
    global_batch_size: int,
    *,
    epoch: int,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """The epoch's sample order, wrap-padded (or cut) to a whole number of global batches."""
    if dataset_len < 1 or global_batch_size < 1:
        raise ValueError(
            f"dataset_len ({dataset_len}) and global_batch_size ({global_batch_size}) must be >= 1"
        )
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=g).tolist()
    else:
        order = list(range(dataset_len))
    if drop_last:
        return order[: dataset_len - dataset_len % global_batch_size]
    padding = -dataset_len % global_batch_size
    # Wrap-around padding, as DistributedSampler pads, even when padding exceeds the dataset.
    return order + (order * math.ceil(padding / dataset_len))[:padding]


def eval_shard(dataset_len: int, rank: int, world_size: int) -> range:
    """Rank's contiguous slice of range(dataset_len); slices are disjoint and cover it all."""
    _check_rank(rank, world_size)
    base, extra = divmod(dataset_len, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size} (0 to {world_size - 1})")


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    _check_rank(rank, world_size)
    return rank, world_size


_STATE_KEYS = ("dataset_len", "global_batch_size", "seed", "shuffle", "drop_last")


class ShardedSampler(Sampler[int]):
    """Per-rank sample indices whose k-th batches form the same global batch at any world size.

    - The epoch's order is `global_order(...)`: a permutation seeded by `seed + epoch`, padded
      by wrapping around (or cut with `drop_last`) to whole global batches.
    - Global batch k is `order[k * G:(k + 1) * G]`; rank r takes `[r::world_size]` of it.
    - The position is counted in global samples and only moves on `mark_consumed()`: a
      DataLoader's prefetching runs ahead of training, so the trainer says what it trained on.
    - `state_dict()` can be loaded at another world size; `global_batch_size`, `seed`,
      `shuffle`, `drop_last` and `dataset_len` must match, since they define the order.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {dataset_len}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if global_batch_size % self.world_size:
            w = self.world_size
            below, above = global_batch_size // w * w, (global_batch_size // w + 1) * w
            choices = f"{below} or {above}" if below else f"{above}"
            raise ValueError(
                f"global_batch_size {global_batch_size} is not divisible by world_size {w}; "
                f"use a multiple of {w}, such as {choices}"
            )
        if drop_last and dataset_len < global_batch_size:
            raise ValueError(
                f"drop_last=True with dataset_len {dataset_len} < global_batch_size "
                f"{global_batch_size} leaves no batch; use drop_last=False or a smaller batch"
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._consumed_samples = 0
        # Global samples one batch (num_batches, mark_consumed) covers over every rank.
        self.batch_samples = global_batch_size

    @property
    def per_rank_batch_size(self) -> int:
        """Samples per batch on this rank: global_batch_size // world_size."""
        return self.global_batch_size // self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """Batches in a whole epoch (the same on every rank)."""
        steps = self.dataset_len // self.global_batch_size
        if not self.drop_last:
            steps = math.ceil(self.dataset_len / self.global_batch_size)
        return steps * self.global_batch_size // self.batch_samples

    @property
    def consumed_samples(self) -> int:
        """Global samples (padding included) marked consumed in the current epoch."""
        return self._consumed_samples

    @property
    def num_batches(self) -> int:
        """Batches left in the current epoch from the current position."""
        return self.batches_per_epoch - self._consumed_samples // self.batch_samples

    def __len__(self) -> int:
        return self.num_batches * self.per_rank_batch_size

    def _order(self) -> list[int]:
        return global_order(
            self.dataset_len,
            self.global_batch_size,
            epoch=self.epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        # Built eagerly: the position is read when iteration starts, not at the first next().
        return iter(self._order()[self._consumed_samples + self.rank :: self.world_size])

    def set_epoch(self, epoch: int) -> None:
        """Use epoch's order; a new epoch starts at its beginning, the current one stays put."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._consumed_samples = 0

    def mark_consumed(self, num_batches: int = 1) -> None:
        """Record that the next `num_batches` batches (every rank's) were trained on."""
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        if num_batches > self.num_batches:
            raise RuntimeError(
                f"mark_consumed({num_batches}) but epoch {self.epoch} has only "
                f"{self.num_batches} batch(es) left; call set_epoch({self.epoch + 1}) "
                "before the next epoch and mark_consumed() once per batch"
            )
        self._consumed_samples += num_batches * self.batch_samples

    _state_keys = _STATE_KEYS

    def state_dict(self) -> dict[str, Any]:
        """Epoch and global samples consumed, plus the settings that define the order."""
        state = {key: getattr(self, key) for key in self._state_keys}
        state.update(
            epoch=self.epoch,
            consumed_samples=self._consumed_samples,
            world_size=self.world_size,  # informational: resuming at another size is fine
        )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at `state`'s epoch and position; the world size may differ."""
        name = type(self).__name__
        missing = [k for k in (*self._state_keys, "epoch", "consumed_samples") if k not in state]
        if missing:
            raise KeyError(f"sampler state is missing {missing}; was it made by {name}?")
        for key in self._state_keys:
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"checkpointed sampler has {key}={state[key]!r} but this one has "
                    f"{key}={getattr(self, key)!r}; construct {name} with "
                    f"{key}={state[key]!r} to resume (it defines the sample order)"
                )
        consumed = int(state["consumed_samples"])
        full = self.batches_per_epoch * self.batch_samples
        if consumed % self.global_batch_size or not 0 <= consumed <= full:
            raise ValueError(
                f"consumed_samples {consumed} is not a whole number of global batches of "
                f"{self.global_batch_size} within the epoch's {full} samples"
            )
        self.epoch = int(state["epoch"])
        self._consumed_samples = consumed


class MicroBatchSampler(ShardedSampler):
    """Per-rank indices of micro-batches that are the same samples at any world size: the
    deterministic mode's sampler (TrainerConfig(deterministic=True, micro_batch_size=N)).

    - The epoch's order is ShardedSampler's: `global_order(...)` padded (or cut) to whole
      global batches of `global_batch_size` G, whatever the world size.
    - Micro-batch k of global batch s is `order[s * G + k * N:][:N]`; rank r takes k = r,
      r + world_size, ...: its j-th micro-batch of a step is k = j * world_size + r.
    - A "batch" here (num_batches, mark_consumed) is one round of world_size micro-batches,
      one per rank; a step is G / (N * world_size) rounds. The position is counted in global
      samples, so `state_dict()` loads at any world size that divides G / N.
    """

    _state_keys = (*_STATE_KEYS, "micro_batch_size")

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        _, ranks = _rank_and_world(rank, world_size)
        micro_batches = global_batch_size // micro_batch_size
        if micro_batch_size < 1 or global_batch_size % micro_batch_size or micro_batches % ranks:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not micro-batches of "
                f"{micro_batch_size} that {ranks} ranks can share evenly"
            )
        super().__init__(
            dataset_len,
            global_batch_size=global_batch_size,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.micro_batch_size = micro_batch_size
        self.batch_samples = micro_batch_size * self.world_size

    @property
    def per_rank_batch_size(self) -> int:
        """Samples per micro-batch on this rank."""
        return self.micro_batch_size

    def __iter__(self) -> Iterator[int]:
        order, n = self._order(), self.micro_batch_size
        start = self._consumed_samples + self.rank * n
        mine = [order[a : a + n] for a in range(start, len(order), self.batch_samples)]
        return iter([i for micro_batch in mine for i in micro_batch])


class EvalSampler(Sampler[int]):
    """This rank's contiguous shard for evaluation: no padding, so every sample counts once.

    Ranks may get one sample (and so one batch) more than others: reduce the summed metrics
    once after the loop, never with a collective per batch.
    """

    def __init__(self, dataset_len: int, *, rank: int | None = None, world_size: int | None = None):
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.indices = eval_shard(dataset_len, self.rank, self.world_size)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

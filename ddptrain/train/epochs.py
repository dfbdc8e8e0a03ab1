"""Where each optimizer step's micro-batches come from, one epoch at a time.

    epochs = make_epochs(cfg, info, train_set)     # even (map-style) or uneven (IterableDataset)
    trainer.total_steps = epochs.total_steps       # known up front, for schedules
    epoch = epochs.start(epoch_index, steps_left)
    with epoch.running(model):                     # nothing, or torch's Join (uneven)
        for batches in epoch:                      # one optimizer step's micro-batches
            ...                                    # forward, backward, optimizer step
            epoch.consumed(len(batches))
    step = epoch.finish(step, optimizer, scheduler, scaler)   # uneven: ranks meet again

Even: a map-style dataset read through the resumable ShardedSampler, which gives every rank the
same number of micro-batches in every epoch, so ranks step in lockstep and may meet after any
step (`lockstep`): logs, evaluations and checkpoints follow their schedule. Uneven: an
IterableDataset that is each rank's own part, of a length that may differ across ranks; the
epoch runs under torch's Join through the wrapper, a rank that runs out answers the others'
collectives, and they meet again only when the epoch ends: periodic work waits for then, when
every rank takes the step count and the optimizer, scheduler and scaler state of the rank that
finished last (the others skipped its last steps).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddptrain.dist import DistInfo
from ddptrain.train import build
from ddptrain.train.config import ConfigError, TrainerConfig


def is_uneven(dataset: Dataset) -> bool:
    """Whether each rank reads its own part, of a length that may differ across ranks."""
    return isinstance(dataset, IterableDataset)


def make_epochs(
    cfg: TrainerConfig, info: DistInfo, train_set: Dataset
) -> EvenEpochs | UnevenEpochs:
    """The epochs of `train_set`: uneven for an IterableDataset, else even (collective)."""
    if is_uneven(train_set):
        return UnevenEpochs(cfg, info, train_set)
    return EvenEpochs(cfg, info, train_set)


class EvenEpochs:
    """Epochs of a map-style dataset: every rank the same number of micro-batches."""

    lockstep = True

    def __init__(self, cfg: TrainerConfig, info: DistInfo, train_set: Dataset) -> None:
        self.cfg = cfg
        self.sampler = build.sampler(cfg, len(train_set))
        self.total_steps = build.total_steps(cfg, self.sampler)
        self.by_epochs = build.epoch_steps(cfg, self.sampler)
        self._loader = build.loader(cfg, info, self.sampler, train_set)

    def start(self, index: int, steps_left: int) -> EvenEpoch:
        """Epoch `index` (from where a resumed sampler left it), for at most `steps_left` steps."""
        self.sampler.set_epoch(index)
        return EvenEpoch(self, iter(self._loader), steps_left)


class EvenEpoch:
    """One epoch of EvenEpochs: iterate for each step's micro-batches."""

    lockstep = True

    def __init__(self, epochs: EvenEpochs, batches: Iterator, steps_left: int) -> None:
        self._epochs, self._batches, self._steps_left = epochs, batches, steps_left
        self.deferred = False

    def running(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Nothing to set up: every rank takes every step."""
        return contextlib.nullcontext()

    def __iter__(self) -> Iterator[list[Any]]:
        sampler = self._epochs.sampler
        accum = self._epochs.cfg.accumulation(sampler.world_size)
        for _ in range(self._steps_left):
            if sampler.num_batches == 0:
                return
            # An epoch's last step may be short of grad_accum_steps micro-batches.
            yield [next(self._batches) for _ in range(min(accum, sampler.num_batches))]

    def consumed(self, micro_batches: int) -> None:
        """These micro-batches are trained on: a checkpoint from now on resumes after them."""
        self._epochs.sampler.mark_consumed(micro_batches)

    @property
    def complete(self) -> bool:
        """Whether every batch of the epoch was trained on."""
        return self._epochs.sampler.num_batches == 0

    def finish(self, step: int, optimizer: Any, scheduler: Any, scaler: Any) -> int:
        """The step count after the epoch (every rank took the same steps)."""
        return step


class UnevenEpochs:
    """Epochs of an IterableDataset: each rank its own part, of its own length."""

    lockstep = False
    sampler = None

    def __init__(self, cfg: TrainerConfig, info: DistInfo, train_set: IterableDataset) -> None:
        check_uneven_supported(cfg)
        self.cfg, self.info = cfg, info
        self.dataset = train_set
        self.per_rank_batch_size = cfg.round_size(info.world_size) // info.world_size
        self._loader = DataLoader(
            train_set,
            batch_size=self.per_rank_batch_size,
            num_workers=cfg.num_workers,
            pin_memory=info.device.type == "cuda",
            drop_last=cfg.drop_last,
            **build.worker_processes(cfg.num_workers),
        )
        self.total_steps = self._total_steps()
        self.by_epochs = None

    def _total_steps(self) -> int:
        """Optimizer steps of the whole run: the longest part sets each epoch's (collective)."""
        cfg = self.cfg
        try:
            samples = len(self.dataset)
        except TypeError:
            if cfg.max_steps is None:
                raise ConfigError(
                    f"{type(self.dataset).__name__} has no __len__, so the number of steps is "
                    "unknown; define __len__ (this rank's sample count) or set max_steps"
                ) from None
            return cfg.max_steps
        rounding = math.floor if cfg.drop_last else math.ceil
        batches = rounding(samples / self.per_rank_batch_size)
        longest = torch.tensor([math.ceil(batches / cfg.grad_accum_steps)])
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        by_epochs = int(longest.item()) * cfg.epochs
        return min(by_epochs, cfg.max_steps) if cfg.max_steps is not None else by_epochs

    def start(self, index: int, steps_left: int) -> UnevenEpoch:
        """Epoch `index`, for at most `steps_left` steps of this rank."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(index)
        return UnevenEpoch(self, iter(self._loader), steps_left)


class UnevenEpoch:
    """One epoch of UnevenEpochs: run under `running(model)`, then `finish`."""

    lockstep = False
    complete = True  # the epoch ends where every rank's part does

    def __init__(self, epochs: UnevenEpochs, batches: Iterator, steps_left: int) -> None:
        self._epochs, self._batches, self._steps_left = epochs, batches, steps_left
        self._join: Any = None
        self._steps = 0

    def running(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """torch's Join through the wrapper: a rank out of batches answers the others."""
        self._join = model.join()
        return self._join

    @property
    def deferred(self) -> bool:
        """This rank's part ended mid-round of accumulation; its gradients went to the others'
        next reduction (ddp/join.py): it skips the optimizer step and stops."""
        return self._join is not None and self._join.deferred

    def __iter__(self) -> Iterator[list[Any]]:
        accum = self._epochs.cfg.grad_accum_steps
        for _ in range(self._steps_left):
            chunk = list(itertools.islice(self._batches, accum))
            if not chunk:
                return
            self._steps += 1
            yield chunk

    def consumed(self, micro_batches: int) -> None:
        """Nothing to record: an uneven epoch resumes from its start."""

    def finish(self, step: int, optimizer: Any, scheduler: Any, scaler: Any) -> int:
        """Collective: the step count after the epoch (the longest part's), and the optimizer,
        scheduler and scaler state of the rank that finished last on every rank."""
        taken = torch.tensor([self._steps])
        dist.all_reduce(taken, op=dist.ReduceOp.MAX)
        _adopt_state(self._join.authoritative_rank, optimizer, scheduler, scaler)
        return step - self._steps + int(taken.item())


def _adopt_state(src: int, optimizer: Any, scheduler: Any, scaler: Any) -> None:
    """Every rank takes rank `src`'s optimizer, scheduler and scaler state."""
    if dist.get_world_size() == 1:
        return
    parts = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    box = [
        {k: v.state_dict() if v is not None else None for k, v in parts.items()}
        if dist.get_rank() == src
        else None
    ]
    dist.broadcast_object_list(box, src=src)
    if dist.get_rank() != src:
        for key, part in parts.items():
            if part is not None:
                part.load_state_dict(box[0][key])


def check_uneven_supported(cfg: TrainerConfig) -> None:
    """Refuse settings whose collectives a rank that ran out could not answer."""
    if cfg.deterministic:
        raise ConfigError(
            "deterministic=True with an IterableDataset train set: each rank reads its own "
            "part, so which samples make a step depends on the world size. Use a map-style "
            "dataset (the MicroBatchSampler gives micro-batch k the same samples at any size)"
        )
    if cfg.profile_steps is not None:
        raise ConfigError(
            "profile_steps with an IterableDataset train set: the profiled steps start with a "
            "barrier, which a rank whose part ran out cannot join. Profile a map-style dataset "
            "run, or set profile_steps=None"
        )
    if cfg.zero_stage:
        raise ConfigError(
            f"zero_stage={cfg.zero_stage} with an IterableDataset train set: ZeRO's optimizer "
            "step is collective, and a rank whose part ran out skips it. Use zero_stage=0, or "
            "a map-style dataset (the ShardedSampler gives every rank the same batch count)"
        )

"""What makes a micro-batch's forward the same at any world size, for the exact mode
(ddp/deterministic.py, fsdp/deterministic.py): its random numbers, and its BatchNorm statistics.

    forwards = MicroBatchForwards(module, group)   # collective: rank 0's seed
    ... training forwards: hooks on `module` key the RNG and restore the statistics ...
    forwards.combine(count)                         # collective, after the step's backwards
    # or, where the step's own reduction can carry them (the exact reducer's bucket tail):
    forwards.write_records(region)                  # before the sum over ranks
    forwards.combine(count, gathered)               # the summed region: no collective

Micro-batch k of a step is counted over every rank (rank r's j-th is j * world_size + r), so
its seed micro_batch_seed(seed, step, k) never depends on the rank or the world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ddptrain.ddp.hooks import global_rank


def micro_batch_seed(seed: int, step: int, micro_batch: int) -> int:
    """The random seed of micro-batch `micro_batch` (counted over every rank) of step `step`:
    a mix of the three (splitmix64), never of the rank."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + micro_batch) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**63


def default_generators(module: nn.Module) -> list[torch.Generator]:
    """The default generators a forward of `module` draws from: the CPU's and those of the
    CUDA devices its parameters are on (seeding them alone costs microseconds; torch.manual_seed
    seeds every backend, about a millisecond on CPU)."""
    generators = [torch.default_generator]
    for device in sorted({str(p.device) for p in module.parameters()}):
        device = torch.device(device)
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            generators.append(torch.cuda.default_generators[index])
        elif device.type != "cpu":
            raise ValueError(
                f"deterministic=True seeds the CPU's and CUDA's generators; the model has "
                f"parameters on {device}"
            )
    return generators


class MicroBatchForwards:
    """What makes a micro-batch's forward the same at any world size: its random numbers
    drawn from micro_batch_seed(seed, step, k), and its BatchNorm layers starting from the
    running statistics the step began with; `combine` then makes the step's statistics the
    mean of the micro-batches' results, in the order of k, on every rank.

        forwards = MicroBatchForwards(module, group)   # collective: rank 0's seed
        ... training forwards: hooks on `module` do the rest ...
        forwards.combine(count)                         # collective, after the step's backwards
    """

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # Synchronized backwards so far: the step that keys micro-batches' random numbers. A
        # resumed run sets it to the step it resumes from.
        self.step = 0
        self.forwards = 0  # this rank's training forwards in this step
        seed = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64)
        if self.world_size > 1:
            dist.broadcast(seed, global_rank(group, 0), group=group)
        self.seed = int(seed.item())
        self._norms = [
            m
            for m in module.modules()
            if isinstance(m, _NormBase) and m.track_running_stats and m.running_mean is not None
        ]
        self._step_start: list[torch.Tensor] | None = None
        self._records: list[torch.Tensor] = []
        self._generators: list[torch.Generator] | None = None
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        k = self.forwards * self.world_size + self.rank
        seed = micro_batch_seed(self.seed, self.step, k)
        if self._generators is None:
            self._generators = default_generators(module)
        for generator in self._generators:
            generator.manual_seed(seed)
        self.forwards += 1
        if not self._norms:
            return
        with torch.no_grad():
            if self._step_start is None:
                self._step_start = [t.clone() for t in self._norm_tensors()]
            else:
                torch._foreach_copy_(self._norm_tensors(), self._step_start)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._norms and module.training and torch.is_grad_enabled():
            stats = [t.detach().reshape(-1) for t in self._norm_tensors(counts=False)]
            self._records.append(torch.cat(stats).double())

    @property
    def record_numel(self) -> int:
        """The elements one micro-batch's statistics take (0 without BatchNorm)."""
        return sum(t.numel() for t in self._norm_tensors(counts=False))

    def write_records(self, region: torch.Tensor) -> bool:
        """This rank's statistics of the step into `region` (int64, zeroed first), micro-batch
        k's as the bits of its float64s at k * record_numel: a sum of every rank's region is
        then what combine's all_gather would bring, in the order of k. False: they do not fit."""
        region.zero_()
        if not self._records:
            return True
        n, world = self.record_numel, self.world_size
        rows = (len(self._records) - 1) * world + self.rank + 1
        if rows * n > region.numel():
            return False
        # Rank r's j-th record is micro-batch j * world_size + r.
        region[: rows * n].view(torch.float64).view(rows, n)[self.rank :: world] = torch.stack(
            self._records
        )
        return True

    def _norm_tensors(self, counts: bool = True) -> list[torch.Tensor]:
        out = []
        for m in self._norms:
            out += [m.running_mean, m.running_var]
            if counts and m.num_batches_tracked is not None:
                out.append(m.num_batches_tracked)
        return out

    def combine(self, count: int, gathered: torch.Tensor | None = None) -> None:
        """Collective after the step's last backward (`count` micro-batches over every rank):
        the running statistics every rank ends the step with; the next step begins.
        `gathered`: every rank's statistics in the order of k (the sum of write_records'
        regions, count * record_numel float64), sparing the all_gather."""
        self.step += 1
        forwards, self.forwards = self.forwards, 0
        if not self._norms or self._step_start is None:
            return
        if forwards * self.world_size != count:
            raise RuntimeError(
                "deterministic=True needs one training forward per micro-batch and the same "
                f"number on every rank: this rank ran {forwards} forwards, the step {count} "
                f"backwards over {self.world_size} ranks"
            )
        if gathered is not None:
            ordered = gathered.view(count, -1)
        else:
            mine = torch.stack(self._records)
            everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
            if self.world_size > 1:
                dist.all_gather(everyone, mine, group=self.group)
            else:
                everyone = [mine]
            # Rank r's j-th record is micro-batch j * world_size + r.
            ordered = torch.stack(everyone, dim=1).reshape(count, -1)
        total = torch.zeros_like(ordered[0])
        for record in ordered:
            total += record
        mean = total / count
        start, offset = iter(self._step_start), 0
        with torch.no_grad():
            for t in self._norm_tensors():
                first = next(start)
                if t.dtype == torch.long:
                    t.copy_(first + count)
                    continue
                t.copy_(mean[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
        self._step_start, self._records = None, []

"""Distributed evaluation without duplicates: every sample is scored once, on one rank.

    def step(module, batch):                   # per-batch SUMS, not means
        x, y = batch
        out = module(x)
        return {"loss": F.nll_loss(out, y, reduction="sum"), "accuracy": (out.argmax(1) == y).sum()}

    metrics = evaluate(model.module, test_set, step, batch_size=1000, device=info.device)
    # {"eval_accuracy": 0.991, "eval_loss": 0.03, "eval_samples": 10000} on every rank

Each rank takes a contiguous shard (EvalSampler: no padding), runs the UNWRAPPED module (shards
may differ in length by one batch, so no collective can run per batch), and the sums and the
sample count are reduced once at the end. `deterministic=True`: the set is cut into batches of
`batch_size` whatever the world size, batch c scored by rank c % world_size, and every batch's
sums are added in batch order on every rank: the same bits at any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ddptrain.data import EvalSampler
from ddptrain.data.loader import batch_loader
from ddptrain.dist import broadcast_object


@torch.no_grad()
def evaluate(
    module: nn.Module,
    dataset: Dataset,
    step: Callable[[nn.Module, Any], dict[str, Any]],
    *,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    deterministic: bool = False,
) -> dict[str, float]:
    """Exact `eval_<key>` = global sum / global sample count for each key `step` returns."""
    if deterministic:
        indices = _batches_of_this_rank(len(dataset), batch_size)
    else:
        indices = EvalSampler(len(dataset))
    was_training = module.training
    module.eval()
    # Its own generator: iter(loader) draws a seed, which must not come from the global RNG
    # that training's dropout uses (evaluating would change the masks, and exact resume).
    loader = batch_loader(dataset, indices, batch_size, generator=torch.Generator())
    per_batch: list[tuple[dict[str, float], int]] = []
    sums: dict[str, torch.Tensor] = {}
    count = 0
    try:
        for batch in loader:
            batch = move_to(batch, device)
            with autocast():
                out = step(module, batch)
            values = {
                k: torch.as_tensor(v, device=device).detach().double() for k, v in out.items()
            }
            for key, value in values.items():
                sums[key] = sums[key] + value if key in sums else value
            count += batch_len(batch)
            if deterministic:
                per_batch.append(({k: v.item() for k, v in values.items()}, batch_len(batch)))
    finally:
        module.train(was_training)
    if deterministic:
        return _in_batch_order(per_batch)
    # Rank 0 holds the largest shard, so it has seen every key any rank has.
    keys = broadcast_object(sorted(sums))
    zero = torch.zeros((), dtype=torch.float64, device=device)
    count_t = torch.tensor(float(count), dtype=torch.float64, device=device)
    totals = torch.stack([sums.get(k, zero) for k in keys] + [count_t])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    totals = totals.cpu().tolist()
    n = int(totals[-1])
    metrics: dict[str, float] = {f"eval_{k}": totals[i] / max(n, 1) for i, k in enumerate(keys)}
    metrics["eval_samples"] = n
    return metrics


def _batches_of_this_rank(dataset_len: int, batch_size: int) -> list[int]:
    """The indices of batches c = rank, rank + world_size, ... of the set cut in batch_size."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    starts = range(rank * batch_size, dataset_len, world_size * batch_size)
    return [i for start in starts for i in range(start, min(start + batch_size, dataset_len))]


def _in_batch_order(per_batch: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Collective: every rank's per-batch sums, added in the order of the batches."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    everyone: list[Any] = [per_batch]
    if world_size > 1:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, per_batch)
    # Rank r's j-th batch is batch j * world_size + r.
    longest = max(len(batches) for batches in everyone)
    ordered = [b[j] for j in range(longest) for b in everyone if j < len(b)]
    totals: dict[str, float] = {}
    count = 0
    for values, n in ordered:
        for key, value in values.items():
            totals[key] = totals.get(key, 0.0) + value
        count += n
    metrics = {f"eval_{k}": v / max(count, 1) for k, v in sorted(totals.items())}
    metrics["eval_samples"] = count
    return metrics


def move_to(batch: Any, device: torch.device) -> Any:
    """The batch (tensor, or tuple/list/dict of them) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def batch_len(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, (list, tuple)) and batch:
        return batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_len(next(iter(batch.values())))
    raise TypeError(f"cannot tell the number of samples in a batch of type {type(batch)}")

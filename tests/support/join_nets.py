"""Models and loops shared by the join tests: a small net, per-rank batches, a training loop."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ddptrain.comm import named_hook
from ddptrain.ddp.wrapper import DistributedDataParallel

# Tiny buckets (about 1 KB): several per model, so launch order and the rebuild are exercised.
BUCKET_MB = 0.001


class Net(nn.Module):
    """BatchNorm buffers to broadcast, several buckets, and optionally a layer no rank uses.

    Official DDP's joined rank reports stale "used" flags (its last backward's, or
    uninitialized memory if it never ran one), so a never-used layer is left out of the
    comparisons with it; ours reports none used, checked against zero-gradient steps.
    """

    def __init__(self, batchnorm: bool, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(16, 16)
        self.never_used = nn.Linear(16, 16) if unused else None
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


def batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(6, 12, generator=g), torch.randint(0, 10, (6,), generator=g)


def train(model, n_batches: int, micro: int, join=None, pad_to: int = 0) -> tuple[int, list]:
    """Train on n_batches (then pad_to - n_batches zero-gradient ones).

    Returns the steps taken and the parameters with grad=None after the last backward.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    steps = 0
    grad_none: list[str] = []
    rank = torch.distributed.get_rank()
    with join if join is not None else nullcontext():
        for i in range(max(n_batches, pad_to)):
            x, y = batch(rank, i)
            sync = (i + 1) % micro == 0
            with nullcontext() if sync else model.no_sync():
                loss = F.cross_entropy(model(x), y)
                (loss if i < n_batches else loss * 0).backward()
            grad_none = sorted(n for n, p in model.module.named_parameters() if p.grad is None)
            if sync:
                opt.step()
                opt.zero_grad()
                steps += 1
    return steps, grad_none


def state(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])


def wrap(base: nn.Module, hook_name: str, group=None, copied=True) -> DistributedDataParallel:
    return DistributedDataParallel(
        copy.deepcopy(base) if copied else base,
        bucket_cap_mb=BUCKET_MB,
        first_bucket_cap_mb=BUCKET_MB,
        comm_hook=None if hook_name == "default" else named_hook(hook_name, group),
        process_group=group,
    )


def compare(ours: nn.Module, theirs: nn.Module) -> dict:
    a, b = state(ours), state(theirs)
    return {
        "max_diff": (a - b).abs().max().item(),
        "bitwise": torch.equal(a, b),
        "state": a,
    }

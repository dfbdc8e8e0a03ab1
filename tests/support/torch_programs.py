"""What the torch-protocol tests' programs share: a small MLP, per-rank batches, the flat
parameters, a training loop under a comm hook, and torch's PowerSGD hook with its state.

    from support.torch_programs import STEPS, batch, hooked, mlp, params, powersgd
    hooked(ddptrain.DDP, rank, powersgd, bucket_cap_mb=25)   # the parameters after STEPS steps
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

STEPS = 8


def mlp() -> nn.Module:
    """A 32-64-64-10 MLP, the same weights on every call and every rank."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def batch(rank: int, step: int, features: int = 32, classes: int = 10):
    """16 samples and class labels of `rank` at `step`: each rank its own, the same every run."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, features, generator=g), torch.randint(0, classes, (16,), generator=g)


def params(model: nn.Module) -> torch.Tensor:
    """Every parameter of `model`, detached, in one flat vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def hooked(DDP, rank: int, make_hook, bucket_cap_mb: float) -> torch.Tensor:  # noqa: N803
    """mlp() wrapped in `DDP` with the (state, hook) of make_hook() registered, after STEPS SGD
    steps: its parameters."""
    ddp_model = DDP(mlp(), bucket_cap_mb=bucket_cap_mb)
    ddp_model.register_comm_hook(*make_hook())
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(rank, step)
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return params(ddp_model)


def powersgd():
    """torch's powerSGD_hook and its state: rank-2 approximation after 3 plain iterations."""
    # Error feedback and warm start on (torch's defaults); plain all_reduce for 3 iterations.
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3
    )
    return state, powerSGD_hook.powerSGD_hook

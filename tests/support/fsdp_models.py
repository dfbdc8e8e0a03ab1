"""The FullyShardedDataParallel tests' models, each with its data and units, the wrappers and
optimizer they train under, and their whole parameters."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ddptrain.ddp.wrapper import DistributedDataParallel
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.nn.sync_batchnorm import convert_sync_batchnorm
from support import toy_models


def conv_last() -> nn.Module:
    """LeNet without dropout, its 4-D weights in channels_last memory order."""
    return toy_models.make("lenet_nodrop").to(memory_format=torch.channels_last)


class Wide(nn.Module):
    """Three Linear layers of 832-4160 parameters, units of the size policy at 800, and a head
    of 650 left to the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 64), nn.Linear(64, 64), nn.Linear(64, 64)])
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return F.log_softmax(self.head(x), dim=1)


# name -> (factory, data of toy_models.batch, units of the wrapped module (None: size policy))
MODELS = {
    "wide": (Wide, "tanh", None),
    "tanh": (lambda: toy_models.make("tanh"), "tanh", lambda m: [m.net[0], m.net[2]]),
    "lenet": (lambda: toy_models.make("lenet_nodrop"), "lenet", lambda m: [m.conv2, m.fc1]),
    "channels_last": (conv_last, "lenet", lambda m: [m.conv1, m.conv2]),
    "tied": (lambda: toy_models.make("tied"), "tied", lambda m: [m.embed, m.hidden, m.out]),
    "frozen": (lambda: toy_models.make("frozen"), "frozen", lambda m: [m.frozen, m.fc1]),
    # The branch (rank 1 only) in the root unit, then a unit of its own, which the other
    # ranks' forwards skip; the swapped layers run in another order on rank 1.
    "branch": (lambda: toy_models.make("branch"), "branch", lambda m: [m.trunk, m.never_used]),
    "branch_unit": (
        lambda: toy_models.make("branch"),
        "branch",
        lambda m: [m.trunk, m.branch, m.never_used],
    ),
    "swapped": (lambda: toy_models.make("swapped"), "swapped", lambda m: [m.first, m.second]),
    # BatchNorm's running stats: rank 0's at every forward, as under the DDP wrapper.
    "batchnorm": (lambda: toy_models.make("batchnorm"), "batchnorm", lambda m: [m.conv, m.fc]),
    "syncbn": (
        lambda: convert_sync_batchnorm(toy_models.make("batchnorm")),
        "batchnorm",
        lambda m: [m.conv, m.fc],
    ),
}


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW, weight decay on weights only (groups picked by name)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not n.endswith("bias")]
    rest = [p for n, p in named if n.endswith("bias")]
    if kind == "sgd":
        groups = [{"params": decay, "weight_decay": 1e-3}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 2e-3}]
    return torch.optim.AdamW(groups, lr=1e-3)


def wrap(name: str, base: nn.Module, stage: int, rank: int, group=None) -> nn.Module:
    """A copy of `base` under the DDP wrapper (stage 0) or the sharded one at ZeRO `stage`,
    its units those MODELS gives `name`."""
    module = copy.deepcopy(base)
    if stage == 0:
        return DistributedDataParallel(module, process_group=group)
    units = MODELS[name][2]
    return FullyShardedDataParallel(
        module,
        process_group=group,
        units=units(module) if units else None,
        unit_min_numel=800,
        reshard_after_forward=stage == 3,
    )


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by name (collective for the sharded wrapper)."""
    if isinstance(model, FullyShardedDataParallel):
        state = model.state_dict()
    else:
        state = model.module.state_dict()
    names = {n for n, _ in (model.module.named_parameters())}
    return {k: v for k, v in state.items() if k in names}

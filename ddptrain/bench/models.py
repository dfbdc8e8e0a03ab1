"""The bench's models: communication-heavy (MLP), the recipe's LeNet, compute-heavy (conv net)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddptrain.models import LeNet


class MLP(nn.Module):
    """Communication-heavy: ~16.8M parameters, little compute per parameter at batch 32."""

    def __init__(self, width: int = 2240, depth: int = 4) -> None:
        super().__init__()
        dims = [784] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False))
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


def _recipe_lenet() -> nn.Module:
    return LeNet(width=2, batchnorm=True, dropout=0.1).to(memory_format=torch.channels_last)


def conv_net() -> nn.Module:
    """Compute-heavy: ~0.24M parameters, four 3x3 convolutions on 3x32x32 images."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


# name -> (model factory, input shape of one sample, per-rank batch size, default steps); the
# cheap models get more steps, so each model gets a similar share of a run and small
# step-time differences stand out of the noise.
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int, int]] = {
    "lenet": (lambda: LeNet(dropout=0.0), (1, 28, 28), 64, 200),
    # recipes/mnist.py's default model and per-rank batch at world size 2.
    "lenet-recipe": (_recipe_lenet, (1, 28, 28), 128, 120),
    "mlp": (MLP, (1, 28, 28), 32, 40),
    "convnet": (conv_net, (3, 32, 32), 16, 80),
}

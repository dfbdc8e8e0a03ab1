"""The bench's models: communication-heavy (MLP), the recipe's LeNet, compute-heavy (conv net),
each with its input shape, per-rank batch and step count."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ddptrain.models import MLP, LeNet, conv_net


def _recipe_lenet() -> nn.Module:
    return LeNet(width=2, batchnorm=True, dropout=0.1).to(memory_format=torch.channels_last)


# name -> (model factory, input shape of one sample, per-rank batch size, default steps); the
# cheap models get more steps, so each model gets a similar share of a run and small
# step-time differences stand out of the noise.
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int, int]] = {
    "lenet": (lambda: LeNet(dropout=0.0), (1, 28, 28), 64, 200),
    # recipes/mnist.py's default model and per-rank batch at world size 2.
    "lenet-recipe": (_recipe_lenet, (1, 28, 28), 128, 120),
    "mlp": (MLP, (1, 28, 28), 32, 40),
    # About as many parameters as the MLP (16.6M) in 17 layers: a deeper model, with 15 units
    # of 1.05M parameters under the fully sharded wrapper's size policy (the MLP has 4).
    "deep-mlp": (lambda: MLP(width=1024, depth=16), (1, 28, 28), 32, 40),
    "convnet": (conv_net, (3, 32, 32), 16, 80),
}

"""Reference models used by the recipe, the benchmark and the tests.

from ddptrain.models import LeNet, MLP, conv_net
model = LeNet()            # 1x28x28 input, 10 log-probabilities out
model = LeNet(batchnorm=True)   # BatchNorm after each conv and the hidden layer
model = MLP()              # 16.8M parameters, little compute each: communication shows
model = conv_net()         # 3x32x32 input: compute-heavy
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LeNet(nn.Module):
    """The convolutional net of PyTorch's classic MNIST and distributed tutorials.

    `width` multiplies every layer's channels/units (1 is the tutorial's 10-20-50 net).
    `batchnorm=True` puts a BatchNorm after conv1, conv2 and fc1 (whose biases it replaces).
    """

    def __init__(self, dropout: float = 0.5, width: int = 1, batchnorm: bool = False) -> None:
        super().__init__()
        c1, c2, hidden = 10 * width, 20 * width, 50 * width
        self.conv1 = nn.Conv2d(1, c1, kernel_size=5, bias=not batchnorm)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=5, bias=not batchnorm)
        self.conv2_drop = nn.Dropout2d(dropout)
        self.fc1 = nn.Linear(c2 * 16, hidden, bias=not batchnorm)
        self.fc2 = nn.Linear(hidden, 10)
        self.dropout = dropout
        norm2d = nn.BatchNorm2d if batchnorm else lambda _: nn.Identity()
        self.bn1, self.bn2 = norm2d(c1), norm2d(c2)
        self.bn3 = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.bn1(self.conv1(x)), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.bn2(self.conv2(x))), 2))
        x = x.flatten(1)
        x = F.relu(self.bn3(self.fc1(x)))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


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

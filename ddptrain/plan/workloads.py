"""What a plan trains: a model, a per-rank batch of random data and its loss.

    w = workload("mlp")                         # the bench's models: lenet, mlp, deep-mlp, convnet
    w = workload("mlp", batch_size=64)          # another per-rank batch
    w = workload("mypkg.nets:build")            # the user's: build() returns an nn.Module
    model = w.factory(); x, y = w.batch(torch.Generator().manual_seed(rank))
    loss = w.loss(model(x), y)

A user's factory returns an nn.Module that takes a float batch of `input_shape` samples and
returns class scores (cross-entropy against random labels), or a ready `Workload`. "gpt" is
ddptrain.models.GPT where the package has it (token batches, next-token cross-entropy).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ddptrain.bench.models import MODELS

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A model factory, one rank's batch of random data and the loss the step minimizes."""

    name: str
    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    batch_size: int
    classes: int = 10
    tokens: bool = False  # inputs are token ids (batch, input_shape[0]); labels one per token

    def batch(self, generator: torch.Generator) -> Batch:
        """One rank's batch: random inputs and labels from `generator`."""
        if self.tokens:
            shape = (self.batch_size, *self.input_shape)
            x = torch.randint(0, self.classes, shape, generator=generator)
            return x, torch.randint(0, self.classes, shape, generator=generator)
        x = torch.randn(self.batch_size, *self.input_shape, generator=generator)
        return x, torch.randint(0, self.classes, (self.batch_size,), generator=generator)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the model's scores against the labels."""
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def _gpt() -> Workload | None:
    from ddptrain import models

    gpt = getattr(models, "GPT", None)
    if gpt is None:
        return None
    # A few-block model whose step takes about as long as the MLP's on a CPU core.
    return Workload("gpt", lambda: gpt(n_layer=4, n_head=4, n_embd=256), (128,), 8, 256, True)


def names() -> list[str]:
    """The built-in workloads (gpt only where ddptrain.models has it)."""
    return [*MODELS, *(["gpt"] if _gpt() is not None else [])]


def workload(name: str, batch_size: int | None = None) -> Workload:
    """The built-in workload `name`, or a user's `module:factory`; `batch_size` per rank."""
    if name in MODELS:
        factory, shape, default_batch, _ = MODELS[name]
        found = Workload(name, factory, shape, default_batch)
    elif name == "gpt" and _gpt() is not None:
        found = _gpt()
    elif ":" in name:
        found = _user(name)
    else:
        raise ValueError(
            f"unknown model {name!r}: choose one of {', '.join(names())}, or give your own as "
            "module:factory (a function returning an nn.Module)"
        )
    return found if batch_size is None else replace(found, batch_size=batch_size)


def _user(spec: str) -> Workload:
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    made = factory()
    if isinstance(made, Workload):
        return made
    if not isinstance(made, nn.Module):
        raise TypeError(f"{spec} returned {type(made).__name__}, not an nn.Module or Workload")
    return Workload(spec, factory, (1, 28, 28), 32)

"""What a transformer's configure_optimizers returns: AdamW's parameter groups and a warmup +
cosine learning-rate schedule.

    def configure_optimizers(self, model):
        opt = torch.optim.AdamW(adamw_groups(model, weight_decay=0.1), lr=1e-3, betas=(0.9, 0.95))
        return opt, warmup_cosine(opt, warmup_steps=100, total_steps=self.total_steps)

Both work at every zero_stage: the groups are told apart by the module that holds a parameter
and its name, never its shape (under zero_stage 2 and 3 `model`'s parameters are 1-D shards),
and ZeRO-1's optimizer shares the param_groups the schedule sets. The schedule is a LambdaLR
whose state_dict holds numbers only, so a checkpoint resumes it where it was.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

# Modules whose parameters are scales, shifts and lookup tables, not weights of a matmul:
# decaying them toward zero changes what the layer computes rather than regularising it.
NO_DECAY_MODULES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,
)


def adamw_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[{"params": the weights of matmuls and convolutions, "weight_decay": weight_decay},
    {"params": biases, norms' and embeddings' parameters, "weight_decay": 0.0}], trainable
    parameters only, each once (a weight tied to an embedding is the embedding's), in
    model.parameters() order; an empty group is left out."""
    exempt: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, NO_DECAY_MODULES) or name == "bias":
                exempt.add(id(p))
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if id(p) in exempt else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Each group's lr rises linearly over `warmup_steps` optimizer steps to its initial value,
    then follows a half cosine down to min_lr_ratio of it at `total_steps`, and stays there."""
    if warmup_steps < 0 or total_steps < 1 or not 0 <= min_lr_ratio <= 1:
        raise ValueError(
            f"warmup_cosine needs warmup_steps >= 0, total_steps >= 1 and min_lr_ratio in "
            f"[0, 1], got {warmup_steps}, {total_steps}, {min_lr_ratio}"
        )
    factor = functools.partial(
        warmup_cosine_factor,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        min_lr_ratio=min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_cosine_factor(
    step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> float:
    """The multiple of the initial lr for the optimizer step after `step` steps (pure)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

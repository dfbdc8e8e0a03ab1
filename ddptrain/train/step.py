"""One optimizer step's pieces, as functions of what they touch.

with autocast("bf16", device):                  # the forward's precision
    loss = training_step(model, batch)
stepped = optimizer_step(model, optimizer, scaler, grad_clip_norm)   # False: not finite
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ddptrain.train import build


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's autocast for TrainerConfig.precision ("fp32": none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    grad_clip_norm: float | None,
) -> bool:
    """Clip (or measure) the gradient norm and step; return False, having dropped the
    gradients and changed nothing, if they are not finite (the caller applies the policy)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = build.grad_norm(model, grad_clip_norm)
    if scaler is not None:
        # GradScaler skips steps with inf/NaN itself: they are expected while it calibrates.
        scaler.step(optimizer)
        scaler.update()
        return True
    # Gradients are already averaged, so every rank reaches the same verdict here.
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    return True

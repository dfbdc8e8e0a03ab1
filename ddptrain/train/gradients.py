"""What a step does with the averaged gradients: their norm, clipping, the non-finite check
and the optimizer step; and the forward's precision.

    with autocast("bf16", device):                  # the forward's precision
        loss = training_step(model, batch)
    norm = grad_norm(model, max_norm=1.0)           # clipped to 1.0 (collective under ZeRO-2/3)
    stepped = optimizer_step(model, optimizer, scaler, grad_clip_norm)   # False: not finite
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ddptrain.ddp.exact import exact_norm
from ddptrain.fsdp.wrapper import FullyShardedDataParallel


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
    norm = grad_norm(model, grad_clip_norm)
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


def grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """The whole gradient's norm, after clipping it to max_norm when given (collective under
    zero_stage 2 and 3, where each rank holds a shard of the gradient). Clipping uses the exact
    norm (ddp/exact.py): the same bits at every ZeRO stage and world size, so every stage clips
    alike; without clipping the norm only tells whether the gradients are finite."""
    if isinstance(model, FullyShardedDataParallel):
        return model.grad_norm() if max_norm is None else model.clip_grad_norm_(max_norm)
    params = [p for p in model.module.parameters() if p.grad is not None]
    if max_norm is None:
        return nn.utils.get_total_norm([p.grad for p in params])
    norm = exact_norm([p.grad for p in params])
    nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm

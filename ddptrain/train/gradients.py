"""What a step does with the averaged gradients: their norm, clipping, the non-finite check,
its report and the optimizer step; and the forward's precision.

    with autocast("bf16", device):                  # the forward's precision
        loss = training_step(model, batch)
    norm = grad_norm(model, max_norm=1.0)           # clipped to 1.0 (collective under ZeRO-2/3)
    stepped = optimizer_step(model, optimizer, scaler, grad_clip_norm)   # False: not finite
    report_nonfinite_steps([(step, loss_finite, False)], "stop", None)   # collective: raises
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.ddp.exact import HEADROOM_BITS
from ddptrain.ddp.norm import exact_norm
from ddptrain.dist import print0
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.train.checkpoint import latest_checkpoint


class NonFiniteError(RuntimeError):
    """The averaged gradients were inf/NaN and the config says to stop."""


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
    # numel bounds the sum's terms: the whole model's, as the sharded wrappers count it.
    numel = sum(p.numel() for p in model.module.parameters())
    norm = exact_norm([p.grad for p in params], numel=numel)
    nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def report_nonfinite_steps(
    mine: list[tuple[int, bool, bool]], policy: str, checkpoint_dir: str | None
) -> None:
    """Collective: report every rank's skipped steps, given as (step, whether this rank's own
    loss was finite, whether the exact sums overflowed: deterministic=True, the same on every
    rank), naming for each the ranks whose loss was not finite."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for step in sorted({entry[0] for theirs in everyone for entry in theirs}):
        bad = [r for r, theirs in enumerate(everyone) if (step, False) in {e[:2] for e in theirs}]
        overflowed = any(e[0] == step and e[2] for theirs in everyone for e in theirs)
        report_nonfinite(
            step, bad, policy=policy, checkpoint_dir=checkpoint_dir, overflowed=overflowed
        )


def report_nonfinite(
    step: int,
    bad: list[int],
    *,
    policy: str,
    checkpoint_dir: str | None,
    overflowed: bool = False,
) -> None:
    """Warn (policy "skip") or raise NonFiniteError ("stop") for a step whose averaged
    gradients were not finite; `bad` are the ranks whose own loss was not; `overflowed`: the
    exact sums of deterministic=True overflowed."""
    where = f"non-finite local loss on rank(s) {bad}" if bad else "losses finite everywhere"
    if overflowed and not bad:
        where = (
            f"the exact sums overflowed: a gradient element was over 2**{HEADROOM_BITS} times "
            "the largest of micro-batch 0's for its parameter (docs/guide.md, 'Same bits at any "
            "world size')"
        )
    if policy == "skip":
        print0(f"warning: step {step} skipped: non-finite gradients ({where})")
        return
    last = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    raise NonFiniteError(
        f"step {step}: non-finite gradients ({where}); stopped on every rank before the "
        f"optimizer step, so no weights were changed. Last good checkpoint: "
        f"{last or 'none'}. Lower the learning rate, clip gradients (grad_clip_norm), or set "
        "nonfinite='skip' to skip such steps"
    )

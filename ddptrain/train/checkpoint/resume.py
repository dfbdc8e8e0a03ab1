"""Checkpoints in a distributed run: rank 0 reads and writes, every rank learns the outcome.

    check_checkpoint_dir(cfg, info, module)           # before training: fail early, on every rank
    state = read_resume_state(cfg, info, module)      # rank 0 loads the weights into `module`
    model = DistributedDataParallel(module)           # ... which broadcasts them to the others
    step, epoch = apply_resume_state(state, cfg, info, optimizer, scheduler, scaler, sampler)
    save_training_state(cfg, info, model, optimizer, scheduler, scaler, sampler,
                        step=step, epoch=epoch, metrics=metrics)

No shared filesystem is needed: only rank 0 touches the files, and the state it read reaches the
others through broadcast_object. Any failure on rank 0 is broadcast too, so every rank raises the
same CheckpointError instead of the others hanging in the next collective.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.data import ShardedSampler
from ddptrain.dist import DistInfo, broadcast_object, print0
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.train import checkpoint as ckpt
from ddptrain.train.config import TrainerConfig


def check_checkpoint_dir(cfg: TrainerConfig, info: DistInfo, module: nn.Module) -> None:
    """Raise a CheckpointError on every rank if rank 0 cannot write checkpoints of `module`."""
    error = None
    if info.is_main:
        model_bytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
        try:
            # Model + optimizer state (up to 2x for momentum/Adam) for keep_last + 1 files.
            ckpt.check_writable(
                cfg.checkpoint_dir, required_bytes=3 * model_bytes * (cfg.keep_last + 1)
            )
        except ckpt.CheckpointError as e:
            error = str(e)
    error = broadcast_object(error)
    if error:
        raise ckpt.CheckpointError(error)


def read_resume_state(
    cfg: TrainerConfig, info: DistInfo, module: nn.Module
) -> dict[str, Any] | None:
    """The checkpoint to resume from, without its weights (rank 0 loaded them into `module`)."""
    if not cfg.resume:
        return None
    state, error = None, None
    if info.is_main:
        try:
            auto = cfg.resume == "auto"
            path = _latest_setting_aside_invalid(cfg.checkpoint_dir) if auto else cfg.resume
            if path is not None:
                state = ckpt.load_checkpoint(path)
                try:
                    ckpt.load_model_state(module, state.pop("model"))
                except ckpt.CheckpointError as e:
                    raise ckpt.CheckpointError(f"{path}: {e}") from None
                cfg.check_resumable(state.get("config", {}))
                if not auto:
                    _refuse_later_checkpoints(cfg, int(state["step"]))
                print0(f"resuming from {path} (step {state['step']})")
            elif cfg.resume == "auto":
                print0(
                    f"resume='auto': no valid checkpoint in {cfg.checkpoint_dir}; starting fresh"
                )
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank
            error = str(e)
    state, error = broadcast_object((state, error))
    if error:
        raise ckpt.CheckpointError(error)
    return state


def apply_resume_state(
    state: dict[str, Any],
    cfg: TrainerConfig,
    info: DistInfo,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    sampler: ShardedSampler | None,
    model: nn.Module | None = None,
) -> tuple[int, int]:
    """Load the optimizer, schedule, scaler, sampler and RNG states; return (step, index from 0
    of the epoch the loop continues in).
    `model`: the wrapper, whose optimizer state a fully sharded one loads piece by piece."""
    # Popped: the whole optimizer state would otherwise stay alive on every rank all run long,
    # undoing what a sharded (ZeRO) optimizer saves.
    if isinstance(model, FullyShardedDataParallel):
        model.load_optim_state_dict(optimizer, state.pop("optimizer"))
    else:
        optimizer.load_state_dict(state.pop("optimizer"))
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    if sampler is not None:  # None: per-rank parts of an IterableDataset (train/epochs.py)
        sampler.load_state_dict(state["sampler"])
    # The checkpoint's epoch is its step's, from 1. Even epochs continue where the sampler
    # stopped, inside or at the end of its epoch; uneven ones from the start of the next, whose
    # index (from 0) is the number of the one the checkpoint completed.
    step = int(state["step"])
    epoch = sampler.epoch if sampler is not None else int(state["epoch"])
    rng = state.get("rng") or []
    if len(rng) == info.world_size:
        ckpt.restore_rng_state(rng[info.rank])
    else:
        # At another world size there is no matching stream to continue; derive one.
        torch.manual_seed(cfg.seed + 1 + info.rank + 7919 * step)
    return step, epoch


def save_training_state(
    cfg: TrainerConfig,
    info: DistInfo,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    sampler: ShardedSampler | None,
    *,
    step: int,
    epoch: int,
    metrics: dict[str, float],
) -> Path | None:
    """Rank 0 writes the checkpoint of `step` and returns its path (None elsewhere); a failed
    save raises on every rank."""
    rng = [None] * info.world_size
    dist.all_gather_object(rng, ckpt.capture_rng_state())
    # Collective when sharded (ZeRO gathers every rank's shard), so every rank calls it.
    model_state, optimizer_state = _whole_states(model, optimizer)
    error, path = None, None
    if info.is_main:
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "sampler": sampler.state_dict() if sampler is not None else None,
            "rng": rng,
            "config": asdict(cfg),
            "world_size": info.world_size,
        }
        best = cfg.best_metric if cfg.best_metric in metrics else None
        try:
            path = ckpt.save_checkpoint(
                cfg.checkpoint_dir,
                state,
                step=step,
                epoch=epoch,
                metrics=metrics,
                keep_last=cfg.keep_last,
                best_metric=best,
                best_mode=cfg.best_mode,
            )
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank
            error = f"saving the checkpoint of step {step} failed: {e}"
    error = broadcast_object(error)
    if error:
        raise ckpt.CheckpointError(error)
    return path


def _whole_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The plain module's state_dict and the plain optimizer's, whatever is sharded: what a
    checkpoint holds, so it loads at any world size and zero_stage, or without ddptrain."""
    if isinstance(model, FullyShardedDataParallel):
        return model.state_dict(), model.optim_state_dict(optimizer)
    return model.module.state_dict(), optimizer.state_dict()


def _latest_setting_aside_invalid(directory: str) -> Path | None:
    """The newest valid checkpoint in `directory`; each newer, invalid one is moved into its
    invalid/ subfolder with one line saying why, so resume='auto' never stops behind it."""
    path, skipped = ckpt.latest_valid_checkpoint(directory)
    for invalid, reason in skipped:
        moved = ckpt.set_aside_checkpoint(invalid)
        print0(f"resume='auto': {invalid} {reason}; moved it and its sidecar to {moved.parent}/")
    return path


def _refuse_later_checkpoints(cfg: TrainerConfig, step: int) -> None:
    """Resuming behind newer checkpoints would later collide with their step numbers."""
    if not cfg.checkpoint_dir:
        return
    later = [
        p.name
        for p in ckpt.list_checkpoints(cfg.checkpoint_dir)
        if (ckpt.parse_step(p.name) or 0) > step
    ]
    if later:
        raise ckpt.CheckpointError(
            f"resuming from step {step}, but {cfg.checkpoint_dir} already holds later "
            f"checkpoints ({', '.join(later[:3])}{', ...' if len(later) > 3 else ''}), whose "
            "step numbers this run would write again; resume from the newest with "
            "resume='auto' (recipe: --resume auto), which sets aside any that fail "
            "verification, move the later ones out of the directory, or use another "
            "checkpoint_dir"
        )

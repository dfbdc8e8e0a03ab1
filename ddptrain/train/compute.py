"""How the model's forward runs: activation checkpointing of its blocks, and torch.compile.

    checkpoint_blocks(model.blocks)   # backward recomputes each block's activations
    compile_blocks(model.blocks)      # one compiled forward shared by the blocks of a class
    prepare_model(cfg, module, blocks)   # what TrainerConfig asks for, before wrapping

Both act on each block's forward, inside the block's call, never around it: hooks on the
block (the fully sharded wrapper gathers a unit's parameters in them) run once per forward, and
the recomputation in backward reads the same parameters the forward did. Checkpointing is
torch.utils.checkpoint's non-reentrant form: the forward's graph is recorded as usual (the DDP
wrapper sees every parameter it reaches) and only the saved activations are dropped, so the
gradients are the same bits as without it (tests/train/test_gpt_trainer.py).

Under the DDP wrapper (zero_stage 0 and 1) compile=True compiles the whole module in place
(`nn.Module.compile`: its state_dict keys stay the plain ones) and the wrapper around it stays
eager, so its hooks, buckets and overlap are unchanged. Under the fully sharded wrapper (2, 3)
the blocks are the units and each block's forward is compiled between the wrapper's gathers,
which a compiled graph could not contain.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddptrain.train.config import ConfigError, TrainerConfig

# Set on a block whose forward checkpoint_blocks wrapped, so that it is wrapped once.
CHECKPOINTED = "_ddptrain_checkpointed"


def checkpoint_blocks(blocks: Sequence[nn.Module]) -> None:
    """Run each block's forward under non-reentrant activation checkpointing (in training:
    with gradients enabled); the RNG state is replayed, so dropout masks recompute alike."""
    for block in blocks:
        if getattr(block, CHECKPOINTED, False):
            continue
        block.forward = functools.partial(_checkpointed, block.forward)
        setattr(block, CHECKPOINTED, True)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # evaluation: nothing is saved for a backward
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def compile_blocks(blocks: Sequence[nn.Module]) -> None:
    """torch.compile each block's forward (not its call: hooks on the block stay eager); the
    blocks of one class share one compiled function, traced once for all of them."""
    compiled: dict[type, Callable[..., Any]] = {}
    for block in blocks:
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward)
        block.forward = functools.partial(compiled[cls], block)


def prepare_model(
    cfg: TrainerConfig, module: nn.Module, blocks: Sequence[nn.Module] | None
) -> None:
    """Apply cfg's activation_checkpointing and compile to `module` (before it is wrapped);
    `blocks` are the model's repeated blocks (Trainer.blocks), None if it has none."""
    if not blocks and (cfg.activation_checkpointing or (cfg.compile and cfg.zero_stage >= 2)):
        what = "activation_checkpointing" if cfg.activation_checkpointing else "compile"
        raise ConfigError(
            f"{what} acts on the model's blocks, and {type(module).__name__} has none that "
            "Trainer.blocks() finds (a ModuleList named `blocks`); override blocks(model) to "
            "return its repeated layers"
        )
    if cfg.compile and cfg.zero_stage >= 2:
        compile_blocks(blocks)
    if cfg.activation_checkpointing:
        checkpoint_blocks(blocks)
    if cfg.compile and cfg.zero_stage < 2:
        module.compile()


def default_blocks(module: nn.Module) -> list[nn.Module] | None:
    """The module's `blocks` if it is a ModuleList of them (ddptrain.models.GPT's), else None."""
    blocks = getattr(module, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) and len(blocks) else None

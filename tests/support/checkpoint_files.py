"""What the checkpoint tests share: the smallest state worth saving, and a folder's file names
(`from checkpoint_files import file_names, tiny_state`)."""

from __future__ import annotations

import os

import torch


def tiny_state(value: float = 1.0) -> dict:
    """A one-tensor model state that save_checkpoint accepts; `value` tells copies apart."""
    return {"model": {"w": torch.full((3,), value)}, "world_size": 1}


def file_names(directory) -> list[str]:
    """The names in `directory`, sorted."""
    return sorted(os.listdir(directory))

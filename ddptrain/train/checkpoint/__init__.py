"""Checkpoints: what one holds (contents.py), how it is stored (files.py), and how a distributed
run reads and writes them, rank 0 on behalf of every rank (resume.py).

    save_checkpoint("ckpts", state, step=step, epoch=epoch, metrics={"val_loss": 0.31},
                    keep_last=3, best_metric="val_loss")     # rank 0 only
    path = latest_checkpoint("ckpts")                        # newest VALID one, or None
    state = load_checkpoint(path)                            # weights_only: nothing executes
    load_model_state(model, state["model"])                  # names keys of another model

A checkpoint is a torch.save of a plain dict: `torch.load(path, weights_only=True)["model"]`
loads into a plain nn.Module without ddptrain.
"""

from ddptrain.train.checkpoint.contents import (
    FORMAT_KEY,
    FORMAT_VERSION,
    capture_rng_state,
    check_model_compat,
    load_checkpoint,
    load_model_state,
    restore_rng_state,
    save_checkpoint,
)
from ddptrain.train.checkpoint.files import (
    BEST_POINTER,
    INVALID_DIR,
    CheckpointError,
    best_checkpoint,
    check_writable,
    checkpoint_name,
    latest_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    parse_step,
    set_aside_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "BEST_POINTER",
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "INVALID_DIR",
    "CheckpointError",
    "best_checkpoint",
    "capture_rng_state",
    "check_model_compat",
    "check_writable",
    "checkpoint_name",
    "latest_checkpoint",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_state",
    "parse_step",
    "restore_rng_state",
    "save_checkpoint",
    "set_aside_checkpoint",
    "verify_checkpoint",
]

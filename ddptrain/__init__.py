"""ddptrain: a small, readable data-parallel training framework on torch.distributed."""

from ddptrain.ddp import DDP, DistributedDataParallel
from ddptrain.dist import (
    DistInfo,
    all_reduce_mean,
    all_reduce_sum,
    broadcast_object,
    init_distributed,
    is_main,
    print0,
    shutdown,
)
from ddptrain.launch import WorkerError, spawn

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "DistInfo",
    "DistributedDataParallel",
    "WorkerError",
    "all_reduce_mean",
    "all_reduce_sum",
    "broadcast_object",
    "init_distributed",
    "is_main",
    "print0",
    "shutdown",
    "spawn",
]

"""ddptrain: a small, readable data-parallel training framework on torch.distributed."""

from ddptrain import cpu  # noqa: F401 - registers the CPU transports as the default
from ddptrain.comm import named_hook
from ddptrain.data import DataPartitioner, EvalSampler, ShardedSampler
from ddptrain.ddp.wrapper import DDP, DistributedDataParallel
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
from ddptrain.fsdp.wrapper import FSDP, FullyShardedDataParallel
from ddptrain.launch.spawn import WorkerError, spawn
from ddptrain.nn.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from ddptrain.optim.zero import ZeroRedundancyOptimizer
from ddptrain.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from ddptrain.train.config import TrainerConfig
from ddptrain.train.evaluation import evaluate
from ddptrain.train.trainer import NonFiniteError, Trainer

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "CheckpointError",
    "DataPartitioner",
    "DistInfo",
    "DistributedDataParallel",
    "EvalSampler",
    "FSDP",
    "FullyShardedDataParallel",
    "NonFiniteError",
    "ShardedSampler",
    "SyncBatchNorm",
    "Trainer",
    "TrainerConfig",
    "WorkerError",
    "ZeroRedundancyOptimizer",
    "all_reduce_mean",
    "all_reduce_sum",
    "broadcast_object",
    "convert_sync_batchnorm",
    "evaluate",
    "init_distributed",
    "is_main",
    "latest_checkpoint",
    "load_checkpoint",
    "named_hook",
    "print0",
    "shutdown",
    "spawn",
]

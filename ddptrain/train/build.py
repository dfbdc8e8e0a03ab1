"""What Trainer.fit builds before the loop, as functions of the config: checks, wrapper, sampler,
loader, optimizer pair, step count.

    train_set, eval_set = build.check_datasets(cfg, *trainer.build_datasets())
    model = build.wrap_model(cfg, module)
    sampler = build.sampler(cfg, len(train_set))
    loader = build.loader(cfg, info, sampler, train_set)
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddptrain.comm import named_hook
from ddptrain.data import MicroBatchSampler, ShardedSampler
from ddptrain.data.loader import batch_loader
from ddptrain.ddp.buckets import DEFAULT_FIRST_BUCKET_CAP_MB
from ddptrain.ddp.hooks import CommHook, module_on_cpu
from ddptrain.ddp.wrapper import DistributedDataParallel
from ddptrain.dist import DistInfo
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.nn.sync_batchnorm import convert_sync_batchnorm
from ddptrain.optim.zero import ZeroRedundancyOptimizer
from ddptrain.train.config import ConfigError, TrainerConfig


def check_datasets(
    cfg: TrainerConfig, train_set: Dataset, eval_set: Dataset | None
) -> tuple[Dataset, Dataset | None]:
    """Refuse an empty training set or a global batch larger than it (sized datasets only),
    and a best_metric with nothing to evaluate."""
    if cfg.best_metric is not None and eval_set is None:
        raise ConfigError(
            f"best_metric={cfg.best_metric!r} needs an evaluation, but build_datasets() "
            "returned no eval set; return (train_set, eval_set), or set best_metric=None"
        )
    if isinstance(train_set, IterableDataset):  # each rank's own part: no length to check
        return train_set, eval_set
    if len(train_set) == 0:
        raise ValueError(
            "the training dataset is empty; build_datasets() returned 0 samples: check the "
            "data path and any filtering in build_datasets()"
        )
    if cfg.global_batch_size > len(train_set):
        raise ConfigError(
            f"global_batch_size {cfg.global_batch_size} is larger than the training "
            f"set ({len(train_set)} samples); use global_batch_size <= {len(train_set)}"
        )
    return train_set, eval_set


def wrap_model(
    cfg: TrainerConfig, module: nn.Module, blocks: Sequence[nn.Module] | None = None
) -> DistributedDataParallel | FullyShardedDataParallel:
    """The wrapper the config asks for (SyncBatchNorm converted first): DDP for zero_stage 0
    and 1, the fully sharded wrapper for 2 (parameters gathered once a step) and 3, whose
    units are the model's `blocks` when it has them, else chosen by size."""
    if cfg.sync_batchnorm:
        module = convert_sync_batchnorm(module)
    if cfg.zero_stage >= 2:
        units = list(blocks) if blocks else None
        return FullyShardedDataParallel(
            module,
            units=units,
            reshard_after_forward=cfg.zero_stage == 3,
            deterministic=cfg.deterministic,
        )
    return DistributedDataParallel(
        module,
        bucket_cap_mb=cfg.bucket_cap_mb,
        # A small first bucket starts communication early in backward, whatever the cap.
        first_bucket_cap_mb=min(DEFAULT_FIRST_BUCKET_CAP_MB, cfg.bucket_cap_mb),
        comm_hook=comm_hook(cfg, module),
        deterministic=cfg.deterministic,
    )


def pin_kernels(device: torch.device) -> None:
    """deterministic=True: kernels whose bits depend on anything but their inputs are pinned:
    one CPU thread per rank (a convolution's or a matmul's sums are split by thread count),
    and on CUDA torch's deterministic algorithms."""
    torch.set_num_threads(1)
    if device.type == "cuda":
        # cuBLAS needs it before its first call to give the same bits every time.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def exact_sums(model: nn.Module) -> Any:
    """Either wrapper's deterministic state; its `step` keys the micro-batches' random numbers
    (a resumed run sets it)."""
    return model.exact if isinstance(model, FullyShardedDataParallel) else model.reducer


def comm_hook(cfg: TrainerConfig, module: nn.Module) -> tuple[object, CommHook] | None:
    """Collective: the (state, hook) the config names (None: the wrapper's default)."""
    if cfg.comm_hook == "default":
        return None
    return named_hook(
        cfg.comm_hook,
        on_cpu=module_on_cpu(module),
        powersgd_rank=cfg.powersgd_rank,
        powersgd_start_step=cfg.powersgd_start_step,
    )


def sampler(cfg: TrainerConfig, num_samples: int) -> ShardedSampler | MicroBatchSampler:
    """The resumable sampler of micro-batches (a step is cfg.accumulation(world_size) of
    them); deterministic: the same samples in micro-batch k at any world size."""
    order = {"shuffle": cfg.shuffle, "seed": cfg.seed, "drop_last": cfg.drop_last}
    if cfg.deterministic:
        return MicroBatchSampler(
            num_samples,
            global_batch_size=cfg.global_batch_size,
            micro_batch_size=cfg.micro_batch_size,
            **order,
        )
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return ShardedSampler(num_samples, global_batch_size=cfg.round_size(world_size), **order)


def loader(
    cfg: TrainerConfig, info: DistInfo, sampler: ShardedSampler, train_set: Dataset
) -> DataLoader:
    """This rank's DataLoader over its shard of every global batch."""
    return batch_loader(
        train_set,
        sampler,
        sampler.per_rank_batch_size,
        num_workers=cfg.num_workers,
        pin_memory=info.device.type == "cuda",
        # Its own generator: iter(loader) draws a worker seed, which must not consume the
        # global RNG that dropout uses, or a resumed run would draw different masks.
        generator=torch.Generator().manual_seed(cfg.seed),
        **worker_processes(cfg.num_workers),
    )


def worker_processes(num_workers: int) -> dict[str, Any]:
    """DataLoader keywords for `num_workers` loading processes (none for 0)."""
    if num_workers == 0:
        return {}
    # Not forked from this process: a rank runs threads (communication, heartbeat), and a
    # fork while one of them holds an interpreter lock leaves the worker deadlocked at its
    # start (seen on Python 3.11). Persistent, so the start is paid once, not per epoch.
    if "forkserver" not in mp.get_all_start_methods():
        return {"multiprocessing_context": "spawn", "persistent_workers": True}
    ctx = mp.get_context("forkserver")
    # The workers then fork with torch imported instead of importing it each (seconds a
    # worker). Only if this starts the process's forkserver; one already running keeps its own.
    ctx.set_forkserver_preload(["torch"])
    return {"multiprocessing_context": ctx, "persistent_workers": True}


def optimizer(cfg: TrainerConfig, value: Any) -> tuple[torch.optim.Optimizer, Any]:
    """(optimizer, scheduler or None) from what configure_optimizers returned."""
    if isinstance(value, torch.optim.Optimizer):
        opt, scheduler = value, None
    elif isinstance(value, tuple) and len(value) == 2:
        opt, scheduler = value
    else:
        raise TypeError(
            "configure_optimizers must return an optimizer or (optimizer, lr_scheduler), "
            f"got {type(value).__name__}"
        )
    if cfg.zero_stage == 1:
        # The user's optimizer only describes the run (class, groups, hyperparameters);
        # ZeRO shares its param_groups, so a scheduler built on it still sets the lr.
        opt = ZeroRedundancyOptimizer.from_optimizer(opt)
    # Stages 2 and 3: the module's parameters are already this rank's shards, so the user's
    # optimizer, built on them, holds 1/world_size of the state as it is.
    return opt, scheduler


def whole_parameters(model: nn.Module) -> contextlib.AbstractContextManager:
    """Where model.module holds whole parameters, for evaluating it alone on each rank:
    gathered for the duration under zero_stage 2 and 3 (collective), else as it is."""
    if isinstance(model, FullyShardedDataParallel):
        return model.summon_full_params()
    return contextlib.nullcontext()


def steps_per_optimizer_step(scheduler: Any) -> bool:
    """Whether the Trainer steps `scheduler` after each optimizer step; ReduceLROnPlateau
    needs a metric, so it is stepped after each evaluation instead (plateau_step)."""
    return scheduler is not None and not isinstance(
        scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
    )


def plateau_metric(cfg: TrainerConfig) -> str:
    """The evaluation metric a ReduceLROnPlateau scheduler follows."""
    return cfg.best_metric or "eval_loss"


def check_plateau(scheduler: Any, eval_set: Dataset | None) -> None:
    """Refuse a ReduceLROnPlateau with nothing to evaluate."""
    if scheduler is not None and not steps_per_optimizer_step(scheduler) and eval_set is None:
        raise ConfigError(
            "ReduceLROnPlateau is stepped with an evaluation metric after each evaluation, but "
            "build_datasets() returned no eval set; return (train_set, eval_set), or use a "
            "schedule stepped per optimizer step"
        )


def plateau_step(cfg: TrainerConfig, scheduler: Any, metrics: dict[str, float]) -> None:
    """Step a ReduceLROnPlateau with this evaluation's metric (no-op for other schedulers)."""
    if scheduler is None or steps_per_optimizer_step(scheduler):
        return
    name = plateau_metric(cfg)
    if name not in metrics:
        raise ConfigError(
            f"ReduceLROnPlateau follows {name!r} (best_metric, else eval_loss), which the "
            f"evaluation does not give ({sorted(metrics)}); return 'loss' from "
            "validation_step or set best_metric to one of them"
        )
    scheduler.step(metrics[name])


def epoch_steps(cfg: TrainerConfig, sampler: ShardedSampler) -> int:
    """Optimizer steps in cfg.epochs epochs of the sampler (an epoch's last step may be short)."""
    accumulation = cfg.accumulation(sampler.world_size)
    return math.ceil(sampler.batches_per_epoch / accumulation) * cfg.epochs


def total_steps(cfg: TrainerConfig, sampler: ShardedSampler) -> int:
    """Optimizer steps in the run: epochs of the sampler, capped by max_steps."""
    by_epochs = epoch_steps(cfg, sampler)
    return min(by_epochs, cfg.max_steps) if cfg.max_steps is not None else by_epochs

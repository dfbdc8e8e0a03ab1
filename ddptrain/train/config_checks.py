"""What TrainerConfig refuses that no single field's check can see: settings that cannot work
together (a sharded stage with a comm hook), or with the files they need (no checkpoint_dir).
Each error names the setting and the fix; the recipes turn names into flags (ddptrain/flags.py).

    check_together(cfg)              # TrainerConfig.__post_init__ calls it
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from ddptrain.train.metrics import TENSORBOARD_HINT, tensorboard_installed
from ddptrain.train.preempt import signal_number

if TYPE_CHECKING:
    from ddptrain.train.config import TrainerConfig

# What deterministic=True can sum exactly (ddptrain/comm.py names; casts and PowerSGD round).
EXACT_COMM_HOOKS = ("default", "allreduce", "shm", "tcp", "ring")


class ConfigError(ValueError):
    """A setting that cannot work (alone, or with this world size); the message names the fix."""


def check_together(cfg: TrainerConfig) -> None:
    """Raise ConfigError for the first combination of settings that cannot work."""
    check_deterministic(cfg)
    check_sharded(cfg)
    if cfg.resume == "auto" and not cfg.checkpoint_dir:
        raise ConfigError("resume='auto' looks in checkpoint_dir; set checkpoint_dir too")
    check_preemption(cfg)
    if cfg.best_metric is not None and not cfg.checkpoint_dir:
        raise ConfigError(
            f"best_metric={cfg.best_metric!r} marks the best checkpoint in checkpoint_dir; "
            "set checkpoint_dir too"
        )
    check_observability(cfg)


def check_preemption(cfg: TrainerConfig) -> None:
    for name in ("checkpoint_every_steps", "checkpoint_every_minutes"):
        value = getattr(cfg, name)
        if value is not None and not cfg.checkpoint_dir:
            raise ConfigError(f"{name}={value} saves into checkpoint_dir; set checkpoint_dir too")
    numbers = []
    for name in cfg.preempt_signals:
        try:
            numbers.append(signal_number(name))
        except ValueError as e:
            raise ConfigError(f"preempt_signals: {e}") from None
        if numbers[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(
                f"preempt_signals: {numbers[-1].name} cannot be caught; use SIGTERM, SIGINT, "
                "SIGUSR1 or SIGUSR2"
            )
    cfg.preempt_signals = tuple(number.name for number in numbers)


def check_deterministic(cfg: TrainerConfig) -> None:
    """Refuse what would make a deterministic run depend on the world size."""
    if not cfg.deterministic:
        if cfg.micro_batch_size is not None:
            raise ConfigError(
                "micro_batch_size splits steps with deterministic=True; set deterministic, "
                "or use grad_accum_steps"
            )
        return
    problems = {
        "micro_batch_size": cfg.micro_batch_size is None,
        "grad_accum_steps": cfg.grad_accum_steps != 1,
        "comm_hook": cfg.comm_hook not in EXACT_COMM_HOOKS,
        "precision": cfg.precision == "fp16",
        "sync_batchnorm": cfg.sync_batchnorm,
    }
    why = {
        "micro_batch_size": "set micro_batch_size, the samples of one forward and backward",
        "grad_accum_steps": "micro_batch_size sets the micro-batches; leave grad_accum_steps 1",
        "comm_hook": f"integers are summed exactly only by {', '.join(EXACT_COMM_HOOKS)}",
        "precision": "fp16's loss scale skips steps by each rank's inf/NaN; use bf16 or fp32",
        "sync_batchnorm": "statistics over every rank's batch change with the world size",
    }
    for name, bad in problems.items():
        if bad:
            raise ConfigError(f"deterministic=True with {name}={getattr(cfg, name)!r}: {why[name]}")
    if cfg.global_batch_size % cfg.micro_batch_size:
        raise ConfigError(
            f"global_batch_size {cfg.global_batch_size} is not a whole number of "
            f"micro_batch_size {cfg.micro_batch_size} micro-batches"
        )


def check_sharded(cfg: TrainerConfig) -> None:
    """Refuse what cannot work when gradients and parameters are sharded (stages 2, 3)."""
    if cfg.zero_stage < 2:
        return
    stage = f"zero_stage={cfg.zero_stage}"
    if cfg.comm_hook != "default":
        raise ConfigError(
            f"comm_hook={cfg.comm_hook!r} with {stage}: stages 2 and 3 reduce-scatter "
            "gradients over the backend, and comm hooks reduce whole buckets under the DDP "
            "wrapper; use comm_hook='default', or zero_stage 0 or 1"
        )
    if cfg.check_replicas_every is not None:
        raise ConfigError(
            f"check_replicas_every with {stage}: each rank holds its own shard of the "
            "parameters, so there are no replicas to compare; set check_replicas_every=None"
        )
    if cfg.precision == "fp16":
        raise ConfigError(
            f"precision='fp16' with {stage}: GradScaler would look for inf/NaN in each "
            "rank's gradient shard alone, and ranks could disagree on skipping a step; use "
            "precision='bf16' or 'fp32'"
        )


def check_observability(cfg: TrainerConfig) -> None:
    if "tensorboard" in cfg.loggers:
        if not tensorboard_installed():
            raise ConfigError(TENSORBOARD_HINT)
        if not cfg.log_dir:
            raise ConfigError("loggers with 'tensorboard' write into log_dir; set log_dir")
    if cfg.profile_steps is not None:
        if not (cfg.log_dir or cfg.checkpoint_dir):
            raise ConfigError(
                "profile_steps writes one trace per rank into log_dir (or checkpoint_dir); "
                "set log_dir"
            )

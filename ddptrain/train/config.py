"""TrainerConfig: every knob of the loop, as a keyword-only dataclass whose errors name the fix.

    cfg = TrainerConfig(global_batch_size=128, epochs=10, checkpoint_dir="ckpt", resume="auto")

Batch sizes are GLOBAL: one optimizer step sees `global_batch_size` samples in all, split into
world_size ranks x grad_accum_steps micro-batches of `global_batch_size // (world_size *
grad_accum_steps)` each, so the same config trains the same way at any world size.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, fields
from typing import Any

from ddptrain.comm import NAMES
from ddptrain.compress.powersgd import NAMED_RANK, NAMED_START_STEP
from ddptrain.train.log import LOGGERS, TENSORBOARD_HINT, tensorboard_installed
from ddptrain.train.preempt import DEFAULT_PREEMPT_SIGNALS, signal_number

# Settings that define the sample order and step size: a resumed run must keep them.
RESUME_INVARIANT_FIELDS = ("global_batch_size", "grad_accum_steps", "seed", "shuffle", "drop_last")
PRECISIONS = ("fp32", "bf16", "fp16")
# The names ddptrain/comm.py resolves: "default" is the wrapper's own choice.
COMM_HOOKS = NAMES
NONFINITE_POLICIES = ("stop", "skip")
# 0: every rank keeps the whole optimizer state; 1: ZeRO stage 1 shards it across ranks;
# 2: gradients too (reduce-scattered); 3: parameters too, gathered per unit as they are used.
ZERO_STAGES = (0, 1, 2, 3)


class ConfigError(ValueError):
    """A setting that cannot work (alone, or with this world size); the message names the fix."""


@dataclass(kw_only=True)
class TrainerConfig:
    """Settings of Trainer.fit(); validated on construction."""

    global_batch_size: int = 128
    epochs: int = 1
    max_steps: int | None = None
    grad_accum_steps: int = 1
    grad_clip_norm: float | None = None
    precision: str = "fp32"
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = 0
    eval_batch_size: int = 1000
    eval_every_steps: int | None = None
    log_every_steps: int = 50
    log_dir: str | None = None
    progress_bar: bool | None = None
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    # Also save when this many minutes passed since the last save (rank 0's clock decides).
    checkpoint_every_minutes: float | None = None
    keep_last: int = 3
    best_metric: str | None = None
    best_mode: str = "max"
    resume: str | None = None
    backend: str | None = None
    timeout_s: float = 300.0
    bucket_cap_mb: float = 25.0
    comm_hook: str = "default"
    # comm_hook="powersgd": the rank of each compressed gradient, and the steps averaged
    # uncompressed first (docs/guide.md, "When to compress").
    powersgd_rank: int = NAMED_RANK
    powersgd_start_step: int = NAMED_START_STEP
    # BatchNorm statistics over the global batch (SyncBatchNorm): for small per-rank batches.
    sync_batchnorm: bool = False
    nonfinite: str = "stop"
    heartbeat_timeout_s: float | None = 30.0
    # With checkpoint_dir: on these signals save at the next step boundary and exit with
    # ddptrain.train.preempt.PREEMPTED_EXIT_CODE (train/preempt.py); () keeps their defaults.
    preempt_signals: tuple[str, ...] = DEFAULT_PREEMPT_SIGNALS
    check_replicas_every: int | None = None
    zero_stage: int = 0
    loggers: tuple[str, ...] = ("jsonl",)
    profile_steps: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        positive = {
            "global_batch_size": self.global_batch_size,
            "epochs": self.epochs,
            "grad_accum_steps": self.grad_accum_steps,
            "eval_batch_size": self.eval_batch_size,
            "log_every_steps": self.log_every_steps,
            "keep_last": self.keep_last,
        }
        optional_positive = {
            "max_steps": self.max_steps,
            "eval_every_steps": self.eval_every_steps,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "check_replicas_every": self.check_replicas_every,
        }
        for name, value in {**positive, **optional_positive}.items():
            if value is None and name in optional_positive:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                hint = " (or None)" if name in optional_positive else ""
                raise ConfigError(f"{name} must be a positive integer{hint}, got {value!r}")
        if isinstance(self.powersgd_rank, bool) or not isinstance(self.powersgd_rank, int):
            raise ConfigError(f"powersgd_rank must be an integer >= 1, got {self.powersgd_rank!r}")
        if self.powersgd_rank < 1:
            raise ConfigError(f"powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if self.powersgd_start_step < 2:
            raise ConfigError(
                f"powersgd_start_step must be >= 2, got {self.powersgd_start_step}: the wrapper "
                "rebuilds its buckets after the first step, which PowerSGD's memory outlives"
            )
        if self.num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ConfigError(f"grad_clip_norm must be > 0 or None, got {self.grad_clip_norm}")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.heartbeat_timeout_s is not None and not self.heartbeat_timeout_s > 1:
            raise ConfigError(
                f"heartbeat_timeout_s must be > 1 s (or None to disable), got "
                f"{self.heartbeat_timeout_s}"
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name, value, allowed in (
            ("precision", self.precision, PRECISIONS),
            ("comm_hook", self.comm_hook, COMM_HOOKS),
            ("nonfinite", self.nonfinite, NONFINITE_POLICIES),
            ("best_mode", self.best_mode, ("min", "max")),
        ):
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}")
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise ConfigError(
                f"zero_stage={self.zero_stage!r} is not one of {list(ZERO_STAGES)}: 1 shards the "
                "optimizer state across ranks, 2 the gradients too, 3 the parameters too"
            )
        self._check_sharded()
        if self.resume is not None and self.resume != "auto" and not isinstance(self.resume, str):
            raise ConfigError(
                f"resume must be None, 'auto' or a checkpoint path, got {self.resume!r}"
            )
        if self.resume == "auto" and not self.checkpoint_dir:
            raise ConfigError("resume='auto' looks in checkpoint_dir; set checkpoint_dir too")
        self._check_preemption()
        if self.best_metric is not None and not self.checkpoint_dir:
            raise ConfigError(
                f"best_metric={self.best_metric!r} marks the best checkpoint in checkpoint_dir; "
                "set checkpoint_dir too"
            )
        self._check_observability()

    def _check_preemption(self) -> None:
        minutes = self.checkpoint_every_minutes
        if minutes is not None:
            if isinstance(minutes, bool) or not isinstance(minutes, int | float) or minutes <= 0:
                raise ConfigError(
                    f"checkpoint_every_minutes must be > 0 (or None), got {minutes!r}"
                )
            if not self.checkpoint_dir:
                raise ConfigError(
                    f"checkpoint_every_minutes={minutes} saves into checkpoint_dir; set "
                    "checkpoint_dir too"
                )
        if isinstance(self.preempt_signals, str):
            raise ConfigError(
                f"preempt_signals={self.preempt_signals!r}: use a tuple of signal names, e.g. "
                "('SIGTERM', 'SIGUSR1'), or () to leave every signal's default action"
            )
        for name in self.preempt_signals:
            try:
                number = signal_number(name)
            except ValueError as e:
                raise ConfigError(f"preempt_signals: {e}") from None
            if number in (signal.SIGKILL, signal.SIGSTOP):
                raise ConfigError(
                    f"preempt_signals: {number.name} cannot be caught; use SIGTERM, SIGINT, "
                    "SIGUSR1 or SIGUSR2"
                )

    def _check_sharded(self) -> None:
        """Refuse what cannot work when gradients and parameters are sharded (stages 2, 3)."""
        if self.zero_stage < 2:
            return
        stage = f"zero_stage={self.zero_stage}"
        if self.comm_hook != "default":
            raise ConfigError(
                f"comm_hook={self.comm_hook!r} with {stage}: stages 2 and 3 reduce-scatter "
                "gradients over the backend, and comm hooks reduce whole buckets under the DDP "
                "wrapper; use comm_hook='default', or zero_stage 0 or 1"
            )
        if self.check_replicas_every is not None:
            raise ConfigError(
                f"check_replicas_every with {stage}: each rank holds its own shard of the "
                "parameters, so there are no replicas to compare; set check_replicas_every=None"
            )
        if self.precision == "fp16":
            raise ConfigError(
                f"precision='fp16' with {stage}: GradScaler would look for inf/NaN in each "
                "rank's gradient shard alone, and ranks could disagree on skipping a step; use "
                "precision='bf16' or 'fp32'"
            )

    def check_best_metric(self, metrics: dict[str, float]) -> None:
        """Refuse a best_metric the evaluation does not produce: keep_last would otherwise
        delete the best checkpoint, never having known which it was."""
        if self.best_metric is None or self.best_metric in metrics:
            return
        guess = f"eval_{self.best_metric}"
        hint = f"best_metric={guess!r}" if guess in metrics else "one of them"
        raise ConfigError(
            f"best_metric={self.best_metric!r} is not among the evaluation's metrics "
            f"{sorted(metrics)}; use {hint}"
        )

    def _check_observability(self) -> None:
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown or isinstance(self.loggers, str):
            raise ConfigError(f"loggers={self.loggers!r}: use a tuple of {list(LOGGERS)}")
        if "tensorboard" in self.loggers:
            if not tensorboard_installed():
                raise ConfigError(TENSORBOARD_HINT)
            if not self.log_dir:
                raise ConfigError("loggers with 'tensorboard' write into log_dir; set log_dir")
        if self.profile_steps is not None:
            steps = tuple(self.profile_steps)
            if not (
                len(steps) == 2
                and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                and 1 <= steps[0] <= steps[1]
            ):
                raise ConfigError(
                    f"profile_steps={self.profile_steps!r}: use (first, last) optimizer steps, "
                    "1 <= first <= last, e.g. (5, 7) profiles steps 5, 6 and 7"
                )
            if not (self.log_dir or self.checkpoint_dir):
                raise ConfigError(
                    "profile_steps writes one trace per rank into log_dir (or checkpoint_dir); "
                    "set log_dir"
                )

    @property
    def micro_global_batch_size(self) -> int:
        """Samples per micro-step across all ranks: global_batch_size // grad_accum_steps."""
        return self.global_batch_size // self.grad_accum_steps

    def check_world_size(self, world_size: int) -> None:
        """Raise if the global batch cannot be split evenly over ranks and accumulation steps."""
        unit = world_size * self.grad_accum_steps
        if self.global_batch_size % unit:
            low = self.global_batch_size // unit * unit
            high = low + unit
            options = f"{low} or {high}" if low else f"{high}"
            accum = (
                f" x grad_accum_steps {self.grad_accum_steps}" if self.grad_accum_steps > 1 else ""
            )
            raise ConfigError(
                f"global_batch_size {self.global_batch_size} is not divisible by world_size "
                f"{world_size}{accum}; use a multiple of {unit} (e.g. {options})"
            )
        if self.precision == "fp16" and not _cuda():
            raise ConfigError(
                "precision='fp16' needs CUDA (GradScaler); on CPU use precision='bf16' or 'fp32'"
            )

    def check_resumable(self, saved: dict[str, Any]) -> None:
        """Raise if a checkpoint's config differs in a setting that defines order or step size."""
        names = {f.name for f in fields(self)}
        for name in RESUME_INVARIANT_FIELDS:
            if name in saved and name in names and saved[name] != getattr(self, name):
                raise ConfigError(
                    f"cannot resume: the checkpoint was trained with {name}={saved[name]!r} but "
                    f"this run has {name}={getattr(self, name)!r}; set {name}={saved[name]!r} to "
                    "resume, or start a fresh run in another checkpoint_dir"
                )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()

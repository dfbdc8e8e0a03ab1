"""TrainerConfig: every knob of the loop, as a keyword-only dataclass whose errors name the fix.

    cfg = TrainerConfig(global_batch_size=128, epochs=10, checkpoint_dir="ckpt", resume="auto")
    ddptrain.flags.add_flags(parser, [TrainerConfig])    # each field a flag: --global-batch-size

Batch sizes are GLOBAL: one optimizer step sees `global_batch_size` samples in all, split into
world_size ranks x grad_accum_steps micro-batches of `global_batch_size // (world_size *
grad_accum_steps)` each, so the same config trains the same way at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from ddptrain.comm import NAMES
from ddptrain.compress.powersgd import NAMED_RANK, NAMED_START_STEP
from ddptrain.flags import NON_NEGATIVE, POSITIVE, Check, check_fields, setting
from ddptrain.train import config_checks
from ddptrain.train.config_checks import ConfigError
from ddptrain.train.health import LOST_RANK_EXIT_CODE
from ddptrain.train.metrics import LOGGERS
from ddptrain.train.preempt import DEFAULT_PREEMPT_SIGNALS, PREEMPTED_EXIT_CODE

# Settings that define the sample order and step size: a resumed run must keep them.
RESUME_INVARIANT_FIELDS = (
    *("global_batch_size", "grad_accum_steps", "seed", "shuffle", "drop_last"),
    *("deterministic", "micro_batch_size"),
)
# The names ddptrain/comm.py resolves: "default" is the wrapper's own choice.
COMM_HOOKS = NAMES


@dataclass(kw_only=True)
class TrainerConfig:
    """Settings of Trainer.fit(); validated on construction. Each field is also a recipe's
    command-line flag (`--field-name`), with this help and check (ddptrain/flags.py)."""

    # ----------------------------------------------------------------- training
    global_batch_size: int = setting(
        128,
        "samples per optimizer step, summed over ranks and micro-steps; divisible by world "
        "size x grad_accum_steps",
        group="training",
        check=POSITIVE,
    )
    epochs: int = setting(1, "passes over the training set", group="training", check=POSITIVE)
    max_steps: int | None = setting(
        None,
        "stop after N optimizer steps",
        group="training",
        check=POSITIVE,
        unset="all the epochs",
    )
    grad_accum_steps: int = setting(
        1,
        "micro-steps per optimizer step, all but the last under no_sync()",
        group="training",
        check=POSITIVE,
    )
    grad_clip_norm: float | None = setting(
        None,
        "clip the averaged gradients to this global norm",
        group="training",
        check=POSITIVE,
        unset="no clipping",
    )
    precision: Literal["fp32", "bf16", "fp16"] = setting(
        "fp32",
        "bf16: the forward under autocast; fp16: autocast and GradScaler, CUDA only",
        group="training",
    )
    seed: int = setting(
        0,
        "seed of the model's initial weights, the data order and dropout",
        group="training",
    )
    shuffle: bool = setting(
        True, "shuffle the training order each epoch (seeded)", group="training"
    )
    drop_last: bool = setting(
        False,
        "drop the last partial global batch instead of padding it by wrapping around",
        group="training",
    )
    num_workers: int = setting(
        0, "DataLoader worker processes per rank", group="training", check=NON_NEGATIVE
    )
    deterministic: bool = setting(
        False,
        "the same bits at any world size: each micro-batch of micro_batch_size samples summed "
        "exactly, dropout keyed by step and micro-batch, one CPU thread per rank (design.md)",
        group="training",
    )
    micro_batch_size: int | None = setting(
        None,
        "with deterministic: samples per forward and backward; global_batch_size / N "
        "micro-batches a step, shared by the ranks (replaces grad_accum_steps)",
        group="training",
        check=POSITIVE,
        unset="none",
    )
    nonfinite: Literal["stop", "skip"] = setting(
        "stop",
        "on inf/NaN averaged gradients: stop raises NonFiniteError on every rank, skip drops "
        "the step",
        group="training",
    )
    # ----------------------------------------------------------------- compute
    activation_checkpointing: bool = setting(
        False,
        "recompute each block's activations in backward instead of keeping them (the blocks "
        "Trainer.blocks() names): less memory for about one more forward of compute",
        group="compute",
    )
    compile: bool = setting(
        False,
        "torch.compile the model: the whole module under zero_stage 0 and 1, each block under "
        "2 and 3; the first step waits for the compiler",
        group="compute",
    )
    # ----------------------------------------------------------------- evaluation
    eval_batch_size: int = setting(
        1000, "evaluation batch size per rank", group="evaluation", check=POSITIVE
    )
    eval_every_steps: int | None = setting(
        None,
        "evaluate every N optimizer steps; always once at the end",
        group="evaluation",
        check=POSITIVE,
        unset="at each epoch's end",
    )
    # ----------------------------------------------------------------- checkpoints
    checkpoint_dir: str | None = setting(
        None,
        "where rank 0 writes checkpoints",
        group="checkpoints",
        metavar="DIR",
        unset="none, no checkpoints",
    )
    checkpoint_every_steps: int | None = setting(
        None,
        "checkpoint every N optimizer steps; always one at the end",
        group="checkpoints",
        check=POSITIVE,
        unset="at each epoch's end",
    )
    checkpoint_every_minutes: float | None = setting(
        None,
        "also checkpoint when this many minutes passed since the last one (rank 0's clock "
        "decides for every rank)",
        group="checkpoints",
        metavar="M",
        check=POSITIVE,
        unset="none",
    )
    keep_last: int = setting(
        3,
        "keep the newest K checkpoints (and the best one), delete older ones",
        group="checkpoints",
        metavar="K",
        check=POSITIVE,
    )
    best_metric: str | None = setting(
        None,
        "the evaluation metric that picks the best checkpoint, e.g. eval_accuracy",
        group="checkpoints",
        metavar="NAME",
        unset="none",
    )
    best_mode: Literal["max", "min"] = setting(
        "max",
        "whether the best checkpoint has the largest or smallest metric",
        group="checkpoints",
    )
    resume: str | None = setting(
        None,
        "auto: the newest valid checkpoint in the checkpoint dir (newer invalid ones moved "
        "into its invalid/), or a fresh start; or a checkpoint's path",
        group="checkpoints",
        metavar="{auto,PATH}",
        unset="a fresh start",
    )
    preempt_signals: tuple[str, ...] = setting(
        DEFAULT_PREEMPT_SIGNALS,
        "with a checkpoint dir, these signals save the current step and exit with status "
        f"{PREEMPTED_EXIT_CODE}; none keeps their default action",
        group="checkpoints",
        metavar="SIG,...",
    )
    # ----------------------------------------------------------------- distributed
    backend: str | None = setting(
        None,
        "process-group backend",
        group="distributed",
        metavar="NAME",
        unset="nccl with CUDA, else gloo",
    )
    timeout_s: float = setting(
        300.0,
        "seconds a rank waits for its peers in a collective",
        group="distributed",
        check=POSITIVE,
    )
    heartbeat_timeout_s: float | None = setting(
        30.0,
        f"a rank whose peer is silent this long exits with code {LOST_RANK_EXIT_CODE}; none: "
        "no heartbeat",
        group="distributed",
        check=Check(lambda v: v > 1, "> 1 s"),
    )
    zero_stage: Literal[0, 1, 2, 3] = setting(
        0,
        "shard across ranks: 1 the optimizer state (ZeRO-1), 2 the gradients too, 3 the "
        "parameters too",
        group="distributed",
    )
    comm_hook: str = setting(
        "default",
        "how gradients are averaged over ranks (ddptrain/comm.py): default is the wrapper's "
        "choice for the device and hosts",
        group="distributed",
        metavar="HOOK",
        choices=COMM_HOOKS,
    )
    bucket_cap_mb: float = setting(
        25.0,
        "DDP bucket cap in MiB (the first bucket stays <= 1 MiB)",
        group="distributed",
        metavar="MB",
        check=POSITIVE,
    )
    powersgd_rank: int = setting(
        NAMED_RANK,
        "with comm_hook powersgd: the rank each weight's gradient is compressed to",
        group="distributed",
        metavar="R",
        check=POSITIVE,
    )
    powersgd_start_step: int = setting(
        NAMED_START_STEP,
        "with comm_hook powersgd: steps averaged uncompressed first (the wrapper rebuilds its "
        "buckets after the first, which PowerSGD's memory outlives)",
        group="distributed",
        check=Check(lambda v: v >= 2, ">= 2"),
    )
    sync_batchnorm: bool = setting(
        False,
        "BatchNorm statistics over the global batch (SyncBatchNorm), for small per-rank batches",
        group="distributed",
    )
    check_replicas_every: int | None = setting(
        None,
        "every N steps, check that every rank holds the same parameters",
        group="distributed",
        check=POSITIVE,
        unset="never",
    )
    # ----------------------------------------------------------------- output
    log_dir: str | None = setting(
        None,
        "where rank 0 writes metrics.jsonl (then: python -m ddptrain.plot DIR)",
        group="output",
        metavar="DIR",
        unset="none, no logs",
    )
    log_every_steps: int = setting(
        50, "a training record every N steps (and at the last)", group="output", check=POSITIVE
    )
    loggers: tuple[str, ...] = setting(
        ("jsonl",),
        "what rank 0 writes into the log dir: jsonl (metrics.jsonl) and/or tensorboard",
        group="output",
        metavar="NAME,...",
        check=Check(lambda v: all(name in LOGGERS for name in v), f"names among {LOGGERS}"),
    )
    progress_bar: bool | None = setting(
        None,
        "a progress bar on rank 0",
        group="output",
        unset="when stderr is a terminal",
    )
    profile_steps: tuple[int, int] | None = setting(
        None,
        "trace optimizer steps A..B (numbered from 1) per rank into the log dir (Perfetto)",
        group="output",
        unset="none",
        check=Check(lambda v: 1 <= v[0] <= v[1], "(first, last) with 1 <= first <= last"),
    )

    def __post_init__(self) -> None:
        if isinstance(self.preempt_signals, str):
            raise ConfigError(
                f"preempt_signals={self.preempt_signals!r}: use a tuple of signal names, e.g. "
                "('SIGTERM', 'SIGUSR1'), or () to leave every signal's default action"
            )
        if isinstance(self.loggers, str):
            raise ConfigError(f"loggers={self.loggers!r}: use a tuple of {list(LOGGERS)}")
        for name in ("preempt_signals", "loggers", "profile_steps"):
            value = getattr(self, name)
            if isinstance(value, list):
                setattr(self, name, tuple(value))
        check_fields(self, ConfigError)
        config_checks.check_together(self)

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

    def accumulation(self, world_size: int) -> int:
        """Micro-batches a rank runs per optimizer step."""
        if self.deterministic:
            return self.global_batch_size // (self.micro_batch_size * world_size)
        return self.grad_accum_steps

    def round_size(self, world_size: int) -> int:
        """Samples of one micro-batch on every rank: global_batch_size // accumulation."""
        return self.global_batch_size // self.accumulation(world_size)

    def check_world_size(self, world_size: int) -> None:
        """Raise if the global batch cannot be split evenly over ranks and accumulation steps."""
        if self.deterministic:
            micro_batches = self.global_batch_size // self.micro_batch_size
            if micro_batches % world_size:
                fits = [w for w in range(1, micro_batches + 1) if micro_batches % w == 0]
                raise ConfigError(
                    f"deterministic=True: {micro_batches} micro-batches a step "
                    f"(global_batch_size {self.global_batch_size} / micro_batch_size "
                    f"{self.micro_batch_size}) cannot be shared by {world_size} ranks; run at a "
                    f"world size that divides {micro_batches}: {', '.join(map(str, fits))}"
                )
        unit = world_size * self.accumulation(world_size)
        if self.global_batch_size % unit:
            low = self.global_batch_size // unit * unit
            high = low + unit
            options = f"{low} or {high}" if low else f"{high}"
            accum = f" x grad_accum_steps {self.grad_accum_steps}" if unit > world_size else ""
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

"""Training on per-rank data parts of different lengths: each epoch runs under model.join().

    class ShardTrainer(Trainer):
        def build_datasets(self):
            return MyShards(rank=dist.get_rank()), eval_set   # an IterableDataset: this rank's part

    ShardTrainer(TrainerConfig(global_batch_size=64, epochs=3)).fit()

The Trainer takes this path when build_datasets() returns a torch IterableDataset: there is no
sampler, the DataLoader batches what the dataset yields (global_batch_size / world_size /
grad_accum_steps per micro-batch) and a rank whose part runs out first keeps answering the
others' collectives until the epoch ends everywhere. `len(dataset)`, when defined, is this
rank's sample count and gives the step count up front (for schedules); without it, set
`max_steps`. Everything collective besides the training step (loss logging, evaluation,
replica checks, checkpoints, naming the ranks of a non-finite step) waits for the epoch's end,
when ranks meet again; then the optimizer, scheduler and scaler states of the rank that
finished last are sent to the others, which skipped its last steps. Evaluation and
checkpoints happen at every epoch's end (eval_every_steps and checkpoint_every_steps do not
apply: ranks only meet there).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddptrain.train import health
from ddptrain.train.config import ConfigError
from ddptrain.train.evaluation import move_to

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer


def is_uneven(dataset: Dataset) -> bool:
    """Whether each rank reads its own part, of a length that may differ across ranks."""
    return isinstance(dataset, IterableDataset)


def check_supported(cfg: Any) -> None:
    """Refuse settings whose collectives a rank that ran out could not answer."""
    if cfg.profile_steps is not None:
        raise ConfigError(
            "profile_steps with an IterableDataset train set: the profiled steps start with a "
            "barrier, which a rank whose part ran out cannot join. Profile a map-style dataset "
            "run, or set profile_steps=None"
        )
    if cfg.zero_stage:
        raise ConfigError(
            f"zero_stage={cfg.zero_stage} with an IterableDataset train set: ZeRO's optimizer "
            "step is collective, and a rank whose part ran out skips it. Use zero_stage=0, or "
            "a map-style dataset (the ShardedSampler gives every rank the same batch count)"
        )


def per_rank_batch_size(trainer: Trainer) -> int:
    """Samples in one rank's micro-batch."""
    return trainer.config.micro_global_batch_size // trainer.info.world_size


def build_loader(trainer: Trainer, train_set: IterableDataset) -> DataLoader:
    """The loader batches this rank's part as the dataset yields it."""
    return DataLoader(
        train_set,
        batch_size=per_rank_batch_size(trainer),
        num_workers=trainer.config.num_workers,
        pin_memory=trainer.info.device.type == "cuda",
        drop_last=trainer.config.drop_last,
    )


def total_steps(trainer: Trainer, train_set: IterableDataset) -> int:
    """Optimizer steps of the whole run: the longest part sets each epoch's (collective)."""
    cfg = trainer.config
    try:
        samples = len(train_set)
    except TypeError:
        if cfg.max_steps is None:
            raise ConfigError(
                f"{type(train_set).__name__} has no __len__, so the number of steps is unknown; "
                "define __len__ (this rank's sample count) or set max_steps"
            ) from None
        return cfg.max_steps
    rounding = math.floor if cfg.drop_last else math.ceil
    batches = rounding(samples / per_rank_batch_size(trainer))
    longest = torch.tensor([math.ceil(batches / cfg.grad_accum_steps)])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    by_epochs = int(longest.item()) * cfg.epochs
    return min(by_epochs, cfg.max_steps) if cfg.max_steps is not None else by_epochs


def train(trainer: Trainer, loader: DataLoader, eval_set: Dataset | None) -> None:
    """Run epochs under model.join(); periodic work happens at each epoch's end."""
    cfg = trainer.config
    while trainer.step < trainer.total_steps and trainer.epoch < cfg.epochs:
        dataset = loader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(trainer.epoch)
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64)
        steps = 0
        # Non-finite steps are reported when ranks meet: a rank that ran out cannot answer
        # the gather that names the ranks whose loss was not finite.
        nonfinite = {"skipped": [], "bad_loss": []}
        batches = iter(loader)
        with trainer.model.join() as join:
            while trainer.step + steps < trainer.total_steps:
                chunk = list(itertools.islice(batches, cfg.grad_accum_steps))
                if not chunk:
                    break
                loss, outcome = _train_step(trainer, chunk, join)
                loss_sum += loss
                steps += 1
                if not math.isfinite(loss):
                    nonfinite["bad_loss"].append(trainer.step + steps)
                if outcome == "deferred":
                    break  # this rank's data ended mid-round: its gradients went to the others
                if outcome == "nonfinite":
                    nonfinite["skipped"].append(trainer.step + steps)
                    if cfg.nonfinite == "stop":
                        break  # every rank still training sees the same averaged gradients
        _adopt_optimizer_state(trainer, join.authoritative_rank)
        _report_nonfinite(trainer, nonfinite)
        # Ranks counted their own steps; the epoch took as many as the longest part.
        counts = torch.tensor([steps, 0], dtype=torch.float64)
        counts[1] = loss_sum
        longest = torch.tensor([steps])
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        dist.all_reduce(counts)
        trainer.step += int(longest.item())
        trainer.epoch += 1
        _log_epoch(trainer, counts, time.perf_counter() - start)
        if cfg.check_replicas_every:
            health.check_replicas(trainer.model.module)
        trainer._progress.metrics = trainer._evaluate_and_log(eval_set)
        trainer._progress.evaluated_at = trainer.step
        if cfg.checkpoint_dir:
            trainer._save()


def _train_step(trainer: Trainer, chunk: list[Any], join: Any) -> tuple[float, str]:
    """One optimizer step on this rank's micro-batches: (summed local loss, "stepped",
    "nonfinite" (skipped, nothing changed) or "deferred" (see parallel/join.py))."""
    trainer.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=trainer.info.device)
    for m, batch in enumerate(chunk):
        batch = move_to(batch, trainer.info.device)
        total += trainer._micro_step(batch, len(chunk), sync=m == len(chunk) - 1)
    if join.deferred:
        return float(total), "deferred"
    if not trainer._optimizer_step():
        return float(total), "nonfinite"
    trainer._step_scheduler()
    return float(total), "stepped"


def _report_nonfinite(trainer: Trainer, mine: dict[str, list[int]]) -> None:
    """Warn about (policy "skip") or stop at (policy "stop") the epoch's non-finite steps."""
    cfg = trainer.config
    everyone = [None] * trainer.info.world_size
    dist.all_gather_object(everyone, mine)
    skipped = sorted({step for d in everyone for step in d["skipped"]})
    for step in skipped:
        bad = [rank for rank, d in enumerate(everyone) if step in d["bad_loss"]]
        health.report_nonfinite(step, bad, policy=cfg.nonfinite, checkpoint_dir=cfg.checkpoint_dir)


def _adopt_optimizer_state(trainer: Trainer, src: int) -> None:
    """Give every rank the optimizer, scheduler and scaler state of the rank that finished last."""
    if trainer.info.world_size == 1:
        return
    scheduler, scaler = trainer.scheduler, trainer.scaler
    box = [
        {
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        if trainer.info.rank == src
        else None
    ]
    dist.broadcast_object_list(box, src=src)
    if trainer.info.rank != src:
        state = box[0]
        trainer.optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])


def _log_epoch(trainer: Trainer, counts: torch.Tensor, wall_s: float) -> None:
    steps, loss_sum = int(counts[0].item()), counts[1].item()
    progress = trainer._progress
    progress.last_loss = loss_sum / max(steps, 1)
    record = {
        "step": trainer.step,
        "epoch": trainer.epoch,
        "loss": progress.last_loss,
        "lr": trainer.optimizer.param_groups[0]["lr"],
        # `steps` here counts every rank's steps, each of grad_accum_steps micro-batches.
        "samples_per_s": steps
        * trainer.config.grad_accum_steps
        * per_rank_batch_size(trainer)
        / max(wall_s, 1e-9),
        "time_s": time.perf_counter() - progress.start,
    }
    trainer._bar.update(trainer.step, record)
    if trainer._log:
        trainer._log.write(record)

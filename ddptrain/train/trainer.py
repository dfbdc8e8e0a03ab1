"""The Trainer: subclass it, override a few hooks, call fit().

    class MNISTTrainer(Trainer):
        def build_model(self):               return LeNet()
        def build_datasets(self):            return mnist(root), mnist(root, train=False)
        def configure_optimizers(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
        def training_step(self, model, batch):
            x, y = batch
            return F.nll_loss(model(x), y)
        def validation_step(self, model, batch):      # sums over the batch, not means
            x, y = batch
            out = model(x)
            return {"loss": F.nll_loss(out, y, reduction="sum"),
                    "accuracy": (out.argmax(1) == y).sum()}

    summary = MNISTTrainer(TrainerConfig(global_batch_size=128, epochs=2)).fit()

fit() is the synchronous-SGD loop: init distributed -> seed -> build -> wrap (rank 0's weights
everywhere) -> resume -> for each step: per-rank shard of the global batch, forward, backward
(gradients averaged by the wrapper), optimizer step -> periodic evaluation, logs, checkpoints.
Every collective runs on every rank; only printing, progress and file writes are rank 0's.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddptrain.data import ShardedSampler
from ddptrain.dist import DistInfo, broadcast_object, init_distributed, print0, shutdown
from ddptrain.parallel.ddp import DistributedDataParallel
from ddptrain.train import checkpoint as ckpt
from ddptrain.train.config import TrainerConfig
from ddptrain.train.evaluation import evaluate, move_to
from ddptrain.train.health import Heartbeat, RankLostError, check_replicas
from ddptrain.train.log import MetricsLog, ProgressBar


class NonFiniteError(RuntimeError):
    """The averaged gradients were inf/NaN and the config says to stop."""


class Trainer:
    """Subclass and override build_model, build_datasets, configure_optimizers, training_step,
    and (optionally) validation_step; then call fit()."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.info: DistInfo | None = None
        self.step = 0
        self.epoch = 0

    # ----------------------------------------------------------------------- user hooks
    def build_model(self) -> nn.Module:
        """Return the plain model (the Trainer moves it to the device and wraps it)."""
        raise NotImplementedError("override build_model() to return your nn.Module")

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """Return (train_dataset, eval_dataset or None); both map-style."""
        raise NotImplementedError("override build_datasets() to return (train, eval or None)")

    def configure_optimizers(self, model: nn.Module) -> Any:
        """Return an optimizer, or (optimizer, lr_scheduler) stepped once per optimizer step.

        `self.total_steps` (optimizer steps of the whole run) is set by then, for schedules.
        """
        raise NotImplementedError("override configure_optimizers(model) to return an optimizer")

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Return the scalar mean loss of this rank's batch (model is the wrapped model)."""
        raise NotImplementedError("override training_step(model, batch) to return the loss")

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        """Return per-batch SUMS of metrics; fit() divides by the exact global sample count."""
        raise NotImplementedError("override validation_step(model, batch) to evaluate")

    # ----------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train to config.max_steps or config.epochs; return a summary (the same on every rank)."""
        owns_group = not dist.is_initialized()
        self.info = init_distributed(self.config.backend, timeout_s=self.config.timeout_s)
        timeout = self.config.heartbeat_timeout_s
        self._heartbeat = Heartbeat(timeout_s=timeout).start() if timeout else None
        try:
            return self._fit(self.info)
        except RuntimeError as e:
            # Backends report a dead peer as a plain RuntimeError (gloo) or a DistError.
            comm_failure = type(e) is RuntimeError or isinstance(e, dist.DistError)
            lost = self._heartbeat.lost_ranks() if self._heartbeat and comm_failure else []
            if not lost:
                raise
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RankLostError(
                f"rank {self.info.rank}: lost rank(s) {lost} at step {self.step} (they stopped "
                f"heartbeating; the collective failed with: {first_line[:200]}). Restart the job "
                "(torchrun --max-restarts=N) with resume='auto' to continue from the latest "
                "checkpoint"
            ) from e
        finally:
            if self._heartbeat:
                self._heartbeat.stop()
            if owns_group:
                shutdown()

    def _fit(self, info: DistInfo) -> dict[str, Any]:
        cfg = self.config
        cfg.check_world_size(info.world_size)
        torch.manual_seed(cfg.seed)
        train_set, eval_set = self.build_datasets()
        if len(train_set) == 0:
            raise ValueError(
                "the training dataset is empty; build_datasets() returned 0 samples: check the "
                "data path and any filtering in build_datasets()"
            )
        if cfg.global_batch_size > len(train_set):
            raise ValueError(
                f"global_batch_size {cfg.global_batch_size} is larger than the training set "
                f"({len(train_set)} samples); use global_batch_size <= {len(train_set)}"
            )
        module = self.build_model().to(info.device)
        if cfg.checkpoint_dir:
            self._check_checkpoint_dir(module)
        resumed = self._load_resume_state(module)
        model = DistributedDataParallel(
            module, bucket_cap_mb=cfg.bucket_cap_mb, comm_hook=cfg.resolve_comm_hook()
        )
        self.model = model
        sampler = ShardedSampler(
            len(train_set),
            global_batch_size=cfg.micro_global_batch_size,
            shuffle=cfg.shuffle,
            seed=cfg.seed,
            drop_last=cfg.drop_last,
        )
        self.total_steps = self._total_steps(sampler)
        optimizer, scheduler = _split_optimizers(self.configure_optimizers(module))
        scaler = torch.amp.GradScaler(info.device.type) if cfg.precision == "fp16" else None
        # Each rank draws its own dropout masks, reproducibly.
        torch.manual_seed(cfg.seed + 1 + info.rank)
        if resumed is not None:
            self._apply_resume_state(resumed, optimizer, scheduler, scaler, sampler)
        loader = DataLoader(
            train_set,
            batch_size=sampler.per_rank_batch_size,
            sampler=sampler,
            num_workers=cfg.num_workers,
            pin_memory=info.device.type == "cuda",
            # Its own generator: iter(loader) draws a worker seed, which must not consume the
            # global RNG that dropout uses, or a resumed run would draw different masks.
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        total_steps = self.total_steps
        self._announce(model, sampler, total_steps, resumed is not None)
        log = MetricsLog(cfg.log_dir) if info.is_main and cfg.log_dir else None
        bar = ProgressBar(total_steps, self.step, enabled=info.is_main and _want_bar(cfg))
        start, first_step = time.perf_counter(), self.step
        window_start, window_samples, window_loss = start, 0, torch.zeros((), device=info.device)
        metrics: dict[str, float] = {}
        last_loss = math.nan
        # A resumed run re-evaluates even if it has no step left, so its summary has metrics;
        # it never re-saves the step it resumed from (that file exists).
        evaluated_at = -1
        saved_at = self.step if resumed is not None else -1
        try:
            while self.step < total_steps:
                sampler.set_epoch(self.epoch)
                batches = iter(loader)
                while sampler.num_batches > 0 and self.step < total_steps:
                    micro = min(cfg.grad_accum_steps, sampler.num_batches)
                    loss, stepped = self._train_step(
                        model, batches, micro, optimizer, scaler, sampler
                    )
                    if scheduler is not None and stepped:
                        scheduler.step()
                    self.step += 1
                    if cfg.check_replicas_every and self.step % cfg.check_replicas_every == 0:
                        check_replicas(model.module)
                    window_loss += loss
                    window_samples += micro * cfg.micro_global_batch_size
                    if self.step % cfg.log_every_steps == 0 or self.step == total_steps:
                        steps_in_window = (self.step - 1) % cfg.log_every_steps + 1
                        last_loss = _mean_over_ranks(window_loss) / steps_in_window
                        elapsed = time.perf_counter() - window_start
                        record = {
                            "step": self.step,
                            "epoch": self.epoch,
                            "loss": last_loss,
                            "lr": optimizer.param_groups[0]["lr"],
                            "samples_per_s": window_samples / max(elapsed, 1e-9),
                            "time_s": time.perf_counter() - start,
                        }
                        bar.update(self.step, record)
                        if log:
                            log.write(record)
                        window_start, window_samples = time.perf_counter(), 0
                        window_loss.zero_()
                    epoch_done = sampler.num_batches == 0
                    if _due(self.step, cfg.eval_every_steps, epoch_done):
                        metrics, evaluated_at = self._evaluate_and_log(eval_set, log), self.step
                    if cfg.checkpoint_dir and _due(
                        self.step, cfg.checkpoint_every_steps, epoch_done
                    ):
                        self._save(model, optimizer, scheduler, scaler, sampler, metrics)
                        saved_at = self.step
                if sampler.num_batches == 0:
                    self.epoch += 1
            if evaluated_at != self.step:
                metrics = self._evaluate_and_log(eval_set, log)
            if cfg.checkpoint_dir and saved_at != self.step:
                self._save(model, optimizer, scheduler, scaler, sampler, metrics)
        finally:
            bar.close()
            if log:
                log.close()
        wall_s = time.perf_counter() - start
        trained = (self.step - first_step) * cfg.global_batch_size
        return {
            "samples_per_s": trained / max(wall_s, 1e-9),
            "step": self.step,
            "epoch": self.epoch,
            "train_loss": last_loss,
            "eval": metrics,
            "wall_s": wall_s,
            "world_size": info.world_size,
        }

    def _train_step(self, model, batches: Iterator, micro: int, optimizer, scaler, sampler):
        cfg = self.config
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.info.device)
        for m in range(micro):
            batch = move_to(next(batches), self.info.device)
            sync = contextlib.nullcontext() if m == micro - 1 else model.no_sync()
            with sync:
                # Forward under autocast, backward outside it, as torch.amp recommends.
                with self._autocast():
                    loss = self.training_step(model, batch)
                if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                    raise ValueError(
                        f"training_step must return a scalar loss tensor, got {shape}; reduce it "
                        "with .mean() (or .sum() / batch size)"
                    )
                scaled = loss / micro
                (scaler.scale(scaled) if scaler else scaled).backward()
            sampler.mark_consumed(1)
            total += scaled.detach().float()
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for p in self.model.module.parameters() if p.grad is not None]
        if cfg.grad_clip_norm is not None:
            norm = nn.utils.clip_grad_norm_(params, cfg.grad_clip_norm)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in params])
        if scaler is not None:
            # GradScaler skips steps with inf/NaN itself: they are expected while it calibrates.
            scaler.step(optimizer)
            scaler.update()
            return total, True
        # Gradients are already averaged, so every rank reaches the same verdict here.
        if not torch.isfinite(norm):
            return total, self._on_nonfinite(total, optimizer)
        optimizer.step()
        return total, True

    def _on_nonfinite(self, local_loss: torch.Tensor, optimizer) -> bool:
        """Stop on every rank (the default) or skip this step; return False (not stepped)."""
        flags = [None] * self.info.world_size
        dist.all_gather_object(flags, bool(torch.isfinite(local_loss)))
        bad = [rank for rank, finite in enumerate(flags) if not finite]
        where = f"non-finite local loss on rank(s) {bad}" if bad else "losses finite everywhere"
        step = self.step + 1
        if self.config.nonfinite == "skip":
            optimizer.zero_grad(set_to_none=True)
            print0(f"warning: step {step} skipped: non-finite gradients ({where})")
            return False
        last = (
            ckpt.latest_checkpoint(self.config.checkpoint_dir)
            if self.config.checkpoint_dir
            else None
        )
        raise NonFiniteError(
            f"step {step}: non-finite gradients ({where}); stopped on every rank before the "
            f"optimizer step, so no weights were changed. Last good checkpoint: "
            f"{last or 'none'}. Lower the learning rate, clip gradients (grad_clip_norm), or set "
            "nonfinite='skip' to skip such steps"
        )

    def _autocast(self):
        precision = self.config.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(self.info.device.type, dtype=dtype)

    # ----------------------------------------------------------------------- evaluation
    def _evaluate(self, eval_set: Dataset | None) -> dict[str, float]:
        if eval_set is None:
            return {}
        return evaluate(
            self.model.module,
            eval_set,
            self.validation_step,
            batch_size=self.config.eval_batch_size,
            device=self.info.device,
            autocast=self._autocast,
        )

    def _evaluate_and_log(self, eval_set, log) -> dict[str, float]:
        metrics = self._evaluate(eval_set)
        if metrics:
            shown = ", ".join(
                f"{k}={v}" if isinstance(v, int) else f"{k}={v:.4f}" for k, v in metrics.items()
            )
            print0(f"step {self.step} epoch {self.epoch}: {shown}")
            if log:
                log.write({"step": self.step, "epoch": self.epoch, **metrics})
        return metrics

    # ----------------------------------------------------------------------- checkpoints
    def _check_checkpoint_dir(self, module: nn.Module) -> None:
        cfg = self.config
        error = None
        if self.info.is_main:
            model_bytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
            try:
                # Model + optimizer state (up to 2x for momentum/Adam) for keep_last + 1 files.
                ckpt.check_writable(
                    cfg.checkpoint_dir, required_bytes=3 * model_bytes * (cfg.keep_last + 1)
                )
            except ckpt.CheckpointError as e:
                error = str(e)
        error = broadcast_object(error)
        if error:
            raise ckpt.CheckpointError(error)

    def _load_resume_state(self, module: nn.Module) -> dict[str, Any] | None:
        """Rank 0 reads the checkpoint; model weights reach the others through the wrapper's
        broadcast and the rest through broadcast_object (no shared filesystem needed)."""
        cfg = self.config
        if not cfg.resume:
            return None
        state, error = None, None
        if self.info.is_main:
            try:
                path = (
                    ckpt.latest_checkpoint(cfg.checkpoint_dir)
                    if cfg.resume == "auto"
                    else cfg.resume
                )
                if path is not None:
                    state = ckpt.load_checkpoint(path)
                    try:
                        ckpt.load_model_state(module, state.pop("model"))
                    except ckpt.CheckpointError as e:
                        raise ckpt.CheckpointError(f"{path}: {e}") from None
                    cfg.check_resumable(state.get("config", {}))
                    self._refuse_later_checkpoints(int(state["step"]))
                    print0(f"resuming from {path} (step {state['step']})")
                elif cfg.resume == "auto":
                    print0(f"resume='auto': no checkpoint in {cfg.checkpoint_dir}; starting fresh")
            except Exception as e:  # noqa: BLE001 - any failure must reach every rank
                error = str(e)
        state, error = broadcast_object((state, error))
        if error:
            raise ckpt.CheckpointError(error)
        return state

    def _refuse_later_checkpoints(self, step: int) -> None:
        """Resuming behind newer checkpoints would later collide with their step numbers."""
        if not self.config.checkpoint_dir:
            return
        later = [
            p.name
            for p in ckpt.list_checkpoints(self.config.checkpoint_dir)
            if (ckpt.parse_step(p.name) or 0) > step
        ]
        if later:
            raise ckpt.CheckpointError(
                f"resuming from step {step}, but {self.config.checkpoint_dir} already holds later "
                f"checkpoints ({', '.join(later[:3])}{', ...' if len(later) > 3 else ''}); move "
                "them away, resume from the latest with resume='auto', or use another "
                "checkpoint_dir"
            )

    def _apply_resume_state(self, state, optimizer, scheduler, scaler, sampler) -> None:
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        rng = state.get("rng") or []
        if len(rng) == self.info.world_size:
            ckpt.restore_rng_state(rng[self.info.rank])
        else:
            # At another world size there is no matching stream to continue; derive one.
            torch.manual_seed(self.config.seed + 1 + self.info.rank + 7919 * self.step)

    def _save(self, model, optimizer, scheduler, scaler, sampler, metrics) -> None:
        """Rank 0 writes; every rank learns the outcome, so a failed save stops all of them."""
        cfg = self.config
        rng = [None] * self.info.world_size
        dist.all_gather_object(rng, ckpt.capture_rng_state())
        error = None
        if self.info.is_main:
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "sampler": sampler.state_dict(),
                "rng": rng,
                "config": asdict(cfg),
                "world_size": self.info.world_size,
            }
            best = cfg.best_metric if cfg.best_metric in metrics else None
            try:
                ckpt.save_checkpoint(
                    cfg.checkpoint_dir,
                    state,
                    step=self.step,
                    epoch=self.epoch,
                    metrics=metrics,
                    keep_last=cfg.keep_last,
                    best_metric=best,
                    best_mode=cfg.best_mode,
                )
            except Exception as e:  # noqa: BLE001 - any failure must reach every rank
                error = f"saving the checkpoint of step {self.step} failed: {e}"
        error = broadcast_object(error)
        if error:
            raise ckpt.CheckpointError(error)

    # ----------------------------------------------------------------------- helpers
    def _total_steps(self, sampler: ShardedSampler) -> int:
        cfg = self.config
        per_epoch = math.ceil(sampler.batches_per_epoch / cfg.grad_accum_steps)
        by_epochs = per_epoch * cfg.epochs
        return min(by_epochs, cfg.max_steps) if cfg.max_steps is not None else by_epochs

    def _announce(self, model, sampler: ShardedSampler, total_steps: int, resumed: bool) -> None:
        cfg, info = self.config, self.info
        buckets = ", ".join(f"{b / 2**20:.2f}" for b in model.bucket_sizes_bytes)
        print0(
            f"ddptrain: world_size={info.world_size} backend={info.backend} "
            f"device={info.device} | global_batch_size={cfg.global_batch_size} = "
            f"{info.world_size} ranks x {sampler.per_rank_batch_size} per rank x "
            f"{cfg.grad_accum_steps} accumulation step(s) | {total_steps} optimizer steps "
            f"({cfg.epochs} epoch(s) of {sampler.batches_per_epoch} micro-batches"
            f"{', resumed at step ' + str(self.step) if resumed else ''}) | "
            f"precision={cfg.precision} | buckets (MiB, launch order)=[{buckets}]"
        )


def _split_optimizers(value: Any) -> tuple[torch.optim.Optimizer, Any]:
    if isinstance(value, torch.optim.Optimizer):
        return value, None
    if isinstance(value, tuple) and len(value) == 2:
        return value
    raise TypeError(
        "configure_optimizers must return an optimizer or (optimizer, lr_scheduler), "
        f"got {type(value).__name__}"
    )


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _mean_over_ranks(t: torch.Tensor) -> float:
    return _sum_over_ranks(t.detach().clone().double()).item() / dist.get_world_size()


def _due(step: int, every_steps: int | None, epoch_done: bool) -> bool:
    """Periodic work runs every `every_steps` optimizer steps, or at each epoch's end if None."""
    return step % every_steps == 0 if every_steps else epoch_done


def _want_bar(cfg: TrainerConfig) -> bool:
    return cfg.progress_bar if cfg.progress_bar is not None else sys.stderr.isatty()

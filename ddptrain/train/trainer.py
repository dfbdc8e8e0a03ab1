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
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddptrain import profiling
from ddptrain.dist import DistInfo, init_distributed, print0, shutdown
from ddptrain.train import build, health, resume, uneven
from ddptrain.train.config import TrainerConfig
from ddptrain.train.evaluation import evaluate, move_to
from ddptrain.train.health import Heartbeat, NonFiniteError
from ddptrain.train.log import (
    LossWindow,
    Progress,
    ProgressBar,
    describe_run,
    format_metrics,
    open_logs,
    start_record,
    want_progress_bar,
)

__all__ = ["NonFiniteError", "Trainer"]


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
        """Return an optimizer, or (optimizer, lr_scheduler) stepped once per optimizer step
        (a ReduceLROnPlateau: after each evaluation, with best_metric or eval_loss).

        `self.total_steps` (optimizer steps of the whole run) is set by then, for schedules.
        """
        raise NotImplementedError("override configure_optimizers(model) to return an optimizer")

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Return the scalar mean loss of this rank's batch (model is the wrapped model)."""
        raise NotImplementedError("override training_step(model, batch) to return the loss")

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        """Return per-batch SUMS of metrics; fit() divides by the exact global sample count."""
        raise NotImplementedError("override validation_step(model, batch) to evaluate")

    # ----------------------------------------------------------------------- the recipe
    def fit(self) -> dict[str, Any]:
        """Train to config.max_steps or config.epochs; return a summary (the same on every rank)."""
        owns_group = not dist.is_initialized()
        self.info = init_distributed(self.config.backend, timeout_s=self.config.timeout_s)
        timeout = self.config.heartbeat_timeout_s
        self._heartbeat = Heartbeat(timeout_s=timeout).start() if timeout else None
        try:
            return self._fit(self.info)
        except BaseException as e:
            peer = health.peer_error(e, self._heartbeat, self.info.rank, self.step)
            if self._heartbeat:
                # Before the group goes: a peer blocked on this rank reports why it left.
                self._heartbeat.stop(error=health.one_line(peer or e))
            if peer is None:
                raise
            raise peer from e
        finally:
            if self._heartbeat:
                self._heartbeat.stop()
            if owns_group:
                shutdown()

    def _fit(self, info: DistInfo) -> dict[str, Any]:
        cfg = self.config
        # 1. Init: one seed everywhere, so every rank builds the same model and data order.
        cfg.check_world_size(info.world_size)
        torch.manual_seed(cfg.seed)
        # 2. Data.
        train_set, eval_set = build.check_datasets(cfg, *self.build_datasets())
        # 3. Model; on resume rank 0 loads the checkpoint's weights into it here.
        module = self.build_model().to(info.device)
        resume_state = self._read_checkpoint(module)
        # 4. Wrap: rank 0's weights reach every rank.
        self.model = build.wrap_model(cfg, module)
        # Per-rank parts of different lengths (an IterableDataset) train under model.join().
        if uneven.is_uneven(train_set):
            uneven.check_supported(cfg)
            self.sampler = None
            self.total_steps = uneven.total_steps(self, train_set)
        else:
            self.sampler = build.sampler(cfg, len(train_set))
            self.total_steps = build.total_steps(cfg, self.sampler)
        # 5. Optimizer (after total_steps, which schedules read).
        self.optimizer, self.scheduler = build.optimizer(cfg, self.configure_optimizers(module))
        build.check_plateau(self.scheduler, eval_set)
        self.scaler = torch.amp.GradScaler(info.device.type) if cfg.precision == "fp16" else None
        # Each rank draws its own dropout masks, reproducibly.
        torch.manual_seed(cfg.seed + 1 + info.rank)
        # 6. Resume the optimizer, sampler and RNG states.
        if resume_state is not None:
            self.step, self.epoch = resume.apply_resume_state(
                resume_state, cfg, info, self.optimizer, self.scheduler, self.scaler, self.sampler
            )
        if self.sampler is None:
            loader = uneven.build_loader(self, train_set)
        else:
            loader = build.loader(cfg, info, self.sampler, train_set)
        resumed = resume_state is not None
        self._announce(resumed)
        # 7. Loop, then 8. a final evaluation and save.
        self._open_logs(resumed)
        try:
            self._train(loader, eval_set)
            self._finish(eval_set)
        finally:
            self._close_logs()
        return self._summary()

    # ----------------------------------------------------------------------- building
    def _read_checkpoint(self, module: nn.Module) -> dict[str, Any] | None:
        if self.config.checkpoint_dir:
            resume.check_checkpoint_dir(self.config, self.info, module)
        return resume.read_resume_state(self.config, self.info, module)

    # ----------------------------------------------------------------------- the loop
    def _train(self, loader: DataLoader, eval_set: Dataset | None) -> None:
        if self.sampler is None:
            return uneven.train(self, loader, eval_set)
        while self.step < self.total_steps:
            self.sampler.set_epoch(self.epoch)
            batches = iter(loader)
            while self.sampler.num_batches > 0 and self.step < self.total_steps:
                self._step(batches, eval_set)
            if self.sampler.num_batches == 0:
                self.epoch += 1

    def _step(self, batches: Iterator, eval_set: Dataset | None) -> None:
        """One optimizer step, then the periodic work that falls due after it."""
        micro = min(self.config.grad_accum_steps, self.sampler.num_batches)
        self._tracer.before_step(self.step + 1)
        loss, stepped = self._train_step(batches, micro)
        self._tracer.after_step(self.step + 1)
        if stepped:
            self._step_scheduler()
        self.step += 1
        self._maybe_check_replicas()
        self._log_step(loss, micro)
        epoch_done = self.sampler.num_batches == 0
        self._maybe_evaluate(eval_set, epoch_done)
        self._maybe_save(epoch_done)

    def _train_step(self, batches: Iterator, micro: int) -> tuple[torch.Tensor, bool]:
        """Forward and backward `micro` micro-batches (averaging on the last); return the summed
        loss and whether the optimizer stepped. Wall-clock marks split its time into the
        phases of ddptrain.train.timing."""
        times = self._progress.window.times
        began = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.info.device)
        for m in range(micro):
            mark = time.perf_counter()
            batch = self._next_batch(batches)
            now = time.perf_counter()
            times.add("data_s", now - mark)
            sync = m == micro - 1
            total += self._micro_step(batch, micro, sync=sync)
            # The wrapper timed its own wait for buckets: communication overlap did not hide.
            comm = self.model.last_comm_wait_s if sync else 0.0
            times.add("compute_s", max(0.0, time.perf_counter() - now - comm))
            times.add("comm_s", comm)
        mark = time.perf_counter()
        with profiling.mark("ddptrain.optimizer"):
            stepped = self._optimizer_step()
        if not stepped:
            cfg = self.config
            health.on_nonfinite_gradients(
                total, step=self.step + 1, policy=cfg.nonfinite, checkpoint_dir=cfg.checkpoint_dir
            )
        now = time.perf_counter()
        times.add("optim_s", now - mark)
        times.add("step_s", now - began)
        return total, stepped

    def _next_batch(self, batches: Iterator) -> Any:
        with profiling.mark("ddptrain.data"):
            return move_to(next(batches), self.info.device)

    def _micro_step(self, batch: Any, micro: int, *, sync: bool) -> torch.Tensor:
        """Forward and backward one micro-batch; gradients are averaged only when `sync`."""
        with contextlib.nullcontext() if sync else self.model.no_sync():
            # Forward under autocast, backward outside it, as torch.amp recommends.
            with self._autocast(), profiling.mark("ddptrain.forward"):
                loss = self.training_step(self.model, batch)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                raise ValueError(
                    f"training_step must return a scalar loss tensor, got {shape}; reduce it "
                    "with .mean() (or .sum() / batch size)"
                )
            scaled = loss / micro
            with profiling.mark("ddptrain.backward"):
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        if self.sampler is not None:
            self.sampler.mark_consumed(1)
        return scaled.detach().float()

    def _step_scheduler(self) -> None:
        """After an optimizer step: the scheduler's step, unless it waits for evaluations."""
        if build.steps_per_optimizer_step(self.scheduler):
            self.scheduler.step()

    def _optimizer_step(self) -> bool:
        """Clip (or measure) the gradient norm and step; return False, having dropped the
        gradients and changed nothing, if they are not finite (the caller applies the policy)."""
        scaler, optimizer = self.scaler, self.optimizer
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for p in self.model.module.parameters() if p.grad is not None]
        if self.config.grad_clip_norm is not None:
            norm = nn.utils.clip_grad_norm_(params, self.config.grad_clip_norm)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in params])
        if scaler is not None:
            # GradScaler skips steps with inf/NaN itself: they are expected while it calibrates.
            scaler.step(optimizer)
            scaler.update()
            return True
        # Gradients are already averaged, so every rank reaches the same verdict here.
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            return False
        optimizer.step()
        return True

    def _autocast(self):
        precision = self.config.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(self.info.device.type, dtype=dtype)

    # ----------------------------------------------------------------------- periodic work
    def _maybe_check_replicas(self) -> None:
        every = self.config.check_replicas_every
        if every and self.step % every == 0:
            health.check_replicas(self.model.module)

    def _log_step(self, loss: torch.Tensor, micro: int) -> None:
        """Add this step to the log window; every log_every_steps, report the window's mean loss."""
        cfg, progress = self.config, self._progress
        progress.window.add(loss, micro * cfg.micro_global_batch_size)
        if self.step % cfg.log_every_steps != 0 and self.step != self.total_steps:
            return
        steps_in_window = (self.step - 1) % cfg.log_every_steps + 1
        progress.last_loss, samples_per_s, split = progress.window.report(steps_in_window)
        record = {
            "step": self.step,
            "epoch": self.epoch,
            "loss": progress.last_loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": samples_per_s,
            "time_s": time.perf_counter() - progress.start,
            **split,
        }
        self._bar.update(self.step, record)
        if self._log:
            self._log.write(record)

    def _maybe_evaluate(self, eval_set: Dataset | None, epoch_done: bool) -> None:
        if _due(self.step, self.config.eval_every_steps, epoch_done):
            with self._progress.window.paused():
                self._progress.metrics = self._evaluate_and_log(eval_set)
            self._progress.evaluated_at = self.step

    def _maybe_save(self, epoch_done: bool) -> None:
        if self.config.checkpoint_dir and _due(
            self.step, self.config.checkpoint_every_steps, epoch_done
        ):
            with self._progress.window.paused():
                self._save()

    def _finish(self, eval_set: Dataset | None) -> None:
        """Evaluate and save the last step unless the loop just did. A resumed run re-evaluates
        even with no step left, so its summary has metrics, but never re-saves its own step."""
        if self._progress.evaluated_at != self.step:
            self._progress.metrics = self._evaluate_and_log(eval_set)
        if self.config.checkpoint_dir and self._progress.saved_at != self.step:
            self._save()

    def _summary(self) -> dict[str, Any]:
        cfg, world_size = self.config, self.info.world_size
        return self._progress.summary(self.step, self.epoch, cfg.global_batch_size, world_size)

    # ----------------------------------------------------------------------- evaluation
    def _evaluate_and_log(self, eval_set: Dataset | None) -> dict[str, float]:
        if eval_set is None:
            return {}
        metrics = evaluate(
            self.model.module,
            eval_set,
            self.validation_step,
            batch_size=self.config.eval_batch_size,
            device=self.info.device,
            autocast=self._autocast,
        )
        self.config.check_best_metric(metrics)
        if metrics:
            build.plateau_step(self.config, self.scheduler, metrics)
        if metrics:
            self._bar.print(f"step {self.step} epoch {self.epoch}: {format_metrics(metrics)}")
            if self._log:
                time_s = time.perf_counter() - self._progress.start
                self._log.write(
                    {"step": self.step, "epoch": self.epoch, **metrics, "time_s": time_s}
                )
        return metrics

    # ----------------------------------------------------------------------- output
    def _save(self) -> None:
        resume.save_training_state(
            self.config,
            self.info,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.sampler,
            step=self.step,
            epoch=self.epoch,
            metrics=self._progress.metrics,
        )
        self._progress.saved_at = self.step

    def _announce(self, resumed: bool) -> None:
        resumed_at = self.step if resumed else None
        cfg, info, sampler, model = self.config, self.info, self.sampler, self.model
        by_epochs = build.epoch_steps(cfg, sampler) if sampler is not None else None
        print0(describe_run(cfg, info, sampler, model, self.total_steps, resumed_at, by_epochs))

    def _open_logs(self, resumed: bool) -> None:
        cfg, info = self.config, self.info
        # A resumed run never re-saves the step it resumed from (that file exists).
        saved_at = self.step if resumed else -1
        self._progress = Progress(LossWindow(info.device), self.step, saved_at)
        self._log = open_logs(cfg.loggers, cfg.log_dir) if info.is_main and cfg.log_dir else None
        if self._log:
            self._log.write(start_record(cfg, info, self.step))
        enabled = info.is_main and want_progress_bar(cfg.progress_bar)
        self._bar = ProgressBar(self.total_steps, self.step, enabled=enabled)
        trace_dir = cfg.log_dir or cfg.checkpoint_dir
        self._tracer = profiling.StepTracer(cfg.profile_steps, trace_dir, info.rank)
        missed = profiling.range_missed(cfg.profile_steps, self.step + 1, self.total_steps)
        if missed and self.step < self.total_steps:
            first, last = cfg.profile_steps
            print0(
                f"warning: profile_steps=({first}, {last}) lies outside the steps this run "
                f"takes ({self.step + 1}..{self.total_steps}): no trace will be written"
            )

    def _close_logs(self) -> None:
        self._tracer.close()
        self._bar.close()
        if self._log:
            self._log.close()


def _due(step: int, every_steps: int | None, epoch_done: bool) -> bool:
    """Periodic work runs every `every_steps` optimizer steps, or at each epoch's end if None."""
    return step % every_steps == 0 if every_steps else epoch_done

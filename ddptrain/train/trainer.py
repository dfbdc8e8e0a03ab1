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
With checkpoint_dir, a preemption signal (or a lost launcher) saves the step and stops at the
next step boundary: fit() raises Preempted, a SystemExit (train/preempt.py).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ddptrain import profiling
from ddptrain.dist import DistInfo, init_distributed, print0, shutdown
from ddptrain.train import build, compute, gradients, health, preempt
from ddptrain.train.checkpoint import resume
from ddptrain.train.config import TrainerConfig
from ddptrain.train.epochs import make_epochs
from ddptrain.train.evaluation import evaluate, move_to
from ddptrain.train.gradients import NonFiniteError, autocast, optimizer_step
from ddptrain.train.output import RunOutput, describe_run

__all__ = ["NonFiniteError", "Preempted", "Trainer"]

Preempted = preempt.Preempted


class Trainer:
    """Subclass and override build_model, build_datasets, configure_optimizers, training_step,
    and (optionally) validation_step and blocks; then call fit()."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.info: DistInfo | None = None
        self.step = 0
        # The epoch the latest step belongs to, from 1 (as logs, the bar and checkpoints show
        # it); the loop counts epochs from 0 in _epoch_index.
        self.epoch = 0
        self._epoch_index = 0

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

    def blocks(self, model: nn.Module) -> list[nn.Module] | None:
        """Return the model's repeated blocks (a transformer's layers), or None: what
        activation_checkpointing recomputes, and the units of zero_stage 2 and 3 (and what
        compile compiles there). Default: `model.blocks` if it is an nn.ModuleList."""
        return compute.default_blocks(model)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Return the scalar mean loss of this rank's batch (model is the wrapped model)."""
        raise NotImplementedError("override training_step(model, batch) to return the loss")

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        """Return per-batch SUMS of metrics; fit() divides by the exact global sample count."""
        raise NotImplementedError("override validation_step(model, batch) to evaluate")

    # ----------------------------------------------------------------------- the recipe
    def fit(self) -> dict[str, Any]:
        """Train to config.max_steps or config.epochs; return a summary (the same on every rank).

        Raises Preempted (a SystemExit) when it saved and stopped early (train/preempt.py)."""
        owns_group = not dist.is_initialized()
        self.info = init_distributed(self.config.backend, timeout_s=self.config.timeout_s)
        cfg = self.config
        self._boundary = preempt.Boundary(cfg, self.info)
        lost = self._boundary.on_launcher_lost()
        watch = health.watching(cfg.heartbeat_timeout_s, self.info.agent_pid, lost)
        try:
            with watch as self._heartbeat:
                try:
                    return self._fit(self.info)
                except Preempted:
                    raise  # a clean stop: peers stop at the same boundary, none waits for it
                except BaseException as e:
                    explained = health.explain_failure(
                        e, self._heartbeat, self.info.rank, self.step
                    )
                    if explained is e:
                        raise
                    raise explained from e
        finally:
            if owns_group:
                shutdown()

    def _fit(self, info: DistInfo) -> dict[str, Any]:
        cfg = self.config
        # 1. Init: one seed everywhere, so every rank builds the same model and data order.
        cfg.check_world_size(info.world_size)
        if cfg.deterministic:
            build.pin_kernels(info.device)
        torch.manual_seed(cfg.seed)
        # 2. Data: even epochs (a map-style dataset), or each rank's own part (IterableDataset).
        train_set, eval_set = build.check_datasets(cfg, *self.build_datasets())
        self.epochs = make_epochs(cfg, info, train_set)
        self.sampler = self.epochs.sampler
        self.total_steps = self.epochs.total_steps
        # 3. Model; on resume rank 0 loads the checkpoint's weights into it here. Then its
        # blocks checkpointed and compiled as the config asks.
        module = self.build_model().to(info.device)
        resume_state = self._read_checkpoint(module)
        blocks = self.blocks(module)
        compute.prepare_model(cfg, module, blocks)
        # 4. Wrap: rank 0's weights reach every rank.
        self.model = build.wrap_model(cfg, module, blocks)
        # 5. Optimizer (after total_steps, which schedules read).
        self.optimizer, self.scheduler = build.optimizer(cfg, self.configure_optimizers(module))
        build.check_plateau(self.scheduler, eval_set)
        self.scaler = torch.amp.GradScaler(info.device.type) if cfg.precision == "fp16" else None
        if not cfg.deterministic:
            # Each rank draws its own dropout masks, reproducibly (deterministic: the wrapper
            # keys them by step and micro-batch instead).
            torch.manual_seed(cfg.seed + 1 + info.rank)
        # 6. Resume the optimizer, sampler and RNG states.
        if resume_state is not None:
            self.step, self._epoch_index = resume.apply_resume_state(
                resume_state,
                cfg,
                info,
                self.optimizer,
                self.scheduler,
                self.scaler,
                self.sampler,
                model=self.model,
            )
        resumed = resume_state is not None
        if cfg.deterministic:
            build.exact_sums(self.model).step = self.step
        # Even epochs resume inside (or at the end of) the sampler's epoch; uneven ones at the
        # start of the epoch after the one their checkpoint completed.
        lockstep = self.epochs.lockstep
        self.epoch = self._epoch_index + 1 if lockstep else max(self._epoch_index, 1)
        self._announce(resumed)
        # 7. Loop, then 8. a final evaluation and save.
        self._open_logs(resumed)
        try:
            # Installed for the loop only: before it there is nothing to save, and Ctrl-C
            # during a rendezvous or a download keeps stopping at once.
            with self._boundary.stop.catching(self._boundary.signals):
                self._train(eval_set)
                self._finish(eval_set)
        finally:
            self._out.close()
        return self._summary()

    # ----------------------------------------------------------------------- building
    def _read_checkpoint(self, module: nn.Module) -> dict[str, Any] | None:
        if self.config.checkpoint_dir:
            resume.check_checkpoint_dir(self.config, self.info, module)
        return resume.read_resume_state(self.config, self.info, module)

    # ----------------------------------------------------------------------- the loop
    def _train(self, eval_set: Dataset | None) -> None:
        """Epoch after epoch, step after step. Ranks in lockstep (even epochs) meet after any
        step for periodic work; ranks of uneven epochs meet again when the epoch ends."""
        while self.step < self.total_steps and self._epoch_index < self.config.epochs:
            epoch = self.epochs.start(self._epoch_index, self.total_steps - self.step)
            self.epoch = self._epoch_index + 1
            with epoch.running(self.model):
                for batches in epoch:
                    if not self._step(batches, epoch, eval_set):
                        break
            self.step = epoch.finish(self.step, self.optimizer, self.scheduler, self.scaler)
            if not epoch.lockstep:
                self._after_step(epoch_done=True, eval_set=eval_set)
            if not epoch.complete:
                return  # max_steps ended the run inside this epoch
            self._epoch_index += 1

    def _step(self, batches: list[Any], epoch: Any, eval_set: Dataset | None) -> bool:
        """One optimizer step on this rank's micro-batches, then the periodic work that falls
        due after it (ranks in lockstep); False: this rank stops the epoch here."""
        self._out.tracer.before_step(self.step + 1)
        loss, outcome = self._train_step(batches, epoch)
        self._out.tracer.after_step(self.step + 1)
        epoch.consumed(len(batches))
        self.step += 1
        self._out.window.add(loss, len(batches) * self._per_rank_batch_size())
        if outcome == "nonfinite":
            overflowed = self.config.deterministic and build.exact_sums(self.model).overflowed
            self._nonfinite.append((self.step, bool(torch.isfinite(loss).all()), overflowed))
        if epoch.lockstep:
            self._after_step(epoch_done=epoch.complete, eval_set=eval_set)
        # Deferred: its gradients went to the others' reduction. Non-finite with "stop": every
        # rank still training saw the same averaged gradients and stops here too.
        return outcome == "stepped" or (outcome == "nonfinite" and self.config.nonfinite == "skip")

    def _train_step(self, batches: list[Any], epoch: Any) -> tuple[torch.Tensor, str]:
        """Forward and backward each micro-batch (averaging on the last), then the optimizer
        step: (summed local loss, "stepped", "nonfinite" (skipped, nothing changed) or
        "deferred"). Wall-clock marks split its time into the phases of train.timing."""
        times = self._out.window.times
        began = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        micro = len(batches)
        for m, batch in enumerate(batches):
            mark = time.perf_counter()
            batch = self._next_batch(batch)
            now = time.perf_counter()
            times.add("data_s", now - mark)
            sync = m == micro - 1
            losses.append(self._micro_step(batch, micro, sync=sync))
            # The wrapper timed its own wait for buckets: communication overlap did not hide.
            comm = self.model.last_comm_wait_s if sync else 0.0
            times.add("compute_s", max(0.0, time.perf_counter() - now - comm))
            times.add("comm_s", comm)
        # Deterministic: the window averages every rank's micro-batch losses in their order.
        total = torch.stack(losses) if self.config.deterministic else torch.stack(losses).sum()
        if epoch.deferred:
            return total, "deferred"
        mark = time.perf_counter()
        with profiling.mark("ddptrain.optimizer"):
            clip = self.config.grad_clip_norm
            stepped = optimizer_step(self.model, self.optimizer, self.scaler, clip)
        if stepped:
            self._step_scheduler()
        now = time.perf_counter()
        times.add("optim_s", now - mark)
        times.add("step_s", now - began)
        return total, "stepped" if stepped else "nonfinite"

    def _next_batch(self, batch: Any) -> Any:
        with profiling.mark("ddptrain.data"):
            return move_to(batch, self.info.device)

    def _per_rank_batch_size(self) -> int:
        return self.config.round_size(self.info.world_size) // self.info.world_size

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
            # Deterministic: the wrapper divides the exact sum by the micro-batch count.
            scaled = loss if self.config.deterministic else loss / micro
            if sync and self._boundary.enabled:
                self._boundary.ride(self.model, self.epochs.lockstep)
            with profiling.mark("ddptrain.backward"):
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return scaled.detach().float()

    def _step_scheduler(self) -> None:
        """After an optimizer step: the scheduler's step, unless it waits for evaluations."""
        if build.steps_per_optimizer_step(self.scheduler):
            self.scheduler.step()

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.config.precision, self.info.device)

    # ----------------------------------------------------------------------- periodic work
    def _after_step(self, *, epoch_done: bool, eval_set: Dataset | None) -> None:
        """What falls due after a step where every rank meets: non-finite steps reported,
        replica checks, the log line, evaluation and checkpoint, each on its schedule."""
        self._report_nonfinite()
        every = self.config.check_replicas_every
        if every and (self.step % every == 0 or not self.epochs.lockstep):
            health.check_replicas(self.model.module)
        lr = self.optimizer.param_groups[0]["lr"]
        self._out.log_step(
            self.step, self.epoch, lr, self.total_steps, force=not self.epochs.lockstep
        )
        self._maybe_evaluate(eval_set, epoch_done)
        agreed = self._boundary.agree() if self._boundary.enabled else None
        self._maybe_save(epoch_done, now=agreed is not None)
        if agreed is not None and agreed.stop:
            saved_here = self._out.progress.saved_at == self.step
            raise self._boundary.stopped(agreed, self.step, saved_here)

    def _report_nonfinite(self) -> None:
        """Warn about (policy "skip") or stop at (policy "stop") the steps skipped for
        non-finite gradients. Collective, except in lockstep with nothing to report: there
        every rank saw the same averaged gradients."""
        if self._nonfinite or not self.epochs.lockstep:
            cfg = self.config
            gradients.report_nonfinite_steps(self._nonfinite, cfg.nonfinite, cfg.checkpoint_dir)
            self._nonfinite = []

    def _maybe_evaluate(self, eval_set: Dataset | None, epoch_done: bool) -> None:
        if self._due(self.config.eval_every_steps, epoch_done):
            with self._out.progress.window.paused():
                self._out.progress.metrics = self._evaluate_and_log(eval_set)
            self._out.progress.evaluated_at = self.step

    def _maybe_save(self, epoch_done: bool, now: bool = False) -> None:
        """Save on the step schedule, or `now` (a stop or a timed save), unless this step is
        saved already."""
        cfg, progress = self.config, self._out.progress
        if not cfg.checkpoint_dir or progress.saved_at == self.step:
            return
        if now or self._due(cfg.checkpoint_every_steps, epoch_done):
            with progress.window.paused():
                self._save()

    def _due(self, every_steps: int | None, epoch_done: bool) -> bool:
        """Periodic work runs every `every_steps` optimizer steps, else at each epoch's end;
        at every epoch's end for uneven epochs, the only place their ranks meet."""
        if not self.epochs.lockstep:
            return True
        return self.step % every_steps == 0 if every_steps else epoch_done

    def _finish(self, eval_set: Dataset | None) -> None:
        """Evaluate and save the last step unless the loop just did. A resumed run re-evaluates
        even with no step left, so its summary has metrics, but never re-saves its own step."""
        if self._out.progress.evaluated_at != self.step:
            self._out.progress.metrics = self._evaluate_and_log(eval_set)
        if self.config.checkpoint_dir and self._out.progress.saved_at != self.step:
            self._save()

    def _summary(self) -> dict[str, Any]:
        cfg, world_size = self.config, self.info.world_size
        return self._out.progress.summary(self.step, self.epoch, cfg.global_batch_size, world_size)

    # ----------------------------------------------------------------------- evaluation
    def _evaluate_and_log(self, eval_set: Dataset | None) -> dict[str, float]:
        if eval_set is None:
            return {}
        with build.whole_parameters(self.model):
            metrics = evaluate(
                self.model.module,
                eval_set,
                self.validation_step,
                batch_size=self.config.eval_batch_size,
                device=self.info.device,
                autocast=self._autocast,
                deterministic=self.config.deterministic,
            )
        self.config.check_best_metric(metrics)
        if metrics:
            build.plateau_step(self.config, self.scheduler, metrics)
        self._out.log_eval(self.step, self.epoch, metrics)
        return metrics

    # ----------------------------------------------------------------------- output
    def _save(self) -> None:
        started = time.monotonic()
        path = resume.save_training_state(
            self.config,
            self.info,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.sampler,
            step=self.step,
            epoch=self.epoch,
            metrics=self._out.progress.metrics,
        )
        self._out.progress.saved_at = self.step
        self._boundary.saved(path, time.monotonic() - started)

    def _announce(self, resumed: bool) -> None:
        resumed_at = self.step if resumed else None
        cfg, info, sampler, model = self.config, self.info, self.sampler, self.model
        by_epochs = self.epochs.by_epochs
        print0(describe_run(cfg, info, sampler, model, self.total_steps, resumed_at, by_epochs))

    def _open_logs(self, resumed: bool) -> None:
        # (step, whether this rank's loss was finite) of steps skipped for non-finite gradients.
        self._nonfinite: list[tuple[int, bool, bool]] = []
        self._out = RunOutput(self.config, self.info, self.total_steps, self.step, resumed)

"""Preemption: a signal on any rank saves the step at the next boundary on every rank and stops
with exit code 76; the same run started again ends bitwise equal to one never stopped. Timed
checkpoints agree across ranks. Unit tests of the parts that need no processes.

Spawned ranks send the signal to themselves (ToyTrainer's fault), so the step it lands in is
known; tests/train/test_launcher_faults.py sends it from outside, to torchrun.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

import ddptrain
from ddptrain.dist import DistInfo
from ddptrain.train import checkpoint as ckpt
from ddptrain.train.config import ConfigError, TrainerConfig
from ddptrain.train.health import LOST_RANK_EXIT_CODE
from ddptrain.train.preempt import PREEMPTED_EXIT_CODE, Agreed, Preempted, StopRequest
from support.toy_models import ToyTrainer, flat_params

ALONE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")


def _config(root: str, **overrides) -> TrainerConfig:
    base = TrainerConfig(
        global_batch_size=12,
        epochs=2,
        log_every_steps=4,
        checkpoint_dir=f"{root}/ckpt",
        checkpoint_every_steps=5,
        resume="auto",
        keep_last=50,
        progress_bar=False,
    )
    return replace(base, **overrides)


# ----------------------------------------------------------------------------- unit tests
def test_signals_are_recorded_not_raised_and_the_handlers_come_back():
    """In catching(), SIGINT twice and SIGUSR1 only record a stop; the old handlers come back."""
    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest()
    with stop.catching(("SIGINT", "USR1")):
        for number in (signal.SIGINT, signal.SIGINT, signal.SIGUSR1):
            os.kill(os.getpid(), number)
        time.sleep(0.05)  # handlers run between bytecodes of the main thread
        agreed = stop.agree(ALONE, carried=None)
    assert signal.getsignal(signal.SIGINT) is before
    assert agreed.stop and agreed.exit_code == PREEMPTED_EXIT_CODE
    assert agreed.describe() == "SIGINT (rank 0)"


def test_a_lost_launcher_outranks_a_signal_and_asks_for_a_restart():
    """A rank that lost its launcher after a signal stops with the lost-rank code (75)."""
    stop = StopRequest()
    stop.request("SIGTERM", PREEMPTED_EXIT_CODE)
    stop.launcher_lost("its torchrun agent (pid 7) is gone")
    agreed = stop.agree(ALONE, carried=None)
    assert agreed.exit_code == LOST_RANK_EXIT_CODE
    assert agreed.describe() == "its torchrun agent (pid 7) is gone (rank 0)"


def test_a_boundary_with_nothing_wanted_agrees_on_nothing_and_a_timed_save_on_no_stop():
    """No request agrees on None; rank 0's clock due saves, not stops; a carried sum decides."""
    stop = StopRequest()
    assert stop.agree(ALONE, carried=None) is None
    timed = stop.agree(ALONE, carried=None, save_due=True)
    assert timed is not None and not timed.stop
    assert stop.agree(ALONE, carried=0, save_due=True) is None
    assert not stop.agree(ALONE, carried=1).stop


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"preempt_signals": ("SIGFOO",)}, "unknown signal 'SIGFOO'"),
        ({"preempt_signals": ("SIGKILL",)}, "SIGKILL cannot be caught"),
        ({"preempt_signals": "SIGTERM"}, "use a tuple of signal names"),
        ({"checkpoint_every_minutes": 0}, r"checkpoint_every_minutes=0: must be > 0 \(or None\)"),
        ({"checkpoint_dir": None, "resume": None}, "saves into checkpoint_dir; set"),
    ],
)
def test_preemption_settings_that_cannot_work_name_the_fix(overrides, match):
    """Bad signals, a non-tuple, minutes <= 0 or no checkpoint_dir: ConfigError naming the fix."""
    settings = {"checkpoint_dir": "ckpt", "checkpoint_every_minutes": 5.0, **overrides}
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(**settings)


# ----------------------------------------------------------------------------- spawned ranks
def _outcome(trainer: ToyTrainer) -> dict:
    """What fit() ended with: the summary and parameters, or where and how it stopped."""
    try:
        summary = trainer.fit()
    except Preempted as e:
        return {"stopped_at": e.step, "code": e.code, "message": e.message}
    return {"summary": summary, "params": flat_params(trainer.model.module)}


def _interrupt_saves_of(step: int) -> list[int]:
    """Two SIGINTs half-way through writing the checkpoint of `step` (Ctrl-C pressed twice);
    returns the steps whose save they hit."""
    real_save = torch.save
    interrupted: list[int] = []

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == step:
            # Into the open temp file: a KeyboardInterrupt here would abandon the save.
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            interrupted.append(step)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    return interrupted


def _count_all_reduces() -> list[int]:
    """Count every dist.all_reduce from now on (any group)."""
    count = [0]
    real = dist.all_reduce

    def all_reduce(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = all_reduce
    return count


def _stop_and_resume(config: TrainerConfig, fault: dict, root: str) -> dict:
    """In one world: a straight run, a run stopped by `fault`, and that run started again."""
    interrupted = _interrupt_saves_of(fault["step"] + 1) if fault["kind"] == "sigint" else []
    all_reduces = _count_all_reduces()
    straight = _outcome(ToyTrainer(replace(config, checkpoint_dir=f"{root}/straight"), 0.3))
    straight_all_reduces = all_reduces[0]
    quiet_config = replace(config, checkpoint_dir=f"{root}/quiet", preempt_signals=())
    quiet = _outcome(ToyTrainer(quiet_config, dropout=0.3))
    quiet_all_reduces = all_reduces[0] - straight_all_reduces
    stopped = _outcome(ToyTrainer(config, dropout=0.3, fault=fault))
    resumed = _outcome(ToyTrainer(config, dropout=0.3))
    return {
        "straight": straight,
        "quiet": quiet,
        "stopped": stopped,
        "resumed": resumed,
        "extra_all_reduces": straight_all_reduces - quiet_all_reduces,
        "interrupted_saves": interrupted,
    }


CASES = {
    # signal, the rank it reaches, world size, comm hook, gradient accumulation, zero_stage
    "sigterm": ("sigterm", 1, 2, "default", 1, 0),
    "sigint_accumulating": ("sigint", 0, 2, "allreduce", 2, 0),
    "sigusr1_alone": ("sigusr1", 0, 1, "default", 1, 0),
    # The sharded wrapper has no flag_next_sync: its boundaries ask with a small all_reduce.
    "sigterm_sharded": ("sigterm", 0, 2, "default", 1, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_saves_the_next_boundary_and_the_rerun_ends_bitwise_equal(tmp_path, case):
    """A signal in step 6 on one rank saves step 6 on every rank, exits 76; the rerun is bitwise."""
    kind, rank, world_size, hook, accum, zero_stage = CASES[case]
    config = _config(str(tmp_path), comm_hook=hook, grad_accum_steps=accum, zero_stage=zero_stage)
    fault = {"kind": kind, "rank": rank, "step": 5}
    results = ddptrain.spawn(
        _stop_and_resume, world_size, config, fault, str(tmp_path), timeout_s=240
    )
    for r in results:
        assert r["stopped"]["stopped_at"] == 6 and r["stopped"]["code"] == PREEMPTED_EXIT_CODE
        assert r["resumed"]["summary"]["step"] == r["straight"]["summary"]["step"] == 16
        assert torch.equal(r["resumed"]["params"], r["straight"]["params"])
        assert torch.equal(r["quiet"]["params"], r["straight"]["params"])
        # Watching for signals costs no collective where the reduction carries the flag; one
        # small all_reduce per step (16) without flag_next_sync; none alone.
        assert r["extra_all_reduces"] == (16 if zero_stage and world_size > 1 else 0)
    # Rank 0 writes the checkpoint: its save is the one interrupted.
    assert results[0]["interrupted_saves"] == ([6] if kind == "sigint" else [])
    message = results[0]["stopped"]["message"]
    assert f"stopped at step 6 on {kind.upper()} (rank {rank})" in message, message
    assert "ckpt-00000006.pt" in message and "exiting with code 76" in message, message
    ckpt.verify_checkpoint(tmp_path / "ckpt" / "ckpt-00000006.pt")


class _RankPart(IterableDataset):
    """Rank r's part: 16 + 8 r samples, so the ranks of 2 run out after 4 and 6 steps; each
    epoch in another order, so an epoch trained twice shows."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        rank = dist.get_rank()
        start = sum(16 + 8 * r for r in range(rank))
        self.x, self.y = (t[start : start + 16 + 8 * rank] for t in data.tensors)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        yield from zip(self.x[order], self.y[order], strict=True)


class _UnevenTrainer(ToyTrainer):
    def build_datasets(self):
        train_set, eval_set = super().build_datasets()
        return _RankPart(train_set), eval_set


def _uneven(config: TrainerConfig, root: str) -> dict:
    straight = _outcome(_UnevenTrainer(replace(config, checkpoint_dir=f"{root}/straight")))
    fault = {"kind": "sigterm", "rank": 1, "step": 1}
    stopped = _outcome(_UnevenTrainer(config, fault=fault))
    resumed = _outcome(_UnevenTrainer(config))
    return {"straight": straight, "stopped": stopped, "resumed": resumed}


def test_uneven_epochs_save_at_the_epoch_end_where_ranks_meet(tmp_path):
    """With per-rank data a signal in step 2 saves step 6, the epoch's end; the rerun is bitwise."""
    # Ranks on per-rank data (an IterableDataset) meet only at the epoch's end.
    config = _config(str(tmp_path), global_batch_size=8, epochs=3)
    for r in ddptrain.spawn(_uneven, 2, config, str(tmp_path), timeout_s=240):
        assert r["stopped"]["stopped_at"] == 6, r["stopped"]
        assert r["resumed"]["summary"]["step"] == r["straight"]["summary"]["step"] == 18
        assert torch.equal(r["resumed"]["params"], r["straight"]["params"])


def _timed(config: TrainerConfig, root: str) -> dict:
    timed = _outcome(ToyTrainer(config, dropout=0.3))
    plain_config = replace(config, checkpoint_dir=f"{root}/plain", checkpoint_every_minutes=None)
    plain = _outcome(ToyTrainer(plain_config, dropout=0.3))
    return {"timed": timed, "plain": plain}


def test_timed_checkpoints_are_agreed_by_every_rank_and_change_nothing(tmp_path):
    """Timed checkpoints save every step on every rank and training ends bitwise as without them."""
    # Rank 0's clock decides and the others follow without hanging.
    config = _config(
        str(tmp_path),
        resume=None,
        checkpoint_every_steps=None,
        checkpoint_every_minutes=1e-6,
        epochs=1,
    )
    results = ddptrain.spawn(_timed, 2, config, str(tmp_path), timeout_s=240)
    steps = sorted(ckpt.parse_step(p.name) for p in (tmp_path / "ckpt").glob("ckpt-*.pt"))
    assert steps == list(range(1, 9))
    for r in results:
        assert torch.equal(r["timed"]["params"], r["plain"]["params"])


class _OrphanedTrainer(ToyTrainer):
    """Rank `orphan`'s launcher goes away during step `at` (its parent process no longer is
    the agent it started under, as for a worker whose torchrun agent died); the others keep
    theirs. The step waits for that rank's heartbeat to notice, so the run cannot end first."""

    def __init__(self, config: TrainerConfig, orphan: int, at: int) -> None:
        super().__init__(config, dropout=0.3)
        self.orphan, self.at = orphan, at

    def training_step(self, model, batch):
        if self.step == self.at and self.info.rank == self.orphan:
            os.getppid = lambda: 1  # reparented to init: what a worker sees when its agent dies
            deadline = time.monotonic() + 60
            while self._heartbeat.launcher_lost is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().training_step(model, batch)


def _one_launcher_lost(config: TrainerConfig, root: str) -> dict:
    """A straight run, the run where rank 1's launcher goes in step 4, and that run resumed."""
    straight = _outcome(ToyTrainer(replace(config, checkpoint_dir=f"{root}/straight"), 0.3))
    real_getppid = os.getppid
    try:
        stopped = _outcome(_OrphanedTrainer(config, orphan=1, at=3))
    finally:
        os.getppid = real_getppid
    resumed = _outcome(ToyTrainer(config, dropout=0.3))
    return {"straight": straight, "stopped": stopped, "resumed": resumed, "agent": os.getppid()}


def test_one_rank_losing_its_launcher_stops_every_rank_with_the_lost_rank_code(tmp_path):
    """When rank 1's agent goes both ranks save one step and stop with 75; the rerun is bitwise."""
    # 75, the lost-rank code, asks for a restart; rank 0 must not stop with the signal's 76.
    config = _config(str(tmp_path))
    # A torchrun agent's variable: each rank then watches its parent as its agent.
    env = {"TORCHELASTIC_RUN_ID": "lost-launcher-test"}
    results = ddptrain.spawn(_one_launcher_lost, 2, config, str(tmp_path), env=env, timeout_s=240)
    steps = {r["stopped"].get("stopped_at") for r in results}
    assert len(steps) == 1 and None not in steps, [r["stopped"] for r in results]
    (step,) = steps
    assert step >= 4, step
    for rank, r in enumerate(results):
        assert r["stopped"]["code"] == LOST_RANK_EXIT_CODE, (rank, r["stopped"])
        assert r["resumed"]["summary"]["step"] == r["straight"]["summary"]["step"] == 16
        assert torch.equal(r["resumed"]["params"], r["straight"]["params"])
    message = results[0]["stopped"]["message"]
    agent = results[1]["agent"]
    assert f"on its torchrun agent (pid {agent}) is gone (rank 1)" in message, message
    assert f"exiting with code {LOST_RANK_EXIT_CODE}" in message, message
    ckpt.verify_checkpoint(tmp_path / "ckpt" / f"ckpt-{step:08d}.pt")


def test_the_stop_line_says_how_to_continue_as_the_run_was_configured():
    """With resume='auto' the stop line says to rerun the command; without, it names the setting."""
    agreed = Agreed(True, 76, {"SIGTERM": [0, 1]})
    resumes = agreed.message(5, "saved ckpt/ckpt-00000005.pt in 0.01 s", resumes=True)
    fresh = agreed.message(5, "saved ckpt/ckpt-00000005.pt in 0.01 s", resumes=False)
    assert resumes.startswith("ddptrain: stopped at step 5 on SIGTERM (ranks 0, 1): saved")
    assert resumes.endswith("Run the same command again to continue from there.")
    assert fresh.endswith("Run it again with resume='auto' (--resume auto) to continue from there.")

"""Trainer on per-rank data parts of different lengths (an IterableDataset) through join."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset

import ddptrain
from ddptrain.train.config import TrainerConfig
from ddptrain.train.epochs import check_uneven_supported
from support.toy_models import N_EVAL, ToyTrainer

BATCH = 8  # global: 4 per rank at world size 2


def _part_len(rank: int) -> int:
    return 16 + 8 * rank


class _RankPart(IterableDataset):
    """Rank r's part of the toy problem: 16 + 8 r samples, so ranks run out at different steps."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        rank = dist.get_rank()
        start = sum(_part_len(r) for r in range(rank))
        self.x, self.y = x[start : start + _part_len(rank)], y[start : start + _part_len(rank)]

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self):
        yield from zip(self.x, self.y, strict=True)


class _UnevenTrainer(ToyTrainer):
    def __init__(
        self, config: TrainerConfig, batchnorm: bool = False, nan_last: bool = False
    ) -> None:
        super().__init__(config)
        self.batchnorm = batchnorm
        # A NaN input as the longest part's last sample: met after the other ranks ran out.
        self.nan_last = nan_last

    def build_model(self):
        if not self.batchnorm:
            return super().build_model()
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))

    def build_datasets(self):
        train_set, eval_set = super().build_datasets()
        x, y = (t.clone() for t in train_set.tensors)
        if self.nan_last:
            x[sum(_part_len(r) for r in range(dist.get_world_size())) - 1] = float("nan")
        return _RankPart(x, y), eval_set


def _fit(config: TrainerConfig, batchnorm: bool = False, nan_last: bool = False) -> dict:
    trainer = _UnevenTrainer(config, batchnorm, nan_last)
    summary = trainer.fit()
    momentum = [s["momentum_buffer"] for s in trainer.optimizer.state.values()]
    return {
        "summary": summary,
        "params": torch.cat([p.detach().reshape(-1) for p in trainer.model.module.parameters()]),
        "momentum": torch.cat([m.reshape(-1) for m in momentum]),
        "lr": trainer.optimizer.param_groups[0]["lr"],
    }


def _run_uneven(config: TrainerConfig, root: str) -> dict:
    ddptrain.init_distributed()  # one group for the three fits below
    straight = _fit(
        replace(config, checkpoint_dir=f"{root}/straight", log_dir=f"{root}/straight-logs")
    )
    halfway = replace(config, checkpoint_dir=f"{root}/halfway")
    _fit(replace(halfway, epochs=1))
    resumed = _fit(replace(halfway, resume="auto"))
    # SyncBatchNorm with the backend all_reduce hook: the Trainer gives it its own group.
    sbn = _fit(replace(config, sync_batchnorm=True, comm_hook="allreduce"), batchnorm=True)
    return {"straight": straight, "resumed": resumed, "sbn": sbn}


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_uneven_parts_train_to_the_end_on_every_rank(tmp_path, world_size):
    """Every rank trains to the longest part's step count; replicas agree and resume is exact."""
    cfg = TrainerConfig(
        global_batch_size=BATCH // 2 * world_size,
        epochs=3,
        keep_last=10,
        check_replicas_every=1,
        progress_bar=False,
    )
    results = ddptrain.spawn(_run_uneven, world_size, cfg, str(tmp_path), timeout_s=240)
    longest = _part_len(world_size - 1) // 4  # 4 samples per rank and step
    for r in results:
        straight = r["straight"]
        assert straight["summary"]["step"] == 3 * longest
        assert straight["summary"]["epoch"] == 3
        assert straight["summary"]["eval"]["eval_samples"] == N_EVAL
        for key in ("params", "momentum"):
            assert torch.equal(straight[key], results[0]["straight"][key]), key
            assert torch.equal(r["resumed"][key], straight[key]), key
        assert r["resumed"]["lr"] == straight["lr"]
        assert r["sbn"]["summary"]["step"] == 3 * longest
        assert torch.equal(r["sbn"]["params"], results[0]["sbn"]["params"])
    records = [json.loads(line) for line in open(tmp_path / "straight-logs" / "metrics.jsonl")]
    losses = [r["loss"] for r in records if "loss" in r]
    print("epoch losses:", losses)
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], losses


def _run_late_rounds(config: TrainerConfig) -> dict:
    ddptrain.init_distributed()
    # 6 samples per rank and micro-batch, rounds of 2: the 16-sample part ends mid-round
    # (micro-batches of 6, 6, 4) while the 24-sample part still accumulates its second round.
    accum = _fit(replace(config, global_batch_size=24, grad_accum_steps=2))
    skipped = _fit(replace(config, nonfinite="skip"), nan_last=True)
    try:
        _fit(replace(config, nonfinite="stop"), nan_last=True)
        stopped = None
    except ddptrain.NonFiniteError as e:
        stopped = str(e)
    return {"accum": accum, "skipped": skipped, "stopped": stopped}


def test_a_rank_out_of_data_mid_round_or_before_a_nan_step_does_not_hang(tmp_path):
    """A part ending mid-round or before a NaN step: each rank finishes or raises the same error."""
    cfg = TrainerConfig(global_batch_size=8, epochs=2, check_replicas_every=1, progress_bar=False)
    cfg = replace(cfg, timeout_s=60)  # a mismatch fails within a minute instead of hanging
    results = ddptrain.spawn(_run_late_rounds, 2, cfg, timeout_s=240)
    for r in results:
        assert r["accum"]["summary"]["step"] == 2 * 2  # the 24-sample part's 2 rounds, 2 epochs
        assert torch.equal(r["accum"]["params"], results[0]["accum"]["params"])
        assert r["skipped"]["summary"]["step"] == 2 * 6
        assert torch.isfinite(r["skipped"]["params"]).all()
        assert torch.equal(r["skipped"]["params"], results[0]["skipped"]["params"])
        assert r["stopped"] == results[0]["stopped"]
        assert "step 6: non-finite gradients (non-finite local loss on rank(s) [1])" in (
            r["stopped"] or ""
        )


def test_zero_stage_with_uneven_parts_is_refused_with_the_fix():
    """ZeRO's collective optimizer step cannot be shadowed by a joined rank: a clear refusal."""
    with pytest.raises(ValueError, match="zero_stage=1 with an IterableDataset.*Use zero_stage=0"):
        check_uneven_supported(TrainerConfig(global_batch_size=8, zero_stage=1))
    check_uneven_supported(TrainerConfig(global_batch_size=8))


def test_profile_steps_with_uneven_parts_is_refused_with_the_fix():
    """The profiler's starting barrier cannot be answered by a joined rank: a clear refusal."""
    config = TrainerConfig(global_batch_size=8, profile_steps=(1, 2), log_dir="logs")
    with pytest.raises(ValueError, match="profile_steps with an IterableDataset.*profile_steps="):
        check_uneven_supported(config)

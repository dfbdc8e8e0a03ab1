"""The Trainer with zero_stage 2 and 3: trains as stage 0 does, checkpoints the plain layouts,
resumes exactly, and refuses what cannot work with a message naming the fix."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import ddptrain
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from ddptrain.train import checkpoint as ckpt
from ddptrain.train.config import TrainerConfig
from support.toy_models import ToyTrainer, flat_params


def _config(tmp_path, **overrides) -> TrainerConfig:
    base = TrainerConfig(
        global_batch_size=12,
        epochs=4,
        log_every_steps=4,
        log_dir=None,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every_steps=5,
        keep_last=10,
        progress_bar=False,
    )
    return replace(base, **overrides)


def _fit(config: TrainerConfig, dropout: float = 0.0, crash_at_step: int | None = None):
    """(summary, whole parameters flattened) of a ToyTrainer fit; the group outlives fit() so
    that the sharded wrapper can gather them."""
    ddptrain.init_distributed()
    try:
        fault = {"kind": "raise", "step": crash_at_step} if crash_at_step is not None else None
        trainer = ToyTrainer(config, dropout=dropout, fault=fault, smooth=True)
        summary = trainer.fit()
        model = trainer.model
        if isinstance(model, FullyShardedDataParallel):
            with model.summon_full_params():
                return summary, flat_params(model.module)
        return summary, flat_params(model.module)
    finally:
        ddptrain.shutdown()


def _fits(runs: list[tuple]) -> list:
    """Several fits in one world: each (summary, parameters), or ("error", message)."""
    out = []
    for run in runs:
        try:
            out.append(_fit(*run))
        except Exception as e:  # noqa: BLE001 - the test asserts on the message
            out.append(("error", f"{type(e).__name__}: {e}"))
    return out


def test_stages_2_and_3_train_bitwise_like_stage_0(tmp_path):
    """zero_stage 2 and 3 end on stage 0's weights and evaluations bitwise (32 steps at ws=2)."""
    runs = [
        (_config(tmp_path / f"s{stage}-a{accum}", zero_stage=stage, grad_accum_steps=accum), 0.1)
        for accum in (1, 2)
        for stage in (0, 2, 3)
    ]
    results = ddptrain.spawn(_fits, 2, runs, timeout_s=240)
    for rank_results in results:
        for accum in range(2):
            (s0, p0), (s2, p2), (s3, p3) = rank_results[3 * accum : 3 * accum + 3]
            assert s0["step"] == s2["step"] == s3["step"] == 32
            assert torch.equal(p0, p2) and torch.equal(p0, p3), accum
            assert s0["eval"] == s2["eval"] == s3["eval"]


def test_clipping_is_bitwise_the_same_at_every_zero_stage(tmp_path):
    """With an active grad_clip_norm, stages 0-3 end bitwise equal after 32 steps at ws=2."""
    # Every stage clips by the exact norm (ddp/exact.py): its bits ignore how the gradient is split.
    runs = [(_config(tmp_path / f"s{s}", zero_stage=s, grad_clip_norm=0.05),) for s in (0, 1, 2, 3)]
    runs.append((_config(tmp_path / "free", zero_stage=0),))
    results = ddptrain.spawn(_fits, 2, runs, timeout_s=240)
    for rank_results in results:
        (_, p0), (_, p1), (_, p2), (_, p3), (_, free) = rank_results
        assert torch.equal(p0, p1) and torch.equal(p0, p2) and torch.equal(p0, p3)
        assert not torch.equal(p0, free)


def test_stage_3_crash_and_resume_is_exact_and_the_checkpoint_is_plain(tmp_path):
    """Stage 3 resumes bitwise at ws=2, within 1e-5 at ws=3, from a checkpoint in plain layouts."""
    crashed = _config(tmp_path / "b", resume="auto", zero_stage=3)
    smooth = _config(tmp_path / "d", resume="auto", zero_stage=3)
    straight = [(_config(tmp_path / "a", zero_stage=3), 0.3), (_config(tmp_path / "c"), 0.0)]
    (s_a, p_a), (_, p_c) = ddptrain.spawn(_fits, 2, straight, timeout_s=240)[0]
    crashes = [(crashed, 0.3, 13), (smooth, 0.0, 13)]
    for error in ddptrain.spawn(_fits, 2, crashes, timeout_s=240)[0]:
        assert error[0] == "error" and "simulated crash" in error[1], error
    [(s_b, p_b)] = ddptrain.spawn(_fits, 2, [(crashed, 0.3)], timeout_s=120)[0]
    assert s_a["step"] == s_b["step"] == 32
    assert torch.equal(p_a, p_b)

    latest = ckpt.latest_checkpoint(tmp_path / "d" / "ckpt")
    saved = torch.load(latest, weights_only=True)
    plain = ToyTrainer(crashed).build_model()
    plain.load_state_dict(saved["model"])
    torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9).load_state_dict(saved["optimizer"])
    shapes = [tuple(s["momentum_buffer"].shape) for s in saved["optimizer"]["state"].values()]
    assert shapes == [tuple(p.shape) for p in plain.parameters()]

    other = tmp_path / "ws3" / "ckpt"
    other.mkdir(parents=True)
    for f in latest.parent.glob("ckpt-*"):
        (other / f.name).write_bytes(f.read_bytes())
    cfg3 = _config(other.parent, resume="auto", zero_stage=2)
    [(_, p3)] = ddptrain.spawn(_fits, 3, [(cfg3,)], timeout_s=120)[0]
    diff = (p3 - p_c).abs().max().item()
    print(f"stage 3 at ws=2 -> stage 2 at ws=3: max|diff| vs stage 0 = {diff:.3g}")
    assert diff < 1e-5


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"comm_hook": "bf16"}, "comm_hook='bf16' with zero_stage=3.*use comm_hook='default'"),
        ({"check_replicas_every": 5}, "no replicas to compare; set check_replicas_every=None"),
        ({"precision": "fp16"}, "precision='fp16' with zero_stage=3.*use precision='bf16'"),
    ],
)
def test_settings_that_cannot_work_when_sharded_name_the_fix(overrides, match):
    """comm hooks, replica checks and fp16's GradScaler are refused with stage 3, naming why."""
    with pytest.raises(ValueError, match=match):
        TrainerConfig(zero_stage=3, **overrides)

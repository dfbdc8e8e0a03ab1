"""Same bits at any world size, through the Trainer and at its edges: a run resumed at 4, then
3, then 2 ranks equals a straight one; an overflowing exact sum stops the step in one line; the
sampler's micro-batches and the refused settings (no processes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddptrain
from ddptrain.data import MicroBatchSampler
from ddptrain.models import LeNet
from ddptrain.train.config import ConfigError, TrainerConfig
from ddptrain.train.gradients import NonFiniteError
from ddptrain.train.trainer import Trainer
from support.digests import tensors_digest

WORLD_TIMEOUT_S = 540
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)


# ------------------------------------------------------------------------------ the Trainer
class _Crash(RuntimeError):
    pass


class _Trainer(Trainer):
    def __init__(self, config: TrainerConfig, crash_at: int | None = None) -> None:
        super().__init__(config)
        self.crash_at = crash_at

    def build_model(self) -> nn.Module:
        return LeNet(dropout=0.3, width=1, batchnorm=True)

    def build_datasets(self):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(120, 1, 28, 28, generator=g), torch.randint(0, 10, (120,), generator=g)
        return TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])

    def configure_optimizers(self, model: nn.Module):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)

    def training_step(self, model, batch):
        if self.step + 1 == self.crash_at:
            raise _Crash(f"crashed in step {self.crash_at}")
        x, y = batch
        return F.nll_loss(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        out = model(x)
        return {"loss": F.nll_loss(out, y, reduction="sum"), "accuracy": (out.argmax(1) == y).sum()}


def _config(root: str, **overrides) -> TrainerConfig:
    settings = {
        "global_batch_size": 24,
        "micro_batch_size": 2,
        "deterministic": True,
        "epochs": 3,
        "eval_batch_size": 7,
        "log_every_steps": 2,
        "log_dir": f"{root}/logs",
        "checkpoint_dir": f"{root}/ckpt",
        "checkpoint_every_steps": 4,
        "resume": "auto",
        "progress_bar": False,
        "seed": 3,
        "grad_clip_norm": 1.0,
    }
    return TrainerConfig(**{**settings, **overrides})


def _fit(root: str, crash_at: int | None = None) -> dict | None:
    trainer = _Trainer(_config(root), crash_at)
    try:
        summary = trainer.fit()
    except _Crash:
        return None
    if trainer.info.rank != 0:
        return None
    state = torch.load(sorted(Path(root, "ckpt").glob("ckpt-*.pt"))[-1], weights_only=True)
    records = [json.loads(line) for line in Path(root, "logs", "metrics.jsonl").open()]
    return {
        "model": tensors_digest([state["model"][k] for k in sorted(state["model"])]),
        "optimizer": tensors_digest(
            [t for s in state["optimizer"]["state"].values() for t in s.values()]
        ),
        "eval": summary["eval"],
        "losses": [(r["step"], r["loss"]) for r in records if "loss" in r],
    }


def test_the_trainer_resumed_at_4_then_3_then_2_ranks_equals_a_straight_run(tmp_path):
    """A run crashed on 4, then 3 ranks and finished on 2 ends bitwise as a straight run on 1."""
    straight = ddptrain.spawn(_fit, 1, str(tmp_path / "straight"), timeout_s=WORLD_TIMEOUT_S)
    chain = str(tmp_path / "chain")
    for world_size, crash_at in ((4, 6), (3, 10), (2, None)):
        results = ddptrain.spawn(_fit, world_size, chain, crash_at, timeout_s=WORLD_TIMEOUT_S)
    expected, got = straight[0], results[0]
    assert got["model"] == expected["model"] and got["optimizer"] == expected["optimizer"]
    assert got["eval"] == expected["eval"]
    # The chain's log holds each piece's records: the same steps, the same losses.
    assert dict(got["losses"]) == dict(expected["losses"])


class _Spiking(_Trainer):
    """Every micro-batch but a step's first has its loss scaled by 10**7."""

    def training_step(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        first = (self.calls - 1) % (self.config.global_batch_size // self.config.micro_batch_size)
        return super().training_step(model, batch) * (1.0 if first == 0 else 1e7)


def _overflow_message(root: str) -> str:
    try:
        _Spiking(_config(root, grad_clip_norm=None)).fit()
    except NonFiniteError as e:
        return str(e)
    return "no NonFiniteError"


def test_an_overflowing_exact_sum_stops_the_step_and_says_why(tmp_path):
    """A gradient beyond the fixed-point range stops the step with one line naming the overflow."""
    message = ddptrain.spawn(_overflow_message, 1, str(tmp_path), timeout_s=WORLD_TIMEOUT_S)[0]
    assert "step 1: non-finite gradients (the exact sums overflowed" in message, message


def _one_sided_gradient() -> dict:
    """One backward whose gradient is negative everywhere, from -2**30 to -1."""
    ddptrain.init_distributed()
    net = nn.Linear(4, 1, bias=False)
    model = ddptrain.DDP(net, deterministic=True)
    x = torch.tensor([[1.0, 2.0**10, 2.0**20, 2.0**30]])
    model(x).sum().neg().backward()
    return {"grad": net.weight.grad, "expected": -x}


def test_a_gradient_of_one_sign_keeps_its_exact_mean():
    """An all-negative gradient from -2**30 to -1 comes back exactly, not clipped or an overflow."""
    # The grid is set by the gradient's largest magnitude on either side: here 2**30, not its
    # maximum -1 (2**30 is past the grid's headroom over 1).
    result = ddptrain.spawn(_one_sided_gradient, 1, timeout_s=WORLD_TIMEOUT_S)[0]
    assert torch.equal(result["grad"], result["expected"]), result


# ------------------------------------------------------------------------------ no processes
def test_micro_batch_k_holds_the_same_samples_at_every_world_size():
    """Rank r's j-th micro-batch is j * W + r: the same samples at any W, also after a resume."""

    def by_k(world_size: int, state: dict | None = None) -> dict:
        out = {}
        for rank in range(world_size):
            sampler = MicroBatchSampler(
                50, global_batch_size=12, micro_batch_size=2, rank=rank, world_size=world_size
            )
            if state is not None:
                sampler.load_state_dict(state)
            for epoch in range(2):
                sampler.set_epoch(epoch)
                indices = list(sampler)
                batches = [indices[i : i + 2] for i in range(0, len(indices), 2)]
                first = sampler.consumed_samples // 12
                for j, micro_batch in enumerate(batches):
                    step, within = divmod(j, 12 // (2 * world_size))
                    out[(epoch, first + step, within * world_size + rank)] = micro_batch
        return out

    reference = by_k(1)
    assert len(reference) == 2 * 5 * 6  # 50 samples padded to 5 steps of 6 micro-batches
    for world_size in (2, 3, 6):
        assert by_k(world_size) == reference
    one = MicroBatchSampler(50, global_batch_size=12, micro_batch_size=2, rank=0, world_size=1)
    one.mark_consumed(6 * 2)  # two steps of 6 rounds
    resumed = by_k(3, one.state_dict())
    assert {k: v for k, v in reference.items() if k[0] == 0 and k[1] >= 2} == {
        k: v for k, v in resumed.items() if k[0] == 0
    }


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"deterministic": True}, "set micro_batch_size"),
        ({"micro_batch_size": 8}, "micro_batch_size splits steps with deterministic=True"),
        ({"deterministic": True, "micro_batch_size": 8, "comm_hook": "bf16"}, "summed exactly"),
        ({"deterministic": True, "micro_batch_size": 8, "comm_hook": "powersgd"}, "summed"),
        ({"deterministic": True, "micro_batch_size": 8, "sync_batchnorm": True}, "statistics"),
        ({"deterministic": True, "micro_batch_size": 8, "grad_accum_steps": 2}, "leave"),
        ({"deterministic": True, "micro_batch_size": 7}, "not a whole number"),
    ],
)
def test_settings_that_cannot_keep_the_promise_are_refused_in_one_line(overrides, fragment):
    """Options that would make a deterministic run depend on the world size are refused."""
    with pytest.raises(ConfigError, match=fragment):
        TrainerConfig(global_batch_size=96, **overrides)


def test_a_world_size_that_does_not_share_the_micro_batches_names_those_that_do():
    """96 / 8 = 12 micro-batches: 5 ranks are refused, the error names 1, 2, 3, 4, 6, 12."""
    cfg = TrainerConfig(global_batch_size=96, micro_batch_size=8, deterministic=True)
    cfg.check_world_size(4)
    with pytest.raises(ConfigError, match="world size that divides 12: 1, 2, 3, 4, 6, 12"):
        cfg.check_world_size(5)

"""CUDA/NCCL path (run with -m gpu on a machine with a GPU; deselected by default)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
import toy_models
from ddptrain.parallel.ddp import DistributedDataParallel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run_nccl_oracle() -> dict:
    info = ddptrain.init_distributed()
    torch.manual_seed(0)
    base = toy_models.make("lenet_nodrop").to(info.device)
    ours = DistributedDataParallel(copy.deepcopy(base))
    theirs = TorchDDP(copy.deepcopy(base), device_ids=[info.local_rank])
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(10):
            x, y = toy_models.batch("lenet", step, info.rank)
            opt.zero_grad()
            F.nll_loss(model(x.to(info.device)), y.to(info.device)).backward()
            opt.step()
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    ]
    return {"backend": info.backend, "device": str(info.device), "max_diff": max(diffs)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_wrapper_matches_official_ddp_on_cuda(world_size):
    """On CUDA with NCCL, 10 steps of LeNet equal official DDP (bitwise at 1-2 ranks)."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    results = ddptrain.spawn(_run_nccl_oracle, world_size, timeout_s=300)
    for r in results:
        assert r["backend"] == "nccl" and r["device"].startswith("cuda")
        assert r["max_diff"] == 0.0, r


def _run_fp16_trainer(tmp: str) -> dict:
    from ddptrain.train.config import TrainerConfig

    cfg = TrainerConfig(global_batch_size=12, epochs=2, precision="fp16", progress_bar=False)
    trainer = toy_models.ToyTrainer(cfg)
    return trainer.fit()


def test_fp16_trainer_with_grad_scaler_on_cuda(tmp_path):
    """precision='fp16' trains on CUDA with a GradScaler and reports finite metrics."""
    summary = ddptrain.spawn(_run_fp16_trainer, 1, str(tmp_path), timeout_s=300)[0]
    assert summary["step"] == 16
    assert summary["eval"]["eval_samples"] == toy_models.N_EVAL
    assert math.isfinite(summary["train_loss"]) and summary["train_loss"] > 0

"""The planner on one GPU (run with -m gpu; deselected by default): predict, then run, at one
rank. No timing bound: step times are checked to exist; memory, which the allocator makes
repeatable, within the planner's 10%."""

from __future__ import annotations

import pytest
import torch

from ddptrain.plan import plan
from ddptrain.plan.check import compare, run_local
from ddptrain.plan.run import Steps
from ddptrain.plan.setup import Setup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_mlp_ddp_at_one_rank_on_cuda_predicted_and_measured():
    """MLP DDP on one GPU: step times positive, predicted peak memory within 10% of measured."""
    result = plan("mlp", strategies=["ddp"], world_sizes=[1], device="cuda")
    (prof,) = result.profiles
    assert prof.device == "cuda" and result.link == "nccl-100g"
    setup = Setup(model="mlp", strategy="ddp", device="cuda")
    measured = run_local(setup, 1, Steps(3, 4, 4))
    row = compare(setup, result.predictions[0].at(1), measured, result.link, 0.0)
    assert row["setup"]["device"] == "cuda" and measured["devices"] == ["cuda"]
    assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0
    assert row["predicted_peak_bytes"] > 0 and row["measured_peak_bytes"] > 0
    assert 0.9 <= row["peak_ratio"] <= 1.1, row

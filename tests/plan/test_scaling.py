"""The models on paper (docs/scaling.md) against closed-form counts."""

from __future__ import annotations

import pytest

from ddptrain.plan.links import named_link
from ddptrain.plan.predict import predict
from ddptrain.plan.scaling import gpt2_small, mlp, paper_profile
from ddptrain.plan.setup import Setup


def test_gpt2_small_has_gpt2s_parameter_count():
    """GPT-2 small with its tied embedding: 124,439,808 parameters (HF GPT2Model's count)."""
    assert gpt2_small().numel == 124_439_808


def test_mlp_on_paper_matches_the_module():
    """The MLP on paper holds the same parameter count as ddptrain.models.MLP (~16.8M)."""
    from ddptrain.models import MLP

    assert mlp().numel == sum(p.numel() for p in MLP().parameters())


@pytest.mark.parametrize("spec", [mlp(), gpt2_small()], ids=lambda s: s.name)
def test_paper_profile_buckets_and_times(spec):
    """Each parameter is in one bucket, backward is 2x forward, GPT-2's tied embedding is last."""
    prof = paper_profile(spec)
    members = sorted(i for b in prof.buckets for i in b)
    assert members == list(range(len(spec.shapes)))
    assert prof.backward_s == pytest.approx(2 * prof.forward_s)
    assert prof.ready_s[0] == pytest.approx(prof.backward_s)
    assert prof.bucket_ready_s == sorted(prof.bucket_ready_s)


def test_ddp_memory_on_paper_is_params_grads_adamw_and_activations():
    """DDP on a GPU link peaks at 12P to 16P (4P + 4P + 8P) bytes plus the activations."""
    # Below the full sum where activations are freed as gradients arrive.
    spec = gpt2_small()
    prof = paper_profile(spec)
    n = spec.numel
    point = predict(Setup(strategy="ddp"), prof, named_link("nccl-100g"), [8]).points[0]
    assert 12 * n + prof.activation_bytes <= point.peak_bytes
    assert point.peak_bytes <= 16 * n + prof.activation_bytes


def test_docs_scaling_md_is_what_the_generator_writes():
    """docs/scaling.md is exactly `python -m ddptrain.plan.scaling`'s output."""
    # Regenerate it when the model changes.
    from pathlib import Path

    from ddptrain.plan.scaling import render

    page = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"
    assert page.read_text() == render()

"""The planner's memory model against closed-form counts on toy models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddptrain.optim.partition import ALIGN
from ddptrain.plan import memory
from ddptrain.plan.predict import peak_memory
from ddptrain.plan.profile import _state_bytes
from ddptrain.plan.setup import Setup
from ddptrain.plan.steps import zero1_broadcast_bytes
from support.plan_profiles import MIB, bus, ddp_profile, local


def _toy() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


TOY_PARAM_BYTES = (8 * 16 + 16 + 16 * 4 + 4) * 4


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), TOY_PARAM_BYTES),
        # Two moments per parameter, and a float32 step counter per parameter tensor.
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), 2 * TOY_PARAM_BYTES + 4 * 4),
    ],
)
def test_optimizer_state_is_counted_as_the_closed_form(optimizer, expected):
    """Optimizer state after a step is 0 for SGD, P with momentum, 2P + step counters for AdamW."""
    model = _toy()
    opt = optimizer(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    assert sum(p.numel() * 4 for p in model.parameters()) == TOY_PARAM_BYTES
    assert _state_bytes(opt) == expected


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_held_bytes_per_zero_stage(world_size):
    """Per-rank bytes follow the ZeRO table: DDP all, ZeRO-1 shards state, ZeRO-2/3 all three."""
    p, o, n = 1200, 2400, world_size
    assert memory.held("ddp", p, o, n) == {"params": p, "grads": p, "optimizer": o}
    assert memory.held("powersgd", p, o, n) == {"params": p, "grads": p, "optimizer": o}
    assert memory.held("zero1", p, o, n) == {"params": p, "grads": p, "optimizer": o // n}
    for stage in ("zero2", "zero3"):
        assert memory.held(stage, p, o, n) == {
            "params": p // n,
            "grads": p // n,
            "optimizer": o // n,
        }


def test_sharded_unit_pads_each_parameter_and_the_shards():
    """A unit pads each parameter to ALIGN and cuts world_size equal shards of ALIGN multiples."""
    assert memory.unit_bytes([3, 5], 1, 4) == (2 * ALIGN * 4, 2 * ALIGN * 4)
    assert memory.unit_bytes([3, 5], 2, 4) == (2 * ALIGN * 4, ALIGN * 4)
    assert memory.unit_bytes([3, 5], 4, 4) == (4 * ALIGN * 4, ALIGN * 4)


def test_shared_bucket_rows_touched():
    """On one host a rank makes 1/n of each other rank's row resident: (n - 1)/n of a bucket."""
    buckets = [8 * MIB, 4 * MIB]
    assert memory.shared_rows_touched(buckets, 1) == 0
    assert memory.shared_rows_touched(buckets, 2) == 6 * MIB
    assert memory.shared_rows_touched(buckets, 4) == 9 * MIB


def test_powersgd_messages_on_a_matrix_and_a_vector():
    """PowerSGD sends a 64x96 gradient as P (64 x r) and Q (96 x r), and a bias whole."""
    p, q = memory.powersgd_messages([(64, 96), (64,)], rank=4, element_bytes=4)
    assert (p, q) == ((64 * 4 + 64) * 4, 96 * 4 * 4)
    # A matrix that would not shrink twice over goes whole, as the hook sends it.
    assert memory.powersgd_messages([(4, 5)], rank=4, element_bytes=4) == (20 * 4, 0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero1_broadcasts_every_element_once(world_size):
    """ZeRO-1's step broadcasts each parameter element exactly once, from its owner."""
    numels = [1000, 37, 4096, 5]
    assert sum(zero1_broadcast_bytes(numels, world_size)) == sum(numels)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ddp_and_zero1_peak_on_one_host(world_size):
    """DDP's peak is one rank's plus (n-1)/n of both 10 MiB buckets; ZeRO-1's less others' state."""
    prof = ddp_profile()
    link, n = local(1e-9), world_size
    rows = 2 * 10 * MIB * (n - 1) // n
    ddp = peak_memory(Setup(strategy="ddp"), prof, link, n)
    assert ddp["peak"] == 200 * MIB + rows
    zero1 = peak_memory(Setup(strategy="zero1"), prof, link, n)
    assert zero1["peak"] == 200 * MIB + rows - (40 * MIB - 40 * MIB // n)


@pytest.mark.parametrize("staged", [False, True])
def test_zero3_peak_of_one_unit(staged):
    """ZeRO-3 at ws 2 peaks at runtime + shard + state/n + gathered unit + grads + activations."""
    # gloo's staging buffer is freed before the gradients exist, so it does not raise the peak.
    eb, n = 4, 2
    whole, shard = 2 * ALIGN * eb, ALIGN * eb
    acts, state = 3 * whole, 2 * 8 * eb
    prof = ddp_profile(
        param_names=["w", "b"],
        param_numels=[3, 5],
        param_shapes=[[3], [5]],
        buckets=[],
        bucket_ready_s=[],
        hook_s=[],
        ready_s=[0.015, 0.012],
        units=[[0, 1]],
        unit_forward_s=[[0.0, 0.010]],
        activation_bytes=acts,
        unit_activation_bytes=[acts],
        optimizer_state_bytes=state,
        peak_rss_bytes=100 * MIB,  # no runtime growth beyond the tensors
    )
    link = local(1e-9) if staged else bus()
    parts = peak_memory(Setup(strategy="zero3"), prof, link, n)
    assert parts["peak"] == 100 * MIB + shard + state // n + 2 * whole + acts

"""adamw_groups and warmup_cosine (ddptrain/train/optimizers.py): which parameters decay,
the schedule's values, and a schedule that resumes from its state_dict."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from ddptrain.models import GPT
from ddptrain.train.optimizers import adamw_groups, warmup_cosine, warmup_cosine_factor


def test_gpt_groups_decay_matmul_weights_only():
    """On the GPT only the blocks' Linear weights decay; each trainable parameter is in a group."""
    # The output projection is tied to an embedding, so it does not decay either.
    model = GPT(n_layer=2, n_head=2, n_embd=16, block_size=8)
    decay, no_decay = adamw_groups(model, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert decayed == sorted(
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    )
    kept = {names[id(p)] for p in no_decay["params"]}
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.mlp.fc.bias"} <= kept
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_groups_are_told_apart_without_shapes():
    """1-D parameters (as ZeRO-2/3 shards are) group by module and name, not by dimensions."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Conv1d(4, 4, 1))
    for module in model:
        for name, p in list(module.named_parameters(recurse=False)):
            module._parameters[name] = nn.Parameter(p.detach().reshape(-1))
    assert all(p.dim() == 1 for p in model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in adamw_groups(model, 0.1)]
    assert groups == [
        ["1.weight", "3.weight"],
        ["0.weight", "1.bias", "2.weight", "2.bias", "3.bias"],
    ]


def test_frozen_parameters_and_empty_groups_are_left_out():
    """A frozen layer is in no group; a model without decayed weights returns one group."""
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    model[0].weight.requires_grad_(False)
    groups = adamw_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.0]
    assert [p.shape for p in groups[0]["params"]] == [(3,), (3,), (3,)]


def test_warmup_rises_linearly_then_cosine_falls_to_the_floor():
    """Warm-up 4 of 20 steps rises as (s+1)/5, then cosine falls to exactly 0.1 from step 20 on."""
    f = [
        warmup_cosine_factor(s, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for s in range(25)
    ]
    assert f[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert f[12] == pytest.approx(0.1 + 0.9 * 0.5)
    assert all(a >= b for a, b in zip(f[4:], f[5:], strict=False))
    assert f[20:] == pytest.approx([0.1] * 5)


def test_the_schedule_resumes_from_a_weights_only_state_dict():
    """A warmup_cosine loaded weights_only after 7 steps continues with the uninterrupted lrs."""

    def make():
        opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=1.0)
        return opt, warmup_cosine(opt, warmup_steps=3, total_steps=12)

    opt, straight = make()
    lrs = []
    for _ in range(12):
        opt.step()
        straight.step()
        lrs.append(opt.param_groups[0]["lr"])
    opt, first = make()
    for _ in range(7):
        opt.step()
        first.step()
    buffer = io.BytesIO()
    torch.save({"scheduler": first.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    opt, resumed = make()
    opt.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["scheduler"])
    again = []
    for _ in range(5):
        opt.step()
        resumed.step()
        again.append(opt.param_groups[0]["lr"])
    assert again == lrs[7:]


def test_bad_schedule_settings_are_refused():
    """A negative warm-up or a ratio above 1 is a ValueError naming the values."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="-1, 10, 0.1"):
        warmup_cosine(opt, warmup_steps=-1, total_steps=10)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        warmup_cosine(opt, warmup_steps=1, total_steps=10, min_lr_ratio=2.0)

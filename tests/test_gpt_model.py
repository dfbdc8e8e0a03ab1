"""ddptrain.models.GPT: shapes, a causal mask, tied embeddings, GPT-2's initialisation, and
sampling that extends the prompt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddptrain.models import GPT


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_head=2, n_embd=32, block_size=16, **kw).eval()


def test_logits_have_one_row_per_position_and_byte():
    """(batch, time) bytes in, (batch, time, 256) logits out, for any time up to block_size."""
    model = _model()
    for t in (1, 7, 16):
        assert model(torch.randint(0, 256, (3, t))).shape == (3, t, 256)
    with pytest.raises(ValueError, match="longer than block_size 16"):
        model(torch.randint(0, 256, (1, 17)))


def test_a_later_byte_does_not_change_earlier_logits():
    """Attention is causal: changing byte 9 leaves logits 0-8 bitwise the same and changes 9 on."""
    model = _model()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_the_output_projection_is_the_token_embedding():
    """lm_head and wte are one tensor, counted once, that a gradient through the logits reaches."""
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    model.train()
    h = torch.randn(2, 4, 32)
    F.cross_entropy(model.lm_head(h).reshape(-1, 256), torch.zeros(8, dtype=torch.long)).backward()
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0


def test_initialisation_is_gpt2s():
    """GPT-2 init: N(0, 0.02), residual out N(0, 0.02/sqrt(2 n_layer)), biases 0, LayerNorms 1."""
    torch.manual_seed(0)
    model = GPT(n_layer=8, n_head=4, n_embd=256, block_size=64)
    proj = model.blocks[0].mlp.proj.weight
    fc = model.blocks[0].mlp.fc.weight
    assert fc.std().item() == pytest.approx(0.02, rel=0.02)
    assert proj.std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert model.blocks[0].attn.qkv.bias.abs().sum() == 0
    assert torch.equal(model.ln_f.weight, torch.ones(256))


def test_generate_extends_the_prompt_reproducibly_past_the_context():
    """generate() keeps the prompt and adds the bytes asked, past block_size, the same per seed."""
    model = _model()
    prompt = torch.tensor([list(b"def ")])
    runs = [
        model.generate(prompt, 20, top_k=5, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]
    assert runs[0].shape == (1, 24)
    assert torch.equal(runs[0][:, :4], prompt)
    assert torch.equal(runs[0], runs[1])


def test_width_must_split_into_heads():
    """n_embd not divisible by n_head is refused, naming both."""
    with pytest.raises(ValueError, match="n_embd 30 is not divisible by n_head 4"):
        GPT(n_embd=30, n_head=4)


def test_training_flops_per_token_count_every_product_but_the_position_table():
    """flops_per_token is 6 per weight but the position table, plus 12 L d T for attention."""
    n_layer, d, t, vocab = 2, 32, 16, 256
    model = GPT(n_layer=n_layer, n_head=4, n_embd=d, block_size=t)
    weights = vocab * d + n_layer * (12 * d * d + 13 * d) + 2 * d
    assert model.flops_per_token() == 6 * weights + 12 * n_layer * d * t

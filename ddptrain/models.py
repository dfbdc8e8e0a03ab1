"""Reference models used by the recipes, the benchmark and the tests.

from ddptrain.models import GPT, LeNet, MLP, conv_net
model = LeNet()            # 1x28x28 input, 10 log-probabilities out
model = LeNet(batchnorm=True)   # BatchNorm after each conv and the hidden layer
model = MLP()              # 16.8M parameters, little compute each: communication shows
model = conv_net()         # 3x32x32 input: compute-heavy
model = GPT(n_layer=4, n_head=4, n_embd=128, block_size=128)   # bytes in, next-byte logits out
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LeNet(nn.Module):
    """The convolutional net of PyTorch's classic MNIST and distributed tutorials.

    `width` multiplies every layer's channels/units (1 is the tutorial's 10-20-50 net).
    `batchnorm=True` puts a BatchNorm after conv1, conv2 and fc1 (whose biases it replaces).
    """

    def __init__(self, dropout: float = 0.5, width: int = 1, batchnorm: bool = False) -> None:
        super().__init__()
        c1, c2, hidden = 10 * width, 20 * width, 50 * width
        self.conv1 = nn.Conv2d(1, c1, kernel_size=5, bias=not batchnorm)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=5, bias=not batchnorm)
        self.conv2_drop = nn.Dropout2d(dropout)
        self.fc1 = nn.Linear(c2 * 16, hidden, bias=not batchnorm)
        self.fc2 = nn.Linear(hidden, 10)
        self.dropout = dropout
        norm2d = nn.BatchNorm2d if batchnorm else lambda _: nn.Identity()
        self.bn1, self.bn2 = norm2d(c1), norm2d(c2)
        self.bn3 = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.bn1(self.conv1(x)), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.bn2(self.conv2(x))), 2))
        x = x.flatten(1)
        x = F.relu(self.bn3(self.fc1(x)))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


class MLP(nn.Module):
    """Communication-heavy: ~16.8M parameters, little compute per parameter at batch 32."""

    def __init__(self, width: int = 2240, depth: int = 4) -> None:
        super().__init__()
        dims = [784] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False))
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.out(x)


def conv_net() -> nn.Module:
    """Compute-heavy: ~0.24M parameters, four 3x3 convolutions on 3x32x32 images."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


class GPT(nn.Module):
    """A decoder-only transformer in GPT-2's layout (nanoGPT's, minus its training code).

    Token and position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention through
    `F.scaled_dot_product_attention`, then a 4x GELU MLP, each added to the residual stream),
    a final LayerNorm and an output projection tied to the token embedding. `vocab_size` 256
    models bytes. `forward(tokens)` maps (batch, time) int64 to (batch, time, vocab) logits.
    `blocks` is the ModuleList of the repeated blocks: what the Trainer checkpoints, and the
    units of ZeRO-3.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        # GPT-2's initialisation: N(0, 0.02), the projections into the residual stream scaled
        # down by sqrt(2 n_layer) so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"a sequence of {t} tokens is longer than block_size {self.block_size}"
            )
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per parameter outside the position embedding (forward
        and backward of its products) plus 12 * n_layer * n_embd * block_size for the attention
        scores and their weighted sums, as in PaLM's appendix B and nanoGPT's estimate_mfu."""
        params = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        n_embd = self.wte.weight.shape[1]
        return 6 * params + 12 * len(self.blocks) * n_embd * self.block_size

    @torch.no_grad()
    def generate(
        self,
        tokens: torch.Tensor,
        new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`tokens` (batch, time) followed by `new_tokens` sampled one at a time, each from the
        logits of the last block_size tokens (divided by temperature, cut to the top_k)."""
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.block_size :])[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return tokens


class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = FeedForward(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class FeedForward(nn.Module):
    """Linear to 4x the width, GELU, linear back (GPT-2's MLP)."""

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))

"""A tiny GPT on the Trainer, as a language-model user writes one: AdamW groups, warmup +
cosine, byte windows; for tests that train it end to end (imported by the tests)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ddptrain.data.text import ByteWindows
from ddptrain.models import GPT
from ddptrain.train.optimizers import adamw_groups, warmup_cosine
from ddptrain.train.trainer import Trainer
from support.toy_models import CrashAt

BLOCK_SIZE = 16
# Bytes of a repeating phrase with a counter: a little to learn, the same on every machine.
TEXT = b"".join(b"def f%d(x):\n    return x + %d\n" % (i % 50, i % 7) for i in range(300))


class TinyGPTTrainer(Trainer):
    """GPT(n_layer 2, n_embd `width`) on windows of TEXT; `crash_at_step` raises CrashAt while
    the step after it runs."""

    def __init__(self, config, width=32, dropout=0.0, crash_at_step=None):
        super().__init__(config)
        self.width, self.dropout, self.crash_at_step = width, dropout, crash_at_step

    def build_model(self):
        return GPT(
            n_layer=2, n_head=2, n_embd=self.width, block_size=BLOCK_SIZE, dropout=self.dropout
        )

    def build_datasets(self):
        data = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
        cut = len(data) * 9 // 10
        return ByteWindows(data[:cut], BLOCK_SIZE), ByteWindows(data[cut:], BLOCK_SIZE)

    def configure_optimizers(self, model):
        opt = torch.optim.AdamW(adamw_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
        return opt, warmup_cosine(opt, warmup_steps=3, total_steps=self.total_steps)

    def training_step(self, model, batch):
        if self.step == self.crash_at_step:
            raise CrashAt(f"simulated crash at step {self.step}")
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        per_window = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
        return {"loss": per_window.sum(), "bpb": per_window.sum() / math.log(2)}

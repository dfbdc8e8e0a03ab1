"""Small models that exercise each corner of the DDP wrapper (imported by the tests)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ddptrain.models import LeNet
from ddptrain.train.trainer import Trainer

N_TRAIN, N_EVAL = 96, 10


class BatchNormNet(nn.Module):
    """Conv + BatchNorm: buffers that change every step and must come from rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 26 * 26, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc(F.relu(self.bn(self.conv(x))).flatten(1)), dim=1)


class TiedNet(nn.Module):
    """One weight shared by the input embedding and the output projection."""

    def __init__(self, vocab: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.out(torch.tanh(self.hidden(self.embed(tokens)))), dim=-1)


class BranchNet(nn.Module):
    """A branch used only when asked (some ranks) and a layer never used at all."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(12, 16)
        self.branch = nn.Linear(16, 16)
        self.never_used = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.relu(self.branch(h))
        return F.log_softmax(self.head(h), dim=1)


class SwappedNet(nn.Module):
    """Two layers that some ranks run in the other order."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 12)
        self.second = nn.Linear(12, 12)
        self.head = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor, swap: bool) -> torch.Tensor:
        a, b = (self.second, self.first) if swap else (self.first, self.second)
        return F.log_softmax(self.head(torch.tanh(b(torch.tanh(a(x))))), dim=1)


class FrozenNet(nn.Module):
    """A frozen first layer (requires_grad=False) in front of trainable ones."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(12, 16)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(torch.relu(self.fc1(torch.relu(self.frozen(x))))), dim=1)


class TanhMLP(nn.Module):
    """Smooth everywhere (no ReLU, max-pool or dropout): rounding differences stay rounding-sized
    over many steps instead of flipping an activation and growing."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.head(self.net(x)), dim=1)


def make(name: str) -> nn.Module:
    """Build a test model by name."""
    return {
        "lenet": LeNet,
        "lenet_nodrop": lambda: LeNet(dropout=0.0),
        "batchnorm": BatchNormNet,
        "tied": TiedNet,
        "branch": BranchNet,
        "swapped": SwappedNet,
        "frozen": FrozenNet,
        "tanh": TanhMLP,
    }[name]()


def batch(name: str, step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (input, target) batch for `name`, different per step and rank."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    if name in ("lenet", "lenet_nodrop", "batchnorm"):
        x = torch.randn(size, 1, 28, 28, generator=g)
    elif name == "tied":
        x = torch.randint(0, 20, (size, 5), generator=g)
        return x, torch.randint(0, 20, (size, 5), generator=g)
    else:
        x = torch.randn(size, 12, generator=g)
    return x, torch.randint(0, 10, (size,), generator=g)


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int):
    """Mean NLL loss of `model` on one batch; the branch model uses its branch on odd ranks,
    the swapped one swaps its layers there."""
    if name == "branch":
        out = model(x, use_branch=rank % 2 == 1)
    elif name == "swapped":
        out = model(x, swap=rank % 2 == 1)
    else:
        out = model(x)
    return F.nll_loss(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class CrashAt(RuntimeError):
    """Raised by ToyTrainer to simulate a job dying mid-run."""


class ToyTrainer(Trainer):
    """A 3-class problem from a fixed linear teacher, with optional dropout and an injected fault.

    fault = {"kind": "raise" | "kill" | "freeze" | "nan" | "perturb" | "sigterm" | "sigint" |
    "sigusr1", "step": S, "rank": R (default: every rank), "stamp": path to write the time of a
    kill/freeze}, injected while the step after S runs. A kill or freeze happens only on a job's
    first attempt, so a torchrun restart runs clean; a signal to itself, only in a run that
    started before S. smooth=True uses tanh instead of ReLU, for runs compared with a tolerance
    rather than bitwise. step_sleep_s slows each step, for a signal from outside to land mid-run.
    """

    def __init__(self, config, dropout=0.0, fault=None, smooth=False, step_sleep_s=0.0):
        super().__init__(config)
        self.dropout = dropout
        self.fault = fault
        self.smooth = smooth
        self.step_sleep_s = step_sleep_s

    def build_model(self):
        activation = nn.Tanh() if self.smooth else nn.ReLU()
        return nn.Sequential(
            nn.Linear(8, 32), activation, nn.Dropout(self.dropout), nn.Linear(32, 3)
        )

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N_TRAIN + N_EVAL, 8, generator=g)
        teacher = torch.randn(8, 3, generator=g)
        y = (x @ teacher).argmax(1)
        return (
            TensorDataset(x[:N_TRAIN], y[:N_TRAIN]),
            TensorDataset(x[N_TRAIN:], y[N_TRAIN:]),
        )

    def configure_optimizers(self, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)

    def training_step(self, model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        return self._inject(model, loss)

    def validation_step(self, model, batch):
        x, y = batch
        out = model(x)
        return {
            "loss": F.cross_entropy(out, y, reduction="sum"),
            "accuracy": (out.argmax(1) == y).sum(),
        }

    def _inject(self, model, loss):
        f = self.fault
        if not f or self.step != f["step"] or f.get("rank", self.info.rank) != self.info.rank:
            return loss
        kind = f["kind"]
        if kind == "raise":
            raise CrashAt(f"simulated crash at step {self.step}")
        if kind == "nan":
            return loss * float("nan")
        if kind == "perturb":
            with torch.no_grad():
                next(model.module.parameters()).add_(1e-3)
            return loss
        if kind.startswith("sig"):
            os.kill(os.getpid(), signal.Signals[kind.upper()])
            return loss
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return loss
        if f.get("stamp"):
            with open(f["stamp"], "w") as out:
                out.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        return loss


def fit(config, dropout=0.0, crash_at_step=None, smooth=False) -> tuple[dict, torch.Tensor]:
    """Train a ToyTrainer (raising CrashAt at `crash_at_step`); its summary and final
    parameters, flattened on the CPU."""
    fault = {"kind": "raise", "step": crash_at_step} if crash_at_step is not None else None
    trainer = ToyTrainer(config, dropout=dropout, fault=fault, smooth=smooth)
    summary = trainer.fit()
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.module.parameters()])
    return summary, params.cpu()


def flat_params(module: nn.Module) -> torch.Tensor:
    """Every parameter, flattened into one float64 vector (for bitwise comparisons)."""
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The oracle tests' optimizer: SGD with momentum and weight decay on trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)

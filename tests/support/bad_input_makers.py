"""The inputs of docs/errors.md's API rows: a tiny trainer, and per row the files it is given
(setups, run once in the parent) and the call that must fail (triggers, run in every rank).

tests/test_bad_inputs.py pairs each with the error it must raise.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddptrain
from ddptrain.data.datasets import mnist
from ddptrain.dist import INIT_METHOD_ENV
from ddptrain.train import checkpoint as ckpt
from ddptrain.train.config import TrainerConfig
from ddptrain.train.trainer import Trainer
from support.error_table import TIME_LIMIT_S
from support.idx_files import write_split


# --------------------------------------------------------------------------- a tiny trainer
class ToyTrainer(Trainer):
    """An 8 -> hidden -> 3 classifier on random data; knobs to make each input bad."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        n_train: int = 24,
        hidden: int = 32,
        scalar: bool = True,
        eval_set: bool = False,
    ) -> None:
        super().__init__(config)
        self.n_train, self.hidden, self.scalar = n_train, hidden, scalar
        self.eval_set = eval_set

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 3))

    def build_datasets(self) -> tuple[TensorDataset, TensorDataset | None]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n_train, 8, generator=g)
        train_set = TensorDataset(x, torch.randint(0, 3, (self.n_train,), generator=g))
        return train_set, (train_set if self.eval_set else None)

    def configure_optimizers(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def training_step(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="mean" if self.scalar else "none")

    def validation_step(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict:
        x, y = batch
        return {"accuracy": (model(x).argmax(1) == y).sum()}


def config(**overrides: object) -> TrainerConfig:
    settings: dict[str, object] = {"global_batch_size": 4, "epochs": 1, "progress_bar": False}
    return TrainerConfig(**{**settings, **overrides})


def fit(trainer_kwargs: dict | None = None, **overrides: object) -> None:
    ToyTrainer(config(**overrides), **(trainer_kwargs or {})).fit()


# --------------------------------------------------------------------------- setups (parent)
def no_setup(case_dir: Path, reference: Path) -> None:
    pass


def copy_reference(case_dir: Path, reference: Path) -> None:
    shutil.copytree(reference, case_dir / "ckpt")


def corrupt_latest(case_dir: Path, reference: Path) -> None:
    copy_reference(case_dir, reference)
    path = ckpt.latest_checkpoint(case_dir / "ckpt")
    data = bytearray(path.read_bytes())
    # A flipped byte in the middle keeps the size, so only the sha256 can tell.
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def write_foreign(case_dir: Path, reference: Path) -> None:
    torch.save(nn.Linear(8, 3).state_dict(), case_dir / "weights.pt")


def write_truncated(case_dir: Path, reference: Path) -> None:
    write_split(case_dir, "train", 20, gz=False)
    images = case_dir / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])


def write_swapped(case_dir: Path, reference: Path) -> None:
    write_split(case_dir, "train", 20, gz=False)
    images, labels = case_dir / "train-images-idx3-ubyte", case_dir / "train-labels-idx1-ubyte"
    image_bytes, label_bytes = images.read_bytes(), labels.read_bytes()
    images.write_bytes(label_bytes)
    labels.write_bytes(image_bytes)


def write_label_12(case_dir: Path, reference: Path) -> None:
    write_split(case_dir, "train", 20, gz=False)
    labels = bytearray((case_dir / "train-labels-idx1-ubyte").read_bytes())
    labels[8 + 7] = 12  # after the 8-byte header: the label of image 7
    (case_dir / "train-labels-idx1-ubyte").write_bytes(bytes(labels))


def write_html(case_dir: Path, reference: Path) -> None:
    # What a failed download through a proxy or captive portal typically leaves behind.
    write_split(case_dir, "train", 20, gz=False)
    (case_dir / "train-images-idx3-ubyte").write_bytes(b"<html><body>403 Forbidden</body></html>")


# --------------------------------------------------------------------------- triggers
def rank() -> int:
    return torch.distributed.get_rank()


def wrap_count(case_dir: Path) -> None:
    extra = [nn.Linear(4, 4)] if rank() == 1 else []
    ddptrain.DDP(nn.Sequential(nn.Linear(4, 4), *extra))


def wrap_shape(case_dir: Path) -> None:
    ddptrain.DDP(nn.Linear(4, 8 if rank() == 1 else 4))


def wrap_dtype(case_dir: Path) -> None:
    ddptrain.DDP(nn.Linear(4, 4).to(torch.float64 if rank() == 1 else torch.float32))


def backward_twice(case_dir: Path) -> None:
    model = ddptrain.DDP(nn.Linear(4, 4))
    loss = model(torch.randn(2, 4)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def backward_outside_no_sync(case_dir: Path) -> None:
    model = ddptrain.DDP(nn.Linear(4, 4))
    with model.no_sync():
        loss = model(torch.randn(2, 4)).sum()
    loss.backward()


def comm_hook_not_callable(case_dir: Path) -> None:
    ddptrain.DDP(nn.Linear(4, 4), comm_hook=3)


def create_graph(case_dir: Path) -> None:
    model = ddptrain.DDP(nn.Linear(4, 4))
    model(torch.randn(2, 4)).pow(2).sum().backward(create_graph=True)


def params_added(case_dir: Path) -> None:
    model = ddptrain.DDP(nn.Sequential(nn.Linear(4, 4)))
    model.module.append(nn.Linear(4, 4))
    model(torch.randn(2, 4))


def batch_not_divisible(case_dir: Path) -> None:
    fit(global_batch_size=5)


def batch_too_large(case_dir: Path) -> None:
    fit({"n_train": 10}, global_batch_size=12)


def empty_dataset(case_dir: Path) -> None:
    fit({"n_train": 0})


def loss_not_scalar(case_dir: Path) -> None:
    fit({"scalar": False})


def checkpointing_without_blocks(case_dir: Path) -> None:
    fit(activation_checkpointing=True)


def best_metric_without_checkpoint_dir(case_dir: Path) -> None:
    config(best_metric="eval_accuracy")


def best_metric_without_eval_set(case_dir: Path) -> None:
    fit(best_metric="eval_accuracy", checkpoint_dir=str(case_dir / "ckpt"))


def best_metric_unknown(case_dir: Path) -> None:
    fit({"eval_set": True}, best_metric="accuracy", checkpoint_dir=str(case_dir / "ckpt"))


def resume_missing(case_dir: Path) -> None:
    fit(resume=str(case_dir / "ckpt-00000099.pt"))


def resume_corrupt(case_dir: Path) -> None:
    path = ckpt.list_checkpoints(case_dir / "ckpt")[-1]
    fit(checkpoint_dir=str(case_dir / "ckpt"), resume=str(path))


def resume_foreign(case_dir: Path) -> None:
    fit(resume=str(case_dir / "weights.pt"))


def resume_other_model(case_dir: Path) -> None:
    fit({"hidden": 16}, checkpoint_dir=str(case_dir / "ckpt"), resume="auto")


def resume_other_config(case_dir: Path) -> None:
    fit(global_batch_size=8, checkpoint_dir=str(case_dir / "ckpt"), resume="auto")


def read_mnist(case_dir: Path) -> None:
    mnist(case_dir)


def nccl_without_cuda(case_dir: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        # So the row means the same on a GPU machine: there it is what a CPU node would see.
        mp.setattr(torch.cuda, "is_available", lambda: False)
        ddptrain.init_distributed(backend="nccl", env={})


def local_rank_beyond_devices(case_dir: Path) -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        ddptrain.init_distributed(env={**env, INIT_METHOD_ENV: f"file://{case_dir}/store"})


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another socket listens on, as a stale job's store would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@contextlib.contextmanager
def torchrun_env(port: int) -> Iterator[None]:
    """What torchrun sets for rank 0 of 2 with --master-port `port`."""
    with pytest.MonkeyPatch.context() as mp:
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for key, value in env.items():
            mp.setenv(key, str(value))
        mp.delenv("LOCAL_RANK", raising=False)
        mp.delenv(INIT_METHOD_ENV, raising=False)
        yield


def master_port_in_use(case_dir: Path) -> None:
    with busy_port() as port, torchrun_env(port):
        # Longer than TIME_LIMIT_S: an error only at the rendezvous timeout fails the row.
        ddptrain.init_distributed(timeout_s=2 * TIME_LIMIT_S)

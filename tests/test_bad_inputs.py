"""Bad inputs: the executable form of docs/errors.md, one test per row of its table.

    python -m pytest tests/test_bad_inputs.py -q

Each row's input must raise the documented exception on every rank, within TIME_LIMIT_S, as
one paragraph holding the documented fragments in order (what is wrong ... the fix), and leave
every file it was given byte-identical. Rows that need ranks run together in one spawned world
of 2 (one start-up for all of them); the rest run in this process.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddptrain
from ddptrain.data.datasets import mnist
from ddptrain.data.idx import IDXFormatError
from ddptrain.dist import INIT_METHOD_ENV
from ddptrain.train import checkpoint as ckpt
from ddptrain.train.config import TrainerConfig
from ddptrain.train.trainer import Trainer
from error_table import (
    GAP,
    MAX_MESSAGE_CHARS,
    TIME_LIMIT_S,
    Outcome,
    attempt,
    doc_rows,
    in_order,
    snapshot,
)
from idx_files import write_split

# The spawned world's collective timeout: a row that leaves ranks out of step fails in this
# time instead of hanging the whole file.
WORLD_TIMEOUT_S = 20.0
API_SECTION = "From the Python API"


# --------------------------------------------------------------------------- a tiny trainer
class _ToyTrainer(Trainer):
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


def _config(**overrides: object) -> TrainerConfig:
    settings: dict[str, object] = {"global_batch_size": 4, "epochs": 1, "progress_bar": False}
    return TrainerConfig(**{**settings, **overrides})


def _fit(trainer_kwargs: dict | None = None, **overrides: object) -> None:
    _ToyTrainer(_config(**overrides), **(trainer_kwargs or {})).fit()


# --------------------------------------------------------------------------- setups (parent)
def _no_setup(case_dir: Path, reference: Path) -> None:
    pass


def _copy_reference(case_dir: Path, reference: Path) -> None:
    shutil.copytree(reference, case_dir / "ckpt")


def _corrupt_latest(case_dir: Path, reference: Path) -> None:
    _copy_reference(case_dir, reference)
    path = ckpt.latest_checkpoint(case_dir / "ckpt")
    data = bytearray(path.read_bytes())
    # A flipped byte in the middle keeps the size, so only the sha256 can tell.
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _write_foreign(case_dir: Path, reference: Path) -> None:
    torch.save(nn.Linear(8, 3).state_dict(), case_dir / "weights.pt")


def _write_truncated(case_dir: Path, reference: Path) -> None:
    write_split(case_dir, "train", 20, gz=False)
    images = case_dir / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])


def _write_swapped(case_dir: Path, reference: Path) -> None:
    write_split(case_dir, "train", 20, gz=False)
    images, labels = case_dir / "train-images-idx3-ubyte", case_dir / "train-labels-idx1-ubyte"
    image_bytes, label_bytes = images.read_bytes(), labels.read_bytes()
    images.write_bytes(label_bytes)
    labels.write_bytes(image_bytes)


def _write_label_12(case_dir: Path, reference: Path) -> None:
    write_split(case_dir, "train", 20, gz=False)
    labels = bytearray((case_dir / "train-labels-idx1-ubyte").read_bytes())
    labels[8 + 7] = 12  # after the 8-byte header: the label of image 7
    (case_dir / "train-labels-idx1-ubyte").write_bytes(bytes(labels))


def _write_html(case_dir: Path, reference: Path) -> None:
    # What a failed download through a proxy or captive portal typically leaves behind.
    write_split(case_dir, "train", 20, gz=False)
    (case_dir / "train-images-idx3-ubyte").write_bytes(b"<html><body>403 Forbidden</body></html>")


# --------------------------------------------------------------------------- triggers
def _rank() -> int:
    return torch.distributed.get_rank()


def _wrap_count(case_dir: Path) -> None:
    extra = [nn.Linear(4, 4)] if _rank() == 1 else []
    ddptrain.DDP(nn.Sequential(nn.Linear(4, 4), *extra))


def _wrap_shape(case_dir: Path) -> None:
    ddptrain.DDP(nn.Linear(4, 8 if _rank() == 1 else 4))


def _wrap_dtype(case_dir: Path) -> None:
    ddptrain.DDP(nn.Linear(4, 4).to(torch.float64 if _rank() == 1 else torch.float32))


def _backward_twice(case_dir: Path) -> None:
    model = ddptrain.DDP(nn.Linear(4, 4))
    loss = model(torch.randn(2, 4)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def _backward_outside_no_sync(case_dir: Path) -> None:
    model = ddptrain.DDP(nn.Linear(4, 4))
    with model.no_sync():
        loss = model(torch.randn(2, 4)).sum()
    loss.backward()


def _comm_hook_not_callable(case_dir: Path) -> None:
    ddptrain.DDP(nn.Linear(4, 4), comm_hook=3)


def _create_graph(case_dir: Path) -> None:
    model = ddptrain.DDP(nn.Linear(4, 4))
    model(torch.randn(2, 4)).pow(2).sum().backward(create_graph=True)


def _params_added(case_dir: Path) -> None:
    model = ddptrain.DDP(nn.Sequential(nn.Linear(4, 4)))
    model.module.append(nn.Linear(4, 4))
    model(torch.randn(2, 4))


def _batch_not_divisible(case_dir: Path) -> None:
    _fit(global_batch_size=5)


def _batch_too_large(case_dir: Path) -> None:
    _fit({"n_train": 10}, global_batch_size=12)


def _empty_dataset(case_dir: Path) -> None:
    _fit({"n_train": 0})


def _loss_not_scalar(case_dir: Path) -> None:
    _fit({"scalar": False})


def _best_metric_without_checkpoint_dir(case_dir: Path) -> None:
    _config(best_metric="eval_accuracy")


def _best_metric_without_eval_set(case_dir: Path) -> None:
    _fit(best_metric="eval_accuracy", checkpoint_dir=str(case_dir / "ckpt"))


def _best_metric_unknown(case_dir: Path) -> None:
    _fit({"eval_set": True}, best_metric="accuracy", checkpoint_dir=str(case_dir / "ckpt"))


def _resume_missing(case_dir: Path) -> None:
    _fit(resume=str(case_dir / "ckpt-00000099.pt"))


def _resume_corrupt(case_dir: Path) -> None:
    path = ckpt.list_checkpoints(case_dir / "ckpt")[-1]
    _fit(checkpoint_dir=str(case_dir / "ckpt"), resume=str(path))


def _resume_foreign(case_dir: Path) -> None:
    _fit(resume=str(case_dir / "weights.pt"))


def _resume_other_model(case_dir: Path) -> None:
    _fit({"hidden": 16}, checkpoint_dir=str(case_dir / "ckpt"), resume="auto")


def _resume_other_config(case_dir: Path) -> None:
    _fit(global_batch_size=8, checkpoint_dir=str(case_dir / "ckpt"), resume="auto")


def _read_mnist(case_dir: Path) -> None:
    mnist(case_dir)


def _nccl_without_cuda(case_dir: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        # So the row means the same on a GPU machine: there it is what a CPU node would see.
        mp.setattr(torch.cuda, "is_available", lambda: False)
        ddptrain.init_distributed(backend="nccl", env={})


def _local_rank_beyond_devices(case_dir: Path) -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        ddptrain.init_distributed(env={**env, INIT_METHOD_ENV: f"file://{case_dir}/store"})


@contextlib.contextmanager
def _busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another socket listens on, as a stale job's store would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@contextlib.contextmanager
def _torchrun_env(port: int) -> Iterator[None]:
    """What torchrun sets for rank 0 of 2 with --master-port `port`."""
    with pytest.MonkeyPatch.context() as mp:
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for key, value in env.items():
            mp.setenv(key, str(value))
        mp.delenv("LOCAL_RANK", raising=False)
        mp.delenv(INIT_METHOD_ENV, raising=False)
        yield


def _master_port_in_use(case_dir: Path) -> None:
    with _busy_port() as port, _torchrun_env(port):
        # Longer than TIME_LIMIT_S: an error only at the rendezvous timeout fails the row.
        ddptrain.init_distributed(timeout_s=2 * TIME_LIMIT_S)


# --------------------------------------------------------------------------- the rows
@dataclass(frozen=True)
class Case:
    """One row of docs/errors.md: how to make the input, and what it must raise."""

    error: type[BaseException]
    fragment: str
    trigger: Callable[[Path], None]
    setup: Callable[[Path, Path], None] = _no_setup
    spawned: bool = True


_SAME_MODEL = "Every rank must build the same architecture with the same parameter order"
CASES: dict[str, Case] = {
    "model-count": Case(
        RuntimeError,
        "ranks wrap different models: 2 parameters and 0 buffers on one rank but 4 parameters "
        f"and 0 buffers on the other (rank 0 vs rank 1){GAP}{_SAME_MODEL}",
        _wrap_count,
    ),
    "model-shape": Case(
        RuntimeError,
        "ranks wrap different models: parameter #0 is 'weight' [4, 4] torch.float32 on one rank "
        f"but parameter 'weight' [8, 4] torch.float32 on the other{GAP}{_SAME_MODEL}",
        _wrap_shape,
    ),
    "model-dtype": Case(
        RuntimeError,
        "ranks wrap different models: parameter #0 is 'weight' [4, 4] torch.float32 on one rank "
        f"but parameter 'weight' [4, 4] torch.float64 on the other{GAP}{_SAME_MODEL}",
        _wrap_dtype,
    ),
    "batch-not-divisible": Case(
        ValueError,
        f"global_batch_size 5 is not divisible by world_size 2{GAP}use a multiple of 2 (e.g. 4 "
        "or 6)",
        _batch_not_divisible,
    ),
    "batch-larger-than-shard": Case(
        ValueError,
        "global_batch_size 12 is larger than the training set (10 samples)"
        f"{GAP}use global_batch_size <= 10",
        _batch_too_large,
    ),
    "data-missing": Case(
        FileNotFoundError,
        f"MNIST train split not found; looked in{GAP}Put train-images-idx3-ubyte.gz and "
        f"train-labels-idx1-ubyte.gz in <root>/MNIST/raw/{GAP}or pass download=True",
        _read_mnist,
        spawned=False,
    ),
    "data-truncated": Case(
        IDXFormatError,
        "train-images-idx3-ubyte: truncated: header says 20x28x28 = 15680 bytes of data, found "
        f"15580{GAP}delete it and download it again",
        _read_mnist,
        _write_truncated,
        spawned=False,
    ),
    "data-wrong-magic": Case(
        IDXFormatError,
        "train-images-idx3-ubyte: magic number 0x00000801 but expected 0x00000803 (IDX images, "
        f"3 dims){GAP}are the images and labels files swapped?",
        _read_mnist,
        _write_swapped,
        spawned=False,
    ),
    "data-not-idx": Case(
        IDXFormatError,
        "train-images-idx3-ubyte: not an IDX file (it does not start with two zero bytes)"
        f"{GAP}delete it and download it again",
        _read_mnist,
        _write_html,
        spawned=False,
    ),
    "data-label-out-of-range": Case(
        IDXFormatError,
        f"train-labels-idx1-ubyte: label 12 at index 7 is outside 0..9{GAP}delete it and "
        "download it again",
        _read_mnist,
        _write_label_12,
        spawned=False,
    ),
    "best-metric-without-checkpoint-dir": Case(
        ValueError,
        "best_metric='eval_accuracy' marks the best checkpoint in checkpoint_dir; set "
        "checkpoint_dir too",
        _best_metric_without_checkpoint_dir,
        spawned=False,
    ),
    "best-metric-without-eval-set": Case(
        ValueError,
        "best_metric='eval_accuracy' needs an evaluation, but build_datasets() returned no eval "
        "set; return (train_set, eval_set), or set best_metric=None",
        _best_metric_without_eval_set,
    ),
    "best-metric-unknown": Case(
        ValueError,
        "best_metric='accuracy' is not among the evaluation's metrics ['eval_accuracy', "
        "'eval_samples']; use best_metric='eval_accuracy'",
        _best_metric_unknown,
    ),
    "ckpt-missing": Case(
        ckpt.CheckpointError,
        f"ckpt-00000099.pt does not exist or is not a file{GAP}pick one with "
        "latest_checkpoint(dir)",
        _resume_missing,
    ),
    "ckpt-corrupt": Case(
        ckpt.CheckpointError,
        "ckpt-00000006.pt does not match the sha256 in ckpt-00000006.json: the file is "
        f"corrupted{GAP}resume from an earlier checkpoint",
        _resume_corrupt,
        _corrupt_latest,
    ),
    "ckpt-foreign": Case(
        ckpt.CheckpointError,
        "weights.pt is a torch file but not a ddptrain checkpoint (no 'ddptrain_format' key; "
        "found ['bias', 'weight'])"
        f"{GAP}load its weights yourself with torch.load(path, weights_only=True)",
        _resume_foreign,
        _write_foreign,
    ),
    "ckpt-other-model": Case(
        ckpt.CheckpointError,
        f"ckpt-00000006.pt{GAP}does not match this model: 3 shape mismatches: 0.weight "
        f"(checkpoint [32, 8], model [16, 8]){GAP}resume with the model it was saved from, or "
        "start a fresh run in another checkpoint_dir",
        _resume_other_model,
        _copy_reference,
    ),
    "resume-other-config": Case(
        ckpt.CheckpointError,
        "cannot resume: the checkpoint was trained with global_batch_size=4 but this run has "
        f"global_batch_size=8{GAP}set global_batch_size=4 to resume, or start a fresh run in "
        "another checkpoint_dir",
        _resume_other_config,
        _copy_reference,
    ),
    "nccl-without-cuda": Case(
        RuntimeError,
        "backend 'nccl' needs CUDA, but torch.cuda.is_available() is False on this machine"
        f"{GAP}use backend='gloo'",
        _nccl_without_cuda,
        spawned=False,
    ),
    "local-rank-beyond-devices": Case(
        RuntimeError,
        "LOCAL_RANK=1 but only 1 CUDA device(s) are visible"
        f"{GAP}use --nproc_per_node <= 1 or check CUDA_VISIBLE_DEVICES",
        _local_rank_beyond_devices,
        spawned=False,
    ),
    "master-port-in-use": Case(
        RuntimeError,
        f"MASTER_PORT{GAP}on 127.0.0.1 is already in use (EADDRINUSE){GAP}pick a free port "
        "(MASTER_PORT=PORT, or torchrun --master-port PORT",
        _master_port_in_use,
        spawned=False,
    ),
    "empty-dataset": Case(
        ValueError,
        "the training dataset is empty; build_datasets() returned 0 samples"
        f"{GAP}check the data path and any filtering in build_datasets()",
        _empty_dataset,
    ),
    "loss-not-scalar": Case(
        ValueError,
        f"training_step must return a scalar loss tensor, got (2,){GAP}reduce it with .mean()",
        _loss_not_scalar,
    ),
    "backward-twice": Case(
        RuntimeError,
        "backward was called twice on one forward under DistributedDataParallel"
        f"{GAP}Run a new forward before each backward",
        _backward_twice,
    ),
    "backward-outside-no-sync": Case(
        RuntimeError,
        "gradient of 'bias' arrived in a backward outside no_sync() whose forward ran inside it"
        f"{GAP}Run the forward and its backward both inside no_sync() (to accumulate) or both "
        "outside (to synchronize)",
        _backward_outside_no_sync,
    ),
    "comm-hook-not-callable": Case(
        TypeError,
        f"comm_hook must be a hook (callable) or one of default{GAP}got int",
        _comm_hook_not_callable,
    ),
    "create-graph": Case(
        RuntimeError,
        "backward(create_graph=True) is not supported under DistributedDataParallel"
        f"{GAP}take torch.autograd.grad(loss, params, create_graph=True)",
        _create_graph,
    ),
    "params-added-after-wrapping": Case(
        RuntimeError,
        f"the wrapped module's parameters changed after wrapping{GAP}Add every parameter "
        "before wrapping",
        _params_added,
    ),
}


# --------------------------------------------------------------------------- running rows
def _run_spawned(case_dirs: dict[str, str]) -> dict[str, Outcome]:
    ddptrain.init_distributed(timeout_s=WORLD_TIMEOUT_S)
    return {cid: attempt(CASES[cid].trigger, Path(d)) for cid, d in case_dirs.items()}


@dataclass(frozen=True)
class Observed:
    """A row's outcome on every rank, and its files before and after."""

    outcomes: list[Outcome]
    before: dict[str, str]
    after: dict[str, str]


def _reference_checkpoints(folder: Path) -> Path:
    """A finished run's checkpoint_dir, made by the trainer itself (world size 1)."""
    _fit(checkpoint_dir=str(folder / "ckpt"), keep_last=2)
    return folder / "ckpt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _reference_checkpoints(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory, reference: Path) -> dict[str, Observed]:
    root = tmp_path_factory.mktemp("spawned")
    dirs = {cid: root / cid for cid, case in CASES.items() if case.spawned}
    for cid, d in dirs.items():
        d.mkdir()
        CASES[cid].setup(d, reference)
    before = {cid: snapshot(d) for cid, d in dirs.items()}
    per_rank = ddptrain.spawn(
        _run_spawned, 2, {cid: str(d) for cid, d in dirs.items()}, timeout_s=180
    )
    return {
        cid: Observed([r[cid] for r in per_rank], before[cid], snapshot(d))
        for cid, d in dirs.items()
    }


@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_input(case_id: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The row's input raises its documented one-paragraph error on every rank, fast, harmlessly."""
    case = CASES[case_id]
    if case.spawned:
        observed = request.getfixturevalue("spawned")[case_id]
    else:
        case.setup(tmp_path, request.getfixturevalue("reference"))
        before = snapshot(tmp_path)
        observed = Observed([attempt(case.trigger, tmp_path)], before, snapshot(tmp_path))
    for rank, seen in enumerate(observed.outcomes):
        assert seen.error is not None, f"rank {rank} raised nothing"
        assert issubclass(seen.error, case.error), (rank, seen.error, seen.message)
        assert in_order(seen.message, case.fragment), (
            f"rank {rank}: {seen.message!r} lacks {case.fragment!r}"
        )
        assert "\n" not in seen.message and len(seen.message) < MAX_MESSAGE_CHARS, seen.message
        assert seen.elapsed_s < TIME_LIMIT_S, seen.elapsed_s
    assert len({(o.error, o.message) for o in observed.outcomes}) == 1, observed.outcomes
    assert observed.after == observed.before


@pytest.mark.parametrize("use_tcp", [False, True])
def test_port_in_use_names_the_port(use_tcp: bool) -> None:
    """A busy rendezvous port is named with its number, for env:// and tcp:// alike."""
    with _busy_port() as port, _torchrun_env(port):
        method = f"tcp://127.0.0.1:{port}" if use_tcp else None
        where = f"port {port} on 127.0.0.1" if use_tcp else f"MASTER_PORT {port} on 127.0.0.1"
        with pytest.raises(RuntimeError, match=re.escape(where)):
            ddptrain.init_distributed(init_method=method, timeout_s=10)


def test_doc_table_matches_the_tests() -> None:
    """docs/errors.md lists exactly these rows, with the fragments and types asserted here."""
    rows = doc_rows(API_SECTION)
    assert set(rows) == set(CASES)
    for case_id, (where, fragment) in rows.items():
        assert fragment == CASES[case_id].fragment, case_id
        assert CASES[case_id].error.__name__ in where, case_id

"""Bad inputs: the executable form of docs/errors.md, one test per row of its table.

    python -m pytest tests/test_bad_inputs.py -q

Each row's input must raise the documented exception on every rank, within TIME_LIMIT_S, as
one paragraph holding the documented fragments in order (what is wrong ... the fix), and leave
every file it was given byte-identical. Rows that need ranks run together in one spawned world
of 2 (one start-up for all of them); the rest run in this process.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import ddptrain
from ddptrain.data.idx import IDXFormatError
from ddptrain.train import checkpoint as ckpt
from support import bad_input_makers as make
from support.error_table import (
    GAP,
    MAX_MESSAGE_CHARS,
    TIME_LIMIT_S,
    Outcome,
    attempt,
    doc_rows,
    in_order,
    snapshot,
)

# The spawned world's collective timeout: a row that leaves ranks out of step fails in this
# time instead of hanging the whole file.
WORLD_TIMEOUT_S = 20.0
API_SECTION = "From the Python API"


# --------------------------------------------------------------------------- the rows
@dataclass(frozen=True)
class Case:
    """One row of docs/errors.md: how to make the input, and what it must raise."""

    error: type[BaseException]
    fragment: str
    trigger: Callable[[Path], None]
    setup: Callable[[Path, Path], None] = make.no_setup
    spawned: bool = True


_SAME_MODEL = "Every rank must build the same architecture with the same parameter order"
CASES: dict[str, Case] = {
    "model-count": Case(
        RuntimeError,
        "ranks wrap different models: 2 parameters and 0 buffers on one rank but 4 parameters "
        f"and 0 buffers on the other (rank 0 vs rank 1){GAP}{_SAME_MODEL}",
        make.wrap_count,
    ),
    "model-shape": Case(
        RuntimeError,
        "ranks wrap different models: parameter #0 is 'weight' [4, 4] torch.float32 on one rank "
        f"but parameter 'weight' [8, 4] torch.float32 on the other{GAP}{_SAME_MODEL}",
        make.wrap_shape,
    ),
    "model-dtype": Case(
        RuntimeError,
        "ranks wrap different models: parameter #0 is 'weight' [4, 4] torch.float32 on one rank "
        f"but parameter 'weight' [4, 4] torch.float64 on the other{GAP}{_SAME_MODEL}",
        make.wrap_dtype,
    ),
    "batch-not-divisible": Case(
        ValueError,
        f"global_batch_size 5 is not divisible by world_size 2{GAP}use a multiple of 2 (e.g. 4 "
        "or 6)",
        make.batch_not_divisible,
    ),
    "batch-larger-than-shard": Case(
        ValueError,
        "global_batch_size 12 is larger than the training set (10 samples)"
        f"{GAP}use global_batch_size <= 10",
        make.batch_too_large,
    ),
    "data-missing": Case(
        FileNotFoundError,
        f"MNIST train split not found; looked in{GAP}Put train-images-idx3-ubyte.gz and "
        f"train-labels-idx1-ubyte.gz in <root>/MNIST/raw/{GAP}or pass download=True",
        make.read_mnist,
        spawned=False,
    ),
    "data-truncated": Case(
        IDXFormatError,
        "train-images-idx3-ubyte: truncated: header says 20x28x28 = 15680 bytes of data, found "
        f"15580{GAP}delete it and download it again",
        make.read_mnist,
        make.write_truncated,
        spawned=False,
    ),
    "data-wrong-magic": Case(
        IDXFormatError,
        "train-images-idx3-ubyte: magic number 0x00000801 but expected 0x00000803 (IDX images, "
        f"3 dims){GAP}are the images and labels files swapped?",
        make.read_mnist,
        make.write_swapped,
        spawned=False,
    ),
    "data-not-idx": Case(
        IDXFormatError,
        "train-images-idx3-ubyte: not an IDX file (it does not start with two zero bytes)"
        f"{GAP}delete it and download it again",
        make.read_mnist,
        make.write_html,
        spawned=False,
    ),
    "data-label-out-of-range": Case(
        IDXFormatError,
        f"train-labels-idx1-ubyte: label 12 at index 7 is outside 0..9{GAP}delete it and "
        "download it again",
        make.read_mnist,
        make.write_label_12,
        spawned=False,
    ),
    "best-metric-without-checkpoint-dir": Case(
        ValueError,
        "best_metric='eval_accuracy' marks the best checkpoint in checkpoint_dir; set "
        "checkpoint_dir too",
        make.best_metric_without_checkpoint_dir,
        spawned=False,
    ),
    "best-metric-without-eval-set": Case(
        ValueError,
        "best_metric='eval_accuracy' needs an evaluation, but build_datasets() returned no eval "
        "set; return (train_set, eval_set), or set best_metric=None",
        make.best_metric_without_eval_set,
    ),
    "best-metric-unknown": Case(
        ValueError,
        "best_metric='accuracy' is not among the evaluation's metrics ['eval_accuracy', "
        "'eval_samples']; use best_metric='eval_accuracy'",
        make.best_metric_unknown,
    ),
    "ckpt-missing": Case(
        ckpt.CheckpointError,
        "ckpt-00000099.pt does not exist; pick one with latest_checkpoint(dir)",
        make.resume_missing,
    ),
    "ckpt-corrupt": Case(
        ckpt.CheckpointError,
        "ckpt-00000006.pt does not match the sha256 in ckpt-00000006.json: the file is "
        f"corrupted{GAP}resume from an earlier checkpoint",
        make.resume_corrupt,
        make.corrupt_latest,
    ),
    "ckpt-foreign": Case(
        ckpt.CheckpointError,
        "weights.pt is a torch file but not a ddptrain checkpoint (no 'ddptrain_format' key; "
        "found ['bias', 'weight'])"
        f"{GAP}load its weights yourself with torch.load(path, weights_only=True)",
        make.resume_foreign,
        make.write_foreign,
    ),
    "ckpt-other-model": Case(
        ckpt.CheckpointError,
        f"ckpt-00000006.pt{GAP}does not match this model: 3 shape mismatches: 0.weight "
        f"(checkpoint [32, 8], model [16, 8]){GAP}resume with the model it was saved from, or "
        "start a fresh run in another checkpoint_dir",
        make.resume_other_model,
        make.copy_reference,
    ),
    "resume-other-config": Case(
        ckpt.CheckpointError,
        "cannot resume: the checkpoint was trained with global_batch_size=4 but this run has "
        f"global_batch_size=8{GAP}set global_batch_size=4 to resume, or start a fresh run in "
        "another checkpoint_dir",
        make.resume_other_config,
        make.copy_reference,
    ),
    "nccl-without-cuda": Case(
        RuntimeError,
        "backend 'nccl' needs CUDA, but torch.cuda.is_available() is False on this machine"
        f"{GAP}use backend='gloo'",
        make.nccl_without_cuda,
        spawned=False,
    ),
    "local-rank-beyond-devices": Case(
        RuntimeError,
        "LOCAL_RANK=1 but only 1 CUDA device(s) are visible"
        f"{GAP}use --nproc_per_node <= 1 (one process per GPU), or hide the GPUs "
        "(CUDA_VISIBLE_DEVICES=) to run every rank on CPU with gloo",
        make.local_rank_beyond_devices,
        spawned=False,
    ),
    "master-port-in-use": Case(
        RuntimeError,
        f"MASTER_PORT{GAP}on 127.0.0.1 is already in use (EADDRINUSE){GAP}pick a free port "
        "(MASTER_PORT=PORT, or torchrun --master-port PORT",
        make.master_port_in_use,
        spawned=False,
    ),
    "empty-dataset": Case(
        ValueError,
        "the training dataset is empty; build_datasets() returned 0 samples"
        f"{GAP}check the data path and any filtering in build_datasets()",
        make.empty_dataset,
    ),
    "checkpointing-without-blocks": Case(
        ValueError,
        "activation_checkpointing acts on the model's blocks, and Sequential has none that "
        f"Trainer.blocks() finds{GAP}override blocks(model) to return its repeated layers",
        make.checkpointing_without_blocks,
    ),
    "loss-not-scalar": Case(
        ValueError,
        f"training_step must return a scalar loss tensor, got (2,){GAP}reduce it with .mean()",
        make.loss_not_scalar,
    ),
    "backward-twice": Case(
        RuntimeError,
        "backward was called twice on one forward under DistributedDataParallel"
        f"{GAP}Run a new forward before each backward",
        make.backward_twice,
    ),
    "backward-outside-no-sync": Case(
        RuntimeError,
        "gradient of 'bias' arrived in a backward outside no_sync() whose forward ran inside it"
        f"{GAP}Run the forward and its backward both inside no_sync() (to accumulate) or both "
        "outside (to synchronize)",
        make.backward_outside_no_sync,
    ),
    "comm-hook-not-callable": Case(
        TypeError,
        f"comm_hook must be a (state, hook) pair{GAP}got int; for a hook by name use "
        "comm_hook=ddptrain.named_hook('bf16')",
        make.comm_hook_not_callable,
    ),
    "create-graph": Case(
        RuntimeError,
        "backward(create_graph=True) is not supported under DistributedDataParallel"
        f"{GAP}take torch.autograd.grad(loss, params, create_graph=True)",
        make.create_graph,
    ),
    "params-added-after-wrapping": Case(
        RuntimeError,
        f"the wrapped module's parameters changed after wrapping{GAP}Add every parameter "
        "before wrapping",
        make.params_added,
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
    make.fit(checkpoint_dir=str(folder / "ckpt"), keep_last=2)
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
    with make.busy_port() as port, make.torchrun_env(port):
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

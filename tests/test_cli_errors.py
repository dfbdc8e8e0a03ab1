"""The recipe's command-line errors: each row of docs/errors.md gives its exit status and one
`error:` line; the table and the rows agree.

    python -m pytest tests/test_cli_errors.py -q

The recipe's rows of docs/errors.md ("From the command line") run recipes/mnist.py's main in
this process (world size 1) through ddptrain.cli.run_main, as `python recipes/mnist.py` would,
and check its exit status and that stderr is exactly one `error:` line holding the fragment.
"""

from __future__ import annotations

import gzip
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddptrain import cli
from support import cli_env
from support.error_table import GAP, doc_rows, in_order
from support.idx_files import FASHION_FIRST_LABELS, closed_port_url, idx_bytes, write_split

# @record enables faulthandler on stderr, which pytest has swapped for an object without fileno.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

rank0 = cli_env.rank0

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "mnist.py"
CLI_SECTION = "From the command line"


def _recipe_module():
    spec = importlib.util.spec_from_file_location("mnist_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_recipe(flags: list[str]) -> int:
    """The recipe as `python recipes/mnist.py FLAGS` runs it: run_main with its settings."""
    recipe = _recipe_module()
    return cli.run_main(recipe.main, flags, settings=recipe.SETTINGS)


def test_offline_hint_keeps_the_users_flags_and_launcher(monkeypatch):
    """The offline hint repeats the user's flags and launcher, with --dataset fashion-mnist."""
    hint = _recipe_module()._offline_hint
    monkeypatch.setattr(sys, "argv", ["recipes/mnist.py"])
    flags = ["--dataset", "mnist", "--dry-run", "--log-dir", "runs/a b"]
    under_mpi = hint(2, "mpi", flags)
    assert under_mpi.endswith(
        "your mpi command with recipes/mnist.py --dry-run --log-dir 'runs/a b' --dataset "
        "fashion-mnist"
    )
    assert hint(2, "torchrun", ["--dataset=mnist"]).endswith(
        "torchrun --standalone --nproc_per_node=2 recipes/mnist.py --dataset fashion-mnist"
    )
    assert hint(1, "single", []).endswith("python recipes/mnist.py --dataset fashion-mnist")


@dataclass(frozen=True)
class CliCase:
    """One row: the flags (given the folders fixture) and the exit status and line expected."""

    flags: Callable[[dict[str, Path]], list[str]]
    code: int
    fragment: str


def _data(folders: dict[str, Path], *flags: str) -> list[str]:
    return ["--data-dir", str(folders["data"]), "--no-progress-bar", *flags]


CLI_CASES: dict[str, CliCase] = {
    "cli-epochs-zero": CliCase(
        lambda f: _data(f, "--epochs", "0"),
        2,
        f"error: argument --epochs: must be a positive integer, got 0 (see{GAP}--help)",
    ),
    "cli-batch-zero": CliCase(
        lambda f: _data(f, "--global-batch-size", "0"),
        2,
        f"error: argument --global-batch-size: must be a positive integer, got 0 (see{GAP}--help)",
    ),
    "cli-batch-too-large": CliCase(
        lambda f: _data(f, "--global-batch-size", "1000"),
        2,
        "error: --global-batch-size 1000 is larger than the training set (480 samples)"
        f"{GAP}use --global-batch-size <= 480",
    ),
    "cli-resume-without-dir": CliCase(
        lambda f: _data(f, "--resume", "auto"),
        2,
        "error: --resume auto looks in --checkpoint-dir; set --checkpoint-dir too",
    ),
    "cli-lr-negative": CliCase(
        lambda f: _data(f, "--lr", "-1"),
        2,
        f"error: argument --lr: must be > 0, got -1 (see{GAP}--help)",
    ),
    "cli-unknown-flag": CliCase(
        lambda f: _data(f, "--epcohs", "3"),
        2,
        f"error: unrecognized arguments: --epcohs 3; did you mean --epochs? (see{GAP}--help)",
    ),
    "cli-abbreviated-flag": CliCase(
        lambda f: _data(f, "--epoch", "3"),
        2,
        f"error: unrecognized arguments: --epoch 3; did you mean --epochs? (see{GAP}--help)",
    ),
    "cli-checkpoint-steps-without-dir": CliCase(
        lambda f: _data(f, "--checkpoint-every-steps", "5"),
        2,
        "error: --checkpoint-every-steps 5 saves into --checkpoint-dir; set --checkpoint-dir too",
    ),
    "cli-dropout-out-of-range": CliCase(
        lambda f: _data(f, "--dropout", "1.5"),
        2,
        f"error: argument --dropout: must be in [0, 1), got 1.5 (see{GAP}--help)",
    ),
    "cli-zero-with-channels-last": CliCase(
        lambda f: _data(f, "--zero-stage", "1", "--channels-last"),
        2,
        "error: --zero-stage 1 shards flat, contiguous parameters; drop --channels-last",
    ),
    "cli-data-dir-unwritable": CliCase(
        lambda f: ["--data-dir", str(f["file"] / "data"), "--mirror", closed_port_url()],
        1,
        f"error: cannot create{GAP}to download into:{GAP}/file is a file, not a directory; "
        "choose a data folder you can write to",
    ),
    "cli-data-dir-is-a-file": CliCase(
        lambda f: ["--dataset", "fashion-mnist", "--data-dir", str(f["file"])],
        1,
        f"error: --data-dir{GAP}/file is a file, not a folder; point --data-dir at a folder",
    ),
    "cli-log-dir-unwritable": CliCase(
        lambda f: _data(f, "--max-steps", "1", "--log-dir", str(f["file"] / "logs")),
        1,
        f"error: cannot create --log-dir{GAP}/file/logs:{GAP}/file is a file, not a directory; "
        "choose a --log-dir you can write to",
    ),
    "cli-log-dir-is-a-file": CliCase(
        lambda f: _data(f, "--max-steps", "1", "--log-dir", str(f["file"])),
        1,
        f"error: --log-dir{GAP}/file is a file, not a directory; choose a --log-dir you can "
        "write to",
    ),
    "cli-resume-sidecar": CliCase(
        lambda f: _data(f, "--resume", str(f["ckpt"] / "ckpt-00000001.json")),
        1,
        f"error:{GAP}ckpt-00000001.json is the JSON sidecar of a checkpoint; resume from"
        f"{GAP}ckpt-00000001.pt",
    ),
    "cli-checkpoint-dir-unwritable": CliCase(
        lambda f: _data(f, "--checkpoint-dir", str(f["file"] / "ckpt")),
        1,
        f"error: cannot create --checkpoint-dir{GAP}/file/ckpt:{GAP}/file is a file, not a "
        "directory; choose a directory you can write to",
    ),
    "cli-checkpoint-dir-is-a-file": CliCase(
        lambda f: _data(f, "--checkpoint-dir", str(f["file"])),
        1,
        f"error: --checkpoint-dir{GAP}/file is a file, not a directory; choose a directory you "
        "can write to",
    ),
    "cli-resume-empty-file": CliCase(
        lambda f: _data(f, "--resume", str(f["empty_file"])),
        1,
        f"error:{GAP}/empty.pt is an empty file, not a checkpoint; pick one with "
        "latest_checkpoint(dir)",
    ),
    "cli-resume-missing": CliCase(
        lambda f: _data(f, "--resume", str(f["missing"] / "ckpt-00000001.pt")),
        1,
        f"error:{GAP}/missing/ckpt-00000001.pt does not exist; pick one with "
        "latest_checkpoint(dir)",
    ),
    "cli-label-out-of-range": CliCase(
        lambda f: ["--data-dir", str(f["bad_labels"]), "--no-progress-bar"],
        1,
        f"error:{GAP}train-labels-idx1-ubyte.gz: label 12 at index 7 is outside 0..9"
        f"{GAP}delete it and download it again",
    ),
    "cli-data-dir-missing": CliCase(
        lambda f: ["--dataset", "fashion-mnist", "--data-dir", str(f["missing"])],
        1,
        f"error: --data-dir{GAP}/missing does not exist; point --data-dir at a folder holding "
        "Fashion-MNIST's four IDX files, or leave it out to read data/ and then "
        "/usr/share/datasets/fashion-mnist",
    ),
    "cli-data-dir-empty": CliCase(
        lambda f: ["--dataset", "fashion-mnist", "--data-dir", str(f["nothing"])],
        1,
        f"error: --data-dir{GAP}/nothing is empty; point --data-dir at",
    ),
    "cli-data-dir-incomplete": CliCase(
        lambda f: ["--dataset", "fashion-mnist", "--data-dir", str(f["fashion_test"])],
        1,
        f"error: --data-dir{GAP}/fashion_test holds Fashion-MNIST's test split, but "
        "train-images-idx3-ubyte.gz and train-labels-idx1-ubyte.gz are missing; point --data-dir "
        "at",
    ),
    "cli-data-dir-other-dataset": CliCase(
        lambda f: ["--data-dir", str(f["fashion"]), "--mirror", closed_port_url()],
        1,
        f"error: --data-dir{GAP}/fashion holds Fashion-MNIST's train and test splits, not "
        "MNIST's; train on it with --dataset fashion-mnist, or give MNIST a --data-dir of its own",
    ),
    "cli-offline-no-data": CliCase(
        lambda f: ["--data-dir", str(f["empty"]), "--mirror", closed_port_url()],
        1,
        "error: could not download train-images-idx3-ubyte.gz (http://127.0.0.1:"
        f"{GAP}Offline? Put train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
        f"t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz in{GAP}/MNIST/raw/"
        f"{GAP}or train offline on Fashion-MNIST{GAP}--dataset fashion-mnist",
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    write_split(root / "data", "train", 480)
    write_split(root / "data", "t10k", 50)
    write_split(root / "bad_labels", "train", 480)
    write_split(root / "bad_labels", "t10k", 50)
    labels = (torch.arange(480) % 10).to(torch.uint8)
    labels[7] = 12
    (root / "bad_labels/train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))
    (root / "file").write_text("not a folder")
    (root / "empty.pt").touch()
    (root / "empty").mkdir()
    (root / "nothing").mkdir()
    (root / "ckpt").mkdir()
    for name in ("ckpt-00000001.pt", "ckpt-00000001.json"):
        (root / "ckpt" / name).write_text("{}")
    write_split(root / "fashion", "train", 480, first_labels=FASHION_FIRST_LABELS["train"])
    write_split(root / "fashion", "t10k", 50, first_labels=FASHION_FIRST_LABELS["t10k"])
    write_split(root / "fashion_test", "t10k", 50, first_labels=FASHION_FIRST_LABELS["t10k"])
    names = ["data", "bad_labels", "file", "empty", "nothing", "ckpt", "fashion", "fashion_test"]
    return {
        "missing": root / "missing",
        "empty_file": root / "empty.pt",
        **{name: root / name for name in names},
    }


@pytest.mark.parametrize("case_id", list(CLI_CASES))
def test_recipe_error_line(case_id: str, folders, rank0, capsys) -> None:
    """The row's flags give its exit status and exactly one `error:` line with its fragment."""
    case = CLI_CASES[case_id]
    code = _run_recipe(case.flags(folders))
    out, err = capsys.readouterr()
    assert code == case.code, err
    assert err.count("\n") == 1 and in_order(err, case.fragment), err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("case_id", [c for c in CLI_CASES if c.startswith("cli-data-dir-")])
def test_a_data_dir_that_cannot_serve_is_left_as_it_was(case_id: str, folders, rank0, capsys):
    """A --data-dir that cannot serve gains no file or folder (no MNIST/raw/); none is created."""
    flags = CLI_CASES[case_id].flags(folders)
    data_dir = Path(flags[flags.index("--data-dir") + 1])
    before = sorted(data_dir.rglob("*")) if data_dir.exists() else None
    assert _run_recipe(flags) == 1
    assert (sorted(data_dir.rglob("*")) if data_dir.exists() else None) == before


def test_cli_doc_table_matches_the_tests() -> None:
    """docs/errors.md's command-line table lists exactly these rows, statuses and lines."""
    rows = doc_rows(CLI_SECTION)
    assert set(rows) == set(CLI_CASES)
    for case_id, (status, fragment) in rows.items():
        assert fragment == CLI_CASES[case_id].fragment, case_id
        assert status == str(CLI_CASES[case_id].code), case_id

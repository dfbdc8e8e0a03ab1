"""Command-line errors: one `error:` line and an exit status; bugs keep their traceback.

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

import ddptrain
from ddptrain import cli
from ddptrain.data.idx import IDXFormatError
from ddptrain.train.checkpoint import CheckpointError
from ddptrain.train.config import TrainerConfig
from support.error_table import GAP, doc_rows, in_order
from support.idx_files import FASHION_FIRST_LABELS, closed_port_url, idx_bytes, write_split

# @record enables faulthandler on stderr, which pytest has swapped for an object without fileno.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


def _raising(error: BaseException):
    def main(argv: list[str]) -> int:
        raise error

    return main


@pytest.fixture
def rank0(monkeypatch):
    """A world of one: no launcher variables, no debug switch, no reachable download mirror."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", cli.DEBUG_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DDPTRAIN_MNIST_MIRROR", closed_port_url())


def _config_error() -> ValueError:
    with pytest.raises(ValueError) as info:
        TrainerConfig(epochs=0)
    return info.value


@pytest.mark.parametrize(
    ("make_error", "code"),
    [
        (_config_error, 2),
        (lambda: cli.UsageError("argument --lr: must be > 0, got -1"), 2),
        (lambda: IDXFormatError("labels: label 12 at index 7\nis outside 0..9"), 1),
        (lambda: CheckpointError("cannot create checkpoint_dir /proc/x"), 1),
    ],
)
def test_user_error_is_one_line_on_stderr_and_an_exit_code(rank0, capsys, make_error, code):
    """Settings and flags exit 2, data and checkpoints 1; stderr is `error: ...` and no more."""
    error = make_error()
    assert cli.run_main(_raising(error), []) == code
    out, err = capsys.readouterr()
    assert out == "" and err == cli.format_error(error) + "\n"
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_config_error_names_the_fix_in_the_line(rank0, capsys):
    """The line is the validation's own message, so it still names the value and the fix."""
    cli.run_main(_raising(_config_error()), [])
    assert capsys.readouterr().err == "error: epochs=0: must be a positive integer\n"


@pytest.mark.parametrize("switch", ["flag", "env"])
def test_debug_shows_the_traceback(rank0, monkeypatch, switch):
    """--debug or DDPTRAIN_DEBUG=1 lets the user error propagate with its traceback."""
    argv = ["--debug"] if switch == "flag" else []
    if switch == "env":
        monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(IDXFormatError, match="label 12"):
        cli.run_main(_raising(IDXFormatError("label 12")), argv)


def test_ctrl_c_is_one_line_and_status_130_unless_debugging(rank0, capsys):
    """KeyboardInterrupt: `interrupted (Ctrl-C)` alone on stderr, status 130; --debug re-raises."""
    assert cli.run_main(_raising(KeyboardInterrupt()), []) == 130
    assert capsys.readouterr() == ("", "interrupted (Ctrl-C)\n")
    with pytest.raises(KeyboardInterrupt):
        cli.run_main(_raising(KeyboardInterrupt()), ["--debug"])


@pytest.mark.parametrize("bug", [ZeroDivisionError("division by zero"), ValueError("bad shape")])
def test_a_bug_keeps_its_traceback(rank0, capsys, bug):
    """Exceptions outside USER_ERRORS (a plain ValueError too) propagate untouched."""
    with pytest.raises(type(bug)):
        cli.run_main(_raising(bug), [])
    assert "error:" not in capsys.readouterr().err


def test_other_ranks_stay_silent_on_settings_and_report_their_own_data_errors(
    rank0, monkeypatch, capsys
):
    """Rank 1 says nothing for a settings error (rank 0 has it too), names itself otherwise."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cli, "PEER_GRACE_S", 0.0)
    assert cli.run_main(_raising(_config_error()), []) == 2
    assert capsys.readouterr().err == ""
    assert cli.run_main(_raising(IDXFormatError("label 12")), []) == 1
    assert capsys.readouterr().err == "error: label 12 (rank 1)\n"


def _fail_on_rank_1() -> int:
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
        raise IDXFormatError("rank 1's labels file: label 12 at index 7")
    return 7


def _run_alike_in_world() -> tuple[str, str, bool]:
    ddptrain.init_distributed(timeout_s=30)
    try:
        cli.run_alike(_fail_on_rank_1)
    except IDXFormatError as e:
        return type(e).__name__, str(e), e.same_on_every_rank
    return "", "", False


def test_an_error_under_a_node_list_only_scontrol_expands_is_still_one_line(monkeypatch, capsys):
    """run_main finding the rank from SLURM variables whose node list its parser refuses: the
    error line, not a second traceback from the handler."""
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    for key, value in {**slurm, "SLURM_JOB_ID": "5", "SLURM_STEP_NODELIST": "n[1-"}.items():
        monkeypatch.setenv(key, value)

    def main(argv: list[str]) -> int:
        raise FileNotFoundError("no data")

    assert cli.run_main(main, []) == cli.USER_EXIT_CODE
    assert capsys.readouterr().err == "error: no data\n"


def test_run_alike_raises_one_ranks_error_on_every_rank():
    """A data error on rank 1 alone is raised on both ranks, marked to be printed by rank 0."""
    expected = ("IDXFormatError", "rank 1's labels file: label 12 at index 7", True)
    assert ddptrain.spawn(_run_alike_in_world, 2, timeout_s=120) == [expected, expected]


def test_an_error_marked_alike_is_left_to_rank_0(rank0, monkeypatch, capsys):
    """Rank 1 prints nothing for an error run_alike raised on every rank; one process runs fn."""
    assert cli.run_alike(lambda: 7) == 7
    with pytest.raises(IDXFormatError) as info:
        cli.run_alike(lambda: _raising(IDXFormatError("label 12"))([]))
    assert info.value.same_on_every_rank
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.run_main(_raising(info.value), []) == 1
    assert capsys.readouterr().err == ""


def test_parser_errors_and_bounded_types_raise_usage_errors():
    """Unknown flags and out-of-range values are UsageErrors naming the flag and --help."""
    parser = cli.ArgumentParser(prog="mnist.py")
    parser.add_argument("--lr", type=cli.positive(float))
    parser.add_argument("--momentum", type=cli.non_negative(float))
    assert parser.parse_args(["--lr", "0.1", "--momentum", "0"]).momentum == 0
    with pytest.raises(cli.UsageError, match=r"argument --lr: must be > 0, got -1 \(see mnist"):
        parser.parse_args(["--lr", "-1"])
    with pytest.raises(cli.UsageError, match="argument --momentum: 'x' is not a float"):
        parser.parse_args(["--momentum", "x"])
    with pytest.raises(cli.UsageError, match="unrecognized arguments: --epoch"):
        parser.parse_args(["--epoch", "3"])


def test_abbreviated_flags_are_refused_with_the_whole_name_suggested():
    """`--epoch 3` is not taken for --epochs 3 (argparse's abbreviations are off); the error
    names the flag meant, and the whole name still works."""
    parser = cli.ArgumentParser(prog="train.py")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--lr", type=float)
    assert parser.parse_args(["--epochs", "3"]).epochs == 3
    for argv in (["--epoch", "3"], ["--epoch=3"]):
        with pytest.raises(cli.UsageError) as info:
            parser.parse_args(argv)
        suggestion = "did you mean --epochs? (see train.py --help)"
        assert str(info.value) == f"unrecognized arguments: {' '.join(argv)}; {suggestion}"


# --------------------------------------------------------------------------- the recipe's rows
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
    """The Fashion-MNIST command the offline error suggests is the user's own run (its flags,
    its launcher) with --dataset fashion-mnist instead of theirs."""
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
    """A --data-dir holding nothing usable, or the other dataset, gains no file and no folder
    (in particular no MNIST/raw/), and a missing one is not created."""
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

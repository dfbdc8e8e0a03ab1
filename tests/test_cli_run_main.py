"""ddptrain.cli's errors: a user error is one `error:` line and an exit status; bugs keep their
traceback; run_alike raises one rank's error on all; the parser's errors name the flag.

    python -m pytest tests/test_cli_run_main.py -q
"""

from __future__ import annotations

import pytest
import torch

import ddptrain
from ddptrain import cli
from ddptrain.data.idx import IDXFormatError
from ddptrain.train.checkpoint import CheckpointError
from ddptrain.train.config import TrainerConfig
from support import cli_env

# @record enables faulthandler on stderr, which pytest has swapped for an object without fileno.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


def _raising(error: BaseException):
    def main(argv: list[str]) -> int:
        raise error

    return main


rank0 = cli_env.rank0


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
    """A SLURM node list the parser refuses still gives one error line, not a second traceback."""
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
    """`--epoch 3` is refused, not taken for --epochs, with the whole name suggested."""
    # argparse's abbreviations are off.
    parser = cli.ArgumentParser(prog="train.py")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--lr", type=float)
    assert parser.parse_args(["--epochs", "3"]).epochs == 3
    for argv in (["--epoch", "3"], ["--epoch=3"]):
        with pytest.raises(cli.UsageError) as info:
            parser.parse_args(argv)
        suggestion = "did you mean --epochs? (see train.py --help)"
        assert str(info.value) == f"unrecognized arguments: {' '.join(argv)}; {suggestion}"

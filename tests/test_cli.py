"""ddptrain.cli: user errors are one `error:` line and an exit status; bugs keep their traceback."""

from __future__ import annotations

import pytest

from ddptrain import cli
from ddptrain.data.idx import IDXFormatError
from ddptrain.train.checkpoint import CheckpointError
from ddptrain.train.config import TrainerConfig

# @record enables faulthandler on stderr, which pytest has swapped for an object without fileno.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


def _raising(error: BaseException):
    def main(argv: list[str]) -> int:
        raise error

    return main


@pytest.fixture
def rank0(monkeypatch):
    """A world of one: no launcher variables, no debug switch."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", cli.DEBUG_ENV):
        monkeypatch.delenv(key, raising=False)


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
        (lambda: CheckpointError("cannot create checkpoint directory /proc/x"), 1),
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
    assert capsys.readouterr().err == "error: epochs must be a positive integer, got 0\n"


@pytest.mark.parametrize("switch", ["flag", "env"])
def test_debug_shows_the_traceback(rank0, monkeypatch, switch):
    """--debug or DDPTRAIN_DEBUG=1 lets the user error propagate with its traceback."""
    argv = ["--debug"] if switch == "flag" else []
    if switch == "env":
        monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(IDXFormatError, match="label 12"):
        cli.run_main(_raising(IDXFormatError("label 12")), argv)


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

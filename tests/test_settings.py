"""Settings written once (ddptrain/flags.py): every TrainerConfig field is a recipe flag and no
flag lacks a field, the flags build the config the defaults describe, checks and errors name
the flag, and the guide's tables are the code's."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from ddptrain import cli, flags
from ddptrain.flags import POSITIVE, setting
from ddptrain.train.config import ConfigError, TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"
TABLE = re.compile(r"<!-- settings-table: (\w+) -->\n(.*?)\n<!-- end settings-table -->", re.S)


def _recipe(name: str = "mnist"):
    path = ROOT / "recipes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"settings_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


@pytest.mark.parametrize(("name", "own"), [("mnist", "MNISTSettings"), ("gpt", "GPTSettings")])
def test_every_config_field_is_a_recipe_flag_and_every_flag_a_field(name, own):
    """A recipe's flags are --help and its config and settings fields as --field-name (or --no-)."""
    recipe = _recipe(name)
    expected = {"--help"}
    for cls in (TrainerConfig, getattr(recipe, own)):
        switches = {f.name for f in dataclasses.fields(cls) if type(f.default) is bool}
        switches |= {"progress_bar", "channels_last"}  # switches whose default is None: auto
        for f in dataclasses.fields(cls):
            expected.add(flags.flag_name(f.name))
            if f.name in switches:
                expected.add("--no-" + f.name.replace("_", "-"))
    assert _flags(recipe.build_parser()) == expected


def test_every_config_field_has_help_a_group_and_a_checked_default():
    """Each TrainerConfig field is a setting, and its own default passes its own checks."""
    for f in dataclasses.fields(TrainerConfig):
        assert f.metadata.get("help") and f.metadata.get("group"), f.name
    flags.check_fields(TrainerConfig())


def test_the_recipe_flags_left_out_build_the_config_its_defaults_describe():
    """No flags: TrainerConfig with the recipe's defaults; each flag type parses to its field."""
    recipe = _recipe()
    assert recipe.build_config(recipe.parse_args([])) == TrainerConfig(**recipe.RECIPE_DEFAULTS)
    args = recipe.parse_args(
        [
            *("--max-steps", "7", "--no-shuffle", "--grad-clip-norm", "0.5"),
            *("--preempt-signals", "SIGTERM,SIGUSR1", "--profile-steps", "2:3"),
            *("--log-dir", "logs", "--heartbeat-timeout-s", "none", "--zero-stage", "1"),
        ]
    )
    cfg = recipe.build_config(args)
    assert (cfg.max_steps, cfg.shuffle, cfg.grad_clip_norm) == (7, False, 0.5)
    assert cfg.preempt_signals == ("SIGTERM", "SIGUSR1") and cfg.profile_steps == (2, 3)
    assert cfg.heartbeat_timeout_s is None and cfg.zero_stage == 1
    assert args.channels_last is False  # the recipe's own rule for --zero-stage 1


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),
        (["--precision", "fp8"], "argument --precision: must be one of 'fp32', 'bf16', 'fp16'"),
        (["--zero-stage", "4"], "argument --zero-stage: must be one of 0, 1, 2, 3, got 4"),
        (["--comm-hook", "bf17"], "argument --comm-hook: must be one of 'default'"),
        (["--profile-steps", "3:x"], "argument --profile-steps: '3:x' is not a (first, last)"),
        (["--dropout", "1"], "argument --dropout: must be in [0, 1), got 1"),
    ],
)
def test_a_bad_flag_value_is_refused_naming_the_flag(argv, fragment):
    """A value outside a field's type, choices or check stops at the parser, naming the flag."""
    with pytest.raises(cli.UsageError) as info:
        _recipe().parse_args(argv)
    assert fragment in str(info.value)


def test_config_errors_speak_flags_on_the_command_line():
    """A ConfigError's field references become the flags a command-line user typed."""
    with pytest.raises(ConfigError) as info:
        TrainerConfig(zero_stage=3, comm_hook="bf16")
    message = flags.in_flags(str(info.value), TrainerConfig)
    assert message.startswith("--comm-hook bf16 with --zero-stage 3:"), message
    assert "use --comm-hook default" in message
    with pytest.raises(ConfigError) as info:
        TrainerConfig(resume="auto")
    assert flags.in_flags(str(info.value), TrainerConfig) == (
        "--resume auto looks in --checkpoint-dir; set --checkpoint-dir too"
    )
    # A single word is a flag only where it is assigned: "resume" alone stays English.
    assert flags.in_flags("cannot resume: seed=3 differs", TrainerConfig) == (
        "cannot resume: --seed 3 differs"
    )


@dataclass(kw_only=True)
class _Toy:
    count: int = setting(1, "how many", group="g", check=POSITIVE)
    mode: Literal["a", "b"] = setting("a", "which", group="g")
    names: tuple[str, ...] = setting(("x",), "some names", group="g")
    cap: float | None = setting(None, "a cap", group="g", unset="no cap")


@pytest.mark.parametrize(
    "values, error",
    [
        ({"count": 0}, "count=0: must be a positive integer"),
        ({"count": True}, "count=True: must be a positive integer"),
        ({"mode": "c"}, "mode='c': must be one of 'a', 'b'"),
        ({"names": "x"}, "names='x': must be a tuple of strings"),
        ({"cap": "1"}, "cap='1': must be a number (or None)"),
    ],
)
def test_check_fields_refuses_wrong_types_choices_and_bounds(values, error):
    """check_fields names the field, the value and what it must be."""
    with pytest.raises(ValueError, match=re.escape(error)):
        flags.check_fields(_Toy(**values))


def test_guide_tables_are_made_from_the_settings():
    """docs/guide.md's settings tables equal what flags.settings_table makes from the fields."""
    tables = dict(TABLE.findall(GUIDE.read_text()))
    assert set(tables) == {"TrainerConfig", "MNISTSettings", "GPTSettings"}
    assert tables["TrainerConfig"] == flags.settings_table(TrainerConfig)
    mnist, gpt = _recipe("mnist").MNISTSettings, _recipe("gpt").GPTSettings
    assert tables["MNISTSettings"] == flags.settings_table(mnist, as_flags=True)
    assert tables["GPTSettings"] == flags.settings_table(gpt, as_flags=True)

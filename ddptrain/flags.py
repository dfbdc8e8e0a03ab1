"""Settings written once: a dataclass field gives its flag, type, default, help and check.

    @dataclass(kw_only=True)
    class Settings:
        lr: float = setting(0.1, "the learning rate", group="optimizer", check=POSITIVE)

    check_fields(settings)                              # __post_init__: types, choices, checks
    add_flags(parser, [Settings], defaults={"lr": 0.2})  # --lr X, its help and its default
    settings = from_flags(Settings, parser.parse_args(argv))
    in_flags("lr must be > 0, got -1", Settings)        # "--lr must be > 0, got -1"

Each field becomes `--field-name` (`--field-name`/`--no-field-name` for a switch), typed by
its annotation: `int`, `float`, `str`, `bool`, a `Literal` (the choices), `tuple[str, ...]`
(comma-separated), `tuple[int, int]` (`A:B`), each optionally `| None` (the word `none`, or
the default). TrainerConfig and the recipes' own settings are written this way, so a field,
its flag, its default and its help cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Check:
    """A bound a value must meet, and how an error says it ("> 0")."""

    ok: Callable[[Any], bool]
    text: str


POSITIVE = Check(lambda v: v > 0, "> 0")
NON_NEGATIVE = Check(lambda v: v >= 0, ">= 0")
PROBABILITY = Check(lambda v: 0 <= v < 1, "in [0, 1)")


def setting(
    default: Any,
    help: str,
    *,
    group: str,
    metavar: str | None = None,
    check: Check | None = None,
    choices: tuple[Any, ...] | None = None,
    unset: str | None = None,
) -> Any:
    """A dataclass field whose metadata makes its flag (module docstring). `choices` for a
    field whose values are listed elsewhere (a `Literal` annotation lists its own); `unset`:
    what None means, for the help's default ("all the epochs")."""
    meta = {"help": help, "group": group, "metavar": metavar, "check": check}
    meta |= {"choices": choices, "unset": unset}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for a sequence default: dataclass defaults are shared")
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class _Kind:
    """What a field's annotation says about its values."""

    base: Any  # int, float, str, bool, "strings" (tuple[str, ...]) or "range" (tuple[int, int])
    optional: bool  # `| None`
    choices: tuple[Any, ...] | None


def _kind(annotation: Any) -> _Kind:
    args = typing.get_args(annotation)
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        optional, annotation = len(rest) < len(args), rest[0]
        args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return _Kind(type(args[0]), optional, args)
    if origin is tuple:
        return _Kind("strings" if args[-1] is Ellipsis else "range", optional, None)
    return _Kind(annotation, optional, None)


def fields(cls: type) -> list[tuple[dataclasses.Field, _Kind]]:
    """The settings of `cls` with what their annotations say."""
    hints = typing.get_type_hints(cls)
    return [(f, _kind(hints[f.name])) for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_name(name: str) -> str:
    """`--global-batch-size` for global_batch_size."""
    return "--" + name.replace("_", "-")


# ----------------------------------------------------------------------------- checking
def check_fields(obj: Any, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the field if a value has the wrong type, is not among its choices,
    or fails its check (what __post_init__ calls; the cross-field rules are the class's)."""
    for f, kind in fields(type(obj)):
        value = getattr(obj, f.name)
        problem = _problem(value, kind, f.metadata)
        if problem:
            raise error(f"{f.name}={value!r}: must be {problem}")


def _problem(value: Any, kind: _Kind, meta: Mapping[str, Any]) -> str | None:
    if value is None:
        return None if kind.optional else _describe(kind, meta)
    choices = kind.choices or meta["choices"]
    if not _typed(value, kind.base) or (choices is not None and value not in choices):
        return _describe(kind, meta)
    check = meta["check"]
    if check is not None and not check.ok(value):
        return _bound(kind, check) + (" (or None)" if kind.optional else "")
    return None


def _bound(kind: _Kind, check: Check) -> str:
    return "a positive integer" if check is POSITIVE and kind.base is int else check.text


def _typed(value: Any, base: Any) -> bool:
    if base == "strings":
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if base == "range":
        return (
            isinstance(value, tuple)
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        )
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base)


def _describe(kind: _Kind, meta: Mapping[str, Any]) -> str:
    choices = kind.choices or meta["choices"]
    if choices is not None:
        text = "one of " + ", ".join(repr(c) for c in choices)
    else:
        names = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}
        names |= {"strings": "a tuple of strings", "range": "a (first, last) pair of integers"}
        text = names[kind.base]
        if meta["check"] is not None:
            bound = _bound(kind, meta["check"])
            text = bound if bound.startswith("a ") else f"{text} {bound}"
    return text + (" (or None)" if kind.optional else "")


# ----------------------------------------------------------------------------- flags
def add_flags(
    parser: argparse.ArgumentParser,
    classes: list[type],
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One flag per setting of `classes`, in argument groups by the fields' `group` (made on
    first use, in field order); `defaults` overrides the classes' (a recipe's own choices)."""
    defaults = dict(defaults or {})
    unknown = set(defaults) - {f.name for cls in classes for f, _ in fields(cls)}
    if unknown:
        raise ValueError(f"defaults for settings that do not exist: {sorted(unknown)}")
    groups: dict[str, Any] = {}
    for f, kind in (pair for cls in classes for pair in fields(cls)):
        # Help written for Python users names other settings as fields: here, as flags.
        meta = f.metadata
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        group = groups[meta["group"]]
        default = defaults.get(f.name, f.default)
        shown = meta["unset"] if default is None and meta["unset"] else _show(default, kind)
        listed = ""
        if meta["metavar"] and (kind.choices or meta["choices"]):
            listed = f"; one of {', '.join(map(str, kind.choices or meta['choices']))}"
        help_text = f"{in_flags(meta['help'], *classes)}{listed} (default: {shown})"
        help_text = help_text.replace("%", "%%")
        if kind.base is bool and kind.choices is None:
            group.add_argument(
                flag_name(f.name),
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
            continue
        group.add_argument(
            flag_name(f.name),
            type=_parser_for(f.name, kind, meta),
            default=default,
            metavar=meta["metavar"] or _metavar(kind, meta),
            help=help_text,
        )


def from_flags(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` built from the parsed flags of its settings (and `overrides`)."""
    values = {f.name: getattr(args, f.name) for f, _ in fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def _show(default: Any, kind: _Kind) -> str:
    if default is None:
        return "none"
    if kind.base is bool and kind.choices is None:
        return "on" if default else "off"
    if kind.base == "strings":
        return ",".join(default) if default else "none"
    if kind.base == "range":
        return f"{default[0]}:{default[1]}"
    return str(default)


def _metavar(kind: _Kind, meta: Mapping[str, Any]) -> str:
    choices = kind.choices or meta["choices"]
    if choices is not None:
        return "{" + ",".join(str(c) for c in choices) + "}"
    names = {int: "N", float: "X", str: "TEXT", "strings": "A,B,...", "range": "A:B"}
    return names[kind.base]


def _parser_for(name: str, kind: _Kind, meta: Mapping[str, Any]) -> Callable[[str], Any]:
    """argparse's `type` for a setting: parses the text and applies the setting's check."""

    def parse(text: str) -> Any:
        if kind.optional and text.strip().lower() == "none":
            return None
        try:
            value = _from_text(text, kind)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {_describe(kind, meta).removesuffix(' (or None)')}"
            ) from None
        problem = _problem(value, kind, meta)
        if problem:
            raise argparse.ArgumentTypeError(f"must be {problem}, got {text}")
        return value

    parse.__name__ = name
    return parse


def _from_text(text: str, kind: _Kind) -> Any:
    if kind.base == "strings":
        words = [w.strip() for w in text.split(",") if w.strip()]
        return () if words == ["none"] else tuple(words)
    if kind.base == "range":
        parts = text.split(":")
        if len(parts) > 2:
            raise ValueError(text)
        first, last = int(parts[0]), int(parts[-1])
        return first, last
    if kind.base is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    return kind.base(text)


# ----------------------------------------------------------------------------- messages
def in_flags(message: str, *classes: type) -> str:
    """`message` with its references to settings as the flags a command-line user typed:
    `comm_hook='bf16'` becomes `--comm-hook bf16`, `checkpoint_dir` becomes `--checkpoint-dir`
    (a single-word name only where it is followed by `=`, as plain words may be English)."""
    names = sorted({f.name for cls in classes for f, _ in fields(cls)}, key=len, reverse=True)
    if not names:
        return message
    alternatives = "|".join(map(re.escape, names))
    assigned = re.compile(
        rf"(?<![\w./-])({alternatives})=('[^']*'|\"[^\"]*\"|\([^)]*\)|[^\s,;:)]+)"
    )

    def flag_value(m: re.Match) -> str:
        value = m.group(2)
        if value[0] in "'\"":
            value = value[1:-1]
        elif value.startswith("("):
            value = ",".join(v.strip(" '\"") for v in value[1:-1].split(",") if v.strip()) or "none"
        return f"{flag_name(m.group(1))} {value}"

    message = assigned.sub(flag_value, message)
    snake = [n for n in names if "_" in n]
    if snake:
        bare = re.compile(rf"(?<![\w./-])({'|'.join(map(re.escape, snake))})(?![\w(/])")
        message = bare.sub(lambda m: flag_name(m.group(1)), message)
    return message


# ----------------------------------------------------------------------------- docs
def settings_table(
    cls: type, defaults: Mapping[str, Any] | None = None, as_flags: bool = False
) -> str:
    """A markdown table of the settings of `cls` (name or flag, default, help): docs/guide.md
    holds these tables and a test keeps them equal to this."""
    defaults = dict(defaults or {})
    head = "| flag | default | meaning |" if as_flags else "| field | default | meaning |"
    rows = [head, "|---|---|---|"]
    for f, kind in fields(cls):
        meta, default = f.metadata, defaults.get(f.name, f.default)
        if as_flags:
            name = flag_name(f.name)
            if kind.base is bool and kind.choices is None:
                name = f"{name}`, `--no-{f.name.replace('_', '-')}"
            shown = meta["unset"] if default is None and meta["unset"] else _show(default, kind)
            text = in_flags(meta["help"], cls)
        else:
            name, shown, text = f.name, repr(default), meta["help"]
            if default is None and meta["unset"]:
                shown += f" ({meta['unset']})"
        choices = kind.choices or meta["choices"]
        if meta["metavar"] and choices:
            text += f"; one of {', '.join(map(str, choices))}"
        rows.append(f"| `{name}` | {shown} | {text} |")
    return "\n".join(rows)

"""docs/errors.md's tables and the checks every documented error must pass (shared by the tests).

A table row is `| `id` | input | where / exit status | `message fragment` |`. A fragment's parts,
separated by GAP, must appear in the message in that order.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
TIME_LIMIT_S = 30.0
MAX_MESSAGE_CHARS = 600
# Separates the parts of a documented fragment; each part must appear, in this order.
GAP = " … "


@dataclass(frozen=True)
class Outcome:
    """What one rank saw: the exception raised (None if none) and how long it took."""

    error: type[BaseException] | None
    message: str
    elapsed_s: float


def attempt(trigger: Callable[[Path], None], case_dir: Path) -> Outcome:
    """Run `trigger(case_dir)` and record what it raised."""
    start = time.perf_counter()
    try:
        trigger(case_dir)
    except Exception as e:  # noqa: BLE001 - the row decides whether this type is right
        return Outcome(type(e), str(e), time.perf_counter() - start)
    return Outcome(None, "", time.perf_counter() - start)


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def in_order(message: str, fragment: str) -> bool:
    """Whether every GAP-separated part of `fragment` occurs in `message`, in order."""
    at = 0
    for part in fragment.split(GAP):
        found = message.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def doc_rows(section: str) -> dict[str, tuple[str, str]]:
    """The table under docs/errors.md's `## {section}` heading as {id: (third cell, fragment)}."""
    rows, inside = {}, False
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            inside = line[3:].strip() == section
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if inside and len(cells) == 4 and re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            rows[cells[0].strip("`")] = (cells[2], cells[3].removeprefix("`").removesuffix("`"))
    return rows

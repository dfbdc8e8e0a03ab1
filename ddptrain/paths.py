"""Folders a setting names, created or refused in words that say what stands in the way.

    make_dir("runs/x", "log_dir", LogDirError, "choose a log_dir you can write to")
    # LogDirError: log_dir runs/x is a file, not a directory; choose a log_dir ...
    # LogDirError: cannot create log_dir runs/x: runs is a file, not a directory; ...

The operating system says "File exists" or "Not a directory", naming neither path.
"""

from __future__ import annotations

import os
from pathlib import Path


def mkdir_problem(path: Path, error: OSError) -> str:
    """Why `path` could not be made a directory: a file in its place or above it, or the OS's
    reason."""
    for candidate in (path, *path.parents):
        if candidate.exists() and not candidate.is_dir():
            return f"{candidate} is a file, not a directory"
    return error.strerror or str(error)


def make_dir(path: str | os.PathLike, setting: str, error: type[Exception], fix: str) -> Path:
    """Create `path` and its parents, or raise `error` naming the `setting` and the obstacle."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if path.exists() and not path.is_dir():
            raise error(f"{setting} {path} is a file, not a directory; {fix}") from None
        raise error(f"cannot create {setting} {path}: {mkdir_problem(path, e)}; {fix}") from None
    return path

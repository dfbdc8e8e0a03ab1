"""How checkpoints are stored: names, atomic writes, sidecars, verification and retention.

    path = write_checkpoint("ckpts", 1000, lambda f: torch.save(payload, f), sidecar,
                            keep_last=3, best_metric="val_loss", best_mode="min")
    verify_checkpoint(path)            # its sidecar exists and matches: size and sha256
    latest_checkpoint("ckpts")         # newest valid one, or None (warns of newer invalid ones)
    path, skipped = latest_valid_checkpoint("ckpts")   # ... and [(invalid path, why), ...]
    set_aside_checkpoint(skipped[0][0])  # into ckpts/invalid/, out of every listing, kept

A directory holds `ckpt-00001000.pt`, its sidecar `ckpt-00001000.json` and `best.json` once a
best metric is used. Every file is written to a temp file, fsynced, renamed, and the directory
fsynced; the sidecar only after the .pt is in place. A .pt counts as valid only when its sidecar
exists and matches it, so a save killed at any point leaves the earlier checkpoints valid. One
writer per directory. What goes into the .pt is contents.py's business; this module stores bytes.
Checkpoints set aside live in the `invalid/` subfolder: never listed, resumed from or pruned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from ddptrain.paths import make_dir

BEST_POINTER = "best.json"
# Where set_aside_checkpoint moves invalid checkpoints: a subfolder, so listing and pruning
# (which read only the directory's own entries) never see them again.
INVALID_DIR = "invalid"

_TEMP_RE = re.compile(r"^\.(?:ckpt-\d{8,}\.(?:pt|json)|best\.json)\.[0-9a-f]{16}\.tmp$")
_SIDECAR_KEYS = ("step", "size_bytes", "sha256", "metrics")
# 0o664, not 0o666: the kernel still applies the user's umask on top, but even a umask of 0
# must not leave a checkpoint that any local user can overwrite.
_FILE_MODE = 0o664
_HASH_CHUNK_BYTES = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or loaded; the message names the file and the fix."""


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint for `step`, e.g. `ckpt-00001000.pt`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"ckpt-{step:08d}.pt"


def parse_step(name: str) -> int | None:
    """Step of a checkpoint file name made by `checkpoint_name`, or None for any other name."""
    match = re.fullmatch(r"ckpt-(\d{8,})\.pt", name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if checkpoint_name(step) == name else None


def write_checkpoint(
    directory: Path,
    step: int,
    write_payload: Callable[[IO[bytes]], Any],
    sidecar: dict[str, Any],
    *,
    keep_last: int | None,
    best_metric: str | None,
    best_mode: str,
) -> Path:
    """Atomically write the .pt of `step`, then its sidecar (size and sha256 added), then prune."""
    path = directory / checkpoint_name(step)
    _json_bytes(sidecar)  # fail on a non-JSON value before anything touches the disk
    directory.mkdir(parents=True, exist_ok=True)
    if _read_sidecar(path) is not None:
        # Replacing it would leave no valid checkpoint for this step until the new sidecar lands.
        raise CheckpointError(
            f"{path} already holds a complete checkpoint; save each step once, or delete "
            f"{path.name} and {path.with_suffix('.json').name} to overwrite it"
        )
    sidecar["size_bytes"], sidecar["sha256"] = _atomic_write(path, write_payload)
    _atomic_write(path.with_suffix(".json"), lambda f: f.write(_json_bytes(sidecar)))
    if best_metric is not None:
        _update_best_pointer(directory, best_metric, best_mode)
    _prune(directory, keep_last=keep_last, just_saved=step)
    return path


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Return the sidecar of `path` if it exists and its size and sha256 match, else raise."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; pick one with latest_checkpoint(dir)")
    sidecar, problem = _check_sidecar(path)
    if problem is not None:
        skips = " (latest_checkpoint skips this one)" if sidecar is None else ""
        raise CheckpointError(f"{path} {problem}; resume from an earlier checkpoint{skips}")
    return sidecar


def _check_sidecar(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(The sidecar of an existing `path` or None, what is wrong with the pair or None)."""
    sidecar_path = path.with_suffix(".json")
    sidecar = _read_sidecar(path)
    if sidecar is None:
        return None, f"has no valid sidecar {sidecar_path.name}: its save did not finish"
    size = path.stat().st_size
    if size != sidecar["size_bytes"]:
        return sidecar, (
            f"is {size} bytes but {sidecar_path.name} records {sidecar['size_bytes']}: "
            "the file was truncated or modified"
        )
    if _sha256_file(path) != sidecar["sha256"]:
        return sidecar, f"does not match the sha256 in {sidecar_path.name}: the file is corrupted"
    return sidecar, None


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in `directory` (valid or not, temp files excluded), oldest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(step, p) for p in directory.iterdir() if (step := parse_step(p.name)) is not None]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """Newest checkpoint in `directory` whose sidecar matches it, or None; warns of newer ones."""
    path, skipped = latest_valid_checkpoint(directory)
    for invalid, reason in skipped:
        warnings.warn(f"skipping invalid checkpoint: {invalid} {reason}", stacklevel=2)
    return path


def latest_valid_checkpoint(
    directory: str | os.PathLike,
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(Newest checkpoint whose sidecar matches it or None, [(each newer one, why invalid)])."""
    skipped = []
    for path in reversed(list_checkpoints(directory)):
        _, problem = _check_sidecar(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def set_aside_checkpoint(path: str | os.PathLike) -> Path:
    """Move a checkpoint and its sidecar into the `invalid/` subfolder (never overwriting
    anything there) and return its new path: kept for inspection, no longer a checkpoint."""
    path = Path(path)
    aside = path.parent / INVALID_DIR
    try:
        aside.mkdir(exist_ok=True)
        dest = aside / path.name
        copy = 0
        while dest.exists() or dest.with_suffix(".json").exists():
            copy += 1
            dest = aside / f"{path.stem}.{copy}{path.suffix}"
        # Sidecar first: a crash between the two renames leaves a .pt without a sidecar, which
        # is invalid still and set aside next time, never a sidecar vouching for a moved file.
        if path.with_suffix(".json").exists():
            os.rename(path.with_suffix(".json"), dest.with_suffix(".json"))
        os.rename(path, dest)
    except OSError as e:
        raise CheckpointError(
            f"cannot move the invalid checkpoint {path} into {aside}/: {e.strerror or e}; move "
            f"it (and its .json) out of {path.parent} yourself"
        ) from None
    _fsync_dir(aside)
    _fsync_dir(path.parent)
    _repoint_best(path.parent, path.name)
    return dest


def _repoint_best(directory: Path, moved: str) -> None:
    """Point best.json away from a checkpoint that was moved, to the best one still there."""
    try:
        best = json.loads((directory / BEST_POINTER).read_text())
        if best["file"] == moved:
            _update_best_pointer(directory, best["metric"], best["mode"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no pointer, or an unreadable one best_checkpoint reports itself


def best_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint `best.json` points to (verified), or None if no best was recorded."""
    pointer = Path(directory) / BEST_POINTER
    try:
        best = json.loads(pointer.read_text())
        path = Path(directory) / best["file"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{pointer} is unreadable ({e}); delete it to reset") from None
    verify_checkpoint(path)
    return path


def check_writable(directory: str | os.PathLike, *, required_bytes: int = 0) -> Path:
    """Create `directory`, prove a file can be written and fsynced there, and check free space."""
    directory = make_dir(
        directory, "checkpoint_dir", CheckpointError, "choose a directory you can write to"
    )
    probe = directory / f".ddptrain-write-probe-{secrets.token_hex(8)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(probe)
        raise CheckpointError(
            f"checkpoint_dir {directory} is not writable ({e.strerror or e}); fix its "
            "permissions or choose another directory"
        ) from None
    free = shutil.disk_usage(directory).free
    if free < required_bytes:
        raise CheckpointError(
            f"only {free / 2**20:.1f} MiB free on the filesystem of {directory}, but "
            f"checkpoints need about {required_bytes / 2**20:.1f} MiB; free some space, lower "
            "keep_last (recipe: --keep-last), or choose another directory"
        )
    return directory


class _HashingWriter:
    """File wrapper that hashes and counts what torch.save writes, saving a second read pass."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self._sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._f.write(data)
        self._sha256.update(data)
        nbytes = memoryview(data).nbytes
        self.size += nbytes
        return nbytes

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()


def _atomic_write(path: Path, write: Callable[[_HashingWriter], Any]) -> tuple[int, str]:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # os.open with a mode lets the kernel apply the umask exactly as a plain open() would;
    # mkstemp's fixed 0o600 would need reading the umask, which is racy in a threaded process.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return writer.size, writer.hexdigest()


def _fsync_dir(directory: Path) -> None:
    # Without it a crash can forget the rename even though the file data reached the disk.
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; nothing more can be done there
    finally:
        os.close(fd)


def _read_sidecar(path: Path) -> dict[str, Any] | None:
    try:
        sidecar = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(sidecar, dict) or any(k not in sidecar for k in _SIDECAR_KEYS):
        return None
    if not isinstance(sidecar["metrics"], dict) or not isinstance(sidecar["size_bytes"], int):
        return None
    return sidecar if sidecar["step"] == parse_step(path.name) else None


def _update_best_pointer(directory: Path, metric: str, mode: str) -> None:
    # Recomputed from the sidecars, so a stale or lost best.json heals on the next save.
    candidates = []
    for path in list_checkpoints(directory):
        sidecar = _read_sidecar(path)
        value = sidecar["metrics"].get(metric) if sidecar else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            candidates.append((value if mode == "min" else -value, sidecar["step"]))
    if not candidates:
        return
    value, step = min(candidates)  # ties go to the earlier step: a later one must improve
    best = {
        "file": checkpoint_name(step),
        "step": step,
        "metric": metric,
        "mode": mode,
        "value": value if mode == "min" else -value,
    }
    _atomic_write(directory / BEST_POINTER, lambda f: f.write(_json_bytes(best)))


def _prune(directory: Path, *, keep_last: int | None, just_saved: int) -> None:
    complete = [parse_step(p.name) for p in list_checkpoints(directory) if _read_sidecar(p)]
    keep = {just_saved, *(complete if keep_last is None else complete[-keep_last:])}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        keep.add(parse_step(json.loads((directory / BEST_POINTER).read_text())["file"]))
    steps = set()
    for name in os.listdir(directory):
        if _TEMP_RE.match(name):
            # A temp file of an interrupted save: one writer per directory, so none is live.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)
        elif name.endswith(".json"):
            steps.add(parse_step(name.removesuffix(".json") + ".pt"))
        else:
            steps.add(parse_step(name))
    for step in steps - keep - {None}:
        # Sidecar first: a crash between the two unlinks then leaves an invalid .pt, never a
        # sidecar that vouches for a missing file.
        path = directory / checkpoint_name(step)
        path.with_suffix(".json").unlink(missing_ok=True)
        path.unlink(missing_ok=True)


def _json_bytes(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _sha256_file(path: Path) -> str:
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            sha256.update(chunk)
    return sha256.hexdigest()

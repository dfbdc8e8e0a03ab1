"""Atomic, step-numbered checkpoints with a JSON sidecar, retention, and loading that runs no code.

    check_writable("ckpts", required_bytes=3 * model_bytes)   # before training: fail early
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "world_size": 2,
             "rng": capture_rng_state(), "config": asdict(cfg), ...}
    save_checkpoint("ckpts", state, step=step, epoch=epoch, metrics={"val_loss": 0.31},
                    keep_last=3, best_metric="val_loss")          # rank 0 only
    path = latest_checkpoint("ckpts")                             # newest VALID one, or None
    state = load_checkpoint(path)                                 # weights_only: nothing executes
    load_model_state(model, state["model"])                       # names keys of another model
    restore_rng_state(state["rng"])

A directory holds `ckpt-00001000.pt` (a torch.save of a plain dict: `torch.load(path,
weights_only=True)["model"]` loads into a plain nn.Module without ddptrain), its sidecar
`ckpt-00001000.json` (step, epoch, time, metrics, world_size, versions, size_bytes, sha256), and
`best.json` once `best_metric` is used. Both files are written to a temp file, fsynced, renamed,
and the directory fsynced; the sidecar only after the .pt is in place. A .pt counts as valid only
when its sidecar exists and matches it, so a save killed at any point leaves the earlier
checkpoints valid. One writer per directory; no torch.distributed calls here.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import pickle
import platform
import random
import re
import secrets
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

try:
    import numpy as np
except ImportError:
    np = None

FORMAT_KEY = "ddptrain_format"
FORMAT_VERSION = 1
BEST_POINTER = "best.json"

_TEMP_RE = re.compile(r"^\.(?:ckpt-\d{8,}\.(?:pt|json)|best\.json)\.[0-9a-f]{16}\.tmp$")
_RESERVED_KEYS = (FORMAT_KEY, "step", "epoch", "versions")
_SIDECAR_KEYS = ("step", "size_bytes", "sha256", "metrics")
# 0o664, not 0o666: the kernel still applies the user's umask on top, but even a umask of 0
# must not leave a checkpoint that any local user can overwrite.
_FILE_MODE = 0o664
_HASH_CHUNK_BYTES = 1 << 20
_MAX_NAMES = 5
# Leaf types torch.load(weights_only=True) rebuilds (a subset: no bytes or bytearray); checking
# at save time turns an unloadable checkpoint into an error now instead of at resume time.
_LEAF_TYPES = (type(None), bool, int, float, complex, str, torch.Size, torch.device, torch.dtype)


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


def save_checkpoint(
    directory: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    step: int,
    epoch: int = 0,
    metrics: Mapping[str, float] | None = None,
    keep_last: int | None = 3,
    best_metric: str | None = None,
    best_mode: str = "min",
) -> Path:
    """Atomically write `state` as the checkpoint for `step`, then its sidecar, then prune."""
    directory = Path(directory)
    path = directory / checkpoint_name(step)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, or None to keep all, got {keep_last}")
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    if "model" not in state:
        raise ValueError("state needs a 'model' entry: the unwrapped module's state_dict()")
    reserved = [key for key in _RESERVED_KEYS if key in state]
    if reserved:
        raise ValueError(f"state keys {reserved} are written by save_checkpoint; remove them")
    metrics = _plain_metrics(metrics or {})
    if best_metric is not None and best_metric not in metrics:
        raise ValueError(
            f"best_metric {best_metric!r} is not in metrics {sorted(metrics)}; pass it in "
            "metrics= on every save, or set best_metric=None"
        )
    versions = _versions()
    payload = {FORMAT_KEY: FORMAT_VERSION, "step": step, "epoch": epoch, "versions": versions}
    payload.update(state)
    _check_loadable(payload, "state")
    sidecar = {
        "format": FORMAT_VERSION,
        "file": path.name,
        "step": step,
        "epoch": epoch,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "metrics": metrics,
        "world_size": state.get("world_size"),
        "versions": versions,
    }
    _json_bytes(sidecar)  # fail on a non-JSON world_size before anything touches the disk

    directory.mkdir(parents=True, exist_ok=True)
    if _read_sidecar(path) is not None:
        # Replacing it would leave no valid checkpoint for this step until the new sidecar lands.
        raise CheckpointError(
            f"{path} already holds a complete checkpoint; save each step once, or delete "
            f"{path.name} and {path.with_suffix('.json').name} to overwrite it"
        )
    sidecar["size_bytes"], sidecar["sha256"] = _atomic_write(path, lambda f: torch.save(payload, f))
    _atomic_write(path.with_suffix(".json"), lambda f: f.write(_json_bytes(sidecar)))
    if best_metric is not None:
        _update_best_pointer(directory, best_metric, best_mode)
    _prune(directory, keep_last=keep_last, just_saved=step)
    return path


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a ddptrain checkpoint (weights_only=True, sidecar-checked if present) or raise."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist or is not a file; pick one with latest_checkpoint(dir)"
        )
    if path.with_suffix(".json").exists():
        verify_checkpoint(path)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found is None:
            raise CheckpointError(_unreadable(path, e)) from None
        raise CheckpointError(
            f"{path} contains a pickled {found.group(1)}, not only tensors and plain values; "
            "ddptrain refuses to unpickle it because that can run arbitrary code. If you wrote "
            "it and trust it, load it with torch.load(weights_only=False) and re-save the "
            "plain state_dicts"
        ) from None
    except Exception as e:
        raise CheckpointError(_unreadable(path, e)) from None
    if not isinstance(obj, dict) or FORMAT_KEY not in obj:
        keys = sorted(map(str, obj))[:_MAX_NAMES] if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(
            f"{path} is a torch file but not a ddptrain checkpoint (no {FORMAT_KEY!r} key; "
            f"found {keys}); load its weights yourself with torch.load(path, weights_only=True) "
            "and model.load_state_dict(...)"
        )
    if obj[FORMAT_KEY] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {obj[FORMAT_KEY]!r}, this ddptrain reads format "
            f"{FORMAT_VERSION}; load it with the ddptrain version that wrote it "
            f"({obj.get('versions', {}).get('ddptrain', 'unknown')})"
        )
    return obj


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Return the sidecar of `path` if it exists and its size and sha256 match, else raise."""
    path = Path(path)
    sidecar_path = path.with_suffix(".json")
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; pick one with latest_checkpoint(dir)")
    sidecar = _read_sidecar(path)
    if sidecar is None:
        raise CheckpointError(
            f"{path} has no valid sidecar {sidecar_path.name}: its save did not finish; "
            "resume from an earlier checkpoint (latest_checkpoint skips this one)"
        )
    size = path.stat().st_size
    if size != sidecar["size_bytes"]:
        raise CheckpointError(
            f"{path} is {size} bytes but {sidecar_path.name} records {sidecar['size_bytes']}: "
            "the file was truncated or modified; resume from an earlier checkpoint"
        )
    if _sha256_file(path) != sidecar["sha256"]:
        raise CheckpointError(
            f"{path} does not match the sha256 in {sidecar_path.name}: the file is corrupted; "
            "resume from an earlier checkpoint"
        )
    return sidecar


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in `directory` (valid or not, temp files excluded), oldest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(step, p) for p in directory.iterdir() if (step := parse_step(p.name)) is not None]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """Newest checkpoint in `directory` whose sidecar matches it, or None (for resume="auto")."""
    for path in reversed(list_checkpoints(directory)):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            warnings.warn(f"skipping invalid checkpoint: {e}", stacklevel=2)
            continue
        return path
    return None


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


def check_model_compat(model_state: Mapping[str, Any], checkpoint_state: Mapping[str, Any]) -> None:
    """Raise a CheckpointError naming missing, unexpected and mis-shaped keys, if any."""
    missing = [k for k in model_state if k not in checkpoint_state]
    unexpected = [k for k in checkpoint_state if k not in model_state]
    mismatched = [
        f"{k} (checkpoint {_shape(checkpoint_state[k])}, model {_shape(model_state[k])})"
        for k in model_state
        if k in checkpoint_state and _shape(checkpoint_state[k]) != _shape(model_state[k])
    ]
    problems = [
        f"{len(names)} {label}: {_first_names(names)}"
        for label, names in (
            ("missing keys (in the model, not in the checkpoint)", missing),
            ("unexpected keys (in the checkpoint, not in the model)", unexpected),
            ("shape mismatches", mismatched),
        )
        if names
    ]
    if not problems:
        return
    hint = (
        "it was saved from a different model or config; resume with the model it was saved "
        "from, or start a fresh run in another checkpoint_dir"
    )
    if unexpected and all(k.startswith("module.") for k in unexpected):
        hint = "its keys start with 'module.': it was saved from a wrapped model; strip the prefix"
    raise CheckpointError(f"checkpoint does not match this model: {'; '.join(problems)}; {hint}")


def load_model_state(module: torch.nn.Module, model_state: Mapping[str, Any]) -> None:
    """Load `model_state` into `module` (unwrapped) after check_model_compat."""
    check_model_compat(module.state_dict(), model_state)
    module.load_state_dict(model_state)


def check_writable(directory: str | os.PathLike, *, required_bytes: int = 0) -> Path:
    """Create `directory`, prove a file can be written and fsynced there, and check free space."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create checkpoint directory {directory}: {e.strerror or e}; choose a "
            "directory you can write to"
        ) from None
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
            f"checkpoint directory {directory} is not writable ({e.strerror or e}); fix its "
            "permissions or choose another directory"
        ) from None
    free = shutil.disk_usage(directory).free
    if free < required_bytes:
        raise CheckpointError(
            f"only {free / 2**20:.1f} MiB free on the filesystem of {directory}, but "
            f"checkpoints need about {required_bytes / 2**20:.1f} MiB; free some space, lower "
            "keep_last, or choose another directory"
        )
    return directory


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch and CUDA RNG states, as weights_only-loadable values."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        state["numpy"] = {
            "bit_generator": str(kind),
            "state": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    # Only an initialised CUDA has draws to preserve; asking otherwise would create a CUDA
    # context on this rank's GPU for nothing. One device per rank, so the current one suffices.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore RNG states from capture_rng_state(), so the following draws repeat exactly."""
    py = state["python"]
    internal = tuple(int(x) for x in py["state"].tolist())
    random.setstate((int(py["version"]), internal, py["gauss_next"]))
    torch.set_rng_state(state["torch"].cpu())
    if np is not None and "numpy" in state:
        saved = state["numpy"]
        keys = saved["state"].cpu().numpy().astype(np.uint32)
        extra = (saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        np.random.set_state((saved["bit_generator"], keys, *extra))
    # A CPU-only resume of a GPU run (e.g. to inspect it) has no CUDA generator to restore.
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


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


def _plain_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    plain = {}
    for name, value in metrics.items():
        try:
            plain[str(name)] = float(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"metric {name!r} is {value!r}; pass numbers") from None
    return plain


def _check_loadable(obj: Any, where: str) -> None:
    if isinstance(obj, torch.Tensor) or type(obj) in _LEAF_TYPES:
        return
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            _check_loadable(key, f"{where} key {key!r}")
            _check_loadable(value, f"{where}[{key!r}]")
        return
    if type(obj) in (list, tuple, set):
        for i, value in enumerate(obj):
            _check_loadable(value, f"{where}[{i}]")
        return
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    raise CheckpointError(
        f"{where} is a {kind}, which torch.load(weights_only=True) refuses; store tensors, "
        "numbers, strings, lists or dicts instead (e.g. int(x), x.tolist(), dataclasses.asdict)"
    )


def _versions() -> dict[str, str]:
    import ddptrain  # here, not at the top: the package __init__ re-exports this module

    return {
        "torch": str(torch.__version__),  # TorchVersion is a class weights_only would refuse
        "ddptrain": ddptrain.__version__,
        "python": platform.python_version(),
    }


def _json_bytes(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _sha256_file(path: Path) -> str:
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            sha256.update(chunk)
    return sha256.hexdigest()


def _unreadable(path: Path, error: Exception) -> str:
    # torch's own messages run to a paragraph; the unpickler's one line is the informative part.
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", str(error))
    reason = found.group(1) if found else str(error).split(". ")[0] or "no details"
    return (
        f"{path} is not a readable torch checkpoint ({type(error).__name__}: {reason}); it is "
        "truncated or not a torch file; resume from latest_checkpoint(dir) instead"
    )


def _shape(value: Any) -> list[int] | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else list(shape)


def _first_names(names: list[str]) -> str:
    more = f" (and {len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else ""
    return ", ".join(names[:_MAX_NAMES]) + more

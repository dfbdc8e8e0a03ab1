"""What a checkpoint holds: training state in, validated; loading that runs no code; RNG streams.

    check_writable("ckpts", required_bytes=3 * model_bytes)   # before training: fail early
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "world_size": 2,
             "rng": capture_rng_state(), "config": asdict(cfg), ...}
    save_checkpoint("ckpts", state, step=step, epoch=epoch, metrics={"val_loss": 0.31},
                    keep_last=3, best_metric="val_loss")          # rank 0 only
    path = latest_checkpoint("ckpts")                             # newest VALID one, or None
    path, skipped = latest_valid_checkpoint("ckpts")              # ... and the invalid newer ones
    set_aside_checkpoint(skipped[0][0])                           # into ckpts/invalid/, kept
    state = load_checkpoint(path)                                 # weights_only: nothing executes
    load_model_state(model, state["model"])                       # names keys of another model
    restore_rng_state(state["rng"])

A checkpoint is a torch.save of a plain dict: `torch.load(path, weights_only=True)["model"]`
loads into a plain nn.Module without ddptrain. save_checkpoint refuses, before writing, any value
that weights_only loading would refuse. How the files are named, written atomically, verified and
pruned is files.py's part. No torch.distributed calls here (resume.py does the
rank-0-and-broadcast part).
"""

from __future__ import annotations

import datetime
import os
import pickle
import platform
import random
import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddptrain.train.checkpoint.files import (
    CheckpointError,
    checkpoint_name,
    verify_checkpoint,
    write_checkpoint,
)

try:
    import numpy as np
except ImportError:
    np = None

FORMAT_KEY = "ddptrain_format"
FORMAT_VERSION = 1

_RESERVED_KEYS = (FORMAT_KEY, "step", "epoch", "versions")
_MAX_NAMES = 5
# Leaf types torch.load(weights_only=True) rebuilds (a subset: no bytes or bytearray); checking
# at save time turns an unloadable checkpoint into an error now instead of at resume time.
_LEAF_TYPES = (type(None), bool, int, float, complex, str, torch.Size, torch.device, torch.dtype)


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
    directory, name = Path(directory), checkpoint_name(step)
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
        "file": name,
        "step": step,
        "epoch": epoch,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "metrics": metrics,
        "world_size": state.get("world_size"),
        "versions": versions,
    }
    return write_checkpoint(
        directory,
        step,
        lambda f: torch.save(payload, f),
        sidecar,
        keep_last=keep_last,
        best_metric=best_metric,
        best_mode=best_mode,
    )


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a ddptrain checkpoint (weights_only=True, sidecar-checked if present) or raise."""
    path = Path(path)
    auto = "or resume='auto' with checkpoint_dir=DIR (recipe: --resume auto --checkpoint-dir DIR)"
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a directory, not a checkpoint; pick one with latest_checkpoint(dir), "
            + auto
        )
    what = None
    if not path.exists():
        what = "does not exist"
    elif not path.is_file():
        what = "is not a regular file"
    elif path.stat().st_size == 0:
        what = "is an empty file, not a checkpoint"
    if what:
        raise CheckpointError(f"{path} {what}; pick one with latest_checkpoint(dir), " + auto)
    if path.suffix == ".json" and path.with_suffix(".pt").is_file():
        raise CheckpointError(
            f"{path} is the JSON sidecar of a checkpoint; resume from {path.with_suffix('.pt')}"
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

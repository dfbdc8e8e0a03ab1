"""Checkpoint naming, atomic saves, validation on load, safe loading and RNG round trips."""

import hashlib
import json
import os
import random
import signal
import warnings

import pytest
import torch
from torch import nn

from ddptrain.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    check_model_compat,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    load_model_state,
    parse_step,
    restore_rng_state,
    save_checkpoint,
)
from support import forked
from support.checkpoint_files import file_names, tiny_state

try:
    import numpy as np
except ImportError:
    np = None


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _state(model: nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": torch.amp.GradScaler("cpu").state_dict(),
        "sampler": {"epoch": 1, "position": 40, "seed": 7},
        "rng": capture_rng_state(),
        "config": {"lr": 0.1, "layers": [4, 8, 3], "name": "mlp", "amp": False},
        "world_size": 2,
    }


@pytest.mark.parametrize("step", [0, 7, 12_345_678, 123_456_789])
def test_checkpoint_name_round_trips_through_parse_step(step):
    """parse_step inverts checkpoint_name, including steps wider than 8 digits."""
    assert parse_step(checkpoint_name(step)) == step


@pytest.mark.parametrize(
    "name",
    ["ckpt-1.pt", "ckpt-000000001.pt", "ckpt-00000001.json", ".ckpt-00000001.pt.0a1b.tmp", "x.pt"],
)
def test_parse_step_rejects_names_checkpoint_name_never_makes(name):
    """Temp files, sidecars and foreign names are not checkpoints."""
    assert parse_step(name) is None


def test_checkpoint_name_rejects_negative_step():
    """A negative step is an error, not a strangely sorted file name."""
    with pytest.raises(ValueError, match="non-negative"):
        checkpoint_name(-1)


def test_round_trip_restores_every_entry(tmp_path):
    """What save_checkpoint writes, load_checkpoint returns, plus step, epoch and versions."""
    state = _state(_model())
    path = save_checkpoint(tmp_path, state, step=10, epoch=1, metrics={"loss": 0.5})
    loaded = load_checkpoint(path)
    assert path.name == "ckpt-00000010.pt"
    assert (loaded["ddptrain_format"], loaded["step"], loaded["epoch"]) == (1, 10, 1)
    assert loaded["versions"]["torch"] == str(torch.__version__)
    for key in state["model"]:
        assert torch.equal(loaded["model"][key], state["model"][key])
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], exp_avg)
    for key in ("scheduler", "scaler", "sampler", "config", "world_size"):
        assert loaded[key] == state[key]


def test_model_loads_into_plain_module_with_plain_torch_load(tmp_path):
    """The model entry loads with torch.load(weights_only=True) into a fresh plain nn.Module."""
    trained = _model(seed=1)
    path = save_checkpoint(tmp_path, _state(trained), step=1)
    fresh = _model(seed=2)
    fresh.load_state_dict(torch.load(path, weights_only=True, map_location="cpu")["model"])
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), trained(x))


def test_sidecar_is_readable_json_describing_the_file(tmp_path):
    """The sidecar holds step, epoch, metrics, world_size, versions, size and sha256 of the .pt."""
    path = save_checkpoint(tmp_path, tiny_state(), step=3, epoch=2, metrics={"val_loss": 1.5})
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["step"] == 3 and sidecar["epoch"] == 2 and sidecar["world_size"] == 1
    assert sidecar["metrics"] == {"val_loss": 1.5}
    assert set(sidecar["versions"]) == {"torch", "ddptrain", "python"}
    assert sidecar["size_bytes"] == path.stat().st_size
    assert sidecar["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "time" in sidecar


_KILLED_SAVE = """
import os, signal, sys
import torch
import ddptrain.train.checkpoint as ckpt
import ddptrain.train.checkpoint.files as ckpt_io

stage, directory = sys.argv[1], sys.argv[2]
real_write, real_replace = ckpt_io._HashingWriter.write, os.replace

def write(self, data):
    if stage == "mid_write" and self.size > 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(self, data)

def replace(src, dst):
    if stage == "before_rename" or (stage == "before_sidecar" and str(dst).endswith(".json")):
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)

ckpt_io._HashingWriter.write = write
os.replace = replace
ckpt.save_checkpoint(directory, {"model": {"w": torch.full((256, 256), 2.0)}}, step=2)
"""


@pytest.mark.parametrize("stage", ["mid_write", "before_rename", "before_sidecar"])
def test_save_killed_midway_keeps_previous_checkpoint(tmp_path, stage):
    """A save SIGKILLed anywhere leaves the previous checkpoint latest; the next save cleans up."""
    save_checkpoint(tmp_path, tiny_state(1.0), step=1)
    child = forked.run(["-c", _KILLED_SAVE, stage, str(tmp_path)], timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout
    leftovers = set(file_names(tmp_path)) - {"ckpt-00000001.pt", "ckpt-00000001.json"}
    temps = {name for name in leftovers if name.endswith(".tmp")}
    assert len(temps) == 1
    assert leftovers - temps == ({"ckpt-00000002.pt"} if stage == "before_sidecar" else set())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = latest_checkpoint(tmp_path)
    skipped = [w for w in caught if "skipping invalid checkpoint" in str(w.message)]
    assert len(skipped) == (1 if stage == "before_sidecar" else 0)  # temp files are not candidates
    assert latest == tmp_path / "ckpt-00000001.pt"
    assert torch.equal(load_checkpoint(latest)["model"]["w"], torch.ones(3))

    save_checkpoint(tmp_path, tiny_state(3.0), step=3, keep_last=5)
    assert file_names(tmp_path) == [
        "ckpt-00000001.json",
        "ckpt-00000001.pt",
        "ckpt-00000003.json",
        "ckpt-00000003.pt",
    ]


def test_failed_save_keeps_older_checkpoints_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """Retention runs only after the new file is safe: a failing save deletes nothing."""
    save_checkpoint(tmp_path, tiny_state(1.0), step=1, keep_last=1)

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path, tiny_state(2.0), step=2, keep_last=1)
    monkeypatch.undo()
    assert file_names(tmp_path) == ["ckpt-00000001.json", "ckpt-00000001.pt"]
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-00000001.pt"


def test_truncated_file_is_a_clear_error(tmp_path):
    """A truncated .pt without sidecar fails with CheckpointError naming the file."""
    path = save_checkpoint(tmp_path, tiny_state(), step=1)
    path.with_suffix(".json").unlink()
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"ckpt-00000001\.pt is not a readable torch"):
        load_checkpoint(path)


def test_truncated_file_with_sidecar_fails_the_size_check(tmp_path):
    """A truncated .pt with its sidecar is reported as truncated, before torch reads it."""
    path = save_checkpoint(tmp_path, tiny_state(), step=1)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="truncated or modified"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "is an empty file, not a checkpoint"),
        (b"hello, not a checkpoint\n", "not a readable torch checkpoint"),
        (b"PK\x03\x04garbage", "not a readable torch checkpoint"),
    ],
)
def test_non_torch_file_is_a_clear_error(tmp_path, content, said):
    """Empty, text and fake-zip files raise CheckpointError saying what they are, no traceback."""
    path = tmp_path / "ckpt-00000001.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=said):
        load_checkpoint(path)


def test_foreign_torch_file_is_a_clear_error(tmp_path):
    """A valid torch.save of a dict without the ddptrain marker is refused with the fix."""
    path = tmp_path / "weights.pt"
    torch.save({"state_dict": _model().state_dict()}, path)
    with pytest.raises(CheckpointError, match="not a ddptrain checkpoint.*state_dict"):
        load_checkpoint(path)


def test_missing_file_is_a_clear_error(tmp_path):
    """A path that does not exist raises CheckpointError naming it."""
    with pytest.raises(CheckpointError, match="nope.pt does not exist"):
        load_checkpoint(tmp_path / "nope.pt")


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    """A checkpoint whose pickle would run code is refused, and the code does not run."""
    marker = tmp_path / "payload-ran"
    path = tmp_path / "ckpt-00000001.pt"
    torch.save({"ddptrain_format": 1, "model": {}, "x": _Payload(marker)}, path)
    with pytest.raises(CheckpointError, match="refuses to unpickle"):
        load_checkpoint(path)
    assert not marker.exists()
    opened = torch.load(path, weights_only=False)["x"]  # unsafe loading runs the payload
    opened.close()
    assert marker.exists()


def test_flipped_byte_is_caught_by_the_sidecar_hash(tmp_path):
    """A same-size corruption fails sha256: load refuses it and latest falls back one step."""
    save_checkpoint(tmp_path, tiny_state(1.0), step=1)
    path = save_checkpoint(tmp_path, tiny_state(2.0), step=2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(path)
    with pytest.warns(UserWarning, match="corrupted"):
        assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-00000001.pt"


def test_saving_a_step_twice_is_refused(tmp_path):
    """Overwriting a complete checkpoint is refused, because it could not be done atomically."""
    save_checkpoint(tmp_path, tiny_state(1.0), step=1)
    with pytest.raises(CheckpointError, match="already holds a complete checkpoint"):
        save_checkpoint(tmp_path, tiny_state(2.0), step=1)
    assert torch.equal(load_checkpoint(tmp_path / "ckpt-00000001.pt")["model"]["w"], torch.ones(3))


def test_state_that_weights_only_would_refuse_fails_at_save_time(tmp_path):
    """A non-plain value (here a numpy scalar or a function) is named at save, not at resume."""
    bad = {**tiny_state(), "config": {"lr": lambda step: 0.1}}
    with pytest.raises(CheckpointError, match=r"state\['config'\]\['lr'\] is a .*function"):
        save_checkpoint(tmp_path, bad, step=1)
    if np is not None:
        with pytest.raises(CheckpointError, match="numpy"):
            save_checkpoint(tmp_path, {**tiny_state(), "sampler": {"pos": np.int64(3)}}, step=1)
    assert file_names(tmp_path) == []


def test_non_numeric_metric_is_refused_before_writing(tmp_path):
    """Metrics go into JSON, so a non-number is named before any file is written."""
    with pytest.raises(CheckpointError, match="metric 'acc'"):
        save_checkpoint(tmp_path, tiny_state(), step=1, metrics={"acc": torch.ones(2)})
    assert file_names(tmp_path) == []


def test_reserved_keys_in_state_are_refused(tmp_path):
    """step and epoch come from the keyword arguments only, so they cannot disagree."""
    with pytest.raises(ValueError, match="'step'"):
        save_checkpoint(tmp_path, {**tiny_state(), "step": 4}, step=5)


def _draws() -> list:
    drawn = [random.random(), random.gauss(0, 1), torch.rand(3).tolist(), torch.randn(2).tolist()]
    if np is not None:
        drawn += [np.random.rand(3).tolist(), float(np.random.normal())]
    return drawn


def test_rng_state_round_trips_in_process():
    """Draws after restore_rng_state equal the draws made right after capture_rng_state."""
    random.gauss(0, 1)  # leaves a cached gaussian in python's state, which must survive too
    if np is not None:
        np.random.normal()
    state = capture_rng_state()
    expected = _draws()
    restore_rng_state(state)
    assert _draws() == expected


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    """The captured RNG state survives save and weights_only load, then replays the same draws."""
    path = save_checkpoint(tmp_path, {**tiny_state(), "rng": capture_rng_state()}, step=1)
    expected = _draws()
    restore_rng_state(load_checkpoint(path)["rng"])
    assert _draws() == expected


def test_checkpoint_of_another_model_names_the_keys():
    """Missing, unexpected and mis-shaped keys are listed by name."""
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3), nn.Linear(3, 1))
    with pytest.raises(CheckpointError) as err:
        load_model_state(_model(), other.state_dict())
    message = str(err.value)
    assert "2 unexpected keys (in the checkpoint, not in the model): 3.weight, 3.bias" in message
    assert "0.weight (checkpoint [16, 4], model [8, 4])" in message
    assert "different model" in message
    partial = {k: v for k, v in _model().state_dict().items() if k != "2.bias"}
    with pytest.raises(CheckpointError, match="1 missing keys .*: 2.bias"):
        check_model_compat(_model().state_dict(), partial)


def test_wrapped_model_state_gets_a_strip_the_prefix_hint():
    """A state_dict saved from a wrapper (module. prefix) says to strip the prefix."""
    wrapped = {f"module.{k}": v for k, v in _model().state_dict().items()}
    with pytest.raises(CheckpointError, match="strip the prefix"):
        check_model_compat(_model().state_dict(), wrapped)


def test_matching_state_loads():
    """A checkpoint of the same architecture loads without error."""
    model = _model(seed=3)
    load_model_state(model, _model(seed=4).state_dict())
    assert torch.equal(model[0].weight, _model(seed=4)[0].weight)

"""The checkpoint directory: listing, retention, the best checkpoint, file modes, writability."""

import json
import os
import stat

import pytest

import ddptrain.train.checkpoint as ckpt
from ddptrain.train.checkpoint import (
    CheckpointError,
    best_checkpoint,
    check_writable,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    parse_step,
    save_checkpoint,
    verify_checkpoint,
)
from support.checkpoint_files import file_names, tiny_state


def test_latest_and_list_ignore_temp_files_and_empty_dirs(tmp_path):
    """latest_checkpoint is None for a missing or empty dir; temp files are never listed."""
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / ".ckpt-00000009.pt.0123456789abcdef.tmp").write_bytes(b"partial")
    save_checkpoint(tmp_path, tiny_state(), step=5)
    save_checkpoint(tmp_path, tiny_state(), step=12)
    assert list_checkpoints(tmp_path) == [
        tmp_path / "ckpt-00000005.pt",
        tmp_path / "ckpt-00000012.pt",
    ]
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-00000012.pt"
    assert not any(name.endswith(".tmp") for name in file_names(tmp_path))


def test_keep_last_keeps_only_the_newest_k(tmp_path):
    """keep_last=2 leaves the two newest checkpoints and their sidecars."""
    for step in range(1, 6):
        save_checkpoint(tmp_path, tiny_state(step), step=step, keep_last=2)
    assert list_checkpoints(tmp_path) == [
        tmp_path / "ckpt-00000004.pt",
        tmp_path / "ckpt-00000005.pt",
    ]
    assert len(file_names(tmp_path)) == 4
    verify_checkpoint(tmp_path / "ckpt-00000005.pt")


def test_keep_last_none_keeps_everything(tmp_path):
    """keep_last=None never deletes a complete checkpoint."""
    for step in range(1, 5):
        save_checkpoint(tmp_path, tiny_state(), step=step, keep_last=None)
    assert [parse_step(p.name) for p in list_checkpoints(tmp_path)] == [1, 2, 3, 4]


@pytest.mark.parametrize(("mode", "best_step"), [("min", 2), ("max", 4)])
def test_best_checkpoint_survives_retention(tmp_path, mode, best_step):
    """The best-by-metric checkpoint is kept beyond keep_last and best.json points to it."""
    for step, value in enumerate([3.0, 1.0, 2.0, 5.0, 4.0], start=1):
        save_checkpoint(
            tmp_path,
            tiny_state(value),
            step=step,
            metrics={"val_loss": value},
            keep_last=1,
            best_metric="val_loss",
            best_mode=mode,
        )
    assert [parse_step(p.name) for p in list_checkpoints(tmp_path)] == sorted({best_step, 5})
    assert best_checkpoint(tmp_path) == tmp_path / checkpoint_name(best_step)
    pointer = json.loads((tmp_path / "best.json").read_text())
    assert (pointer["step"], pointer["metric"], pointer["mode"]) == (best_step, "val_loss", mode)
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-00000005.pt"


def test_best_checkpoint_is_none_without_best_metric(tmp_path):
    """No best.json is written unless best_metric is given."""
    save_checkpoint(tmp_path, tiny_state(), step=1, metrics={"val_loss": 1.0})
    assert best_checkpoint(tmp_path) is None


def test_best_metric_missing_from_metrics_is_an_error(tmp_path):
    """A misspelt best_metric fails loudly instead of never recording a best."""
    with pytest.raises(ValueError, match="'val_loss' is not in metrics \\['loss'\\]"):
        save_checkpoint(
            tmp_path, tiny_state(), step=1, metrics={"loss": 1.0}, best_metric="val_loss"
        )
    assert file_names(tmp_path) == []


@pytest.mark.parametrize(("umask", "expected_mode"), [(0o022, 0o644), (0o077, 0o600), (0, 0o664)])
def test_saved_files_follow_umask_and_are_never_world_writable(tmp_path, umask, expected_mode):
    """Checkpoint, sidecar and best.json get 0o666 minus the umask, minus world-write."""
    old = os.umask(umask)
    try:
        save_checkpoint(tmp_path, tiny_state(), step=1, metrics={"m": 1.0}, best_metric="m")
    finally:
        os.umask(old)
    for name in ("ckpt-00000001.pt", "ckpt-00000001.json", "best.json"):
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == expected_mode, (name, oct(mode))
        assert not mode & stat.S_IWOTH


def test_check_writable_creates_the_directory(tmp_path):
    """check_writable creates missing parents and leaves no probe file behind."""
    target = tmp_path / "a" / "b"
    assert check_writable(target, required_bytes=1) == target
    assert target.is_dir() and file_names(target) == []


def test_check_writable_under_a_regular_file_is_a_clear_error(tmp_path):
    """A directory that cannot be created (parent is a file) is named with the fix."""
    (tmp_path / "some_file").write_text("x")
    with pytest.raises(
        CheckpointError,
        match="cannot create checkpoint_dir .*some_file/ckpts: .*some_file is a file",
    ):
        check_writable(tmp_path / "some_file" / "ckpts")


def test_check_writable_reports_permission_denied(tmp_path, monkeypatch):
    """A refused probe write is a clear error (simulated: root ignores chmod 0o500)."""
    real_open = os.open

    def deny_probe(path, flags, mode=0o777):
        if "write-probe" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", deny_probe)
    with pytest.raises(CheckpointError, match="is not writable \\(Permission denied\\)"):
        check_writable(tmp_path)


def test_check_writable_on_read_only_directory(tmp_path):
    """A real 0o500 directory is reported as not writable, where permission bits bind."""
    target = tmp_path / "ro"
    target.mkdir(mode=0o500)
    try:
        try:
            (target / "canary").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("permission bits do not bind here (root with CAP_DAC_OVERRIDE)")
        with pytest.raises(CheckpointError, match="is not writable"):
            check_writable(target)
    finally:
        target.chmod(0o700)


def test_check_writable_reports_too_little_free_space(tmp_path):
    """Too little free space fails before training, naming the recipe's --keep-last as the fix."""
    with pytest.raises(CheckpointError, match="MiB free on the filesystem") as info:
        check_writable(tmp_path, required_bytes=2**62)
    assert "lower keep_last (recipe: --keep-last)" in str(info.value)


def _truncate(path) -> bytes:
    """Cut `path` to half its size, keeping its sidecar; return the bytes left."""
    data = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(data)
    return data


def test_latest_valid_checkpoint_names_each_newer_invalid_one_and_why(tmp_path):
    """Past a truncated and an unfinished newer save it finds step 1, and says why for each."""
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, tiny_state(step), step=step)
    _truncate(tmp_path / "ckpt-00000003.pt")
    (tmp_path / "ckpt-00000002.json").unlink()
    path, skipped = ckpt.latest_valid_checkpoint(tmp_path)
    assert path == tmp_path / "ckpt-00000001.pt"
    assert [p.name for p, _ in skipped] == ["ckpt-00000003.pt", "ckpt-00000002.pt"]
    assert "but ckpt-00000003.json records" in skipped[0][1] and "truncated" in skipped[0][1]
    assert skipped[1][1] == "has no valid sidecar ckpt-00000002.json: its save did not finish"
    with pytest.warns(UserWarning) as caught:
        assert latest_checkpoint(tmp_path) == path
    assert len(caught) == 2


def test_set_aside_moves_a_checkpoint_into_invalid_where_it_is_kept_and_never_pruned(tmp_path):
    """A set-aside checkpoint moves intact into invalid/, unlisted, never overwritten or pruned."""
    save_checkpoint(tmp_path, tiny_state(1), step=1)
    save_checkpoint(tmp_path, tiny_state(2), step=2)
    cut = _truncate(tmp_path / "ckpt-00000002.pt")
    moved = ckpt.set_aside_checkpoint(tmp_path / "ckpt-00000002.pt")
    assert moved == tmp_path / ckpt.INVALID_DIR / "ckpt-00000002.pt"
    assert moved.read_bytes() == cut and moved.with_suffix(".json").is_file()
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-00000001.pt"]

    save_checkpoint(tmp_path, tiny_state(2), step=2)
    (tmp_path / "ckpt-00000002.json").unlink()
    again = ckpt.set_aside_checkpoint(tmp_path / "ckpt-00000002.pt")
    assert again == tmp_path / ckpt.INVALID_DIR / "ckpt-00000002.1.pt"
    assert moved.read_bytes() == cut

    for step in range(3, 7):
        save_checkpoint(tmp_path, tiny_state(step), step=step, keep_last=1)
    assert file_names(tmp_path / ckpt.INVALID_DIR) == [
        "ckpt-00000002.1.pt",
        "ckpt-00000002.json",
        "ckpt-00000002.pt",
    ]
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-00000006.pt"]


def test_set_aside_points_best_json_at_the_best_checkpoint_left(tmp_path):
    """best.json naming the checkpoint set aside is recomputed from those still there."""
    for step, value in [(1, 0.5), (2, 0.7), (3, 0.9)]:
        save_checkpoint(
            tmp_path,
            tiny_state(),
            step=step,
            metrics={"acc": value},
            best_metric="acc",
            best_mode="max",
        )
    assert best_checkpoint(tmp_path) == tmp_path / "ckpt-00000003.pt"
    ckpt.set_aside_checkpoint(tmp_path / "ckpt-00000003.pt")
    assert best_checkpoint(tmp_path) == tmp_path / "ckpt-00000002.pt"

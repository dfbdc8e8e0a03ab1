"""The GPT recipe runs end to end under ddptrain-run on the standard library's source, holds
text out by file, and speaks the same flags as the MNIST recipe."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain import cli
from support.child_env import child_env
from support.launch_cmds import DDPTRAIN_RUN

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "gpt.py"


def _recipe():
    spec = importlib.util.spec_from_file_location("gpt_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        args, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
def test_dry_run_at_world_size_2_trains_evaluates_samples_and_checkpoints(tmp_path):
    """gpt.py --dry-run at 2 ranks logs its data, 5 steps, eval_bpb, a sample; best is eval_bpb."""
    ckpt = tmp_path / "ckpt"
    flags = ["--dry-run", "--no-progress-bar", "--checkpoint-dir", str(ckpt)]
    out = _run([*DDPTRAIN_RUN, "--standalone", "--nproc_per_node=2", str(RECIPE), *flags], tmp_path)
    lines = out.stdout.splitlines()
    stdlib = _recipe().STDLIB
    assert re.fullmatch(
        rf"data: the standard library {re.escape(str(stdlib))}: \d+ files \(\*\.py outside "
        r"test/, tests/, site-packages/\), [\d,]+ bytes",
        lines[0],
    ), lines[0]
    assert lines[1].startswith("held out by file (--val-fraction 0.05, --seed 1234): ")
    assert out.stdout.count("data: ") == 1  # rank 0 alone
    assert re.search(r"^step 5 epoch 1/1: eval_bpb=[\d.]+, eval_loss=", out.stdout, re.M)
    assert "--- sample 1 (temperature 0.8) ---\ndef " in out.stdout
    final = re.search(
        r"^FINAL data=stdlib val_bpb=([\d.]+) steps=5 .* world_size=2$", out.stdout, re.M
    )
    assert final and 0 < float(final.group(1)) < 8.5, out.stdout
    best = json.loads((ckpt / "best.json").read_text())
    assert (best["metric"], best["mode"], best["step"]) == ("eval_bpb", "min", 5)


@pytest.mark.slow
def test_a_data_folder_under_zero3_with_checkpointed_blocks(tmp_path):
    """A --data folder is read, split by file, trained under ZeRO-3 with checkpointing, sampled."""
    folder = tmp_path / "notes"
    folder.mkdir()
    for i in range(6):
        (folder / f"n{i}.txt").write_text(f"note {i}: the quick brown fox\n" * 40)
    flags = ["--data", str(folder), "--files", "*.txt", "--dry-run", "--no-progress-bar"]
    flags += ["--zero-stage", "3", "--activation-checkpointing", "--global-batch-size", "8"]
    out = _run([sys.executable, str(RECIPE), *flags], tmp_path).stdout
    assert out.startswith(f"data: --data {folder}: 6 files (*.txt outside test/, tests/, ")
    assert "held out by file (--val-fraction 0.05, --seed 1234): 1 files, " in out
    assert re.search(rf"^FINAL data={re.escape(str(folder))} val_bpb=[\d.]+ steps=5 ", out, re.M)


def test_held_out_files_are_never_trained_on(tmp_path):
    """load_text holds out whole files, the same per seed; a single file holds out its tail."""
    # Each file's text is unique, so the bytes show which files each part holds.
    recipe = _recipe()
    for i in range(30):
        (tmp_path / f"f{i:02}.py").write_text(f"# file {i:02}\n" * 30)
    args = recipe.parse_args(["--data", str(tmp_path), "--val-fraction", "0.1"])
    train, val, lines = recipe.load_text(args, seed=5)
    train_text = bytes(train.data.tolist()).decode()
    val_text = bytes(val.data.tolist()).decode()
    held = sorted({int(m) for m in re.findall(r"# file (\d\d)", val_text)})
    assert len(held) == 3
    assert not any(f"# file {i:02}" in train_text for i in held)
    assert len(train_text) + len(val_text) == 30 * 30 * len("# file 00\n")
    assert recipe.load_text(args, seed=5)[2] == lines
    one = recipe.parse_args(["--data", str(tmp_path / "f00.py"), "--block-size", "8"])
    train, val, lines = recipe.load_text(one, seed=5)
    assert lines[1].startswith("held out: its last ") and len(val.data) == 15  # 5% of 300


def test_flags_are_checked_together():
    """--n-embd not divisible by --n-head is one usage error; --dry-run shrinks only defaults."""
    recipe = _recipe()
    with pytest.raises(cli.UsageError, match="--n-embd 30 is not divisible by --n-head 4"):
        recipe.parse_args(["--n-embd", "30"])
    args = recipe.parse_args(["--dry-run", "--n-layer", "3"])
    assert (args.n_layer, args.n_embd, args.max_steps) == (3, 32, 5)

"""The MNIST recipe runs end to end under torchrun and as a plain script (on small IDX data)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from idx_files import write_split

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "mnist.py"


@pytest.fixture
def data_dir(tmp_path) -> Path:
    folder = tmp_path / "data" / "MNIST" / "raw"
    write_split(folder, "train", 640, seed=1)
    write_split(folder, "t10k", 101, seed=2)
    return tmp_path / "data"


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def _torchrun(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


def test_dry_run_under_torchrun_prints_the_summary_and_checkpoints(tmp_path, data_dir):
    """torchrun --nproc_per_node=2 recipes/mnist.py --dry-run trains 5 steps, evaluates, saves."""
    ckpt_dir = tmp_path / "ckpt"
    result = _run(
        _torchrun(2)
        + [
            str(RECIPE),
            "--data-dir",
            str(data_dir),
            "--dry-run",
            "--no-progress",
            "--checkpoint-dir",
            str(ckpt_dir),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    final = re.search(r"^FINAL .*test_accuracy=([\d.]+).*world_size=2$", result.stdout, re.M)
    assert final, result.stdout
    assert "steps=5" in final.group(0)
    assert "world_size=2 backend=gloo" in result.stdout
    assert (ckpt_dir / "ckpt-00000005.pt").is_file()
    assert (tmp_path / "logs" / "metrics.jsonl").read_text().count("\n") >= 2


def test_plain_python_run_and_target_acc_exit_code(tmp_path, data_dir):
    """python recipes/mnist.py works as world size 1; --target-acc above reach exits 1."""
    result = _run(
        [
            sys.executable,
            str(RECIPE),
            "--data-dir",
            str(data_dir),
            "--dry-run",
            "--no-progress",
            "--target-acc",
            "1.01",
        ],
        tmp_path,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "world_size=1" in result.stdout
    assert "below --target-acc 1.01" in result.stdout


def test_missing_data_says_where_to_put_it(tmp_path):
    """Without data files the recipe fails with the folder to fill, not a deep traceback only."""
    result = _run(
        [
            sys.executable,
            str(RECIPE),
            "--data-dir",
            str(tmp_path / "none"),
            "--dry-run",
            "--no-progress",
        ],
        tmp_path,
    )
    assert result.returncode != 0
    assert "MNIST train split not found" in result.stderr

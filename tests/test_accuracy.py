"""Full-data accuracy gate for the recipe (slow: run with python -m pytest -m slow)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain.data.datasets import DEBIAN_FASHION_MNIST

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "mnist.py"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    not DEBIAN_FASHION_MNIST.is_dir(), reason="apt-get install -y dataset-fashion-mnist"
)
def test_recipe_defaults_reach_90_percent_on_fashion_mnist_at_world_size_2(tmp_path):
    """torchrun --nproc_per_node=2 recipes/mnist.py --dataset fashion-mnist reaches >= 90%."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(RECIPE),
            "--dataset",
            "fashion-mnist",
            "--no-progress-bar",
            "--target-acc",
            "0.90",
        ],
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=1750,
    )
    final = re.search(r"^FINAL .*$", result.stdout, re.M)
    print(final.group(0) if final else result.stdout[-2000:])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

"""Reference runs for the launcher tests, started with ddptrain.spawn instead of torchrun.

    ddptrain.spawn(spawned_refs.recipe, 2, ["--dry-run", ...])   # recipes/mnist.py's main
    ddptrain.spawn(spawned_refs.job, 4, ["--out", "ref.pt"])     # tests/support/multinode_job.py

spawn forks its ranks from a server that imported torch once, where a launcher starts a fresh
interpreter per rank (2-3 s each here). The ranks are the same world (RANK, WORLD_SIZE, one
host), so what they compute is what torchrun's ranks compute; torchrun itself is covered by
tests/test_recipe.py and tests/train/test_launcher_faults.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from support import multinode_job

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "mnist.py"


def recipe(argv: list[str]) -> int:
    """recipes/mnist.py's main(argv) on this rank; its exit status."""
    spec = importlib.util.spec_from_file_location("ddptrain_recipe_mnist", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def job(argv: list[str]) -> None:
    """tests/support/multinode_job.py's main(argv) on this rank."""
    multinode_job.main(argv)

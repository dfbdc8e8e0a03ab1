"""The environment a test gives a child job: no launcher's rank variables, one torch thread."""

from __future__ import annotations

import os

# What a launcher (torchrun, or this test run inside one) sets for a rank: a child that saw
# them would join that world instead of starting its own.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without LAUNCHER_VARS, with OMP_NUM_THREADS=1 and `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}

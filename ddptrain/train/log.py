"""Rank-0 output of the Trainer: a JSON-lines metrics file and a tqdm progress bar.

log = MetricsLog("runs/mnist")        # appends to runs/mnist/metrics.jsonl
log.write({"step": 10, "loss": 0.31})
# read back: [json.loads(line) for line in open("runs/mnist/metrics.jsonl")]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsLog:
    """Append-only JSON lines, one record per line, flushed at once so other tools can tail it."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class ProgressBar:
    """A tqdm bar over optimizer steps showing loss and samples/s; a no-op when disabled."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self._bar = (
            tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True) if enabled else None
        )

    def update(self, step: int, record: dict[str, Any]) -> None:
        """Move to `step` and show the latest loss and throughput."""
        if self._bar is None:
            return
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix(
            loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.0f}"
        )

    def close(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()

"""Bytes of text files as fixed-length windows for a byte-level language model.

    files = text_files(Path(sysconfig.get_paths()["stdlib"]), "*.py", ("test", "tests"))
    train_files, val_files = split_by_file(files, root, val_fraction=0.05, seed=1234)
    train = ByteWindows(read_bytes(train_files), block_size=128)
    x, y = train[0]                        # 128 int64 bytes, and the same shifted by one
    val = ByteWindows(read_bytes(val_files), block_size=128, max_windows=256)

A window i is bytes [i * block_size, (i + 1) * block_size] of the concatenated files: x is its
first block_size bytes, y its last (each position's next byte). Windows do not overlap, so an
epoch reads every byte once; the dataset is map-style, so ddptrain's ShardedSampler shuffles,
shards and resumes it exactly like any other. The held-out split is chosen by file, so no text
of a validation file is ever trained on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset


def text_files(path: Path, pattern: str = "*", exclude: Sequence[str] = ()) -> list[Path]:
    """`path` itself if it is a file, else the files under it matching `pattern` (a glob on
    the name), sorted, leaving out any under a folder named in `exclude`."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a file nor a folder")
    skip = set(exclude)
    return sorted(
        f
        for f in path.rglob(pattern)
        if f.is_file() and not skip.intersection(f.relative_to(path).parts[:-1])
    )


def split_by_file(
    files: Sequence[Path], root: Path, val_fraction: float, seed: int
) -> tuple[list[Path], list[Path]]:
    """(train files, validation files): round(val_fraction * len(files)) files, at least one,
    drawn with `seed` from the files in the order of their paths relative to `root`, so the
    split is the same on every rank, machine and run. Both lists keep that order."""
    if len(files) < 2:
        raise ValueError(f"splitting by file needs at least 2 files, got {len(files)}")
    ordered = sorted(files, key=lambda f: f.relative_to(root).as_posix())
    count = min(len(ordered) - 1, max(1, round(val_fraction * len(ordered))))
    held = set(random.Random(seed).sample(range(len(ordered)), count))
    train = [f for i, f in enumerate(ordered) if i not in held]
    val = [f for i, f in enumerate(ordered) if i in held]
    return train, val


def read_bytes(files: Sequence[Path]) -> torch.Tensor:
    """The files' bytes, one after another, as a uint8 tensor."""
    data = b"".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteWindows(Dataset):
    """Non-overlapping windows of block_size + 1 bytes of `data` (module docstring); with
    `max_windows`, that many of them spread evenly over the data (a cheaper evaluation)."""

    def __init__(self, data: torch.Tensor, block_size: int, max_windows: int | None = None):
        count = (len(data) - 1) // block_size
        if count < 1:
            raise ValueError(
                f"{len(data)} bytes hold no window of {block_size + 1}; use more text or a "
                "smaller block_size"
            )
        self.data, self.block_size = data, block_size
        starts = torch.arange(count) * block_size
        if max_windows is not None and max_windows < count:
            starts = starts[torch.linspace(0, count - 1, max_windows).round().long()]
        self.starts = starts
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i])
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]

    def get_batch(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """The batch default_collate would make of these windows, in one gather."""
        windows = self.data[self.starts[list(indices)][:, None] + self._offsets].long()
        return [windows[:, :-1].contiguous(), windows[:, 1:].contiguous()]

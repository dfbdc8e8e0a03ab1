"""The tutorial's partitioner: a dataset cut into seeded random parts, one per rank.

part = DataPartitioner(train_set, [0.5, 0.5]).use(rank)    # "Writing Distributed
indices = partition_indices(len(train_set), [0.7, 0.3])    #  Applications with PyTorch"
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

# Float sums such as 0.7 + 0.2 + 0.1 miss 1.0 by an ulp; they still mean "all of the data".
_SUM_TOLERANCE = 1e-9


def partition_indices(n: int, sizes: Sequence[float], seed: int = 1234) -> list[list[int]]:
    """Shuffle range(n) with `seed` and cut it into disjoint parts of fractions `sizes`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    sizes = [float(s) for s in sizes]
    total = sum(sizes)
    if not sizes or any(s < 0 for s in sizes) or total > 1 + _SUM_TOLERANCE:
        raise ValueError(
            f"sizes must be non-negative fractions summing to at most 1, got {sizes} "
            f"(sum {total:.6g}); e.g. [0.5, 0.5] or [1 / world_size] * world_size"
        )
    indices = list(range(n))
    # Python's Random, as the PyTorch distributed tutorial's DataPartitioner, so a seed gives
    # the tutorial's partitions whenever each fraction times n is a whole number.
    random.Random(seed).shuffle(indices)
    # Cutting at rounded cumulative fractions (not int(frac * n) per part) loses no sample
    # when the fractions sum to 1, and keeps each part within one sample of frac * n.
    bounds, cumulative = [0], 0.0
    for s in sizes:
        cumulative += s
        bounds.append(min(n, math.floor(cumulative * n + 0.5)))
    if total >= 1 - _SUM_TOLERANCE:
        bounds[-1] = n
    return [indices[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


class Partition(Dataset):
    """A view of `data` restricted to `indices`."""

    def __init__(self, data: Any, indices: Sequence[int]):
        self.data = data
        self.indices = list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.data[self.indices[i]]


class DataPartitioner:
    """Split a dataset into seeded random parts: `DataPartitioner(ds, [0.5, 0.5]).use(rank)`."""

    def __init__(self, data: Any, sizes: Sequence[float] = (0.7, 0.2, 0.1), seed: int = 1234):
        self.data = data
        self.partitions = partition_indices(len(data), sizes, seed)

    def use(self, partition: int) -> Partition:
        """The `partition`-th part as a dataset."""
        if not 0 <= partition < len(self.partitions):
            raise IndexError(
                f"partition {partition} does not exist; there are {len(self.partitions)} "
                f"(0 to {len(self.partitions) - 1})"
            )
        return Partition(self.data, self.partitions[partition])

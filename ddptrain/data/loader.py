"""DataLoaders that fetch a whole batch in one call from datasets that can.

    loader = batch_loader(dataset, sampler, batch_size=128)   # DataLoader keywords pass through
    for x, y in loader: ...    # the batches DataLoader(dataset, batch_size=128, sampler=sampler)
                               # gives, bit for bit

A map-style dataset may define `get_batch(indices)`: the batch default_collate would build from
`[dataset[i] for i in indices]`. IDXDataset does: its samples are rows of one tensor, so a
batch is one gather instead of a __getitem__ call per sample and a stack, which was most of
what a LeNet step spent on data (docs/benchmarks.md, "Costs the code is shaped around").
Other datasets get a plain DataLoader.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, Dataset


def batch_loader(
    dataset: Dataset, sampler: Iterable[int], batch_size: int, **kwargs: Any
) -> DataLoader:
    """A DataLoader over `sampler`'s indices in batches of `batch_size` (the last may be short)."""
    if callable(getattr(dataset, "get_batch", None)):
        batches = BatchSampler(sampler, batch_size, drop_last=False)
        # batch_size=None: each "index" the loader draws is a whole batch's list of indices.
        return DataLoader(_WholeBatches(dataset), sampler=batches, batch_size=None, **kwargs)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **kwargs)


class _WholeBatches(Dataset):
    """Indexed by a list of indices: the dataset's get_batch of them."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> Any:
        return self.dataset.get_batch(indices)

"""batch_loader: whole-batch fetches give exactly the batches a per-sample DataLoader gives."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddptrain.data.idx import IDXDataset
from ddptrain.data.loader import batch_loader


def _dataset(n: int = 300, transform=None) -> IDXDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
    targets = torch.randint(0, 10, (n,), generator=g)
    return IDXDataset(images, targets, mean=0.13, std=0.31, transform=transform)


def _same_batches(a, b) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(
        type(x) is type(y) and all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("num_workers", [0, 1])
def test_whole_batches_equal_per_sample_batches_bitwise(num_workers):
    """Shuffled indices, a short last batch, workers or not: the same batches, bit for bit."""
    ds = _dataset()
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1)).tolist()
    ours = batch_loader(ds, order, 64, num_workers=num_workers)
    theirs = DataLoader(ds, batch_size=64, sampler=order, num_workers=num_workers)
    assert len(ours) == len(theirs) == 5
    assert _same_batches(ours, theirs)


def test_transforms_apply_per_sample_in_the_same_random_order():
    """A random per-sample transform sees each image once, drawing the RNG as DataLoader does."""

    def jitter(image: torch.Tensor) -> torch.Tensor:
        return image + torch.rand(())

    ds = _dataset(50, transform=jitter)
    order = list(range(49, -1, -1))
    torch.manual_seed(5)
    ours = list(batch_loader(ds, order, 16))
    torch.manual_seed(5)
    theirs = list(DataLoader(ds, batch_size=16, sampler=order))
    assert _same_batches(ours, theirs)
    torch.manual_seed(5)
    assert not _same_batches(ours, DataLoader(_dataset(50), batch_size=16, sampler=order))


class _Counting(Dataset):
    """A dataset with get_batch that counts its calls; __getitem__ must not be used."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        raise AssertionError("per-sample access")

    def get_batch(self, indices):
        self.calls.append(list(indices))
        return torch.tensor(indices)


class _PerSample(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def test_get_batch_is_called_once_per_batch_and_others_load_per_sample():
    """One get_batch call per batch where defined; a plain DataLoader where it is not."""
    ds = _Counting()
    batches = [b.tolist() for b in batch_loader(ds, range(10), 4)]
    assert batches == ds.calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    plain = batch_loader(_PerSample(), range(10), 4)
    assert [b.tolist() for b in plain] == batches

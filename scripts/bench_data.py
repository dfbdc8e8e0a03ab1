"""Time loading an MNIST-format split and one epoch: bulk tensors vs per-sample transforms.

    python scripts/bench_data.py                              # Fashion-MNIST 60k (Debian folder)
    python scripts/bench_data.py --dataset mnist --root data --batch-size 128 --repeats 5

"bulk" is ddptrain.data's IDXDataset: the split is decoded once and normalized in one tensor op,
and each batch is one gather (IDXDataset.get_batch, through ddptrain.data.loader.batch_loader, as
the Trainer loads it).
"per-sample" is torchvision's MNIST pattern: uint8 images kept, and each __getitem__ runs
ToTensor + Normalize (through PIL and torchvision when they import, else the same two steps
written out on tensors, which skips the PIL round trip and so flatters the baseline).
Both iterate the same ShardedSampler order through a DataLoader; medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from ddptrain.data import ShardedSampler, fashion_mnist, mnist, read_idx
from ddptrain.data.loader import batch_loader


class PerSampleDataset(Dataset):
    """uint8 images transformed one at a time in __getitem__, as torchvision's MNIST does."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, transform: Callable):
        self.images, self.targets, self.transform = images, targets, transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[i]), int(self.targets[i])


def per_sample_transform(mean: float, std: float) -> tuple[Callable, str]:
    """torchvision's ToTensor + Normalize on a PIL image, or the same steps on tensors."""
    try:
        from PIL import Image
        from torchvision import transforms
    except ImportError:
        return _manual_transform(mean, std), "ToTensor + Normalize written out (no torchvision)"
    pipeline = transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))])
    return lambda img: pipeline(Image.fromarray(img.numpy())), "torchvision + PIL"


def _manual_transform(mean: float, std: float) -> Callable:
    def transform(img: torch.Tensor) -> torch.Tensor:
        # What torchvision's ToTensor and Normalize do to one HxW uint8 image.
        x = img.unsqueeze(0).contiguous().to(torch.float32).div(255)
        m = torch.as_tensor((mean,), dtype=x.dtype)
        s = torch.as_tensor((std,), dtype=x.dtype)
        if (s == 0).any():
            raise ValueError("std evaluated to zero")
        return x.clone().sub_(m.view(-1, 1, 1)).div_(s.view(-1, 1, 1))

    return transform


def time_epoch(dataset: Dataset, batch_size: int, num_workers: int) -> float:
    """Seconds to draw every batch of one epoch through the Trainer's kind of DataLoader."""
    sampler = ShardedSampler(len(dataset), global_batch_size=batch_size, rank=0, world_size=1)
    loader = batch_loader(dataset, sampler, batch_size, num_workers=num_workers)
    start = time.perf_counter()
    for x, _ in loader:
        assert x.dtype == torch.float32
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=["fashion", "mnist"], default="fashion")
    parser.add_argument("--root", default=None, help="data folder (default: Debian's, fashion)")
    parser.add_argument("--test", action="store_true", help="the 10k test split, not 60k train")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    # 1. Settings shared by both paths; a first load finds the files and warms the page cache.
    torch.set_num_threads(args.threads)
    load = fashion_mnist if args.dataset == "fashion" else mnist
    train = not args.test
    first = load(args.root, train=train)
    paths, mean, std, n = first.paths, first.mean, first.std, len(first)
    del first
    transform, how = per_sample_transform(mean, std)

    bulk_load, bulk_epoch, per_load, per_epoch = [], [], [], []
    for _ in range(args.repeats):
        # 2. Bulk: load and normalize the split at once, then one epoch.
        start = time.perf_counter()
        bulk = load(args.root, train=train)
        bulk_load.append(time.perf_counter() - start)
        bulk_epoch.append(time_epoch(bulk, args.batch_size, args.num_workers))
        del bulk

        # 3. Per-sample: the same files to uint8, then one epoch transforming each sample.
        start = time.perf_counter()
        per_sample = PerSampleDataset(read_idx(paths[0]), read_idx(paths[1]).long(), transform)
        per_load.append(time.perf_counter() - start)
        per_epoch.append(time_epoch(per_sample, args.batch_size, args.num_workers))
        del per_sample

    # 4. Report medians and ratios.
    rows = {
        "bulk (ddptrain)": (statistics.median(bulk_load), statistics.median(bulk_epoch)),
        "per-sample": (statistics.median(per_load), statistics.median(per_epoch)),
    }
    print(
        f"{args.dataset} {'train' if train else 'test'} ({n} samples) from {paths[0].parent}; "
        f"batch {args.batch_size}, {args.num_workers} workers, {args.threads} thread(s), "
        f"median of {args.repeats}; per-sample = {how}"
    )
    print(f"{'':24}{'load_s':>9}{'epoch_s':>9}{'total_s':>9}")
    for name, (load_s, epoch_s) in rows.items():
        print(f"{name:24}{load_s:9.3f}{epoch_s:9.3f}{load_s + epoch_s:9.3f}")
    (bl, be), (pl, pe) = rows.values()
    print(
        f"{'ratio per-sample / bulk':24}{pl / bl:8.2f}x{pe / be:8.2f}x{(pl + pe) / (bl + be):8.2f}x"
    )


if __name__ == "__main__":
    main()

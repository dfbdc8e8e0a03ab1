"""MNIST-format (IDX) files read straight into tensors, and the dataset built from them.

    images = read_idx("train-images-idx3-ubyte.gz")          # uint8 [N, 28, 28], validated
    train_set = IDXDataset.from_files(images_path, labels_path, mean=0.2860, std=0.3530)
    x, y = train_set[0]                        # float [1, 28, 28] normalized, int64 label
    train_set.images, train_set.targets        # uint8 [N, 28, 28], int64 [N]

The whole split is one uint8 tensor, converted and normalized once in bulk, so an epoch pays
no per-sample PIL or ToTensor work. Which files make MNIST or Fashion-MNIST, and where they are
found: data/datasets.py; fetching them: data/download.py.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

_IMAGES_MAGIC, _LABELS_MAGIC = 0x0803, 0x0801
_UINT8 = 0x08
GZIP_MAGIC = b"\x1f\x8b"


class IDXFormatError(ValueError):
    """An IDX file that is truncated, corrupt or of the wrong kind; the message names it."""


def read_idx(path: str | os.PathLike, *, magic: int | None = None) -> torch.Tensor:
    """A uint8 IDX file (`.gz` or raw) as a tensor of its header's shape, fully validated."""
    path = Path(path)
    raw = path.read_bytes()
    # Sniffed, not taken from the suffix: a gunzipped file keeping its .gz name still loads.
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise IDXFormatError(
                f"{path}: not a complete gzip file ({e}); delete it and download it again"
            ) from None
    if len(raw) < 4 or raw[0] or raw[1]:
        raise IDXFormatError(
            f"{path}: not an IDX file (it does not start with two zero bytes); delete it and "
            "download it again"
        )
    found_magic, ndim = int.from_bytes(raw[:4], "big"), raw[3]
    if raw[2] != _UINT8:
        raise IDXFormatError(f"{path}: IDX data type 0x{raw[2]:02x} is not uint8 (0x08)")
    if magic is not None and found_magic != magic:
        raise IDXFormatError(
            f"{path}: magic number 0x{found_magic:08x} but expected 0x{magic:08x} "
            f"({_describe(magic)}); are the images and labels files swapped?"
        )
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise IDXFormatError(
            f"{path}: truncated inside its {header_len}-byte header; delete it and download it "
            "again"
        )
    shape = struct.unpack(f">{ndim}I", raw[4:header_len])
    expected = 1
    for d in shape:
        expected *= d
    found = len(raw) - header_len
    if found != expected:
        dims = "x".join(map(str, shape))
        problem = "truncated" if found < expected else "longer than its header says"
        raise IDXFormatError(
            f"{path}: {problem}: header says {dims} = {expected} bytes of data, found {found}; "
            "delete it and download it again"
        )
    if not expected:
        return torch.empty(shape, dtype=torch.uint8)
    # bytearray: a writable buffer, so torch.frombuffer does not warn and the tensor owns it.
    data = bytearray(memoryview(raw)[header_len:])
    return torch.frombuffer(data, dtype=torch.uint8).view(shape)


def _describe(magic: int) -> str:
    return {_IMAGES_MAGIC: "IDX images, 3 dims", _LABELS_MAGIC: "IDX labels, 1 dim"}.get(
        magic, "IDX"
    )


class IDXDataset(Dataset):
    """(image, label) pairs held as whole-split tensors, normalized once in bulk.

    `images` is uint8 [N, H, W], `targets` int64 [N], `data` float32 [N, 1, H, W]:
    pixels / 255, then (x - mean) / std when `mean`/`std` are given. `transform`, if any,
    is applied per sample to the float image (torchvision tensor transforms work).
    `paths` names the (images, labels) files when read by `from_files`, `mnist`, ...
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        *,
        mean: float | None = None,
        std: float | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if images.dtype != torch.uint8 or images.dim() != 3:
            raise ValueError(
                f"images must be uint8 [N, H, W], got {images.dtype} {tuple(images.shape)}"
            )
        if len(images) != len(targets):
            raise ValueError(f"{len(images)} images but {len(targets)} targets")
        self.images = images
        self.targets = targets.to(torch.int64)
        self.mean, self.std = mean, std
        self.transform = transform
        self.paths: tuple[Path, Path] | None = None
        data = images.unsqueeze(1).to(torch.float32).div_(255)
        if mean is not None:
            data.sub_(mean).div_(1.0 if std is None else std)
        self.data = data

    @classmethod
    def from_files(
        cls,
        images_path: str | os.PathLike,
        labels_path: str | os.PathLike,
        *,
        num_classes: int | None = None,
        **kwargs,
    ) -> IDXDataset:
        """Read an IDX images file and its labels file (validated and checked to match).

        With `num_classes`, every label must lie in 0..num_classes-1.
        """
        images = read_idx(images_path, magic=_IMAGES_MAGIC)
        labels = read_idx(labels_path, magic=_LABELS_MAGIC)
        if len(images) != len(labels):
            raise IDXFormatError(
                f"{images_path} holds {len(images)} images but {labels_path} holds "
                f"{len(labels)} labels; the two files are from different splits or versions"
            )
        if num_classes is not None:
            _check_labels(labels, num_classes, labels_path)
        dataset = cls(images, labels, **kwargs)
        dataset.paths = (Path(images_path), Path(labels_path))
        return dataset

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.data[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[i]

    def get_batch(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """[images, labels] of these samples as DataLoader would collate them, in one gather
        (ddptrain's loaders call it; see data/loader.py)."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        x = self.data[index]
        if self.transform is not None:
            x = torch.stack([self.transform(sample) for sample in x])
        return [x, self.targets[index]]


def _check_labels(labels: torch.Tensor, num_classes: int, path: str | os.PathLike) -> None:
    # Caught here, naming the file: in the loss it is an IndexError on one rank, mid-epoch.
    bad = (labels >= num_classes).nonzero().flatten()
    if len(bad):
        index = int(bad[0])
        raise IDXFormatError(
            f"{path}: label {int(labels[index])} at index {index} is outside 0..{num_classes - 1} "
            f"({len(bad)} of {len(labels)} labels are); the file is corrupt or from another "
            "dataset; delete it and download it again"
        )

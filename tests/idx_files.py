"""Write small synthetic MNIST-format (IDX) splits for tests."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import torch


def idx_bytes(tensor: torch.Tensor) -> bytes:
    """The IDX encoding (uint8 data) of `tensor`."""
    header = bytes([0, 0, 0x08, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    return header + tensor.to(torch.uint8).contiguous().numpy().tobytes()


def write_split(folder: Path, prefix: str, n: int, gz: bool = True, seed: int = 0) -> None:
    """Write a small synthetic MNIST-format split (n images of 28x28, labels 0-9)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
    labels = torch.arange(n, dtype=torch.uint8) % 10
    folder.mkdir(parents=True, exist_ok=True)
    for stem, tensor in [
        (f"{prefix}-images-idx3-ubyte", images),
        (f"{prefix}-labels-idx1-ubyte", labels),
    ]:
        data = idx_bytes(tensor)
        path = folder / (stem + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(data) if gz else data)


# The real MNIST test split CI places beside the repo (../shared), and its known label counts.
MNIST_ROOT = Path(__file__).resolve().parents[2] / "shared/data/mnist"
MNIST_TEST_LABEL_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]

"""Write small synthetic MNIST-format (IDX) splits for tests, and serve them as a local mirror."""

from __future__ import annotations

import contextlib
import functools
import gzip
import http.server
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import torch


def idx_bytes(tensor: torch.Tensor) -> bytes:
    """The IDX encoding (uint8 data) of `tensor`."""
    header = bytes([0, 0, 0x08, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    return header + tensor.to(torch.uint8).contiguous().numpy().tobytes()


def write_split(
    folder: Path, prefix: str, n: int, gz: bool = True, seed: int = 0, first_labels: tuple = ()
) -> None:
    """Write a small synthetic MNIST-format split (n images of 28x28, labels 0-9 cycling, after
    `first_labels` if given)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
    labels = torch.arange(n, dtype=torch.uint8) % 10
    labels[: len(first_labels)] = torch.tensor(first_labels, dtype=torch.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    for stem, tensor in [
        (f"{prefix}-images-idx3-ubyte", images),
        (f"{prefix}-labels-idx1-ubyte", labels),
    ]:
        data = idx_bytes(tensor)
        path = folder / (stem + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(data) if gz else data)


# The first ten labels of Fashion-MNIST's splits, by which ddptrain tells its files from MNIST's.
FASHION_FIRST_LABELS = {
    "train": (9, 0, 0, 3, 0, 2, 7, 2, 5, 5),
    "t10k": (9, 2, 1, 1, 6, 1, 4, 6, 5, 7),
}

# The real MNIST test split CI places beside the repo (../shared), and its known label counts.
MNIST_ROOT = Path(__file__).resolve().parents[3] / "shared/data/mnist"
MNIST_TEST_LABEL_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


class _MirrorHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; with `cut_at`, promises whole files but sends only that many bytes."""

    cut_at: int | None = None

    def copyfile(self, source, outputfile) -> None:
        if self.cut_at is None:
            super().copyfile(source, outputfile)
        else:
            outputfile.write(source.read(self.cut_at))
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_folder(folder: Path, cut_at: int | None = None) -> Iterator[str]:
    """An HTTP mirror of `folder` on 127.0.0.1 (never the network); yields its base URL."""
    handler = type("Handler", (_MirrorHandler,), {"cut_at": cut_at})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    """A base URL on 127.0.0.1 where nothing listens: what an offline machine sees."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"

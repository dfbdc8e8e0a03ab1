"""MNIST-format (IDX) datasets read straight into tensors: MNIST and Fashion-MNIST, offline.

    train_set = mnist("data")                  # data/MNIST/raw/, data/raw/ or data/
    test_set = fashion_mnist(train=False)      # also finds /usr/share/datasets/fashion-mnist
    x, y = train_set[0]                        # float [1, 28, 28] normalized, int64 label
    train_set.images, train_set.targets        # uint8 [N, 28, 28], int64 [N]

The whole split is one uint8 tensor, converted and normalized once in bulk, so an epoch pays
no per-sample PIL or ToTensor work. `download=True` fetches missing files (through torchvision
when it imports, else from the standard mirrors here) and checks their MD5.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import struct
import tempfile
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
_IMAGES_MAGIC, _LABELS_MAGIC = 0x0803, 0x0801
_UINT8 = 0x08
_GZIP_MAGIC = b"\x1f\x8b"
_DOWNLOAD_TIMEOUT_S = 30.0


class IDXFormatError(ValueError):
    """An IDX file that is truncated, corrupt or of the wrong kind; the message names it."""


class DownloadError(RuntimeError):
    """A dataset file could not be fetched intact; the one-line message says where to put it."""


@dataclass(frozen=True)
class _Spec:
    name: str  # torchvision's class and folder name: root/<name>/raw/
    mean: float
    std: float
    mirrors: tuple[str, ...]
    md5: dict[str, str] = field(default_factory=dict)
    fallback_dirs: tuple[Path, ...] = ()
    # The first labels of the (train, test) splits: MNIST and Fashion-MNIST share file names,
    # so a folder holding the other one's files is told apart by these, not by its name.
    first_labels: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())


_MNIST = _Spec(
    "MNIST",
    mean=0.1307,
    std=0.3081,
    mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
    md5={
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    first_labels=((5, 0, 4, 1, 9, 2, 1, 3, 1, 4), (7, 2, 1, 0, 4, 1, 4, 9, 5, 9)),
)
_FASHION_MNIST = _Spec(
    "FashionMNIST",
    mean=0.2860,
    std=0.3530,
    mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
    md5={
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    fallback_dirs=(DEBIAN_FASHION_MNIST,),
    first_labels=((9, 0, 0, 3, 0, 2, 7, 2, 5, 5), (9, 2, 1, 1, 6, 1, 4, 6, 5, 7)),
)
_SPECS = (_MNIST, _FASHION_MNIST)


def read_idx(path: str | os.PathLike, *, magic: int | None = None) -> torch.Tensor:
    """A uint8 IDX file (`.gz` or raw) as a tensor of its header's shape, fully validated."""
    path = Path(path)
    raw = path.read_bytes()
    # Sniffed, not taken from the suffix: a gunzipped file keeping its .gz name still loads.
    if raw[:2] == _GZIP_MAGIC:
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


def mnist(
    root: str | os.PathLike,
    train: bool = True,
    download: bool = False,
    normalize: bool = True,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> IDXDataset:
    """MNIST's train (60k) or test (10k) split from `root`; normalized with 0.1307 / 0.3081."""
    return _load(_MNIST, root, train, download, normalize, transform)


def fashion_mnist(
    root: str | os.PathLike | None = None,
    train: bool = True,
    download: bool = False,
    normalize: bool = True,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> IDXDataset:
    """Fashion-MNIST from `root` or Debian's /usr/share/datasets/fashion-mnist; 0.2860 / 0.3530."""
    return _load(_FASHION_MNIST, root, train, download, normalize, transform)


def _split_files(train: bool) -> tuple[str, str]:
    prefix = "train" if train else "t10k"
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def _search_dirs(spec: _Spec, root: str | os.PathLike | None) -> list[Path]:
    dirs = []
    if root is not None:
        root = Path(root).expanduser()
        dirs += [root / spec.name / "raw", root / "raw", root]
    return dirs + list(spec.fallback_dirs)


def _find_split_files(
    spec: _Spec, root: str | os.PathLike | None, train: bool
) -> tuple[Path, Path] | None:
    """The split's (images, labels) paths in the first folder holding both, else None."""
    return _scan(spec, root, train)[0]


def _scan(
    spec: _Spec, root: str | os.PathLike | None, train: bool
) -> tuple[tuple[Path, Path] | None, list[str]]:
    """(The split's paths or None, the folders passed over because they hold another dataset)."""
    passed_over = []
    for folder in _search_dirs(spec, root):
        found = []
        for stem in _split_files(train):
            # The uncompressed file first: torchvision leaves both, and it skips the gunzip.
            candidates = [folder / stem, folder / f"{stem}.gz"]
            found.append(next((p for p in candidates if p.is_file()), None))
        if not all(found):
            continue
        other = _other_dataset(spec, found[1], train)
        if other is None:
            return (found[0], found[1]), passed_over
        passed_over.append(f"{folder} holds {other}'s {'train' if train else 'test'} split")
    return None, passed_over


def _other_dataset(spec: _Spec, labels_path: Path, train: bool) -> str | None:
    """The name of the known dataset other than `spec` whose labels these are, else None."""
    first = _first_labels(labels_path)
    for other in _SPECS:
        known = other.first_labels[0 if train else 1]
        if other.name != spec.name and known and first == known:
            return other.name
    return None


def _first_labels(path: Path, n: int = 10) -> tuple[int, ...]:
    """The first `n` labels of an IDX labels file (empty if unreadable: read_idx reports it)."""
    try:
        with path.open("rb") as f:
            head = f.read(2)
        opener = gzip.open if head == _GZIP_MAGIC else open
        with opener(path, "rb") as f:
            data = f.read(8 + n)
    except (OSError, EOFError, zlib.error):
        return ()
    return tuple(data[8:])


def _load(spec, root, train, download, normalize, transform) -> IDXDataset:
    paths, passed_over = _scan(spec, root, train)
    if paths is None and download:
        if root is None:
            raise ValueError(f"{spec.name}: download=True needs a root folder to download into")
        _fetch(spec, Path(root).expanduser(), train)
        paths, passed_over = _scan(spec, root, train)
    if paths is None:
        names = " and ".join(f"{s}.gz" for s in _split_files(train))
        searched = ", ".join(str(d) for d in _search_dirs(spec, root)) or "(no root given)"
        skipped = "".join(f" (passed over: {note})" for note in passed_over)
        raise FileNotFoundError(
            f"{spec.name} {'train' if train else 'test'} split not found; looked in {searched}"
            f"{skipped}. Put {names} in <root>/{spec.name}/raw/ (or any folder passed as root), "
            "or pass download=True"
        )
    stats = {"mean": spec.mean, "std": spec.std} if normalize else {}
    return IDXDataset.from_files(*paths, num_classes=10, transform=transform, **stats)


def _fetch(spec: _Spec, root: Path, train: bool) -> Path:
    """Download the split's two files into root/<name>/raw/ (MD5-checked); return the folder."""
    dest = root / spec.name / "raw"
    try:
        # torchvision's mirror list is maintained upstream; ours is the fallback without it.
        import torchvision.datasets
    except ImportError:
        names = [f"{s}.gz" for s in _split_files(train)]
        download_files({n: spec.md5[n] for n in names}, spec.mirrors, dest)
        return dest
    try:
        getattr(torchvision.datasets, spec.name)(str(root), train=train, download=True)
    except Exception as e:  # noqa: BLE001 - every download failure gets the same advice
        raise DownloadError(
            f"could not download {spec.name} with torchvision ({type(e).__name__}: {e}). "
            f"Offline? Put the files from {spec.mirrors[0]} in {dest}/"
        ) from None
    return dest


def download_files(md5: dict[str, str], mirrors: Sequence[str], dest: Path) -> None:
    """Fetch each file name in `md5` from the first mirror that serves it intact, into dest."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DownloadError(
            f"cannot create {dest} to download into: {e.strerror or e}; choose a data folder "
            "you can write to"
        ) from None
    for name, expected in md5.items():
        if (dest / name).is_file() and _md5(dest / name) == expected:
            continue
        errors = []
        for mirror in mirrors:
            url = mirror.rstrip("/") + "/" + name
            try:
                _download(url, dest / name, expected)
                break
            # HTTPException: a connection closed mid-file (IncompleteRead) is not an OSError.
            except (OSError, ValueError, http.client.HTTPException) as e:
                errors.append(f"{url}: {_one_line(e)}")
        else:
            raise DownloadError(
                f"could not download {name} ({'; '.join(errors)}). "
                f"Offline? Put {', '.join(md5)} in {dest}/ (from {mirrors[0]})"
            )


def download_mnist(root: str | os.PathLike, mirrors: Sequence[str] | None = None) -> Path:
    """Fetch the MNIST files `root` lacks into root/MNIST/raw/ (MD5-checked); return that folder.

    `mirrors` are base URLs (https://, http:// or file://) tried in order; None means the
    standard ones. A split already found under `root` (any layout `mnist()` reads) is left alone.
    """
    dest = Path(root).expanduser() / _MNIST.name / "raw"
    missing = [
        f"{stem}.gz"
        for train in (True, False)
        if _find_split_files(_MNIST, root, train) is None
        for stem in _split_files(train)
    ]
    if missing:
        download_files({n: _MNIST.md5[n] for n in missing}, mirrors or _MNIST.mirrors, dest)
    return dest


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _download(url: str, path: Path, expected_md5: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with (
            os.fdopen(fd, "wb") as out,
            urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response,
        ):
            while chunk := response.read(1 << 20):
                out.write(chunk)
        got = _md5(Path(tmp))
        if got != expected_md5:
            raise ValueError(f"MD5 {got} does not match the expected {expected_md5}")
        # mkstemp's file is private (0600); a downloaded dataset gets the umask's usual mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        # Renamed only once verified, so a half-written file never looks like a dataset.
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()

"""MNIST and Fashion-MNIST: which IDX files they are, where they are found, and loading them.

    train_set = mnist("data")                  # data/MNIST/raw/, data/raw/ or data/
    test_set = fashion_mnist(train=False)      # also finds /usr/share/datasets/fashion-mnist
    download_mnist("data")                     # the files "data" lacks, MD5-checked
    str(survey_data_dir("data", "mnist"))      # "data holds MNIST's test split, but ... missing"

The two datasets share file names, so a folder is told apart by its first labels. `download=True`
fetches missing files (through torchvision when it imports, else from the standard mirrors
with data/download.py) and checks their MD5. Files are downloaded only into root/<name>/raw/ of
a root that holds none of the other dataset's files where this one's would be read: a folder of
Fashion-MNIST never gains an MNIST/raw/ subfolder.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddptrain.data.download import DownloadError, download_files
from ddptrain.data.idx import GZIP_MAGIC, IDXDataset

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


@dataclass(frozen=True)
class _Spec:
    name: str  # torchvision's class and folder name: root/<name>/raw/
    title: str  # the name users know it by, in messages
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
    "Fashion-MNIST",
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
_SPEC_NAMES = {"mnist": "_MNIST", "fashion-mnist": "_FASHION_MNIST"}


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
    *,
    fallback: bool = True,
) -> IDXDataset:
    """Fashion-MNIST from `root`, then (unless fallback=False) Debian's
    /usr/share/datasets/fashion-mnist; normalized with 0.2860 / 0.3530."""
    return _load(_FASHION_MNIST, root, train, download, normalize, transform, fallback)


def _split_files(train: bool) -> tuple[str, str]:
    prefix = "train" if train else "t10k"
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def _search_dirs(spec: _Spec, root: str | os.PathLike | None, fallback: bool = True) -> list[Path]:
    dirs = []
    if root is not None:
        root = Path(root).expanduser()
        dirs += [root / spec.name / "raw", root / "raw", root]
    return dirs + list(spec.fallback_dirs if fallback else ())


def _find_split_files(
    spec: _Spec, root: str | os.PathLike | None, train: bool
) -> tuple[Path, Path] | None:
    """The split's (images, labels) paths in the first folder holding both, else None."""
    return _scan(spec, root, train)[0]


def _scan(
    spec: _Spec, root: str | os.PathLike | None, train: bool, fallback: bool = True
) -> tuple[tuple[Path, Path] | None, list[tuple[Path, str]]]:
    """(The split's paths or None, [(folder passed over, the other dataset's title it holds)])."""
    passed_over = []
    for folder in _search_dirs(spec, root, fallback):
        found = [_split_file(folder, stem) for stem in _split_files(train)]
        if not all(found):
            continue
        other = _other_dataset(spec, found[1], train)
        if other is None:
            return (found[0], found[1]), passed_over
        passed_over.append((folder, other))
    return None, passed_over


def _split_file(folder: Path, stem: str) -> Path | None:
    # The uncompressed file first: torchvision leaves both, and it skips the gunzip.
    return next((p for p in (folder / stem, folder / f"{stem}.gz") if p.is_file()), None)


@dataclass(frozen=True)
class DataDirSurvey:
    """What a folder holds of one dataset, in the layouts its loader reads (no fallback folder);
    str() says it in words for an error message."""

    root: Path
    dataset: str  # the title: "MNIST" or "Fashion-MNIST"
    splits: tuple[str, ...]  # its complete splits found: "train", "test"
    other: str | None  # the other dataset's title, where its split lies in this one's place
    other_splits: tuple[str, ...]
    present: tuple[str, ...]  # files found of splits that are incomplete
    missing: tuple[str, ...]  # files of splits neither found nor taken by the other dataset

    def __str__(self) -> str:
        root = self.root
        if not root.exists():
            return f"{root} does not exist"
        if not root.is_dir():
            return f"{root} is a file, not a folder"
        held = list(self.present)
        if self.splits:
            held.insert(0, f"{self.dataset}'s {_splits(self.splits)}")
        if self.other_splits:
            held.insert(0, f"{self.other}'s {_splits(self.other_splits)}")
        if not held:
            entries = sorted(e.name + "/" * e.is_dir() for e in root.iterdir())
            if not entries:
                return f"{root} is empty"
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            return f"{root} holds none of {self.dataset}'s IDX files (only {shown})"
        text = f"{root} holds {_and(held)}"
        if self.other_splits:
            text += f", not {self.dataset}'s"
        if self.missing:
            text += (
                f", but {_and(self.missing)} {'is' if len(self.missing) == 1 else 'are'} missing"
            )
        return text


def survey_data_dir(root: str | os.PathLike, dataset: str) -> DataDirSurvey:
    """What `root` holds of `dataset` ("mnist" or "fashion-mnist"), ignoring fallback folders."""
    # Looked up at call time, so a test's replaced spec (other mirrors, fallbacks) is the one used.
    return _survey(globals()[_SPEC_NAMES[dataset]], root)


def _survey(spec: _Spec, root: str | os.PathLike) -> DataDirSurvey:
    root = Path(root).expanduser()
    splits, other, other_splits, present, missing = [], None, [], [], []
    for train in (True, False):
        split = "train" if train else "test"
        paths, passed_over = _scan(spec, root, train, fallback=False)
        if paths is not None:
            splits.append(split)
        elif passed_over:
            other = passed_over[0][1]
            other_splits.append(split)
        else:
            for stem in _split_files(train):
                found = [_split_file(d, stem) for d in _search_dirs(spec, root, fallback=False)]
                found = [f for f in found if f is not None]
                if found:
                    present.append(found[0].name)
                else:
                    missing.append(f"{stem}.gz")
    return DataDirSurvey(
        root, spec.title, tuple(splits), other, tuple(other_splits), tuple(present), tuple(missing)
    )


def _splits(splits: Sequence[str]) -> str:
    return f"{' and '.join(splits)} split{'s' if len(splits) > 1 else ''}"


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _other_dataset(spec: _Spec, labels_path: Path, train: bool) -> str | None:
    """The name of the known dataset other than `spec` whose labels these are, else None."""
    first = _first_labels(labels_path)
    for other in _SPECS:
        known = other.first_labels[0 if train else 1]
        if other.name != spec.name and known and first == known:
            return other.title
    return None


def _first_labels(path: Path, n: int = 10) -> tuple[int, ...]:
    """The first `n` labels of an IDX labels file (empty if unreadable: read_idx reports it)."""
    try:
        with path.open("rb") as f:
            head = f.read(2)
        opener = gzip.open if head == GZIP_MAGIC else open
        with opener(path, "rb") as f:
            data = f.read(8 + n)
    except (OSError, EOFError, zlib.error):
        return ()
    return tuple(data[8:])


def _load(spec, root, train, download, normalize, transform, fallback=True) -> IDXDataset:
    paths, passed_over = _scan(spec, root, train, fallback)
    if paths is None and download:
        if root is None:
            raise ValueError(f"{spec.title}: download=True needs a root folder to download into")
        _fetch(spec, Path(root).expanduser(), train)
        paths, passed_over = _scan(spec, root, train, fallback)
    if paths is None:
        split = "train" if train else "test"
        names = " and ".join(f"{s}.gz" for s in _split_files(train))
        searched = ", ".join(str(d) for d in _search_dirs(spec, root, fallback))
        # What root holds says it all for root's own folders; a fallback folder passed over
        # (it holds the other dataset) is named apart.
        held = f": {_survey(spec, root)}" if root is not None else ""
        fallbacks = spec.fallback_dirs if fallback else ()
        skipped = "".join(
            f" (passed over: {folder} holds {other}'s {split} split)"
            for folder, other in passed_over
            if folder in fallbacks
        )
        raise FileNotFoundError(
            f"{spec.title} {split} split not found; looked in {searched or '(no root given)'}"
            f"{held}{skipped}. Put {names} in <root>/{spec.name}/raw/ (or any folder passed as "
            "root), or pass download=True"
        )
    stats = {"mean": spec.mean, "std": spec.std} if normalize else {}
    return IDXDataset.from_files(*paths, num_classes=10, transform=transform, **stats)


def _check_download_root(spec: _Spec, root: str | os.PathLike) -> None:
    """Refuse to download into a root that holds the other dataset where this one's goes."""
    survey = _survey(spec, root)
    if survey.other_splits:
        raise FileNotFoundError(
            f"{survey}; {spec.title} is downloaded only into a folder that holds no other "
            f"dataset: load this one as {survey.other}, or choose another folder for {spec.title}"
        )


def _fetch(spec: _Spec, root: Path, train: bool) -> Path:
    """Download the split's two files into root/<name>/raw/ (MD5-checked); return the folder."""
    _check_download_root(spec, root)
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


def download_mnist(root: str | os.PathLike, mirrors: Sequence[str] | None = None) -> Path:
    """Fetch the MNIST files `root` lacks into root/MNIST/raw/ (MD5-checked); return that folder.

    `mirrors` are base URLs (https://, http:// or file://) tried in order; None means the
    standard ones. A split already found under `root` (any layout `mnist()` reads) is left alone;
    a root holding Fashion-MNIST where MNIST's files would be read is refused, untouched.
    """
    dest = Path(root).expanduser() / _MNIST.name / "raw"
    missing = [
        f"{stem}.gz"
        for train in (True, False)
        if _find_split_files(_MNIST, root, train) is None
        for stem in _split_files(train)
    ]
    if missing:
        _check_download_root(_MNIST, root)
        download_files({n: _MNIST.md5[n] for n in missing}, mirrors or _MNIST.mirrors, dest)
    return dest

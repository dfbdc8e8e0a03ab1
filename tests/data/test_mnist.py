"""IDX reading, MNIST-format datasets, folder layouts and the offline-safe downloader."""

import dataclasses
import gzip
import hashlib
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import ddptrain.data.datasets
from ddptrain.data.datasets import (
    DEBIAN_FASHION_MNIST,
    download_mnist,
    fashion_mnist,
    mnist,
    survey_data_dir,
)
from ddptrain.data.download import download_files
from ddptrain.data.idx import IDXDataset, IDXFormatError, read_idx
from support.idx_files import MNIST_ROOT, MNIST_TEST_LABEL_COUNTS, idx_bytes, write_split

needs_mnist = pytest.mark.skipif(
    not (MNIST_ROOT / "MNIST/raw").is_dir(), reason=f"shared MNIST not found at {MNIST_ROOT}"
)
needs_debian_fashion = pytest.mark.skipif(
    not DEBIAN_FASHION_MNIST.is_dir(), reason=f"{DEBIAN_FASHION_MNIST} not installed"
)


@needs_mnist
def test_shared_mnist_test_split_loads_with_the_known_label_counts():
    """The real 10k test split: shapes, dtypes, label counts, first label 7, bulk normalization."""
    ds = mnist(MNIST_ROOT, train=False)
    assert len(ds) == 10_000
    assert ds.images.dtype == torch.uint8 and ds.images.shape == (10_000, 28, 28)
    assert ds.targets.dtype == torch.int64
    assert torch.bincount(ds.targets).tolist() == MNIST_TEST_LABEL_COUNTS
    x, y = ds[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and int(y) == 7
    torch.testing.assert_close(x, (ds.images[:1].float() / 255 - 0.1307) / 0.3081)


@pytest.mark.parametrize("layout", ["MNIST/raw", "raw", "."])
@pytest.mark.parametrize("gz", [True, False])
def test_root_may_hold_MNIST_raw_or_be_raw_or_a_flat_folder(tmp_path, layout, gz):
    """torchvision's root/MNIST/raw/, root/raw/ and a flat root all load, .gz or not."""
    write_split(tmp_path / layout, "train", 30, gz=gz)
    write_split(tmp_path / layout, "t10k", 20, gz=gz)
    assert len(mnist(tmp_path, train=True)) == 30
    assert len(mnist(tmp_path, train=False)) == 20


def test_read_idx_reads_gz_and_raw_files_identically(tmp_path):
    """read_idx returns the header's shape and exact bytes, gzipped or not, whatever the name."""
    t = torch.randint(0, 256, (5, 3, 4), dtype=torch.uint8)
    (tmp_path / "a").write_bytes(idx_bytes(t))
    (tmp_path / "a.gz").write_bytes(gzip.compress(idx_bytes(t)))
    assert torch.equal(read_idx(tmp_path / "a"), t)
    assert torch.equal(read_idx(tmp_path / "a.gz"), t)
    (tmp_path / "b.gz").write_bytes(idx_bytes(t))
    assert torch.equal(read_idx(tmp_path / "b.gz"), t), "gunzipped but still named .gz"


def _corrupt(tmp_path: Path, how: str) -> Path:
    good = idx_bytes(torch.zeros(10, 28, 28, dtype=torch.uint8))
    path = tmp_path / "train-images-idx3-ubyte"
    if how == "truncated data":
        path.write_bytes(good[:-100])
    elif how == "truncated header":
        path.write_bytes(good[:10])
    elif how == "trailing bytes":
        path.write_bytes(good + b"\0")
    elif how == "not IDX":
        path.write_bytes(b"<html>Service Unavailable</html>")
    elif how == "not uint8":
        path.write_bytes(good[:2] + b"\x0d" + good[3:])
    elif how == "labels as images":
        path.write_bytes(idx_bytes(torch.zeros(10, dtype=torch.uint8)))
    elif how == "truncated gz":
        path = path.with_suffix(".gz")
        path.write_bytes(gzip.compress(good)[:-20])
    return path


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated data", r"truncated: header says 10x28x28 = 7840 bytes of data, found 7740"),
        ("truncated header", r"truncated inside its 16-byte header"),
        ("trailing bytes", r"longer than its header says"),
        ("not IDX", r"not an IDX file"),
        ("not uint8", r"data type 0x0d is not uint8"),
        ("labels as images", r"magic number 0x00000801 but expected 0x00000803"),
        ("truncated gz", r"not a complete gzip file"),
    ],
)
def test_corrupt_or_truncated_files_are_a_clear_error_naming_the_file(tmp_path, how, message):
    """Every malformed file raises IDXFormatError whose message starts with its path."""
    path = _corrupt(tmp_path, how)
    with pytest.raises(IDXFormatError, match=message) as info:
        read_idx(path, magic=0x0803)
    assert str(info.value).startswith(f"{path}: ")


@needs_mnist
def test_a_truncated_copy_of_real_mnist_is_refused_by_mnist(tmp_path):
    """mnist() on a cut-short real download names the broken file."""
    raw = tmp_path / "MNIST/raw"
    raw.mkdir(parents=True)
    for name in ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]:
        data = (MNIST_ROOT / "MNIST/raw" / name).read_bytes()
        (raw / name).write_bytes(data[: len(data) // 2] if "images" in name else data)
    with pytest.raises(IDXFormatError, match="t10k-images-idx3-ubyte.gz: not a complete gzip"):
        mnist(tmp_path, train=False)


def test_images_and_labels_of_different_lengths_are_refused(tmp_path):
    """An images file and a labels file that disagree on N name both files."""
    write_split(tmp_path, "train", 30)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(idx_bytes(torch.zeros(29, dtype=torch.uint8))))
    with pytest.raises(IDXFormatError, match="30 images but .*29 labels"):
        mnist(tmp_path)


def test_missing_files_say_where_to_put_them(tmp_path):
    """Without files and without download the error lists the folders and the file names."""
    with pytest.raises(FileNotFoundError, match=r"Put train-images-idx3-ubyte.gz and") as info:
        mnist(tmp_path)
    assert str(tmp_path / "MNIST/raw") in str(info.value)


@pytest.fixture
def offline(monkeypatch):
    """No torchvision and a URL opener that fails, as on a machine without network."""
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    calls = []

    def refuse(url, *args, **kwargs):
        calls.append(url)
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    return calls


def test_download_offline_fails_with_one_clear_message(tmp_path, offline):
    """download=True with no network: one RuntimeError naming the mirrors and the folder."""
    with pytest.raises(RuntimeError, match="Offline\\? Put train-images-idx3-ubyte.gz") as info:
        mnist(tmp_path, download=True)
    message = str(info.value)
    assert str(tmp_path / "MNIST/raw") in message and "network is unreachable" in message
    assert offline == [
        "https://ossci-datasets.s3.amazonaws.com/mnist/train-images-idx3-ubyte.gz",
        "http://yann.lecun.com/exdb/mnist/train-images-idx3-ubyte.gz",
    ]
    assert list((tmp_path / "MNIST/raw").iterdir()) == []


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_download_files_checks_md5_and_falls_back_to_the_next_mirror(tmp_path):
    """A mirror serving a corrupt file is skipped; a file is kept only when its MD5 matches."""
    write_split(tmp_path / "good", "t10k", 10)
    write_split(tmp_path / "bad", "t10k", 10, seed=1)
    name = "t10k-images-idx3-ubyte.gz"
    md5 = _md5(tmp_path / "good" / name)
    dest = tmp_path / "dest"
    mirrors = [(tmp_path / d).as_uri() + "/" for d in ["missing", "bad", "good"]]

    download_files({name: md5}, mirrors, dest)
    assert _md5(dest / name) == md5

    (dest / name).unlink()
    with pytest.raises(RuntimeError, match=f"MD5 .* does not match the expected {md5}"):
        download_files({name: md5}, mirrors[:2], dest)
    assert list(dest.iterdir()) == []


def _serve_split(tmp_path: Path, monkeypatch, prefix: str, n: int) -> dict[str, str]:
    """A file:// mirror of a synthetic split as mnist()'s only mirror, without torchvision;
    returns the files' MD5s."""
    monkeypatch.setitem(sys.modules, "torchvision", None)
    server = tmp_path / "server"
    write_split(server, prefix, n)
    md5 = {p.name: _md5(p) for p in server.iterdir()}
    mirrors = (server.as_uri() + "/",)
    spec = dataclasses.replace(ddptrain.data.datasets._MNIST, mirrors=mirrors, md5=md5)
    monkeypatch.setattr(ddptrain.data.datasets, "_MNIST", spec)
    return md5


def test_download_true_fetches_then_loads_the_split(tmp_path, monkeypatch):
    """mnist(root, download=True) downloads into root/MNIST/raw/ and loads what it fetched."""
    md5 = _serve_split(tmp_path, monkeypatch, "train", 40)
    ds = mnist(tmp_path / "root", download=True)
    assert len(ds) == 40
    assert sorted(p.name for p in (tmp_path / "root/MNIST/raw").iterdir()) == sorted(md5)


def test_download_true_expands_a_tilde_in_root(tmp_path, monkeypatch):
    """mnist("~/data", download=True) fetches into $HOME/data, not into a folder named "~"."""
    _serve_split(tmp_path, monkeypatch, "t10k", 20)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert len(mnist("~/data", train=False, download=True)) == 20
    assert (tmp_path / "home/data/MNIST/raw/t10k-labels-idx1-ubyte.gz").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []


# The first ten labels of each real split, as ddptrain.data.datasets tells the two datasets apart.
MNIST_FIRST = {"train": (5, 0, 4, 1, 9, 2, 1, 3, 1, 4), "t10k": (7, 2, 1, 0, 4, 1, 4, 9, 5, 9)}
FASHION_FIRST = {"train": (9, 0, 0, 3, 0, 2, 7, 2, 5, 5), "t10k": (9, 2, 1, 1, 6, 1, 4, 6, 5, 7)}


@pytest.mark.parametrize("prefix", ["train", "t10k"])
@pytest.mark.parametrize("wanted", ["mnist", "fashion"])
def test_a_folder_holding_the_other_dataset_is_passed_over(tmp_path, monkeypatch, prefix, wanted):
    """A root holding the other dataset's split is skipped for a later folder, or named if none."""
    # MNIST and Fashion-MNIST share file names.
    load, other_first, own_first = {
        "mnist": (mnist, FASHION_FIRST, MNIST_FIRST),
        "fashion": (fashion_mnist, MNIST_FIRST, FASHION_FIRST),
    }[wanted]
    own = tmp_path / "own"
    write_split(own, prefix, 30, first_labels=own_first[prefix])
    spec_name = "_MNIST" if wanted == "mnist" else "_FASHION_MNIST"
    spec = getattr(ddptrain.data.datasets, spec_name)
    monkeypatch.setattr(
        ddptrain.data.datasets, spec_name, dataclasses.replace(spec, fallback_dirs=(own,))
    )
    write_split(tmp_path / "root", prefix, 20, first_labels=other_first[prefix])
    train = prefix == "train"
    ds = load(tmp_path / "root", train=train)
    assert len(ds) == 30 and ds.paths[1].parent == own

    shutil.rmtree(own)
    with pytest.raises(FileNotFoundError) as info:
        load(tmp_path / "root", train=train)
    other_name, own_name = (
        ("Fashion-MNIST", "MNIST") if wanted == "mnist" else ("MNIST", "Fashion-MNIST")
    )
    split = "train" if train else "test"
    held = f"{tmp_path / 'root'} holds {other_name}'s {split} split, not {own_name}'s"
    assert held in str(info.value)


@needs_mnist
@needs_debian_fashion
def test_fashion_mnist_never_takes_mnists_files_from_the_data_dir(tmp_path):
    """Real MNIST test files in the data dir: fashion_mnist() still loads Fashion-MNIST's split."""
    for name in ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]:
        shutil.copy(MNIST_ROOT / "MNIST/raw" / name, tmp_path)
    assert mnist(tmp_path, train=False).targets[:10].tolist() == list(MNIST_FIRST["t10k"])
    ds = fashion_mnist(tmp_path, train=False)
    assert ds.targets[:10].tolist() == list(FASHION_FIRST["t10k"])
    assert ds.paths[1].parent == DEBIAN_FASHION_MNIST


@needs_debian_fashion
def test_fashion_mnist_finds_the_debian_folder_by_itself(tmp_path):
    """With no root, or a root without the files, Fashion-MNIST loads from /usr/share/datasets."""
    for root in [None, tmp_path]:
        ds = fashion_mnist(root, train=False)
        assert len(ds) == 10_000
        assert torch.bincount(ds.targets).tolist() == [1000] * 10


def test_loader_batches_equal_stacked_samples_and_transforms_apply_per_sample(tmp_path):
    """DataLoader batches equal the stacked ds[i]; a transform sees each [1, 28, 28] image."""
    write_split(tmp_path, "train", 30)
    ds = mnist(tmp_path)
    x, y = next(iter(DataLoader(ds, batch_size=8)))
    assert torch.equal(x, torch.stack([ds[i][0] for i in range(8)]))
    assert torch.equal(y, ds.targets[:8]) and y.dtype == torch.int64

    seen = []
    flipped = mnist(tmp_path, transform=lambda img: seen.append(img.shape) or img.flip(-1))
    x, _ = next(iter(DataLoader(flipped, batch_size=8)))
    assert torch.equal(x, ds.data[:8].flip(-1)) and seen == [(1, 28, 28)] * 8


def test_normalize_false_gives_pixels_in_zero_one(tmp_path):
    """normalize=False scales to [0, 1] like ToTensor, without mean/std."""
    write_split(tmp_path, "train", 10)
    ds = mnist(tmp_path, normalize=False)
    assert torch.equal(ds.data, ds.images.unsqueeze(1).float() / 255)


def test_idx_dataset_rejects_images_that_are_not_uint8_nhw():
    """IDXDataset wants uint8 [N, H, W] images and one target per image."""
    with pytest.raises(ValueError, match="uint8"):
        IDXDataset(torch.zeros(2, 28, 28), torch.zeros(2))
    with pytest.raises(ValueError, match="2 images but 3 targets"):
        IDXDataset(torch.zeros(2, 28, 28, dtype=torch.uint8), torch.zeros(3))


def _survey_case(root: Path, case: str) -> None:
    if case == "file":
        root.write_text("not a folder")
    elif case != "missing":
        root.mkdir()
    if case == "other files":
        (root / "notes.txt").write_text("x")
        (root / "sub").mkdir()
    elif case == "fashion":
        write_split(root, "train", 20, first_labels=FASHION_FIRST["train"])
        write_split(root, "t10k", 10, first_labels=FASHION_FIRST["t10k"])
    elif case == "mnist test split":
        write_split(root / "MNIST/raw", "t10k", 10, first_labels=MNIST_FIRST["t10k"])
    elif case == "half a split":
        write_split(root / "raw", "t10k", 10, first_labels=MNIST_FIRST["t10k"], gz=False)
        (root / "raw/t10k-labels-idx1-ubyte").unlink()


_TRAIN_FILES = "train-images-idx3-ubyte.gz and train-labels-idx1-ubyte.gz are missing"


@pytest.mark.parametrize(
    "case, said",
    [
        ("missing", "does not exist"),
        ("file", "is a file, not a folder"),
        ("empty", "is empty"),
        ("other files", "holds none of MNIST's IDX files (only notes.txt, sub/)"),
        ("fashion", "holds Fashion-MNIST's train and test splits, not MNIST's"),
        ("mnist test split", f"holds MNIST's test split, but {_TRAIN_FILES}"),
        (
            "half a split",
            "holds t10k-images-idx3-ubyte, but train-images-idx3-ubyte.gz, "
            "train-labels-idx1-ubyte.gz and t10k-labels-idx1-ubyte.gz are missing",
        ),
    ],
)
def test_survey_says_what_a_folder_holds_of_mnist(tmp_path, case, said):
    """survey_data_dir says what a folder holds of MNIST, naming the files a partial split lacks."""
    root = tmp_path / "root"
    _survey_case(root, case)
    assert str(survey_data_dir(root, "mnist")) == f"{root} {said}"


def test_a_folder_holding_fashion_mnist_is_never_downloaded_into(tmp_path, offline):
    """MNIST downloads refuse a Fashion-MNIST folder before touching the network or the disk."""
    root = tmp_path / "fashion"
    _survey_case(root, "fashion")
    before = sorted(root.rglob("*"))
    for call in (lambda: download_mnist(root), lambda: mnist(root, download=True)):
        with pytest.raises(FileNotFoundError) as info:
            call()
        assert str(info.value).startswith(f"{root} holds Fashion-MNIST's train and test splits")
        assert "downloaded only into a folder that holds no other dataset" in str(info.value)
    assert sorted(root.rglob("*")) == before and offline == []


def test_fashion_mnist_reads_only_root_without_fallback(tmp_path, monkeypatch):
    """fallback=False: a root lacking the files is an error saying what it holds; no fallback."""
    system = tmp_path / "system"
    write_split(system, "t10k", 10, first_labels=FASHION_FIRST["t10k"])
    spec = dataclasses.replace(ddptrain.data.datasets._FASHION_MNIST, fallback_dirs=(system,))
    monkeypatch.setattr(ddptrain.data.datasets, "_FASHION_MNIST", spec)
    (tmp_path / "empty").mkdir()
    assert fashion_mnist(tmp_path / "empty", train=False).paths[1].parent == system
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'empty'} is empty") as info:
        fashion_mnist(tmp_path / "empty", train=False, fallback=False)
    assert str(system) not in str(info.value)

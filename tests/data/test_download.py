"""download_mnist against mirrors on this machine (HTTP on 127.0.0.1, file://), not the network."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import ddptrain.data.datasets
from ddptrain.data.datasets import download_mnist, mnist
from ddptrain.data.download import DownloadError, download_files
from support.idx_files import (
    MNIST_ROOT,
    MNIST_TEST_LABEL_COUNTS,
    closed_port_url,
    serve_folder,
    write_split,
)

REAL_RAW = MNIST_ROOT / "MNIST/raw"
needs_mnist = pytest.mark.skipif(not REAL_RAW.is_dir(), reason=f"shared MNIST not at {REAL_RAW}")
T10K = ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]


def _files(folder: Path) -> list[str]:
    """Every file in folder, hidden temporaries included."""
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@needs_mnist
def test_download_mnist_fetches_only_the_missing_split_over_http(tmp_path):
    """With the train split present, only the real test split is fetched, MD5-checked, and loads."""
    write_split(tmp_path / "data", "train", 20)
    with serve_folder(REAL_RAW) as url:
        dest = download_mnist(tmp_path / "data", [url])
    assert dest == tmp_path / "data/MNIST/raw" and _files(dest) == T10K
    umask = os.umask(0)
    os.umask(umask)
    assert {(dest / n).stat().st_mode & 0o777 for n in T10K} == {0o666 & ~umask}
    test_set = mnist(tmp_path / "data", train=False)
    assert test_set.targets.bincount().tolist() == MNIST_TEST_LABEL_COUNTS


@needs_mnist
def test_a_download_cut_short_is_refused_and_leaves_no_file(tmp_path):
    """A mirror that closes the connection mid-file gives one DownloadError and an empty folder."""
    write_split(tmp_path / "data", "train", 20)
    with serve_folder(REAL_RAW, cut_at=1000) as url, pytest.raises(DownloadError) as info:
        download_mnist(tmp_path / "data", [url])
    message = str(info.value)
    assert "could not download t10k-images-idx3-ubyte.gz" in message and "\n" not in message
    assert _files(tmp_path / "data/MNIST/raw") == []


def test_a_corrupt_download_never_takes_the_files_name(tmp_path, monkeypatch):
    """A file with the wrong MD5 is deleted: nothing in dest can later pass as the dataset."""
    write_split(tmp_path / "mirror", "t10k", 10)
    md5 = {name: "0" * 32 for name in T10K}
    spec = ddptrain.data.datasets._MNIST
    monkeypatch.setattr(ddptrain.data.datasets, "_MNIST", type(spec)(**{**vars(spec), "md5": md5}))
    write_split(tmp_path / "data", "train", 20)
    with pytest.raises(DownloadError, match="MD5 [0-9a-f]{32} does not match the expected 0{32}"):
        download_mnist(tmp_path / "data", [(tmp_path / "mirror").as_uri()])
    assert _files(tmp_path / "data/MNIST/raw") == []


def test_offline_is_one_line_naming_the_files_and_the_folder(tmp_path):
    """No mirror reachable: one line, every missing file and the folder to put them in."""
    with pytest.raises(DownloadError) as info:
        download_mnist(tmp_path, [closed_port_url()])
    message = str(info.value)
    assert "\n" not in message
    assert "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, " in message
    assert f"t10k-labels-idx1-ubyte.gz in {tmp_path / 'MNIST/raw'}/" in message
    assert _files(tmp_path / "MNIST/raw") == []


def test_files_already_present_are_not_fetched(tmp_path):
    """A split found under root in any layout mnist() reads means no download at all."""
    write_split(tmp_path, "train", 10)
    write_split(tmp_path / "raw", "t10k", 10)
    download_mnist(tmp_path, [closed_port_url()])
    assert not (tmp_path / "MNIST").exists()


@needs_mnist
def test_a_verified_file_is_kept_and_not_fetched_again(tmp_path):
    """download_files skips a file whose MD5 already matches, so a rerun needs no mirror."""
    dest = tmp_path / "raw"
    dest.mkdir()
    shutil.copy(REAL_RAW / T10K[1], dest)
    md5 = {T10K[1]: ddptrain.data.datasets._MNIST.md5[T10K[1]]}
    download_files(md5, [closed_port_url()], dest)
    assert _files(dest) == [T10K[1]]

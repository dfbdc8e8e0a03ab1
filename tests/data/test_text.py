"""Byte windows of text files (ddptrain/data/text.py): which files are read, a held-out split
by file that is deterministic and disjoint, and windows whose targets are the next bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from ddptrain.data.text import ByteWindows, read_bytes, split_by_file, text_files


@pytest.fixture
def tree(tmp_path) -> Path:
    for rel in ("a.py", "b.py", "pkg/c.py", "pkg/d.txt", "pkg/test/e.py", "tests/f.py"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode() * 3)
    for i in range(20):
        (tmp_path / "many").mkdir(exist_ok=True)
        (tmp_path / "many" / f"m{i:02}.py").write_bytes(b"x" * (i + 1))
    return tmp_path


def test_text_files_match_the_pattern_and_skip_excluded_folders(tree):
    """A folder gives its glob matches, sorted, outside excluded folders; a file gives itself."""
    names = [f.relative_to(tree).as_posix() for f in text_files(tree, "*.py", ("test", "tests"))]
    assert names[:3] == ["a.py", "b.py", "many/m00.py"] and names[-1] == "pkg/c.py"
    assert len(names) == 23
    assert text_files(tree / "a.py") == [tree / "a.py"]
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        text_files(tree / "missing")


def test_the_split_is_by_file_disjoint_and_the_same_for_any_listing_order(tree):
    """The parts are disjoint and cover every file; a seed splits alike in any listing order."""
    files = text_files(tree, "*.py")
    train, val = split_by_file(files, tree, val_fraction=0.2, seed=7)
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(files)
    assert len(val) == round(0.2 * len(files))
    assert split_by_file(list(reversed(files)), tree, 0.2, seed=7) == (train, val)
    assert split_by_file(files, tree, 0.2, seed=8)[1] != val


def test_a_tiny_fraction_still_holds_one_file_out_and_one_file_is_refused(tree):
    """At least one file is held out, at least one kept; a single file cannot be split."""
    files = text_files(tree, "*.py")[:3]
    assert [len(part) for part in split_by_file(files, tree, 0.001, seed=0)] == [2, 1]
    assert [len(part) for part in split_by_file(files, tree, 0.99, seed=0)] == [1, 2]
    with pytest.raises(ValueError, match="at least 2 files"):
        split_by_file(files[:1], tree, 0.1, seed=0)


def test_windows_predict_the_next_byte_and_batches_match_collate():
    """Window i is bytes [i*T, i*T+T] as x, y shifted by one; get_batch equals default_collate."""
    data = torch.arange(50, dtype=torch.uint8)
    ds = ByteWindows(data, block_size=8)
    assert len(ds) == 6  # (50 - 1) // 8
    x, y = ds[2]
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    assert x.dtype == torch.long
    got = ds.get_batch([5, 0, 3])
    want = default_collate([ds[i] for i in (5, 0, 3)])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_max_windows_spreads_them_over_the_text():
    """max_windows picks that many windows from the first to the last, evenly."""
    ds = ByteWindows(torch.arange(201, dtype=torch.uint8), block_size=10, max_windows=3)
    assert [int(ds[i][0][0]) for i in range(len(ds))] == [0, 100, 190]
    with pytest.raises(ValueError, match="5 bytes hold no window of 9"):
        ByteWindows(torch.zeros(5, dtype=torch.uint8), block_size=8)


def test_read_bytes_concatenates_the_files_in_order(tree):
    """read_bytes is the files' bytes, one after another."""
    files = [tree / "b.py", tree / "a.py"]
    assert bytes(read_bytes(files).tolist()) == b"b.pyb.pyb.pya.pya.pya.py"

"""Verified downloads: each file from the first mirror that serves it intact (MD5-checked).

    download_files({"t10k-labels-idx1-ubyte.gz": md5}, ["file:///srv/mirror/"], Path("raw"))

A file is written under a temporary name and renamed only once its MD5 matches, so a half-done
download never looks like data. Every failure is one DownloadError line with the fix: the
files to fetch by hand and where to put them, or a folder that can be written.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ddptrain.paths import mkdir_problem

_DOWNLOAD_TIMEOUT_S = 30.0


class DownloadError(RuntimeError):
    """A dataset file could not be fetched intact; the one-line message says where to put it."""


def download_files(md5: dict[str, str], mirrors: Sequence[str], dest: Path) -> None:
    """Fetch each file name in `md5` from the first mirror that serves it intact, into dest."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DownloadError(
            f"cannot create {dest} to download into: {mkdir_problem(dest, e)}; choose a data "
            "folder you can write to"
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

"""The docs' relative links land on files that exist, and docs/bench holds only what they cite."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) where target is not a URL or a bare #anchor.
LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s#]+)(?:#[^)\s]*)?\)")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _links(doc: Path) -> list[Path]:
    text = FENCED.sub("", doc.read_text())
    return [(doc.parent / target).resolve() for target in LINK.findall(text)]


def test_relative_links_point_at_existing_files():
    """Every relative link in README.md and docs/*.md names a file or folder that exists."""
    missing = [
        f"{doc.relative_to(ROOT)} -> {target}"
        for doc in DOCS
        for target in _links(doc)
        if not target.exists()
    ]
    assert len(DOCS) > 3, "the docs were not found"
    assert not missing, "broken links: " + "; ".join(missing)


def test_every_file_in_docs_bench_is_cited_and_there_are_at_most_30():
    """docs/bench keeps only the raw results the docs cite, and no more than 30 files."""
    cited = {target for doc in DOCS for target in _links(doc)}
    files = [p for p in (ROOT / "docs" / "bench").rglob("*") if p.is_file()]
    uncited = [str(p.relative_to(ROOT)) for p in files if p.resolve() not in cited]
    assert files, "docs/bench is empty"
    assert not uncited, "not cited by any doc (delete them; git keeps the history): " + ", ".join(
        uncited
    )
    assert len(files) <= 30


def test_anchors_in_links_between_docs_name_a_heading():
    """A link to another doc's #anchor names one of that doc's headings."""
    anchors = {
        doc.resolve(): {_slug(h) for h in re.findall(r"^#+ (.*)$", doc.read_text(), re.M)}
        for doc in DOCS
    }
    wrong = []
    for doc in DOCS:
        text = FENCED.sub("", doc.read_text())
        for target, anchor in re.findall(r"\]\(([^)\s#]+\.md)#([^)\s]+)\)", text):
            if anchor not in anchors.get((doc.parent / target).resolve(), set()):
                wrong.append(f"{doc.relative_to(ROOT)} -> {target}#{anchor}")
    assert not wrong, "no such heading: " + "; ".join(wrong)

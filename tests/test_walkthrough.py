"""docs/walkthrough.md stays true: its line links land on what they name, and its script runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "walkthrough.md"
# [`name`](../path/to/file.py#L123): the line must contain `name`.
LINK = re.compile(r"\[`([^`]+)`\]\((\.\./[^)#]+)#L(\d+)\)")


def test_line_links_point_at_the_lines_they_name():
    """Every [`name`](../file.py#Lnn) link in the walkthrough lands on a line containing name."""
    links = LINK.findall(DOC.read_text())
    assert len(links) >= 15, "the walkthrough's line links were not found"
    wrong = []
    for name, target, line in links:
        lines = (DOC.parent / target).read_text().splitlines()
        if int(line) > len(lines) or name not in lines[int(line) - 1]:
            wrong.append(f"{target}#L{line} does not contain {name!r}")
    assert not wrong, "update the #L anchors in docs/walkthrough.md: " + "; ".join(wrong)


@pytest.mark.slow
def test_walkthrough_script_runs_and_all_rungs_agree(tmp_path):
    """The page's python blocks, run in order as one script, train every rung to equal weights."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    script = tmp_path / "walk.py"
    script.write_text("\n".join(blocks))
    root = str(DOC.parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rungs agree bitwise" in done.stdout

"""docs/walkthrough.md stays true: the code it names exists where it says, and its script runs."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "walkthrough.md"
# [`name`](../path/to/file.py) or [`Class.method`](../path/to/file.py): the file defines it.
LINK = re.compile(r"\[`([A-Za-z_][\w.]*)`\]\((\.\./[^)#]+\.py)\)")


def defined_names(path: Path) -> set[str]:
    """Module-level functions, classes and assignments of a file, and `Class.method` for the
    methods of its classes."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_symbol_links_name_what_their_files_define():
    """Every [`name`](../file.py) link in the walkthrough names something that file defines."""
    links = LINK.findall(DOC.read_text())
    assert len(links) >= 25, "the walkthrough's symbol links were not found"
    wrong = [
        f"{target} defines no {name!r}"
        for name, target in links
        if name not in defined_names(DOC.parent / target)
    ]
    assert not wrong, "update the links in docs/walkthrough.md: " + "; ".join(wrong)


def test_defined_names_sees_functions_classes_and_methods_only_where_they_are(tmp_path):
    """The check can fail: a method is found as Class.method, a missing name is not."""
    source = tmp_path / "m.py"
    source.write_text("X = 1\nclass A:\n    def f(self): pass\ndef g(): pass\n")
    assert defined_names(source) == {"X", "A", "A.f", "g"}


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

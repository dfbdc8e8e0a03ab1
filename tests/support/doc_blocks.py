"""The docs' example programs, extracted for the tests and for CI's bare-install step.

    python tests/support/doc_blocks.py README.md "ddptrain.DDP(LeNet()"   # prints that block

One extraction for both, so what CI runs is what the README shows.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_block(doc: str, containing: str) -> str:
    """The one ```python block of `doc` (relative to the repo root) that contains `containing`."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.DOTALL)
    found = [b for b in blocks if containing in b]
    if len(found) != 1:
        raise LookupError(f"{doc}: expected one python block with {containing!r}, got {len(found)}")
    return found[0]


if __name__ == "__main__":
    sys.stdout.write(python_block(sys.argv[1], sys.argv[2]))

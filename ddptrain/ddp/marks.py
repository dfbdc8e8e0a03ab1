"""Named spans for torch.profiler traces, free when no trace is being taken.

    with marks.mark("ddptrain.wait bucket", 3):     # a no-op unless marks are on
        work.wait()

`torch.profiler.record_function` costs ~10-15 us even with no profiler running (measured on a
loaded 2-core machine), and the wrapper's hooks run once per parameter per step, so marks are
behind a module flag that ddptrain.profiling turns on while it traces: when off, `mark()` is one
attribute read and a shared null context (< 1 us).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.profiler import record_function

# Read on the hot path, so a plain module global.
active = False
_OFF = contextlib.nullcontext()


def mark(name: str, index: int | None = None) -> contextlib.AbstractContextManager[Any]:
    """A record_function span named `name` (plus ` {index}`) while tracing, else a no-op."""
    if not active:
        return _OFF
    return record_function(name if index is None else f"{name} {index}")


@contextlib.contextmanager
def marks_on() -> Iterator[None]:
    """Turn marks on for a profiler you run yourself (torch.profiler.profile)."""
    global active
    previous, active = active, True
    try:
        yield
    finally:
        active = previous

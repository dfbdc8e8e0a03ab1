"""Named spans of the wrappers' work in torch.profiler traces (ddptrain.profiling reads them).

    with span("ddptrain.fill bucket", 3):   # "ddptrain.fill bucket 3" while tracing
        ...

Off unless ddptrain.profiling turns them on while it traces: record_function has a cost even
with no profiler, and hooks run per parameter.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch.profiler import record_function

tracing = False
OFF = contextlib.nullcontext()


def span(name: str, index: int | None = None) -> contextlib.AbstractContextManager[Any]:
    """A record_function span named `name` (plus ` {index}`) while tracing, else a no-op."""
    if not tracing:
        return OFF
    return record_function(name if index is None else f"{name} {index}")

"""matplotlib, imported only when a picture is drawn (it is an optional extra)."""

from __future__ import annotations

from typing import Any

INSTALL_HINT = (
    "matplotlib is not installed; pip install 'ddptrain[plot]' (or: pip install matplotlib)"
)


class MissingMatplotlib(ImportError):
    """matplotlib is needed for this picture and is not installed."""


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or MissingMatplotlib with the fix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingMatplotlib(INSTALL_HINT) from e
    return plt

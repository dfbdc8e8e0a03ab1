"""python -m ddptrain.plot RUN_DIR [RUN_DIR ...] [-o curves.png]
python -m ddptrain.plot --timeline TRACE [TRACE ...] [-o timeline.png]

Without -o the picture goes beside what it draws: RUN_DIR/curves.png for one run, the runs'
common folder for several (runs/a runs/b -> runs/curves.png); timeline.png into the traces'
folder. The path written is printed."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ddptrain.plot import curves, timeline
from ddptrain.plot._mpl import MissingMatplotlib


def default_out(paths: list[str], name: str, *, folders: bool) -> Path:
    """`name` in the folder the `paths` share (run folders, or the files' folders)."""
    places = [os.path.abspath(p if folders else os.path.dirname(p) or ".") for p in paths]
    shared = Path(os.path.commonpath(places))
    return Path(os.path.relpath(shared / name))


def main(argv: list[str] | None = None) -> int:
    """Draw curves of run directories, or a timeline of traces; 2 on bad input."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.plot", description="Pictures of ddptrain runs (needs matplotlib)."
    )
    p.add_argument("paths", nargs="+", help="run directories (metrics.jsonl), or trace files")
    p.add_argument(
        "-o",
        "--out",
        default=None,
        help="PNG to write (default: curves.png in the run directory, or the runs' common "
        "folder; timeline.png beside the traces)",
    )
    p.add_argument("--timeline", action="store_true", help="paths are Chrome traces of ranks")
    p.add_argument("--title", default="", help="timeline title")
    args = p.parse_args(argv)
    try:
        if args.timeline:
            out = args.out or default_out(args.paths, "timeline.png", folders=False)
            timeline.draw_timeline(timeline.load_spans(args.paths), out, title=args.title)
        else:
            runs = [run for path in args.paths for run in curves.load_runs(path)]
            out = args.out or default_out(args.paths, "curves.png", folders=True)
            curves.draw_curves(runs, out)
    except (curves.NoMetricsError, MissingMatplotlib, OSError, ValueError) as e:
        print(f"ddptrain.plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

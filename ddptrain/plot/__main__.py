"""python -m ddptrain.plot RUN_DIR [RUN_DIR ...] -o curves.png
python -m ddptrain.plot --timeline TRACE [TRACE ...] -o timeline.png"""

from __future__ import annotations

import argparse
import sys

from ddptrain.plot import curves, timeline
from ddptrain.plot._mpl import MissingMatplotlib


def main(argv: list[str] | None = None) -> int:
    """Draw curves of run directories, or a timeline of traces; 2 on bad input."""
    p = argparse.ArgumentParser(
        prog="python -m ddptrain.plot", description="Pictures of ddptrain runs (needs matplotlib)."
    )
    p.add_argument("paths", nargs="+", help="run directories (metrics.jsonl), or trace files")
    p.add_argument("-o", "--out", default=None, help="PNG to write (curves.png / timeline.png)")
    p.add_argument("--timeline", action="store_true", help="paths are Chrome traces of ranks")
    p.add_argument("--title", default="", help="timeline title")
    args = p.parse_args(argv)
    try:
        if args.timeline:
            out = args.out or "timeline.png"
            timeline.draw_timeline(timeline.load_spans(args.paths), out, title=args.title)
        else:
            out = args.out or "curves.png"
            curves.draw_curves([run for path in args.paths for run in curves.load_runs(path)], out)
    except (curves.NoMetricsError, MissingMatplotlib, OSError, ValueError) as e:
        print(f"ddptrain.plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

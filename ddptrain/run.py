"""ddptrain-run: torchrun with the workers' own error line last and their exit code.

    ddptrain-run --standalone --nproc_per_node=2 recipes/mnist.py
    python -m ddptrain.run --standalone --nproc_per_node=2 recipes/mnist.py   # the same
    ddptrain-run --verbose ...        # torchrun's own report as well

Takes torchrun's arguments; see ddptrain/launch/runner.py and docs/launch.md.
"""

import sys

from ddptrain.launch.runner import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

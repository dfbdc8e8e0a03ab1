"""The launcher commands tests start jobs with: ddptrain-run, and torchrun itself."""

from __future__ import annotations

import sys

DDPTRAIN_RUN = [sys.executable, "-m", "ddptrain.run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LAUNCHERS = {"ddptrain-run": DDPTRAIN_RUN, "torchrun": TORCHRUN}

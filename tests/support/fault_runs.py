"""What the fault tests share: the job they start, and how soon a fault must be noticed.

from support.fault_runs import DETECTED_WITHIN_S, JOB
"""

from __future__ import annotations

from pathlib import Path

JOB = Path(__file__).resolve().parent / "fault_job.py"
# A missed detection waits for the collective timeout (TrainerConfig.timeout_s, 300 s); a caught
# one takes seconds (a dead peer resets gloo's connections; a frozen one misses heartbeats).
# The bound sits far from both, so a loaded 2-core machine that starts processes slowly still
# passes while a hang still fails.
DETECTED_WITHIN_S = 90

"""Process-group helpers the wrapper and its transports share: torch only, no launcher.

global_rank(group, 0)           # the default group's number for `group`'s rank 0
release_group(group)            # destroy a new_group() unless shutdown() already did
close_at_shutdown(hook.close)   # ddptrain.shutdown() calls it before destroying groups
timeout_s()                     # how long a rank waits for peers (init_distributed's)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

# What ddptrain.shutdown() closes before it destroys the groups: transports' worker threads and
# their own groups. A group left alive until the interpreter exits may still have a gloo thread
# releasing a finished collective's tensors, which takes the GIL that an exiting interpreter no
# longer gives: a C++ abort ("terminate called without an active exception") instead of exit 0.
_closers: list[weakref.WeakMethod] = []
# init_distributed's timeout_s, which transports that wait outside the backend use too.
_timeout_s = 300.0


def timeout_s() -> float:
    """Seconds a rank waits for its peers before a collective fails (init_distributed's)."""
    return _timeout_s


def set_timeout_s(seconds: float) -> None:
    """Set what timeout_s() returns (ddptrain.init_distributed does)."""
    global _timeout_s
    _timeout_s = float(seconds)


def close_at_shutdown(method: Callable[[], None]) -> None:
    """Have shutdown() call `method` first (a bound method; its object is held weakly)."""
    _closers.append(weakref.WeakMethod(method))


def run_closers() -> None:
    """Call every method registered with close_at_shutdown, newest first, once."""
    closers = [ref() for ref in reversed(_closers)]
    _closers.clear()
    for close in closers:
        if close is not None:
            close()


def resolve(group: Any) -> Any:
    """The process group object `group` names (None: the default group)."""
    return dist.group.WORLD if group is None else group


def global_rank(group: Any, group_rank: int) -> int:
    """The default group's rank of `group`'s rank `group_rank` (None: the default group)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def new_group_like(group: Any, backend: str | None = None) -> Any:
    """Collective on the default group: a new group of `group`'s ranks (None: every rank)."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend=backend)


def release_group(group: Any) -> None:
    """Destroy a group made with new_group(), unless shutdown() destroyed it already."""
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # no longer registered: destroyed with the default group
        pass

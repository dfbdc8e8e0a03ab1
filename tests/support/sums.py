"""What the tests of hand-written sums (ring, shared memory, TCP) share: sizes, the stated
tolerance against the backend, the backend's sum, and the mark for machines without /dev/shm.

    from support.sums import NUMELS, RTOL, ATOL, backend_sum, needs_shm, reduce_with
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ddptrain.cpu.shm import SHM_DIR
from ddptrain.ddp.hooks import GradBucket, Transport

# Sizes around the chunking edge cases: empty, fewer elements than ranks, not divisible.
NUMELS = [0, 1, 2, 3, 5, 7, 64, 1001, 65_539]
# Stated tolerance vs dist.all_reduce for float32 at world size >= 3, where a hand-written sum
# adds in another order than gloo: torch.testing's float32 defaults (a few ulp of the sum; one
# sum of <= 4 standard-normal values, so well-conditioned on any CPU).
RTOL, ATOL = 1.3e-6, 1e-5
# Machines without a /dev/shm tmpfs (some containers, macOS) fall back to all_reduce by design.
needs_shm = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason=f"no {SHM_DIR} on this machine")


def backend_sum(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` summed over the ranks by the backend's all_reduce."""
    out = t.clone()
    dist.all_reduce(out)
    return out


def reduce_with(transport: Transport, tensor: torch.Tensor, last: bool = True) -> torch.Tensor:
    """`tensor` summed in place by `transport`, as the wrapper hands it a bucket."""
    transport.reduce(GradBucket(0, tensor, [], [], last))
    return tensor

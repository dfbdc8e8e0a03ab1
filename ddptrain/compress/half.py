"""Gradients on the wire as bf16 or fp16: half the bytes, rounded once.

    ddptrain.DDP(net, comm_hook=(HalfPrecision(torch.bfloat16), transport_hook))
    ddptrain.DDP(net, comm_hook=ddptrain.named_hook("bf16"))      # around the default transport
    TrainerConfig(comm_hook="ring-fp16")                          # around a named one

A Transport around another one (`inner`, by default the backend's all_reduce). Buckets are
allocated in the wire dtype (where `inner` places them), so the casts ride on the copies the
wrapper makes anyway: gradients are rounded on the way into the bucket and widened on the way
back into `.grad`. A bucket in another dtype is cast into a reused buffer and back. The
used-parameter flags (0/1) survive the casts exactly. The wrapper divides by world_size before
narrowing, so fp16 overflows only where an averaged gradient exceeds 65504.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ddptrain.ddp.hooks import AllReduce, GradBucket, Transport


class HalfPrecision(Transport):
    """Gradients travel as `dtype` (bf16/fp16) through `inner` (module docstring)."""

    sums_exactly = False

    def __init__(self, dtype: torch.dtype = torch.bfloat16, inner: Transport | None = None):
        self.dtype = dtype
        self.inner = inner if inner is not None else AllReduce()
        self._wire: dict[int, tuple[Any, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed bucket in the wire dtype (when `dtype` is floating point)."""
        return self.inner.allocate(numel, self.dtype if dtype.is_floating_point else dtype, device)

    def reduce(self, bucket: GradBucket) -> None:
        buffer = bucket.buffer()
        if buffer.dtype == self.dtype:
            self.inner.reduce(bucket)
            return
        wire = self._wire_for(buffer)
        wire.copy_(buffer)
        self.inner.reduce(GradBucket(bucket.index(), wire, [], [], bucket.is_last()))
        buffer.copy_(wire)

    def _wire_for(self, buffer: torch.Tensor) -> torch.Tensor:
        # One reusable buffer per bucket, so casting allocates nothing per step.
        with self._lock:
            ref, wire = self._wire.get(buffer.data_ptr(), (None, None))
            if ref is None or ref() is not buffer or wire.numel() != buffer.numel():
                wire = self.inner.allocate(buffer.numel(), self.dtype, buffer.device)
                self._wire[buffer.data_ptr()] = (weakref.ref(buffer), wire)
        return wire

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> bool:
        """Buffers travel as they are, through `inner`."""
        return self.inner.broadcast(tensors, src)

    def close(self) -> None:
        self.inner.close()

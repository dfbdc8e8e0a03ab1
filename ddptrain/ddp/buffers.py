"""The wrapper's buffers: rank 0's, sent before the forward or with the gradients.

    buffers = ModelBuffers(module, group)
    buffers.transport = transport                        # where it has a broadcast of its own
    if buffers and not buffers.follow_gradients():       # a forward that may read them
        buffers.sync(src=0)                              # collective: rank 0's, in place

Official DDP broadcasts rank 0's buffers before every forward. A norm layer in training mode
(BatchNorm, InstanceNorm, SyncBatchNorm: torch's _NormBase) normalizes with the batch's own
statistics and only writes its running ones, so for a model whose every buffer is such a
statistic, rank 0's values as its forward left them can travel with the last bucket instead:
training is the same, the ranks meet once per step instead of twice, and every rank ends the
step with rank 0's statistics. Any other buffer, and a norm layer in eval mode, may be read by
the forward, so those are sent before it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ddptrain.ddp.hooks import Transport
from ddptrain.ddp.replicas import broadcast_coalesced, coalesce


class ModelBuffers:
    """A module's buffers, and how to make every rank's equal to one rank's."""

    def __init__(self, module: nn.Module, process_group: Any) -> None:
        self.tensors = list(module.buffers())
        self._chunks = coalesce(self.tensors)
        self._group = process_group
        # A transport with a broadcast of its own (shared memory) saves the backend's round trip.
        self.transport: Transport | None = None
        owners = [m for m in module.modules() if next(m.buffers(recurse=False), None) is not None]
        self._norm_layers = [m for m in owners if isinstance(m, _NormBase)]
        self._only_norm_statistics = len(self._norm_layers) == len(owners)

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def follow_gradients(self) -> bool:
        """Whether a forward now may leave them to the gradients: it cannot read them."""
        return self._only_norm_statistics and all(layer.training for layer in self._norm_layers)

    @torch.no_grad()
    def sync(self, src: int) -> None:
        """Collective: every rank's buffers become rank `src`'s."""
        if self.transport is None or not self.transport.broadcast(self.tensors, src):
            broadcast_coalesced(self._chunks, self._group, src)

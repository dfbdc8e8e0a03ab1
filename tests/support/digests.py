"""One SHA-256 over tensors' bytes, in order: equal digests mean the same bits."""

from __future__ import annotations

import hashlib

import torch


def tensors_digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

"""Bytes a rank holds, per strategy and world size: closed-form counts (pure).

    held("zero1", param_bytes=P, state_bytes=O, world_size=4)   # {"params": P, "grads": P, ...}
    shared_rows_touched([20 << 20, 40 << 20], world_size=4)      # 3/4 of 60 MiB
    powersgd_messages([(2240, 2240), (2240,)], rank=4, element_bytes=4)   # (P bytes, Q bytes)

Parameters (P bytes), their gradients and the optimizer's state (O bytes at world size 1: 0 for
SGD, 2P for AdamW's two moments, plus a step counter per parameter) are held as designed:

| strategy | params | grads | optimizer state |
|---|---|---|---|
| ddp, powersgd | P | P (the buckets) | O |
| zero1 | P | P | O / n |
| zero2, zero3 | P / n | P / n | O / n |

(the sharded wrapper pads each unit to n equal shards: `unit_shard_bytes`). On one host the DDP
wrapper's buckets are rows of shared files: rank r sums chunk r of every row, so its resident
pages are its own row and 1/n of each of the n - 1 others' (`shared_rows_touched`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ddptrain.fsdp.layout import flat_layout


def held(strategy: str, param_bytes: int, state_bytes: int, world_size: int) -> dict[str, int]:
    """Parameters, gradients and optimizer state one rank holds after a step (the table)."""
    n = world_size
    if strategy in ("zero2", "zero3"):
        return {
            "params": param_bytes // n,
            "grads": param_bytes // n,
            "optimizer": state_bytes // n,
        }
    state = state_bytes // n if strategy == "zero1" else state_bytes
    return {"params": param_bytes, "grads": param_bytes, "optimizer": state}


def shared_rows_touched(bucket_bytes: Sequence[int], world_size: int) -> int:
    """Bytes of the other ranks' shared bucket rows this rank's sums make resident."""
    n = world_size
    return sum(b * (n - 1) // n for b in bucket_bytes) if n > 1 else 0


def unit_bytes(numels: Sequence[int], world_size: int, element_bytes: int) -> tuple[int, int]:
    """(gathered, shard) bytes of one unit of the sharded wrapper, padding included."""
    layout = flat_layout(numels, world_size)
    return layout.padded_numel * element_bytes, layout.shard_numel * element_bytes


def compressed(shape: Sequence[int], rank: int, min_rate: float = 2.0) -> tuple[int, int] | None:
    """(rows, rank) of P for a gradient PowerSGD compresses (as a shape[0] x rest matrix),
    None for one it sends whole (a vector, or a matrix that would not shrink min_rate times)."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    r = min(n, m, rank)
    return (n, r) if (n + m) * r * min_rate < n * m else None


def powersgd_messages(
    shapes: Sequence[Sequence[int]], rank: int, element_bytes: int
) -> tuple[int, int]:
    """Bytes of the two messages PowerSGD sums per bucket: P with the uncompressed gradients,
    then Q (compress/powersgd.py)."""
    p = q = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        found = compressed(shape, rank)
        if found is None:
            p += numel
        else:
            rows, r = found
            p += rows * r
            q += numel // rows * r
    return p * element_bytes, q * element_bytes

"""Pure bucket assignment: parameter sizes in, lists of parameter indices out.

    buckets = assign_buckets(sizes_bytes=[4096, 40, 80_000], keys=["f32"] * 3,
                             cap_bytes=25 * 2**20, first_cap_bytes=2**20)

The caller passes parameters in the order their gradients are expected to become ready
(reverse registration order, or the order observed on a first backward). No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

MB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
# Same as torch's dist._DEFAULT_FIRST_BUCKET_BYTES: a small first bucket starts communication
# early in backward instead of waiting for 25 MB of gradients.
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0


def mb_to_bytes(mb: float) -> int:
    """Bucket caps are given in MiB, like the official wrapper's bucket_cap_mb."""
    if mb <= 0:
        raise ValueError(f"bucket cap must be > 0 MB, got {mb}")
    return int(mb * MB)


def assign_buckets(
    sizes_bytes: Sequence[int],
    keys: Sequence[Hashable],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
) -> list[list[int]]:
    """Group indices into buckets of one key each, closing a bucket once it reaches its cap.

    Each key (dtype, device) has its own open bucket; the first bucket closed for a key uses
    `first_cap_bytes`, later ones `cap_bytes`. Buckets are returned in the order they closed
    (open ones last, in first-index order), so launching them in list order follows the order
    in which their gradients become ready. Every index appears in exactly one bucket.
    """
    if len(sizes_bytes) != len(keys):
        raise ValueError(f"{len(sizes_bytes)} sizes but {len(keys)} keys")
    if cap_bytes <= 0 or (first_cap_bytes is not None and first_cap_bytes <= 0):
        raise ValueError("bucket caps must be positive")
    first_cap = cap_bytes if first_cap_bytes is None else first_cap_bytes
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_for_key: dict[Hashable, int] = {}
    closed: list[list[int]] = []
    for index, (size, key) in enumerate(zip(sizes_bytes, keys, strict=True)):
        if size < 0:
            raise ValueError(f"size of index {index} is negative: {size}")
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + size
        limit = first_cap if closed_for_key.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= limit:
            closed.append(open_buckets.pop(key))
            open_bytes.pop(key)
            closed_for_key[key] = closed_for_key.get(key, 0) + 1
    leftovers = sorted(open_buckets.values(), key=lambda b: b[0])
    return closed + leftovers

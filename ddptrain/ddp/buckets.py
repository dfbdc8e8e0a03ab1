"""Buckets: which parameters share one (pure), where each gradient lives in them, and the
Bucket a backward fills and reduces.

    buckets = assign_buckets(sizes_bytes=[4096, 40, 80_000], keys=["f32"] * 3,
                             cap_bytes=25 * 2**20, first_cap_bytes=2**20)
    layout = build_layout(params, order, 25 * MB, MB, torch_zeros, as_view=True, tail=4)
    layout.flats[b], layout.views[i]                          # bucket b; parameter i's slot
    layout.tail                                               # 4 more elements, summed alike
    fill_slot(layout.views[i], p.grad, 2, False, scratch)     # slot = grad / 2
    view = view_like(flat[offset : offset + p.numel()], p)   # p's shape and strides
    scale_into_narrower(grad, 0.5, bf16_view, scratch)        # bf16_view = round(grad * 0.5)

The caller passes parameters in the order their gradients are expected to become ready (reverse
registration order, or the order observed on a first backward). Everything but `Bucket` is a
function of sizes and tensors; `Bucket` hands its reduction to a runner, never a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddptrain.ddp.hooks import GradBucket, Job, OrderedRunner

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


# Elements per piece when scaling and narrowing a gradient into a bf16/fp16 bucket: 256 KB of
# fp32 stays in L2 between the multiply and the cast.
CAST_CHUNK = 64 * 1024


@dataclass
class BucketLayout:
    """Where every parameter's gradient lives, parameters counted by their index."""

    order: list[int]  # the parameters in the order their buckets launch
    members: list[list[int]]  # per bucket, its parameters
    flats: list[torch.Tensor]  # per bucket, one flat tensor (the last may end with the tail)
    views: list[torch.Tensor]  # per parameter, its slot, with its shape and strides
    bucket_of: list[int]  # per parameter, its bucket
    tail: torch.Tensor | None  # the last bucket's extra elements after its gradients
    grad_is_view: list[bool]  # per parameter, whether .grad may be the slot itself

    @property
    def lens(self) -> list[int]:
        return [len(m) for m in self.members]


def build_layout(
    params: list[torch.Tensor],
    order: list[int],
    cap_bytes: int,
    first_cap_bytes: int,
    allocate: Callable[[int, torch.dtype, torch.device], torch.Tensor],
    as_view: bool,
    tail: int = 0,
    bucket_dtype: torch.dtype | None = None,
) -> BucketLayout:
    """Buckets for `params` taken in `order` (assign_buckets), each allocated by `allocate`
    (numel, dtype, device); `as_view`: gradients may live in their slots; `tail`: elements
    the last bucket holds after its gradients, reduced with them (the reducer's flags);
    `bucket_dtype`: every bucket in this dtype (the exact mode's int64), not the parameters'."""
    ordered = [params[i] for i in order]
    buckets = assign_buckets(
        [p.numel() * (bucket_dtype or p.dtype).itemsize for p in ordered],
        [(bucket_dtype or p.dtype, p.device) for p in ordered],
        cap_bytes,
        first_cap_bytes,
    )
    members = [[order[j] for j in bucket] for bucket in buckets]
    n = len(params)
    bucket_of = [0] * n
    views: list[torch.Tensor] = [torch.empty(0)] * n
    flats: list[torch.Tensor] = []
    for b, indices in enumerate(members):
        numel = sum(params[i].numel() for i in indices)
        # A transport sums the whole flat tensor, so values put in the last bucket's tail are
        # summed over ranks without an extra collective.
        extra = tail if b == len(members) - 1 else 0
        first = params[indices[0]]
        flat = allocate(numel + extra, bucket_dtype or first.dtype, first.device)
        offset = 0
        for i in indices:
            views[i] = view_like(flat[offset : offset + params[i].numel()], params[i])
            bucket_of[i] = b
            offset += params[i].numel()
        flats.append(flat)
    # A transport may keep buckets in its wire dtype (bf16): those gradients are copies.
    grad_is_view = [as_view and v.dtype == p.dtype for v, p in zip(views, params, strict=True)]
    tail_view = flats[-1][flats[-1].numel() - tail :] if tail and flats else None
    return BucketLayout(order, members, flats, views, bucket_of, tail_view, grad_is_view)


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed bucket where no transport allocates one."""
    return torch.zeros(numel, dtype=dtype, device=device)


def fill_slot(
    view: torch.Tensor,
    grad: torch.Tensor | None,
    divisor: int,
    claimed: bool,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """view = grad / divisor (zero for no gradient); returns `scratch`, the buffer of CAST_CHUNK
    elements a narrower view is filled through, made anew when grad's dtype needs one.

    `claimed`: autograd computed the scaled gradient into the view itself (Reducer.claim_slot).
    """
    if claimed:
        # A tensor other than the view means more gradients were summed with it.
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.add_(grad - view, alpha=1.0 / divisor)
    elif grad is None:
        view.zero_()
    elif grad.data_ptr() == view.data_ptr():
        if divisor != 1:
            view.div_(divisor)
    elif view.dtype == grad.dtype:
        # Scaling while copying, as the official reducer does: one pass over the gradient.
        torch.mul(grad, 1.0 / divisor, out=view)
    else:
        # A transport's narrower wire dtype (bf16).
        if scratch.dtype != grad.dtype or scratch.numel() < CAST_CHUNK:
            scratch = torch.empty(CAST_CHUNK, dtype=grad.dtype, device=grad.device)
        scale_into_narrower(grad, 1.0 / divisor, view, scratch)
    return scratch


def will_accumulate(grad_acc: Any) -> bool:
    """Whether the running backward will accumulate into .grad through this AccumulateGrad."""
    try:
        return torch._C._will_engine_execute_node(grad_acc)
    except RuntimeError:
        # torch refuses the question for a leaf during torch.autograd.grad(), which returns
        # gradients and accumulates none.
        return False


def has_other_hooks(param: torch.Tensor) -> bool:
    """Hooks besides the wrapper's that would see a gradient before the wrapper scales it."""
    return bool(param._backward_hooks) or len(param._post_accumulate_grad_hooks or ()) > 1


def view_like(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`flat` (p.numel() elements) viewed with p's shape and, for channels_last, its strides: a
    channels_last parameter gets a channels_last gradient view, as autograd would produce, so
    accumulating into it is a plain pass instead of a transposing copy (as the official reducer
    does)."""
    dense = p.is_contiguous() or memory_format(p) is not torch.contiguous_format
    return flat.as_strided(p.shape, p.stride()) if dense else flat.view(p.shape)


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as a 1-D view in the order they lie in memory."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(order).view(-1)


def memory_format(t: torch.Tensor) -> torch.memory_format:
    """channels_last(_3d) for a 4-D (5-D) tensor laid out so and not also plainly contiguous."""
    if t.is_contiguous():
        return torch.contiguous_format
    for dim, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if t.dim() == dim and t.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


def scale_into_narrower(
    grad: torch.Tensor, scale: float, view: torch.Tensor, scratch: torch.Tensor
) -> None:
    """view = grad * scale, rounded once to view's narrower dtype (bf16/fp16).

    The product is taken in grad's dtype in CAST_CHUNK pieces through `scratch` (that dtype, at
    least CAST_CHUNK elements), then cast, so memory is crossed once. On CPU a mixed-dtype
    mul(out=) takes a slower unvectorized path, and cast-then-scale a second pass
    (docs/benchmarks.md, "Costs the code is shaped around").
    """
    if grad.stride() != view.stride():
        grad = grad.contiguous(memory_format=memory_format(view))
    pieces = zip(
        memory_order(grad).split(CAST_CHUNK), memory_order(view).split(CAST_CHUNK), strict=True
    )
    for source, target in pieces:
        scaled = scratch[: source.numel()]
        torch.mul(source, scale, out=scaled)
        target.copy_(scaled)


class Bucket:
    """One flat tensor of gradients, filled slot by slot and reduced once full.

    Its verbs, in the order of a step: `arrived` (one more slot filled; True when all are),
    `launch` (its reduction queued on the runner), `wait` (the mean is in the flat tensor),
    `reset` (ready for the next step). The comm hook gets a fresh GradBucket at each launch:
    torch's hooks may rebind its buffer (set_buffer), never the bucket's own tensor."""

    __slots__ = ("flat", "gradients", "index", "is_last", "job", "members", "params", "pending")

    def __init__(
        self,
        index: int,
        flat: torch.Tensor,
        members: list[int],
        views: list[torch.Tensor],
        params: list[torch.Tensor],
        is_last: bool,
    ) -> None:
        self.index, self.flat, self.members, self.is_last = index, flat, members, is_last
        self.gradients = [views[i] for i in members]
        self.params = [params[i] for i in members]
        self.pending = len(members)
        self.job: Job | None = None

    def grad_bucket(self) -> GradBucket:
        """What the comm hook is handed; for a transport the last one ends with the tail."""
        return GradBucket(self.index, self.flat, self.gradients, self.params, self.is_last)

    def arrived(self) -> bool:
        """One more of its gradients is in its slot; True once every one is."""
        self.pending -= 1
        return self.pending == 0

    def launch(
        self, runner: OrderedRunner, reduce: Callable[[GradBucket], Any], wait_at_once: bool
    ) -> None:
        """Queue its reduction; `wait_at_once`: the caller waits now, so it runs it itself."""
        self.job = runner.submit(reduce, self.grad_bucket(), wake=not wait_at_once)

    def wait(self) -> None:
        """Wait for the reduction; the bucket's flat tensor then holds the mean (what the
        hook's future returned, copied in, converted from its dtype, if it is another tensor)."""
        result = self.job.wait()
        if result is not None and result.data_ptr() != self.flat.data_ptr():
            self.flat.copy_(result.view(-1))

    def reset(self) -> None:
        self.pending, self.job = len(self.members), None

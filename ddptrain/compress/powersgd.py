"""PowerSGD gradient compression in torch's hook protocol: low-rank gradients, error feedback.

    ddptrain.DDP(net, comm_hook=ddptrain.named_hook("powersgd"))   # rank 4 from step 100
    state = PowerSGDState(matrix_rank=2, start_step=500)     # other options (its defaults are
    ddptrain.DDP(net, comm_hook=(state, powersgd_hook))      # torch's: rank 1, step 1000)
    TrainerConfig(comm_hook="powersgd", powersgd_rank=4, powersgd_start_step=100)

The algorithm of torch's `powerSGD_hook` (Vogels et al., 2019, arXiv:1905.13727) and its state's
options, equal to it within float rounding (tests/ddp/test_powersgd.py). Each gradient viewed
as an n x m matrix M is sent as two thin ones: P = M Q (n x r), summed over ranks and
orthogonalized, then Q = M^T P (m x r), averaged; every rank then holds P Q^T, the mean
gradient's projection on P. What is left out (the error, M - P Q^T) is added to the next
step's gradient (error feedback), and each step starts from the last step's Q (warm start),
so one power iteration a step tracks the gradients' top singular vectors. A 2240 x 2240 layer
at r = 4 sends 280x fewer bytes. Vectors (biases) and matrices that would not shrink by
`min_compression_rate` are averaged as they are, in the same message as P. For the first
`start_step` steps every bucket is averaged uncompressed: early training is sensitive to
inaccurate gradients.

Where it differs from torch's, for speed: P and the uncompressed gradients travel in one
message (two round trips per bucket, not three); the error is kept for compressed matrices
only (for the rest it is local minus mean, which sums to zero over ranks: torch's adds only
rounding there); P, Q and the error live in buffers reused every step, the gradient plus error
is formed in the error's buffer (no clone of the bucket) in the pass that computes P, which
also subtracts the last step's approximation; P and Q are computed transposed, the kernels
this CPU runs fastest; a matrix is read in place whatever its memory layout (channels_last
weights, which torch's `view` refuses). Per compressed matrix and step: 5 passes
over its memory (torch's: 12, and a new matrix-sized tensor). The sums go through a
Transport of the hook's own (hooks.default_transport: shared memory on one host, the TCP ring
across hosts), never the group the model runs collectives on (SyncBatchNorm in backward). The
hook runs where the wrapper runs every hook, on its communication thread while backward goes
on. The state is not saved in checkpoints: a resumed run restarts the uncompressed phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddptrain.ddp.hooks import GradBucket, Transport, default_transport

# What the name "powersgd" means (ddptrain/comm.py, TrainerConfig): a rank that keeps
# accuracy on the recipe's models (docs/guide.md, "When to compress") and a start short runs
# reach.
NAMED_RANK = 4
NAMED_START_STEP = 100
# The bytes of one block of rows of M (see _project) and of P Q^T (see _outer).
_PROJECT_BLOCK_BYTES = 1024 * 1024
_OUTER_BLOCK_BYTES = 512 * 1024


class PowerSGDState:
    """Options and per-bucket memory of `powersgd_hook`; torch's PowerSGDState names in
    brackets: matrix_rank (matrix_approximation_rank), start_step (start_powerSGD_iter),
    error_feedback (use_error_feedback); the others are the same.

    Collective to construct where `transport` is None: the sums go through a new
    `default_transport(process_group)`. `start_step` must be >= 2 with error feedback or warm
    start, as torch's: the wrapper rebuilds its buckets after the first step.
    """

    def __init__(
        self,
        process_group: Any = None,
        *,
        matrix_rank: int = 1,
        start_step: int = 1000,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        random_seed: int = 0,
        transport: Transport | None = None,
        on_cpu: bool = True,
    ) -> None:
        if isinstance(matrix_rank, bool) or not isinstance(matrix_rank, int) or matrix_rank < 1:
            raise ValueError(f"matrix_rank must be a positive integer, got {matrix_rank!r}")
        if (error_feedback or warm_start) and start_step < 2:
            raise ValueError(
                f"start_step must be >= 2 with error feedback or warm start, got {start_step}: "
                "the wrapper rebuilds its buckets after the first step"
            )
        self.matrix_rank = matrix_rank
        self.start_step = start_step
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.world_size = dist.get_world_size(process_group)
        self.transport = (
            transport if transport is not None else default_transport(process_group, on_cpu)
        )
        # Steps whose last bucket this hook has reduced (torch's `iter`).
        self.step = 0
        # One draw per bucket's first random Q, as torch's (same seed, same numbers).
        self.rng = np.random.RandomState(random_seed)
        # Per bucket index, the hook's memory: its compression plan (views and buffers).
        self.plans: dict[int, _Plan] = {}
        # Uncompressed phase: buckets staged where the transport places its buffers.
        self.staging: dict[int, torch.Tensor] = {}

    def elements_per_step(self) -> tuple[int, int]:
        """(gradient elements, elements sent) per step over the buckets compressed so far."""
        total = sum(plan.numel for plan in self.plans.values())
        sent = sum(plan.send_p.numel() + plan.send_q.numel() for plan in self.plans.values())
        return total, sent

    def close(self) -> None:
        """Release the transport (ddptrain.shutdown() does it too)."""
        self.transport.close()


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """torch's hook protocol: the bucket's local gradients in, their (compressed) mean out."""
    if state.step < state.start_step:
        _average(state, bucket)
    else:
        _compress(state, bucket, _plan_for(state, bucket))
    if bucket.is_last():
        state.step += 1
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@dataclass
class _Plan:
    """One bucket's compression: views into its buffer and into the reused buffers."""

    buffer_ptr: int
    numel: int
    others_numel: int
    matrices: list[torch.Tensor]  # the compressed gradients, as n x m views of the bucket
    others: list[torch.Tensor]  # the gradients sent as they are
    # Error feedback, per matrix (n x m): what the last step's approximation left out. Kept as
    # that step's M, gradient + error, whose approximation P Q^T is subtracted at the next
    # step, in the same pass that adds the new gradient (see _project).
    errors: list[torch.Tensor]
    send_p: torch.Tensor  # [others | P of each matrix], allocated by the transport
    send_q: torch.Tensor  # [Q of each matrix]
    # Transposed: P^T (r x n) and Q^T (r x m), contiguous. MKL computes Q^T M^T and P^T M
    # several times faster than M Q and M^T P, and they are the same numbers on the wire.
    pts: list[torch.Tensor]
    qts: list[torch.Tensor]
    # The Q^T each error's pending approximation was built from (the P^T is still in pts).
    last_qts: list[torch.Tensor]
    fresh: bool = True  # Q not yet drawn
    pending: bool = False  # the errors still hold M: P Q^T is yet to be subtracted


def _average(state: PowerSGDState, bucket: GradBucket) -> None:
    buffer = bucket.buffer()
    staged = state.staging.get(bucket.index())
    if staged is None or staged.numel() != buffer.numel():
        staged = state.transport.allocate(buffer.numel(), buffer.dtype, buffer.device)
        state.staging[bucket.index()] = staged
    torch.div(buffer, state.world_size, out=staged)
    _sum(state, bucket, staged)
    buffer.copy_(staged)


def _sum(state: PowerSGDState, bucket: GradBucket, flat: torch.Tensor) -> None:
    state.transport.reduce(GradBucket(bucket.index(), flat, [], [], bucket.is_last()))


def _plan_for(state: PowerSGDState, bucket: GradBucket) -> _Plan:
    buffer = bucket.buffer()
    plan = state.plans.get(bucket.index())
    if plan is not None and plan.buffer_ptr == buffer.data_ptr() and plan.numel == buffer.numel():
        return plan
    # The uncompressed phase is over: its staging buffers go.
    state.staging.clear()
    matrices, others = [], []
    for grad in bucket.gradients():
        matrix = _as_matrix(grad)
        if matrix is not None and _worth_compressing(
            *matrix.shape, state.matrix_rank, state.min_compression_rate
        ):
            matrices.append(matrix)
        else:
            others.append(grad)
    ranks = [min(*m.shape, state.matrix_rank) for m in matrices]
    other_numel = sum(g.numel() for g in others)
    p_numel = sum(m.shape[0] * r for m, r in zip(matrices, ranks, strict=True))
    q_numel = sum(m.shape[1] * r for m, r in zip(matrices, ranks, strict=True))
    allocate = state.transport.allocate
    send_p = allocate(other_numel + p_numel, buffer.dtype, buffer.device)
    send_q = allocate(q_numel, buffer.dtype, buffer.device)
    pts, qts, errors = [], [], []
    p_at, q_at = other_numel, 0
    for m, r in zip(matrices, ranks, strict=True):
        (n, k) = m.shape
        pts.append(send_p[p_at : p_at + r * n].view(r, n))
        qts.append(send_q[q_at : q_at + r * k].view(r, k))
        p_at, q_at = p_at + r * n, q_at + r * k
        if state.error_feedback:
            errors.append(torch.zeros_like(m))
    last_qts = [torch.zeros_like(qt) for qt in qts] if state.error_feedback else []
    plan = _Plan(
        buffer.data_ptr(), buffer.numel(), other_numel, matrices, others, errors,
        send_p, send_q, pts, qts, last_qts,
    )  # fmt: skip
    state.plans[bucket.index()] = plan
    return plan


def _compress(state: PowerSGDState, bucket: GradBucket, plan: _Plan) -> None:
    world_size, eps = state.world_size, state.orthogonalization_epsilon
    if plan.fresh or not state.warm_start:
        _draw(state, plan.qts)
        plan.fresh = False
    for qt in plan.qts:
        _orthogonalize(qt.t(), eps)
    # P = M Q, M = gradient + error (formed in the error's buffer), or the gradient alone.
    for i, (matrix, qt, pt) in enumerate(zip(plan.matrices, plan.qts, plan.pts, strict=True)):
        if plan.errors:
            last = plan.last_qts[i] if plan.pending else None
            _project(matrix, plan.errors[i], last, qt, pt)
        else:
            _project(matrix, None, None, qt, pt)
    sources = plan.errors or plan.matrices
    others = plan.send_p[: plan.others_numel]
    if plan.others:
        torch.cat([g.reshape(-1) for g in plan.others], out=others)
    _sum(state, bucket, plan.send_p)
    if plan.others:
        others.div_(world_size)
        offset = 0
        for grad in plan.others:
            grad.copy_(others[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    for pt in plan.pts:
        _orthogonalize(pt.t(), eps)
    # Q = M^T P, averaged; the bucket then holds P Q^T.
    for source, pt, qt in zip(sources, plan.pts, plan.qts, strict=True):
        torch.mm(pt, source, out=qt)
    _sum(state, bucket, plan.send_q)
    plan.send_q.div_(world_size)
    for pt, qt, matrix in zip(plan.pts, plan.qts, plan.matrices, strict=True):
        _outer(pt.t(), qt, matrix)
    for last, qt in zip(plan.last_qts, plan.qts, strict=False):
        last.copy_(qt)
    plan.pending = bool(plan.errors)


def _project(
    grad: torch.Tensor,
    error: torch.Tensor | None,
    last_qt: torch.Tensor | None,
    qt: torch.Tensor,
    pt: torch.Tensor,
) -> None:
    """pt = qt @ M^T. With an error buffer, M = grad + error - P_last @ last_qt is formed in
    it (P_last: pt's values on entry, last_qt None: nothing to subtract); else M = grad."""
    # Block by block: each block of M is multiplied while the additions left it in cache, and
    # subtracting the last approximation here, not in a pass of its own when it was made, saves
    # that pass. A block's old P rows are read before its new ones are written.
    source = grad if error is None else error
    rows = _rows_per_block(source, _PROJECT_BLOCK_BYTES)
    for start in range(0, source.shape[0], rows):
        end = start + rows
        block = source[start:end]
        if error is not None:
            block.add_(grad[start:end])
            if last_qt is not None:
                block.addmm_(pt[:, start:end].t(), last_qt, alpha=-1)
        torch.mm(qt, block.t(), out=pt[:, start:end])


def _rows_per_block(matrix: torch.Tensor, nbytes: int) -> int:
    return max(1, nbytes // (matrix.shape[1] * matrix.element_size()))


def _outer(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> None:
    """out = p @ qt (n x r times r x m), in blocks of rows."""
    # One n x m product with r = 4 runs well below memory speed in MKL; blocks of ~512 KiB of
    # output run near it.
    rows = _rows_per_block(out, _OUTER_BLOCK_BYTES)
    for start in range(0, out.shape[0], rows):
        torch.mm(p[start : start + rows], qt, out=out[start : start + rows])


def _draw(state: PowerSGDState, qts: list[torch.Tensor]) -> None:
    """Standard normal Qs, drawn as torch's hook draws them (so from the same seed, the same
    numbers), from a generator of their own: the global one is the training loop's."""
    generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
    for qt in qts:
        q = qt.t()
        q.copy_(torch.randn(q.shape, generator=generator, dtype=q.dtype))


def _as_matrix(grad: torch.Tensor) -> torch.Tensor | None:
    """`grad` as a (shape[0], rest) matrix over its own memory, or None where its layout has
    no such view (dim 0 not outermost)."""
    if grad.dim() < 1 or grad.numel() == 0:
        return None
    n = grad.shape[0]
    if grad.is_contiguous():
        return grad.view(n, -1)
    # A dense layout with dim 0 outermost (channels_last): the columns come in another order,
    # which changes no singular value, so compressing that matrix is as good.
    if grad.stride(0) * n == grad.numel() and _dense(grad):
        return grad.as_strided((n, grad.numel() // n), (grad.stride(0), 1))
    return None


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one block of memory with no gaps or overlaps."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _worth_compressing(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """Whether an n x m matrix sent at `rank` shrinks by more than min_compression_rate."""
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


def _orthogonalize(matrix: torch.Tensor, eps: float) -> None:
    """Orthonormal columns in place: QR for rank > 2, else Gram-Schmidt (torch's choice; QR
    has no half-precision kernel)."""
    if matrix.shape[1] <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        _gram_schmidt(matrix, eps)
    else:
        q, _ = torch.linalg.qr(matrix)
        matrix.copy_(q)


def _gram_schmidt(matrix: torch.Tensor, eps: float) -> None:
    # With eps = 0 an all-zero column divides by zero (NaN), as in torch's: a gradient that is
    # exactly zero needs eps > 0 (torch suggests 1e-8).
    cols = matrix.shape[1]
    for i in range(cols):
        col = matrix[:, i : i + 1]
        col /= torch.norm(col, dim=0, keepdim=True) + eps
        if i + 1 < cols:
            rest = matrix[:, i + 1 :]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col

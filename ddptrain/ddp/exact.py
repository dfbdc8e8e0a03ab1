"""Sums whose bits do not depend on their order: fixed-point integers for gradients and norms.

    shift = fixed_point_shift(reference)          # per parameter, from an agreed magnitude
    acc = torch.zeros(numel, dtype=torch.int64)   # the accumulator (a bucket slot)
    overflowed = add_fixed(acc, grad, shift)      # acc += round(grad * 2**shift), exactly
    ... acc summed over ranks by any all_reduce: integer addition is associative ...
    mean_from_fixed(acc, shift, count, grad)      # grad = acc * 2**-shift / count, rounded
    norm = exact_norm(grads, group)               # the same bits however the grads are split

A float sum's last bits depend on the order of its additions, so a mean over ranks changes
with the number of ranks. Rounding each term once to a grid of 2**-shift and adding integers
does not: any grouping, any ring or tree, any backend gives the same sum, which is rounded
once more when it becomes a float mean. The grid is per parameter: its spacing is 2**-34 of
the reference magnitude (the largest element of one agreed micro-batch's gradient), so
elements near it keep more bits than a float32 sum would and elements 10**6 times smaller keep
about fourteen; a term more than 2**HEADROOM_BITS times the reference, or more than
2**COUNT_BITS terms in one sum, would not fit in 63 bits: that is an overflow, reported, never
wrapped around.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

# A term may be this many powers of two above the reference before it overflows.
HEADROOM_BITS = 16
# Up to 2**COUNT_BITS terms (micro-batches summed over every rank) in one accumulator.
COUNT_BITS = 12
# Bits of an int64 the magnitudes may use (one spare below the sign bit).
_VALUE_BITS = 62
# Elements per piece converted at once: the scratch buffers stay in cache.
_PIECE = 1 << 16


def fixed_point_shift(reference: float) -> int:
    """The power of two a gradient is scaled by before rounding: values up to
    reference * 2**HEADROOM_BITS, summed 2**COUNT_BITS times, still fit in 62 bits. A zero or
    non-finite reference gets the shift of 1.0."""
    if not math.isfinite(reference) or reference <= 0:
        reference = 1.0
    exponent = math.frexp(reference)[1]  # reference < 2**exponent
    return _VALUE_BITS - COUNT_BITS - HEADROOM_BITS - exponent


def term_bound(shift: int) -> float:
    """The largest magnitude a term may have under `shift` without overflowing."""
    return math.ldexp(1.0, _VALUE_BITS - COUNT_BITS - shift)


def add_fixed(acc: torch.Tensor, grad: torch.Tensor, shift: int) -> bool:
    """acc += round(grad * 2**shift) (acc: int64, grad's shape or flat); True if a term was
    out of range (it was clipped to the bound; the sum is then not to be used)."""
    flat = grad.detach().reshape(-1)
    target = acc.view(-1)
    bound = term_bound(shift)
    overflow = bool(flat.numel()) and not torch.linalg.vector_norm(flat, math.inf) <= bound
    scale = math.ldexp(1.0, shift)
    scaled = torch.empty(min(_PIECE, flat.numel()), dtype=torch.float64, device=flat.device)
    ints = torch.empty(scaled.numel(), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _PIECE):
        piece = flat[start : start + _PIECE]
        n = piece.numel()
        # float64 holds every float32 times a power of two exactly; round half to even.
        s = scaled[:n]
        s.copy_(piece).mul_(scale)
        if overflow:
            s.clamp_(-bound * scale, bound * scale)
        s.round_()
        ints[:n].copy_(s)
        target[start : start + n].add_(ints[:n])
    return overflow


def mean_from_fixed(acc: torch.Tensor, shift: int, count: int, out: torch.Tensor) -> None:
    """out = acc * 2**-shift / count, each element rounded to out's dtype (every rank, every
    world size: the same bits from the same sum)."""
    flat_out = out.view(-1) if out.is_contiguous() else None
    source = acc.view(-1)
    scale = math.ldexp(1.0, -shift)
    piece = torch.empty(min(_PIECE, source.numel()), dtype=torch.float64, device=acc.device)
    result = []
    for start in range(0, source.numel(), _PIECE):
        n = min(_PIECE, source.numel() - start)
        p = piece[:n]
        p.copy_(source[start : start + n]).mul_(scale).div_(count)
        if flat_out is not None:
            flat_out[start : start + n].copy_(p)
        else:
            result.append(p.to(out.dtype))
    if flat_out is None:
        out.copy_(torch.cat(result).view(out.shape) if result else out)


def exact_norm(
    grads: list[torch.Tensor], group: Any = None, sharded: bool = False, numel: int | None = None
) -> torch.Tensor:
    """The 2-norm of all `grads` (float32), the same bits whatever their order or split: each
    square rounded to a grid fixed by the largest element, summed as integers. `sharded`: each
    rank holds a part of the gradient (collective: one MAX, one SUM on `group`), and `numel`
    bounds the whole gradient's elements at any world size (the model's); else every rank
    holds all of it and nothing is sent. Non-finite gradients give a non-finite norm."""
    device = grads[0].device if grads else torch.device("cpu")
    numel = sum(g.numel() for g in grads) if numel is None else numel
    peak = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g.numel():
            peak = torch.maximum(peak, torch.linalg.vector_norm(g.detach(), math.inf).double())
    # NaN does not survive a MAX on every backend: as inf it does, and wins.
    peak = torch.nan_to_num(peak, nan=math.inf, posinf=math.inf)
    if sharded and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    top = peak.item()
    if not math.isfinite(top):
        return torch.tensor(math.inf, dtype=torch.float32, device=device)
    if top == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    # (top * scale)**2 * numel stays below 2**62: the integer sum cannot overflow.
    square_bits = _VALUE_BITS - max(0, math.ceil(math.log2(max(numel, 1))))
    shift = square_bits // 2 - math.frexp(top)[1]
    scale = math.ldexp(1.0, shift)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for g in grads:
        flat = g.detach().reshape(-1)
        for start in range(0, flat.numel(), _PIECE):
            squares = flat[start : start + _PIECE].double().mul_(scale).square_().round_()
            total += squares.to(torch.int64).sum()
    if sharded and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return (total.double() * math.ldexp(1.0, -2 * shift)).sqrt().float()

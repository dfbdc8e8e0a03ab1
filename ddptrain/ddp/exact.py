"""Sums whose bits do not depend on their order: fixed-point integers for gradients and norms.

    shift = fixed_point_shift(reference)          # per parameter, from an agreed magnitude
    acc = torch.zeros(numel, dtype=torch.int64)   # the accumulator (a bucket slot)
    overflowed = add_fixed(acc, grad, shift)      # acc += round(grad * 2**shift), exactly
    peak = add_fixed_float(acc64, grad, shift, room)   # the same in float64 (CPU: faster;
                                                       # a large grad: one compiled pass)
    ... acc summed over ranks by any all_reduce: integer addition is associative ...
    mean_from_fixed(acc, shift, count, grad)      # grad = acc * 2**-shift / count, rounded

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
from collections.abc import Iterable
from typing import Any

import torch

from ddptrain.ddp import compiled
from ddptrain.ddp.buckets import memory_format, memory_order

# A term may be this many powers of two above the reference before it overflows.
HEADROOM_BITS = 16
# Up to 2**COUNT_BITS terms (micro-batches summed over every rank) in one accumulator.
COUNT_BITS = 12
# Bits of an int64 the magnitudes may use (one spare below the sign bit).
VALUE_BITS = 62
# Integers a float64 holds exactly, sums of them included.
FLOAT_EXACT = 2.0**53
# Elements per piece converted at once: the piece stays in cache across its operations, and
# each operation is long enough that its dispatch costs little. A CPU tensor of more elements
# takes the compiled passes (compiled.py).
PIECE = 1 << 18


def fixed_point_shift(reference: float) -> int:
    """The power of two a gradient is scaled by before rounding: values up to
    reference * 2**HEADROOM_BITS, summed 2**COUNT_BITS times, still fit in 62 bits. A zero
    (micro-batch 0 did not reach the parameter) or non-finite reference counts as 1.0."""
    if not math.isfinite(reference) or reference <= 0:
        reference = 1.0
    exponent = math.frexp(reference)[1]  # reference < 2**exponent
    return VALUE_BITS - COUNT_BITS - HEADROOM_BITS - exponent


def term_bound(shift: int) -> float:
    """The largest magnitude a term may have under `shift` without overflowing."""
    return math.ldexp(1.0, VALUE_BITS - COUNT_BITS - shift)


def _flat_pair(acc: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad and acc as 1-D views with their elements in the same order (acc's layout)."""
    grad = grad.detach()
    if grad.stride() != acc.stride():
        grad = grad.contiguous(memory_format=memory_format(acc))
    if acc.is_contiguous():
        return grad.view(-1), acc.view(-1)
    return memory_order(grad), memory_order(acc)


def add_fixed(
    acc: torch.Tensor, grad: torch.Tensor, shift: int, *, first: bool = False
) -> torch.Tensor:
    """acc += round(grad * 2**shift) (acc: int64, grad's shape, any dense layout; `first`:
    acc = ..., whatever it held). Returns a 0-dim bool tensor, True if a term was out of
    range: it was clipped to the bound and the sum is not to be used (a tensor, so that an
    accelerator never waits for it)."""
    flat, target = _flat_pair(acc, grad)
    if not flat.numel():
        return torch.zeros((), dtype=torch.bool, device=acc.device)
    bound = term_bound(shift)
    lo, hi = torch.aminmax(flat)
    # Written so that NaN counts as out of range.
    overflow = torch.logical_not((lo >= -bound) & (hi <= bound))
    scale = math.ldexp(1.0, shift)
    limit = bound * scale
    for start in range(0, flat.numel(), PIECE):
        # float64 holds every float32 times a power of two exactly; round half to even.
        piece = flat[start : start + PIECE].to(torch.float64, copy=True)
        piece.mul_(scale).clamp_(-limit, limit).round_()
        out = target[start : start + piece.numel()]
        if first:
            out.copy_(piece)
        else:
            out.add_(piece.to(torch.int64))
    return overflow


def add_fixed_float(
    acc: torch.Tensor,
    grad: torch.Tensor,
    shift: int,
    room: float,
    *,
    first: bool = False,
    last: bool = False,
) -> float | None:
    """acc += round(grad * 2**shift) with acc float64 holding integers, if every term's
    magnitude is within `room` and the term bound; returns the largest, or None (acc and grad
    left as they were: add_fixed is the way then). The caller keeps every partial sum within
    FLOAT_EXACT, so each add is exact and the sum independent of order, as in int64; on a CPU,
    float64's conversions and adds cost about a third of int64's. `first`: acc = ..., whatever
    it held; `last`: the sum is written as int64 into acc's memory (float_to_fixed's result).
    grad (float32 or float64) may be consumed: scaled and rounded in place, no scratch."""
    if grad.dtype not in (torch.float32, torch.float64) or not -126 <= shift <= 127:
        return None  # a power of two outside float32's range: add_fixed works in float64
    flat, target = _flat_pair(acc, grad)
    if not flat.numel():
        return 0.0
    if flat.numel() > PIECE and flat.device.type == "cpu":
        kernel = compiled.kernel("add", flat.dtype)
        if kernel is not None:
            return _add_fused(kernel, target, flat, shift, room, first, last)
    lo, hi = (v.item() for v in torch.aminmax(flat))
    peak = math.ldexp(max(-lo, hi), shift)
    # Written so that NaN fails it.
    if not (peak <= room and peak <= math.ldexp(term_bound(shift), shift)):
        return None
    scale = math.ldexp(1.0, shift)
    ints = target.view(torch.int64)
    for start in range(0, flat.numel(), PIECE):
        # A float32 times a power of two it can hold is exact; round half to even.
        piece = flat[start : start + PIECE].mul_(scale).round_()
        n = piece.numel()
        if first:
            target[start : start + n].copy_(piece)
        else:
            target[start : start + n].add_(piece)
        if last:
            # Same-size elements: each is read before it is overwritten in place.
            ints[start : start + n].copy_(target[start : start + n])
    return peak


def warm_up(tensors: Iterable[torch.Tensor]) -> bool:
    """Compile now the passes the large ones among `tensors` (CPU float gradients of more than
    2**18 elements) will take (once per process and dtype) rather than in the first
    step; False where torch.compile is unavailable (the eager operations then do their work)."""
    large = [t for t in tensors if t.device.type == "cpu" and t.numel() > PIECE]
    dtypes = {t.dtype for t in large if t.dtype in (torch.float32, torch.float64)}
    kernels = [compiled.kernel(kind, dtype) for dtype in dtypes for kind in ("add", "mean")]
    return all(k is not None for k in kernels)


def _add_fused(
    kernel: Any,
    target: torch.Tensor,
    flat: torch.Tensor,
    shift: int,
    room: float,
    first: bool,
    last: bool,
) -> float | None:
    """add_fixed_float's sum by the compiled kernel, which checks magnitudes after adding:
    its terms are clamped to the room, so the add stays exact and a refused one is taken back
    exactly. grad is left as it was."""
    limit = min(room, math.ldexp(term_bound(shift), shift))
    scale = math.ldexp(1.0, shift)
    ints = target.view(torch.int64)
    top = kernel(
        ints, flat, compiled.scalar(scale), compiled.scalar(limit), first, compiled.scalar(last)
    )
    peak = math.ldexp(top.item(), shift)
    # Written so that NaN fails it.
    if not (peak <= room and peak <= math.ldexp(term_bound(shift), shift)):
        if first:
            return None  # it wrote over what acc held, which was not to be kept
        for start in range(0, flat.numel(), PIECE):
            piece = flat[start : start + PIECE].to(torch.float64, copy=True)
            piece.mul_(scale).round_().nan_to_num_(0.0).clamp_(-limit, limit)
            n = piece.numel()
            if last:  # back from int64; same-size elements, each read before it is written
                ints[start : start + n].sub_(piece.to(torch.int64))
                target[start : start + n].copy_(ints[start : start + n])
            else:
                target[start : start + n].sub_(piece)
        return None
    return peak


def largest_magnitudes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """max |x| of each tensor (none empty) as one float64 tensor, NaN where one holds a NaN:
    the small ones in one call per operation, a large one in one pass, with no copy of it."""
    tops: list[torch.Tensor | None] = [None] * len(tensors)
    small = [i for i, t in enumerate(tensors) if t.numel() <= PIECE]
    for i, t in enumerate(tensors):
        if t.numel() > PIECE:
            lo, hi = torch.aminmax(t.detach())
            tops[i] = torch.maximum(-lo, hi)
    if small:
        found = torch._foreach_max(torch._foreach_abs([tensors[i].detach() for i in small]))
        for i, top in zip(small, found, strict=True):
            tops[i] = top
    return torch.stack(tops).double()


def add_fixed_floats(
    accs: list[torch.Tensor],
    grads: list[torch.Tensor],
    shifts: list[int],
    rooms: list[float],
    firsts: list[bool],
    *,
    last: bool = False,
) -> list[float | None]:
    """add_fixed_float on many tensors at once, the same integers bitwise: one torch call per
    operation for all the small ones instead of several per tensor, which is what a small
    tensor's conversion costs (a large one goes by pieces, as add_fixed_float does it). Per
    tensor: its peak, or None (acc and grad left as they were)."""
    peaks: list[float | None] = [None] * len(grads)
    todo = []
    for i, (grad, shift) in enumerate(zip(grads, shifts, strict=True)):
        if grad.numel() > PIECE:
            peaks[i] = add_fixed_float(accs[i], grad, shift, rooms[i], first=firsts[i], last=last)
        elif grad.dtype in (torch.float32, torch.float64) and -126 <= shift <= 127:
            if grad.numel():
                todo.append(i)
            else:
                peaks[i] = 0.0
    if not todo:
        return peaks
    largest = largest_magnitudes([grads[i] for i in todo]).tolist()
    taken: list[int] = []
    for i, top in zip(todo, largest, strict=True):
        peak = math.ldexp(top, shifts[i])
        # Written so that NaN fails it.
        if peak <= rooms[i] and peak <= math.ldexp(term_bound(shifts[i]), shifts[i]):
            peaks[i] = peak
            taken.append(i)
    if not taken:
        return peaks
    scaled = {i: grads[i].detach() for i in taken}
    # A float32 times a power of two it can hold is exact; round half to even.
    torch._foreach_mul_(list(scaled.values()), [math.ldexp(1.0, shifts[i]) for i in taken])
    torch._foreach_round_(list(scaled.values()))
    copied = [i for i in taken if firsts[i]]
    added = [i for i in taken if not firsts[i]]
    if copied:
        torch._foreach_copy_([accs[i] for i in copied], [scaled[i] for i in copied])
    if added:
        torch._foreach_add_([accs[i] for i in added], [scaled[i] for i in added])
    if last:
        targets = [accs[i] for i in taken]
        # Same-size elements: each is read before it is overwritten in place.
        torch._foreach_copy_([t.view(torch.int64) for t in targets], targets)
    return peaks


def float_to_fixed(acc: torch.Tensor) -> torch.Tensor:
    """The int64 view of a float64 accumulator of integers (each |value| <= FLOAT_EXACT),
    converted in place."""
    flat = memory_order(acc)
    # Same-size elements: each is read before it is overwritten.
    flat.view(torch.int64).copy_(flat)
    return acc.view(torch.int64)


def mean_from_fixed(acc: torch.Tensor, shift: int, count: int, out: torch.Tensor) -> None:
    """out = acc * 2**-shift / count, each element rounded to out's dtype (every rank, every
    world size: the same bits from the same sum); out and acc share one dense layout."""
    flat_out = memory_order(out) if out.stride() == acc.stride() else None
    source = memory_order(acc)
    scale = math.ldexp(1.0, -shift)
    piece = torch.empty(min(PIECE, source.numel()), dtype=torch.float64, device=acc.device)
    result = []
    for start in range(0, source.numel(), PIECE):
        n = min(PIECE, source.numel() - start)
        p = piece[:n]
        p.copy_(source[start : start + n]).mul_(scale).div_(count)
        if flat_out is not None:
            flat_out[start : start + n].copy_(p)
        else:
            result.append(p.to(out.dtype))
    if flat_out is None:
        out.copy_(torch.cat(result).view(out.shape) if result else out)


def means_from_fixed(
    accs: list[torch.Tensor], shifts: list[int], count: int, outs: list[torch.Tensor]
) -> None:
    """mean_from_fixed for many accumulators at once, the same bits; accs and outs of the same
    shapes, and an out may lie in its own acc's first bytes (DDP's .grad in its spent slot):
    each piece is read into a scratch before its results are written. On a CPU the small ones
    go in one call per operation, a large one by pieces that stay in cache; elsewhere each
    goes through mean_from_fixed."""
    # Dividing by a power of two is exact: it joins the scaling, one pass fewer.
    power_of_two = count > 0 and count & (count - 1) == 0
    divisor, extra = (1, count.bit_length() - 1) if power_of_two else (count, 0)
    on_cpu = sum(acc.numel() for acc in accs if acc.device.type == "cpu")
    scratch = torch.empty(min(PIECE, on_cpu), dtype=torch.float64)
    group: list[tuple[torch.Tensor, float, torch.Tensor]] = []
    held = 0

    def convert(group: list[tuple[torch.Tensor, float, torch.Tensor]]) -> None:
        pieces = list(
            scratch[: sum(s.numel() for s, _, _ in group)].split([s.numel() for s, _, _ in group])
        )
        torch._foreach_copy_(pieces, [s for s, _, _ in group])
        torch._foreach_mul_(pieces, [scale for _, scale, _ in group])
        if divisor != 1:
            torch._foreach_div_(pieces, divisor)
        torch._foreach_copy_([t for _, _, t in group], pieces)

    for acc, shift, out in zip(accs, shifts, outs, strict=True):
        if acc.device.type != "cpu" or acc.stride() != out.stride():
            mean_from_fixed(acc, shift, count, out)
            continue
        if not acc.numel():
            continue
        source, target = memory_order(acc), memory_order(out)
        scale = math.ldexp(1.0, -shift - extra)
        kernel = compiled.kernel("mean", out.dtype) if source.numel() > PIECE else None
        if kernel is not None:
            compiled.means(kernel, source, target, scale, divisor)
            continue
        for start in range(0, source.numel(), PIECE):
            part = (source[start : start + PIECE], scale, target[start : start + PIECE])
            if held + part[0].numel() > PIECE:
                convert(group)
                group, held = [], 0
            group.append(part)
            held += part[0].numel()
    if group:
        convert(group)


def means_of_part(
    summed: torch.Tensor, start: int, slots: list[tuple[int, int, torch.dtype, int]], count: int
) -> list[tuple[int, torch.Tensor]]:
    """The means of a part of a bucket of int64 sums (elements start, start + 1, ... of it)
    where each parameter's gradient is read: in the first bytes of its slot. `slots`: per
    parameter (where its slot begins, numel, dtype, shift), in order; elements after the last
    (a tail of other sums) stay as they are. Returns (byte offset in the bucket, bytes)
    pairs, the same bits as means_from_fixed on whole slots."""
    stop = start + summed.numel()
    # Means of 4 bytes or less, each tensor's aligned to 4 bytes.
    rounded = torch.empty(summed.numel() * 4 + 4 * len(slots), dtype=torch.uint8)
    accs, outs, shifts, writes, used = [], [], [], [], 0
    for begins, numel, dtype, shift in slots:
        lo, hi = max(start, begins), min(stop, begins + numel)
        if lo >= hi:
            continue
        size = dtype.itemsize
        if size > 4:
            out = torch.empty(hi - lo, dtype=dtype)
        else:
            out = rounded[used : used + (hi - lo) * size].view(dtype)
            used += -(-(hi - lo) * size // 4) * 4
        accs.append(summed[lo - start : hi - start])
        outs.append(out)
        shifts.append(shift)
        writes.append((begins * 8 + (lo - begins) * size, out.view(torch.uint8)))
    means_from_fixed(accs, shifts, count, outs)
    tail = max(start, slots[-1][0] + slots[-1][1]) if slots else start
    if stop > tail:
        writes.append((tail * 8, summed[tail - start :].view(torch.uint8)))
    return writes

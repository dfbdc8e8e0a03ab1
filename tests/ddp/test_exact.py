"""Order-free sums (ddp/exact.py): fixed-point gradient sums and the exact norm give the same
bits in any grouping, stay within their stated error of float64, and report overflow."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ddptrain.ddp import compiled, exact, norm


def _terms(n: int = 12, numel: int = 70_001) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # Magnitudes spread over six decades, as gradients of one tensor are.
    return [
        torch.randn(numel, generator=g) * 10 ** (-6 * torch.rand(numel, generator=g))
        for _ in range(n)
    ]


def _sum_in_groups(terms: list[torch.Tensor], shift: int, groups: list[list[int]]) -> torch.Tensor:
    total = torch.zeros(terms[0].numel(), dtype=torch.int64)
    for group in groups:
        part = torch.zeros_like(total)
        for i in group:
            assert not exact.add_fixed(part, terms[i], shift)
        total += part
    return total


def test_fixed_point_sums_do_not_depend_on_grouping_or_order():
    """Any split over 1-4 ranks, any order: same integers and mean bitwise; float32 sums vary."""
    terms = _terms()
    shift = exact.fixed_point_shift(max(t.abs().max().item() for t in terms))
    order = list(range(len(terms)))
    random.Random(1).shuffle(order)
    splits = [[order], [order[:6], order[6:]], [order[0::3], order[1::3], order[2::3]]]
    splits.append([order[i::4] for i in range(4)])
    sums = [_sum_in_groups(terms, shift, s) for s in splits]
    assert all(torch.equal(sums[0], s) for s in sums)
    means = []
    for s in sums:
        out = torch.empty(terms[0].numel())
        exact.mean_from_fixed(s, shift, len(terms), out)
        means.append(out)
    assert all(torch.equal(means[0], m) for m in means)
    float_sums = [sum(sum(terms[i] for i in g) for g in s) for s in splits]
    assert not all(torch.equal(float_sums[0], f) for f in float_sums)


def test_fixed_point_mean_is_within_its_grid_of_the_exact_mean():
    """Each mean element is within 2**-shift plus one float32 rounding of the float64 mean."""
    terms = _terms(n=5)
    shift = exact.fixed_point_shift(max(t.abs().max().item() for t in terms))
    acc = _sum_in_groups(terms, shift, [list(range(5))])
    out = torch.empty(terms[0].numel())
    exact.mean_from_fixed(acc, shift, 5, out)
    truth = sum(t.double() for t in terms) / 5
    bound = math.ldexp(1.0, -shift) + truth.abs() * 2**-24
    assert bool(((out.double() - truth).abs() <= bound).all())


def test_a_term_beyond_the_bound_overflows_and_is_reported():
    """A term at the bound (>= 2**HEADROOM_BITS) is summed; one beyond it, or a NaN, overflows."""
    shift = exact.fixed_point_shift(1.0)
    bound = exact.term_bound(shift)
    assert bound >= 2.0**exact.HEADROOM_BITS
    acc = torch.zeros(4, dtype=torch.int64)
    assert not exact.add_fixed(acc, torch.full((4,), -bound), shift)
    assert exact.add_fixed(acc, torch.full((4,), bound * 1.01), shift)
    assert exact.add_fixed(acc, torch.tensor([0.0, math.nan, 0.0, 0.0]), shift)


def test_float64_accumulators_give_the_int64_sums_and_refuse_what_they_cannot_hold():
    """add_fixed_float gives add_fixed's integers bitwise; a NaN or too-large term is a no-op."""
    terms = _terms(n=6, numel=2 * 3 * 5 * 7 * 11)
    shift = exact.fixed_point_shift(max(t.abs().max().item() for t in terms))
    for shape, fmt in (
        ((terms[0].numel(),), torch.contiguous_format),
        ((6, 5, 7, 11), torch.channels_last),
    ):
        ints = torch.zeros(shape, dtype=torch.int64).contiguous(memory_format=fmt)
        floats = torch.full_like(ints, 7, dtype=torch.float64)  # `first` ignores what it held
        bound = 0.0
        for i, t in enumerate(terms):
            t = t.view(shape)
            assert not exact.add_fixed(ints, t, shift)
            first, last = i == 0, i == len(terms) - 1
            consumed = t.clone()
            peak = exact.add_fixed_float(
                floats, consumed, shift, exact.FLOAT_EXACT - bound, first=first, last=last
            )
            assert peak is not None and peak > 0
            bound += peak
        assert torch.equal(floats.view(torch.int64), ints)
    acc = torch.zeros(4, dtype=torch.float64)
    assert exact.add_fixed_float(acc, torch.full((4,), 3.0), 10, room=3.0 * 2**10) == 3.0 * 2**10
    for refused, room in (
        (torch.full((4,), 3.0), 3.0 * 2**10 - 1),
        (torch.tensor([0, math.nan, 0, 0]), 2.0**53),
    ):
        kept = refused.clone()
        assert exact.add_fixed_float(acc, refused, 10, room) is None
        torch.testing.assert_close(refused, kept, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(acc, torch.full((4,), 3.0 * 2**10, dtype=torch.float64))
    halves = torch.zeros(4, dtype=torch.float64)
    assert torch.equal(exact.float_to_fixed(halves.add_(-(2.0**52))), torch.full((4,), -(2**52)))


def _sum_large(terms: list[torch.Tensor], shift: int, refused: torch.Tensor) -> torch.Tensor:
    """add_fixed_float over `terms` (first, middle, last), with `refused` tried as a middle
    term and as the last one."""
    acc = torch.full((terms[0].numel(),), 7.0, dtype=torch.float64)
    bound = 0.0
    for i, t in enumerate(terms):
        first, last = i == 0, i == len(terms) - 1
        if i == 1 or last:
            kept = refused.clone()
            room = exact.FLOAT_EXACT - bound
            assert exact.add_fixed_float(acc, refused, shift, room, last=last) is None
            torch.testing.assert_close(refused, kept, rtol=0, atol=0, equal_nan=True)
        room = exact.FLOAT_EXACT - bound
        peak = exact.add_fixed_float(acc, t.clone(), shift, room, first=first, last=last)
        assert peak is not None
        bound += peak
    return acc.view(torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_pass_gives_the_eager_integers(monkeypatch, dtype):
    """The compiled pass gives the eager integers; a too-large or NaN term leaves the sum alone."""
    # A gradient over one PIECE takes one compiled pass, which adds a too-large term clamped and
    # then takes it back.
    g = torch.Generator().manual_seed(5)
    numel = 3 * exact.PIECE + 17
    terms = [
        (torch.randn(numel, generator=g) * 10 ** (-6 * torch.rand(numel, generator=g))).to(dtype)
        for _ in range(4)
    ]
    shift = exact.fixed_point_shift(max(t.abs().max().item() for t in terms))
    for refused in (terms[0] * 2.0**40, torch.where(terms[0] > 1, math.nan, terms[0])):
        assert compiled.kernel("add", dtype) is not None
        in_one_pass = _sum_large(terms, shift, refused.clone())
        monkeypatch.setitem(compiled.KERNELS, ("add", dtype), False)
        eager = _sum_large(terms, shift, refused.clone())
        monkeypatch.undo()
        assert torch.equal(in_one_pass, eager)
        ints = torch.zeros(numel, dtype=torch.int64)
        for t in terms:
            kept = t.clone()
            assert not exact.add_fixed(ints, t, shift)
            assert torch.equal(t, kept)
        assert torch.equal(in_one_pass, ints)


def test_exact_norm_is_the_same_bits_however_the_gradient_is_split():
    """The exact norm is bitwise equal however split, within 1e-6 of float64; inf/NaN give inf."""
    g = torch.randn(100_003, generator=torch.Generator().manual_seed(2)) * 3e-2
    whole = norm.exact_norm([g])
    for sizes in (1000, 4097, 33_333):
        pieces = list(g.split(sizes))
        random.Random(sizes).shuffle(pieces)
        assert torch.equal(norm.exact_norm(pieces, numel=g.numel()), whole)
    truth = torch.linalg.vector_norm(g.double()).item()
    assert abs(whole.item() - truth) <= 1e-6 * truth
    for bad in (math.inf, math.nan):
        assert norm.exact_norm([g, torch.tensor([bad])]).item() == math.inf


@pytest.mark.parametrize("reference", [0.0, math.inf, 3.0e-7, 5.0e4])
def test_the_shift_keeps_the_headroom_for_any_reference(reference):
    """term_bound(fixed_point_shift(r)) is at least r * 2**HEADROOM_BITS (1.0 for 0 or inf)."""
    r = reference if 0 < reference < math.inf else 1.0
    assert exact.term_bound(exact.fixed_point_shift(reference)) >= r * 2**exact.HEADROOM_BITS


def test_many_tensors_at_once_give_one_at_a_time_bits():
    """add_fixed_floats gives add_fixed_float's integers and peaks bitwise, refusals alike."""
    g = torch.Generator().manual_seed(3)
    shapes = [(7,), (0,), (40, 20, 5, 5), (300, 1000), (100, 640), (3,), (5,), (4,)]
    shift = exact.fixed_point_shift(4.0)
    for last in (False, True):
        accs, ref_accs, grads = [], [], []
        for shape in shapes:
            fmt = torch.channels_last if len(shape) == 4 else torch.contiguous_format
            acc = torch.randint(-(2**40), 2**40, shape, generator=g).double()
            accs.append(acc.contiguous(memory_format=fmt))
            ref_accs.append(accs[-1].clone())
            grads.append(torch.randn(shape, generator=g).contiguous(memory_format=fmt))
        grads[-3] = grads[-3].bfloat16()
        grads[-2][1] = math.nan
        firsts = [i % 2 == 0 for i in range(len(shapes))]
        rooms = [exact.FLOAT_EXACT - 2.0**41] * (len(shapes) - 1) + [2.0**31]
        kept = [t.clone() for t in grads]
        peaks = exact.add_fixed_floats(accs, grads, [shift] * len(shapes), rooms, firsts, last=last)
        for i, t in enumerate(kept):
            want = exact.add_fixed_float(
                ref_accs[i], t, shift, rooms[i], first=firsts[i], last=last
            )
            assert peaks[i] == want
            assert torch.equal(accs[i].view(torch.int64), ref_accs[i].view(torch.int64))
        assert peaks[-3:] == [None, None, None]
        for t, left in zip(kept[-3:], grads[-3:], strict=True):
            torch.testing.assert_close(left, t, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("in_one_pass", [True, False])
def test_means_at_once_give_mean_from_fixed_bits(monkeypatch, in_one_pass):
    """means_from_fixed gives mean_from_fixed's float32 means bitwise, also written in place."""
    # Power-of-two counts fold into the scaling and other counts round: both are covered.
    if in_one_pass:
        assert compiled.kernel("mean", torch.float32) is not None
    else:
        monkeypatch.setitem(compiled.KERNELS, ("mean", torch.float32), False)
    g = torch.Generator().manual_seed(4)
    for count in (1, 3, 8, 12):
        shapes = [(1000,), (6, 5, 7, 11), (2,), (1100, 1000)]
        accs, outs, want = [], [], []
        for shape in shapes:
            fmt = torch.channels_last if len(shape) == 4 else torch.contiguous_format
            acc = torch.randint(-(2**62), 2**62, shape, generator=g)
            acc = (acc >> torch.randint(0, 60, shape, generator=g)).contiguous(memory_format=fmt)
            accs.append(acc)
            want.append(torch.empty(shape).contiguous(memory_format=fmt))
            exact.mean_from_fixed(acc, 40, count, want[-1])
            outs.append(torch.empty_like(want[-1]))
        exact.means_from_fixed([a.clone() for a in accs], [40] * len(shapes), count, outs)
        assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))
        spent = [a.clone(memory_format=torch.preserve_format) for a in accs]
        inside = [_first_bytes(a, w) for a, w in zip(spent, want, strict=True)]
        exact.means_from_fixed(spent, [40] * len(shapes), count, inside)
        assert all(torch.equal(o, w) for o, w in zip(inside, want, strict=True))
        for acc, w in zip(accs, want, strict=True):  # one at a time, as on an accelerator
            out = _first_bytes(acc, w)
            exact.mean_from_fixed(acc, 40, count, out)
            assert torch.equal(out, w)


def _first_bytes(acc: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A float32 tensor shaped and strided as `like`, in the first bytes of int64 `acc`."""
    raw = acc.permute(sorted(range(acc.dim()), key=lambda d: -acc.stride(d))).reshape(-1)
    assert raw.data_ptr() == acc.data_ptr()
    return (
        raw.view(torch.uint8)[: like.numel() * 4]
        .view(torch.float32)
        .as_strided(like.shape, like.stride())
    )


@pytest.mark.parametrize("parts", [1, 3, 4])
def test_means_of_parts_written_into_a_bucket_give_whole_slot_means(parts):
    """means_of_part over any cut of a bucket gives whole-slot means bitwise and keeps the tail."""
    g = torch.Generator().manual_seed(9)
    params = [(700, torch.float32), (5, torch.float64), (1201, torch.bfloat16), (64, torch.float32)]
    tail_numel = 7
    numel = sum(n for n, _ in params) + tail_numel
    bucket = torch.randint(-(2**50), 2**50, (numel,), generator=g)
    shifts, slots, begins = [30, 44, 12, 38], [], 0
    for (n, dtype), shift in zip(params, shifts, strict=True):
        slots.append((begins, n, dtype, shift))
        begins += n
    count = 12
    result = torch.zeros_like(bucket)
    cuts = sorted(torch.randperm(numel - 1, generator=g)[: parts - 1].add(1).tolist())
    for start, stop in zip([0, *cuts], [*cuts, numel], strict=True):
        for offset, data in exact.means_of_part(bucket[start:stop], start, slots, count):
            result.view(torch.uint8)[offset : offset + data.numel()] = data
    for begins, n, dtype, shift in slots:
        want = torch.empty(n, dtype=dtype)
        exact.mean_from_fixed(bucket[begins : begins + n], shift, count, want)
        got = result[begins:].view(torch.uint8)[: n * dtype.itemsize].view(dtype)
        assert torch.equal(got, want), dtype
    assert torch.equal(result[-tail_numel:], bucket[-tail_numel:])

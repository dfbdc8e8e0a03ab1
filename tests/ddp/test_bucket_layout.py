"""Bucket layouts: every gradient has one slot, in its parameter's memory layout (pure tensor
functions, no processes)."""

import pytest
import torch

from ddptrain.ddp.buckets import (
    CAST_CHUNK,
    build_layout,
    fill_slot,
    memory_format,
    memory_order,
    view_like,
)


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def _bf16(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.bfloat16, device=device)


def test_build_layout_gives_each_parameter_one_slot_and_a_tail_after_the_last_bucket_if_asked():
    """Slots tile the buckets in launch order without overlap; an asked-for tail ends the last."""
    params = [torch.empty(300), torch.empty(4, 5, 3, 3).to(memory_format=torch.channels_last)]
    params.append(torch.empty(1000))
    # 1.2 KB closes the first bucket after parameter 2; 0 and 1 share the second.
    layout = build_layout(params, [2, 1, 0], 10**6, 1200, _zeros, as_view=True, tail=4)
    assert layout.order == [2, 1, 0]
    assert layout.members == [[2], [1, 0]] and layout.lens == [1, 2]
    assert layout.bucket_of == [1, 1, 0]
    assert [f.numel() for f in layout.flats] == [1000, 180 + 300 + 3 + 1]
    assert layout.views[2].data_ptr() == layout.flats[0].data_ptr()
    second = layout.flats[1]
    assert layout.views[1].data_ptr() == second.data_ptr()
    assert layout.views[0].data_ptr() == second[180:].data_ptr()
    assert layout.views[1].stride() == params[1].stride()
    assert layout.tail.data_ptr() == second[480:].data_ptr()
    assert layout.tail.numel() == 4
    assert layout.grad_is_view == [True, True, True]
    plain = build_layout(params, [2, 1, 0], 10**6, 1200, _zeros, as_view=True)
    assert [f.numel() for f in plain.flats] == [1000, 180 + 300] and plain.tail is None


def test_build_layout_makes_gradients_copies_where_the_bucket_dtype_differs():
    """A bucket in a narrower wire dtype (bf16), or as_view=False, never holds .grad itself."""
    params = [torch.empty(8), torch.empty(8)]
    assert build_layout(params, [1, 0], 10**6, 10**6, _bf16, True, 3).grad_is_view == [False] * 2
    assert build_layout(params, [1, 0], 10**6, 10**6, _zeros, False, 3).grad_is_view == [False] * 2


def test_fill_slot_scales_copies_zeroes_and_corrects_every_case():
    """Each way a gradient reaches its slot leaves exactly grad / divisor there."""
    grad = torch.arange(6, dtype=torch.float32) + 1
    scratch = torch.empty(0)
    view = torch.full((6,), 7.0)
    fill_slot(view, grad, 4, False, scratch)  # a separate gradient: scaled while copied
    assert torch.equal(view, grad / 4)
    fill_slot(view, None, 4, False, scratch)  # no gradient on this rank counts as zero
    assert torch.equal(view, torch.zeros(6))
    view.copy_(grad)
    fill_slot(view, view, 3, False, scratch)  # accumulated in place: divided where it lies
    assert torch.equal(view, grad / 3)
    view.copy_(grad / 2)  # claimed: autograd wrote the scaled gradient into the slot
    fill_slot(view, view, 2, True, scratch)
    assert torch.equal(view, grad / 2)
    # Claimed, but autograd added a second gradient (10s) to the slot's value outside it.
    fill_slot(view, view + 10, 2, True, scratch)
    assert torch.equal(view, grad / 2 + 5)


def test_fill_slot_narrows_through_a_scratch_of_the_gradient_dtype():
    """A bf16 slot gets grad / divisor rounded once; the scratch is made once and then reused."""
    grad = torch.randn(CAST_CHUNK + 5)
    view = torch.empty(grad.numel(), dtype=torch.bfloat16)
    scratch = fill_slot(view, grad, 2, False, torch.empty(0))
    assert scratch.dtype == torch.float32 and scratch.numel() == CAST_CHUNK
    assert torch.equal(view, (grad / 2).to(torch.bfloat16))
    assert fill_slot(view, grad, 2, False, scratch) is scratch


@pytest.mark.parametrize(
    "shape, fmt",
    [
        ((6, 3, 4, 5), torch.channels_last),
        ((6, 1, 5, 5), torch.channels_last),  # one channel: channels_last and contiguous at once
        ((2, 3, 4, 5, 6), torch.channels_last_3d),
        ((7, 9), torch.contiguous_format),
    ],
)
def test_view_like_takes_the_strides_and_memory_order_walks_the_buffer(shape, fmt):
    """A view of a flat buffer has the parameter's strides, and memory_order returns the buffer."""
    p = torch.empty(shape).contiguous(memory_format=fmt)
    flat = torch.arange(p.numel(), dtype=torch.float32)
    view = view_like(flat, p)
    assert view.shape == p.shape and view.stride() == p.stride()
    assert view.data_ptr() == flat.data_ptr()
    assert torch.equal(memory_order(view), flat)


def test_memory_format_names_channels_last_only_when_not_also_contiguous():
    """memory_format: channels_last for an NHWC tensor, contiguous for a plain or 1-channel one."""
    assert memory_format(torch.empty(2, 3, 4, 5, memory_format=torch.channels_last)) is (
        torch.channels_last
    )
    assert memory_format(torch.empty(2, 3, 4, 5)) is torch.contiguous_format
    assert memory_format(torch.empty(2, 1, 4, 5, memory_format=torch.channels_last)) is (
        torch.contiguous_format
    )

"""Bucket views keep a parameter's memory layout (pure tensor functions, no processes)."""

import pytest
import torch

from ddptrain.parallel.layout import memory_format, memory_order, view_like


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

"""Comparing optimizer state_dicts across wrappers and sharding."""

from __future__ import annotations

import torch


def layout(t: torch.Tensor) -> list[int]:
    """The strides of t's dimensions of size > 1: its memory layout (a size-1 dimension's
    stride is arbitrary)."""
    return [s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1]


def optimizer_state_diff(a: dict, b: dict, *, same_layout: bool = False) -> float:
    """Largest difference between two optimizer state_dicts; inf if their structure differs
    (and, with same_layout, if a tensor's memory layout does)."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return float("inf")
    worst = 0.0
    for index, entry in a["state"].items():
        other = b["state"][index]
        if entry.keys() != other.keys():
            return float("inf")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                if value.shape != other[key].shape:
                    return float("inf")
                if same_layout and layout(value) != layout(other[key]):
                    return float("inf")
                if value.numel():
                    worst = max(worst, (value.double() - other[key].double()).abs().max().item())
            elif value != other[key]:
                return float("inf")
    return worst

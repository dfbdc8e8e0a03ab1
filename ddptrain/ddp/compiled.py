"""Compiled passes of the exact sums (exact.py): one read of a large gradient where eager
operations take four, the same bits.

    add = kernel("add", torch.float32)        # None where torch.compile fails here
    top = add(slot_int64, grad, scalar(2.0**shift), scalar(limit), first, scalar(last))
    mean = kernel("mean", torch.float32)
    mean(out, sums_int64, scalar(2.0**-shift), scalar(count))

Each kernel is compiled once per process and dtype, on scratch tensors, with dynamic sizes
(the cost is in docs/guide.md, "Same bits at any world size"); its scalars are tensors, so a
new value is not a new compilation.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch


def _fused_add(
    acc: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    limit: torch.Tensor,
    first: bool,
    last: torch.Tensor,
) -> torch.Tensor:
    """In one pass over int64 `acc`, which holds float64 integers: acc (+)= round(x * scale)
    clamped to +-limit (NaN as 0; `first`: =), written back as int64 if `last`, else as the
    float64's bits. Returns max |x|. `last` is a tensor: one compiled graph serves both (a
    first term's graph does not read acc)."""
    term = torch.round(x * scale).to(torch.float64)
    # Not nan_to_num: the compiler does not vectorize it (three times slower).
    term = torch.where(term == term, term, 0.0).clamp(-limit, limit)
    total = term if first else acc.view(torch.float64) + term
    acc.copy_(torch.where(last, total.to(torch.int64), total.view(torch.int64)))
    return x.abs().amax()


def _fused_mean(out: torch.Tensor, acc: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor):
    """out = acc * scale / divisor in float64, rounded to out's dtype, in one pass."""
    out.copy_((acc.to(torch.float64) * scale / divisor).to(out.dtype))


class _Compiled:
    """A compiled kernel called as it was compiled: without autograd, and without taking two
    sizes that happen to be equal for the same symbol (duck shapes: a bucket slot's offset
    and a gradient's length), either of which would compile it again."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        shapes: Any = contextlib.nullcontext()
        with contextlib.suppress(ImportError):  # a private module: older torch may lack it
            from torch.fx.experimental import _config

            shapes = _config.patch(use_duck_shape=False)
        with torch.no_grad(), shapes:
            return self.fn(*args)


# Per (kind, dtype): the compiled kernel, or False where torch.compile failed here.
KERNELS: dict[tuple[str, torch.dtype], Any] = {}


def scalar(value: float | bool) -> torch.Tensor:
    """A kernel's argument: a tensor, so that a new value needs no new compilation."""
    return torch.tensor(value, dtype=torch.bool if isinstance(value, bool) else torch.float64)


def kernel(kind: str, dtype: torch.dtype) -> Any:
    """_fused_add ("add", for `dtype` gradients) or _fused_mean ("mean", into `dtype`),
    compiled (tried once, on scratch tensors), or None: a compiled pass reads a gradient once
    where eager operations take four passes over it, and gives the same bits."""
    if (kind, dtype) not in KERNELS:
        fn = _fused_add if kind == "add" else _fused_mean
        kernel = _Compiled(torch.compile(fn, dynamic=True, fullgraph=True))
        acc = torch.zeros(64, dtype=torch.int64)
        if kind == "add":
            x, factors = torch.ones(64, dtype=dtype), (scalar(1.0), scalar(2.0))
            calls = [(acc, x, *factors, first, scalar(False)) for first in (True, False)]
        else:
            calls = [(torch.empty(64, dtype=dtype), acc, scalar(1.0), scalar(3.0))]
        try:
            with warnings.catch_warnings():
                # torch's compiler imports deprecated torch.jit names: not the user's concern.
                warnings.simplefilter("ignore", DeprecationWarning)
                for args in calls:
                    kernel(*args)
            KERNELS[kind, dtype] = kernel
        except Exception as e:  # no compiler, an unsupported platform: the eager way works
            said = False in KERNELS.values()
            KERNELS[kind, dtype] = False
            if not said:
                warnings.warn(
                    f"deterministic mode: torch.compile is unavailable here "
                    f"({type(e).__name__}); large gradients are rounded by eager operations, "
                    "about twice as slow",
                    stacklevel=2,
                )
    return KERNELS[kind, dtype] or None


# Elements a compiled mean converts at once: few calls, and a small scratch (4 MiB, float32).
_MEAN_PIECE = 1 << 20


def means(
    kernel: Any, source: torch.Tensor, target: torch.Tensor, scale: float, divisor: int
) -> None:
    """target = source * scale / divisor by the "mean" kernel (both 1-D), piece by piece;
    target may lie in source's first bytes (DDP's .grad in its spent slot): a piece that
    would overwrite bytes still to be read (the first) goes through a scratch."""
    rounded: torch.Tensor | None = None
    factors = (scalar(scale), scalar(float(divisor)))
    end = source.data_ptr() + source.numel() * source.element_size()
    for start in range(0, source.numel(), _MEAN_PIECE):
        piece = source[start : start + _MEAN_PIECE]
        place = target[start : start + piece.numel()]
        lo = place.data_ptr()
        if lo + place.numel() * place.element_size() <= piece.data_ptr() or lo >= end:
            kernel(place, piece, *factors)
            continue
        if rounded is None:
            rounded = torch.empty(piece.numel(), dtype=target.dtype)
        part = rounded[: piece.numel()]
        kernel(part, piece, *factors)
        place.copy_(part)

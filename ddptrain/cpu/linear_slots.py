"""Linear layers whose gradients autograd computes straight into their bucket slots.

    mode = slots_mode(module, claim)  # claim(param) -> (its bucket view, scale) or None
    with mode:                          # the DDP wrapper's synchronized forward
        out = module(x)                 # F.linear on a large weight goes through _Linear

The CPU transports offer this mode to the wrapper (`Transport.forward_mode`): a measured
speedup for CPU ranks, where copying gradients is memory bandwidth the step spends.

Autograd computes each gradient into a fresh tensor; the wrapper's hook then copies it, scaled
by 1/world_size, into the parameter's bucket slot and frees it. For an MLP's large layers that
is a pass over every gradient byte each step and a gradient-sized transient beside the buckets
at the memory peak (20 MiB for a 2240 x 2240 weight). While a synchronized forward runs, the
wrapper enters this torch function mode, which sends F.linear on its parameters through
`_Linear`: the same forward, and a backward that runs the mm and sum autograd runs for F.linear
with the parameter's bucket slot as the output, scaled there (by the GEMM's alpha when the
scale is a power of two: exact, so the bits of the copy path), and returns the slot as the
gradient. With no `.grad` yet, AccumulateGrad adopts a returned tensor that nobody else holds
as `.grad` without copying it; the wrapper's hook finds it in place, already scaled.

A second gradient for the same parameter in one backward (a tied weight, a penalty term) is
summed by autograd before AccumulateGrad, never into the slot (autograd adds in place only into
memory it alone holds, and the bucket holds the slot's), so the hook sees a tensor other than
the slot and corrects: slot + scale * (sum - slot). The slot is not claimed, and the backward
returns what autograd would, when writing there would change what anyone sees: a `.grad` to
accumulate into (no_sync, zero_grad(set_to_none=False)), create_graph, hooks on the parameter
(they must see the local gradient), a slot already claimed in this backward, a backward that
does not accumulate into this parameter (torch.autograd.grad, backward(inputs=...)). Autocast, other
dtypes, N-D inputs that are not contiguous, calls under torch.func transforms and calls
while saved-tensor hooks are active (non-reentrant activation checkpointing) are not
intercepted.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ddptrain.ddp.hooks import Claim

# Layers whose weight is smaller keep autograd's own function: routing a call through a Python
# autograd function costs about what the copy it saves costs at ~1 MiB (docs/benchmarks.md,
# "Costs the code is shaped around").
SLOT_MIN_BYTES = 1 << 20


def slots_mode(module: nn.Module, claim: Claim) -> LinearSlots | None:
    """The mode for `module`'s large Linear layers (slot_params), or None if it has none."""
    params = slot_params(list(module.modules()))
    return LinearSlots(claim, params) if params else None


def slot_params(modules: list[nn.Module], min_bytes: int | None = None) -> list[torch.Tensor]:
    """Weights (and their biases) of the nn.Linear layers among `modules` worth routing:
    trainable, on CPU, weights of at least `min_bytes` (default SLOT_MIN_BYTES) (pure)."""
    floor = SLOT_MIN_BYTES if min_bytes is None else min_bytes
    out = []
    for m in modules:
        w = m.weight if isinstance(m, nn.Linear) else None
        if w is None or not w.requires_grad or w.device.type != "cpu":
            continue
        if w.numel() * w.element_size() >= floor:
            out += [w] if m.bias is None else [w, m.bias]
    return out


class LinearSlots(TorchFunctionMode):
    """Routes F.linear on parameters that `claim` knows through `_Linear` (see module doc)."""

    def __init__(self, claim: Claim, params: list[torch.Tensor]) -> None:
        super().__init__()
        self._claim = claim
        self._ids = frozenset(id(p) for p in params)
        # Calls per parameter in this forward: a parameter used twice (tied weights) keeps
        # autograd's own summing and the copy path, which stay bitwise official DDP's.
        self._uses: dict[int, int] = {}

    def __enter__(self) -> LinearSlots:
        self._uses = {}
        return super().__enter__()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # A compiled module inside the synchronized forward: its graph computes the
            # gradients (_Linear's slots would be traced into it, guarded on every weight).
            return func(*args, **kwargs)
        for a in (*args, *kwargs.values()):
            if id(a) in self._ids:
                self._uses[id(a)] = self._uses.get(id(a), 0) + 1
        if func is F.linear and self._routable(*args, **kwargs):
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            # Bias before weight: the order autograd's addmm backward makes their gradients
            # ready in, so buckets fill as they would without this mode.
            return _Linear.apply(x, bias, weight, self._claim_once_used)
        return func(*args, **kwargs)

    def _claim_once_used(self, param: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        return None if self._uses.get(id(param), 0) > 1 else self._claim(param)

    def _routable(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> bool:
        if id(weight) not in self._ids or not weight.requires_grad:
            return False
        if type(x) is not torch.Tensor or x.dtype != weight.dtype or x.dim() < 2:
            return False
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            return False  # under vmap/grad: a custom Function would need their rules
        if not torch.is_grad_enabled() or _saved_tensors_hooked():
            # Saved-tensor hooks (non-reentrant activation checkpointing, offloading) replay
            # or replace what the forward saved, matched by position against a recomputation
            # that runs outside this mode, so the saved tensors must be autograd's own.
            return False
        if x.dim() > 2 and not x.is_contiguous():
            return False
        if bias is not None and (bias.dtype != weight.dtype or id(bias) not in self._ids):
            return False
        return not torch.is_autocast_enabled(x.device.type)


# Private torch API; without it, assume hooks may be active and route nothing.
_TOP_SAVED_TENSOR_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_tensors_hooked() -> bool:
    return _TOP_SAVED_TENSOR_HOOKS is None or _TOP_SAVED_TENSOR_HOOKS(False) is not None


class _Linear(torch.autograd.Function):
    """F.linear whose parameter gradients land in their bucket slots when `claim` allows."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        weight: torch.Tensor,
        claim: Claim,
    ) -> torch.Tensor:
        needs_x, _, needs_w, _ = ctx.needs_input_grad
        # Only what autograd's addmm saves: a weight changed in place after this forward
        # still backpropagates when no input gradient needs it (a frozen-input first layer).
        ctx.save_for_backward(x if needs_w else None, weight if needs_x else None)
        # The parameters themselves, not saved tensors: claim() asks them for .grad, which no
        # in-place change invalidates (leaves: no reference cycle through ctx).
        ctx.params = (bias, weight)
        ctx.x_shape = x.shape
        ctx.claim = claim
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs_x, needs_b, needs_w, _ = ctx.needs_input_grad
        x_shape = ctx.x_shape
        # Rows of samples: what at::linear folds an N-D input into.
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = g2.mm(weight).view(x_shape) if needs_x else None
        # The same calls autograd makes for F.linear, so the same bits.
        grad_w = None
        if needs_w:
            grad_w = _into(ctx.claim, ctx.params[1], torch.mm, g2.t(), x.reshape(-1, x_shape[-1]))
        grad_b = _into(ctx.claim, ctx.params[0], torch.sum, g2, 0) if needs_b else None
        return grad_x, grad_b, grad_w, None


def _into(claim: Claim, param: torch.Tensor, op: Any, *args: Any) -> torch.Tensor:
    # create_graph needs differentiable gradients; out= results are not.
    claimed = None if torch.is_grad_enabled() else claim(param)
    if claimed is None:
        return op(*args)
    slot, scale = claimed
    # A new tensor object on the slot's memory, held by nobody else once returned, so
    # AccumulateGrad adopts it instead of copying it.
    out = slot.detach()
    if op is torch.mm and scale != 1.0 and math.frexp(scale)[0] == 0.5:
        # beta=0: the slot's old contents are ignored, NaNs included.
        torch.addmm(out, *args, beta=0.0, alpha=scale, out=out)
        return out
    op(*args, out=out)
    if scale != 1.0:
        # Not folded into alpha: a GEMM's alpha rounds differently from this multiply unless
        # the scale is a power of two.
        out.mul_(scale)
    return out

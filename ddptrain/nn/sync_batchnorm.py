"""SyncBatchNorm: batch statistics over the global batch (all ranks), on CPU/gloo and CUDA/NCCL.

    model = ddptrain.convert_sync_batchnorm(Net())       # every BatchNorm1d/2d/3d, weights kept
    model = ddptrain.DDP(model.to(info.device))
    # or: TrainerConfig(sync_batchnorm=True)

In training mode each rank packs its per-channel count, mean and M2 (sum of squared deviations),
the ranks all_gather the packs, and every rank merges them the same way (Chan et al.), so the
mean and variance are those of the concatenated global batch. Backward all_reduces the two
per-channel gradient sums the input gradient needs. Eval mode uses the running statistics and
communicates nothing. World size 1 (or no process group) runs the same code.

Collective sequence (what a rank that has run out of data must answer: `shadow_forward`):
- forward, training mode, first call of each module instance only: one all_gather of a
  1-element int64 tensor [num_features] (packs of different sizes would abort gloo, so a
  mismatch is caught here with a clear error instead).
- forward, training mode, every call: one all_gather (`_all_gather_stats`) of a float64 tensor
  of 2 + 2*num_features values [count, channels, mean(C), M2(C)] on the input's device.
- backward of that forward (whenever autograd runs it): one all_reduce (`_all_reduce_grads`,
  sum) of a float64 tensor of 2*num_features values [sum(dy), sum(dy * (x - mean))].
All go to the module's `process_group` (None: the default group). Several SyncBatchNorm layers
gather in forward order and reduce in autograd's backward order (reverse of forward for a
chain). The DDP wrapper's transports reduce buckets on channels of their own; a comm hook
registered on this same group is refused, since its reductions would interleave with these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_HEADER = 2  # count, channels


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the batch concatenated over all ranks.

    Invariants:
    - Training forward: mean and biased variance of the global batch, merged in float64 from
      per-rank (count, mean, M2); ranks may hold different batch sizes, 0 included.
    - Running mean and unbiased running variance (and num_batches_tracked) are updated exactly
      as nn.BatchNorm would on the global batch, identically on every rank.
    - Backward: input gradients use the global sums; weight/bias gradients are this rank's
      own sums, which the DDP wrapper then averages like any other gradient.
    - Errors found from the gathered statistics (channel counts differ between ranks, fewer
      than 2 values per channel globally) are raised on every rank, so none is left waiting.
    - Eval mode: running statistics, no communication. Same state_dict keys as nn.BatchNorm.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group
        self._num_features_checked = False

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(
                f"expected an input of at least 2 dimensions (N, C, ...), got {x.dim()}D"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            # Without running statistics BatchNorm normalizes with the batch's own, locally.
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias,
                self.running_mean is None, 0.0, self.eps,
            )  # fmt: skip
        with torch.no_grad():
            mean, var, count = self._global_stats(x)
        return _SyncBatchNormFunction.apply(
            x, self.weight, self.bias, mean, var, self.eps, count, self.process_group
        )

    def _global_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Global mean and biased variance (float64) from one all_gather; updates running stats."""
        if not self._num_features_checked:
            _check_same_num_features(self.num_features, x.device, self.process_group)
            self._num_features_checked = True
        packed = _local_stats(x, self.num_features)
        gathered = _all_gather_stats(packed, self.process_group)
        # One host read of the headers (a single device sync under CUDA).
        header = gathered[:, :_HEADER].long().tolist()
        counts, channels = [h[0] for h in header], [h[1] for h in header]
        if any(c != self.num_features for c in channels):
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got inputs with different channel counts "
                f"on different ranks: {channels} (by rank); every rank must feed "
                f"(N, {self.num_features}, ...)"
            )
        total = sum(counts)
        if total < 2:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total} over all "
                f"{len(counts)} ranks (per rank: {counts})"
            )
        mean, m2 = _merge(gathered[:, 0], gathered, self.num_features)
        self._update_running_stats(mean, m2, total)
        return mean, m2 / total, total

    def shadow_forward(self) -> None:
        """Answer one training forward's collectives with a zero contribution (count 0).

        For a rank that has no batch while the others train (join: ddp/join.py's JoinShadow):
        the running statistics are updated from the others' batch, so they stay equal on every
        rank.
        """
        with torch.no_grad():
            self._global_stats(torch.empty(0, self.num_features, device=_device(self)))

    def shadow_backward(self) -> None:
        """Answer one backward's all_reduce with zero gradient sums."""
        zeros = torch.zeros(2 * self.num_features, dtype=torch.float64, device=_device(self))
        _all_reduce_grads(zeros, self.process_group)

    def _update_running_stats(self, mean: torch.Tensor, m2: torch.Tensor, total: int) -> None:
        if not self.track_running_stats or self.running_mean is None:
            return
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        unbiased = m2 / (total - 1)
        for buf, stat in ((self.running_mean, mean), (self.running_var, unbiased)):
            buf.copy_(buf.double() * (1.0 - factor) + stat * factor)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps, count, group):
        # Statistics kept in the input's precision, float32 at least (bf16/fp16 inputs).
        dtype = torch.promote_types(x.dtype, torch.float32)
        invstd = torch.rsqrt(var + eps)
        stat_dtype = weight.dtype if weight is not None else dtype
        y = F.batch_norm(x, mean.to(stat_dtype), var.to(stat_dtype), weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean.to(dtype), invstd.to(dtype))
        ctx.count, ctx.group = count, group
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        shape = (1, -1) + (1,) * (x.dim() - 2)
        dims = [0, *range(2, x.dim())]
        dy_c = dy.to(mean.dtype)
        xmu = x.to(mean.dtype) - mean.view(shape)
        sum_dy = dy_c.sum(dims)
        sum_dy_xmu = (dy_c * xmu).sum(dims)
        total = _all_reduce_grads(torch.cat([sum_dy, sum_dy_xmu]).double(), ctx.group)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            c = mean.numel()
            mean_dy = (total[:c] / ctx.count).to(mean.dtype)
            mean_dy_xmu = (total[c:] / ctx.count).to(mean.dtype)
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            grad_input = (
                dy_c - mean_dy.view(shape) - xmu * (invstd * invstd * mean_dy_xmu).view(shape)
            ) * scale.view(shape)
            grad_input = grad_input.to(x.dtype).contiguous(memory_format=_memory_format(x))
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:  # affine: weight and bias together
            grad_bias = sum_dy.to(weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every nn.BatchNorm1d/2d/3d in `module` (recursively) by a SyncBatchNorm."""
    out = module
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        # The very tensors move over (not copies): device, dtype, requires_grad and any
        # optimizer already holding the parameters stay valid.
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out


def _local_stats(x: torch.Tensor, num_features: int) -> torch.Tensor:
    """[count, channels, mean(C), M2(C)] of this rank's input, float64 (zeros if unusable)."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    packed = torch.zeros(_HEADER + 2 * num_features, dtype=torch.float64, device=x.device)
    packed[1] = channels
    if channels != num_features:
        return packed  # every rank raises once the channel counts are gathered
    packed[0] = count
    if count > 0:
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(
            x.to(torch.promote_types(x.dtype, torch.float32)), dims, correction=0
        )
        packed[_HEADER : _HEADER + num_features] = mean
        packed[_HEADER + num_features :] = var.double() * count
    return packed


def _merge(
    counts: torch.Tensor, gathered: torch.Tensor, num_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and M2 from per-rank (count, mean, M2), Chan et al.'s parallel merge."""
    means = gathered[:, _HEADER : _HEADER + num_features]
    m2s = gathered[:, _HEADER + num_features :]
    n = counts.unsqueeze(1)
    mean = (n * means).sum(0) / counts.sum()
    # Sum of non-negative terms: no cancellation, unlike E[x^2] - E[x]^2.
    m2 = m2s.sum(0) + (n * (means - mean) ** 2).sum(0)
    return mean, m2


def _all_gather_stats(packed: torch.Tensor, group: Any) -> torch.Tensor:
    """The forward's only collective: every rank's pack, stacked by rank."""
    if not dist.is_initialized():
        return packed.unsqueeze(0)
    out = packed.new_empty(dist.get_world_size(group) * packed.numel())
    _all_gather(out, packed, group)
    return out.view(-1, packed.numel())


def _all_reduce_grads(packed: torch.Tensor, group: Any) -> torch.Tensor:
    """The backward's only collective: [sum(dy), sum(dy * (x - mean))] summed over ranks."""
    if dist.is_initialized():
        dist.all_reduce(packed, group=group)
    return packed


def _check_same_num_features(num_features: int, device: torch.device, group: Any) -> None:
    if not dist.is_initialized():
        return
    mine = torch.tensor([num_features], dtype=torch.int64, device=device)
    out = mine.new_empty(dist.get_world_size(group))
    _all_gather(out, mine, group)
    sizes = out.tolist()
    if any(s != num_features for s in sizes):
        raise ValueError(
            f"SyncBatchNorm layers have different channel counts on different ranks: {sizes} "
            "(by rank); build the same model on every rank"
        )


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    # torch 2.13 renamed all_gather_into_tensor (and warns on the old name).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if (
        x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
    ):
        return torch.channels_last
    if (
        x.dim() == 5
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last_3d)
    ):
        return torch.channels_last_3d
    return torch.contiguous_format


def _device(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")

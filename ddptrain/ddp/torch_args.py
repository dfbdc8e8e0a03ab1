"""torch DDP's constructor arguments: which mean something here, which need nothing, which not.

    options = torch_options(module, device_ids=[0], bucket_cap_mb=None, ...)   # pure checks
    args, kwargs = move_inputs(args, kwargs, options.input_device)             # forward

A program written for `torch.nn.parallel.DistributedDataParallel` passes these positionally or
by name; the wrapper accepts them all, with torch's meaning where one applies and torch's error
where torch errs (GPU ids for a CPU module). Accepted and needing nothing here:
`find_unused_parameters`, `static_graph`, `skip_all_reduce_unused_params` (unused parameters
are always handled: flags say which were used anywhere), `check_reduction` (deprecated in
torch), `batched_grad_copy` (gradients are copied as they become ready), `dim` and
`output_device` (one device per process: nothing to scatter or gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddptrain.ddp.buckets import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB


@dataclass(frozen=True)
class Options:
    """What the wrapper keeps of torch's arguments."""

    process_group: Any
    device_ids: list[int] | None
    input_device: torch.device | None  # where forward moves the inputs (device_ids[0])
    bucket_cap_mb: float
    first_bucket_cap_mb: float
    broadcast_buffers: bool
    init_sync: bool


def torch_options(
    module: nn.Module,
    *,
    device_ids: Any,
    output_device: Any,
    broadcast_buffers: bool | None,
    init_sync: bool,
    process_group: Any,
    bucket_cap_mb: float | None,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    device_mesh: Any,
    bucket_cap_mb_list: Any,
    forward_sync_buffers: bool | None,
    first_bucket_cap_mb: float | None,
) -> Options:
    """Check torch's arguments as torch does and keep what applies."""
    refused = {
        "delay_all_reduce_named_params": delay_all_reduce_named_params,
        "param_to_hook_all_reduce": param_to_hook_all_reduce,
        "bucket_cap_mb_list": bucket_cap_mb_list,
    }
    for name, value in refused.items():
        if value is not None:
            raise ValueError(
                f"{name} is not supported by ddptrain's DistributedDataParallel; use "
                "bucket_cap_mb (and first_bucket_cap_mb) to shape the buckets"
            )
    if mixed_precision is not None:
        raise ValueError(
            "mixed_precision is not supported by ddptrain's DistributedDataParallel; run the "
            "forward under torch.autocast (TrainerConfig(precision='bf16')), or send gradients "
            "as bf16 with comm_hook=ddptrain.named_hook('bf16')"
        )
    if device_mesh is not None:
        if process_group is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        process_group = device_mesh.get_group(mesh_dim=0)
    params = list(module.parameters())
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    device_types = {p.device.type for p in params}
    if len(device_types) > 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {device_types}."
        )
    multi_device = len({p.device for p in params}) > 1
    kept_ids = None
    if device_ids and device_types == {"cuda"} and not multi_device:
        kept_ids = [d if isinstance(d, int) else torch.device(d).index for d in device_ids]
    elif device_ids or output_device is not None:
        raise ValueError(
            "DistributedDataParallel device_ids and output_device arguments only work with "
            "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
            f"{device_ids}, output_device {output_device}, and module parameters "
            f"{ {p.device for p in params} }."
        )
    # forward_sync_buffers is torch's newer name; it wins where both are given.
    sync_buffers = forward_sync_buffers if forward_sync_buffers is not None else broadcast_buffers
    return Options(
        process_group=process_group,
        device_ids=kept_ids,
        input_device=torch.device("cuda", kept_ids[0]) if kept_ids else None,
        bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
        first_bucket_cap_mb=_first_cap_mb(bucket_cap_mb, first_bucket_cap_mb),
        broadcast_buffers=True if sync_buffers is None else bool(sync_buffers),
        init_sync=init_sync,
    )


def _first_cap_mb(bucket_cap_mb: float | None, first_bucket_cap_mb: float | None) -> float:
    """The first bucket's cap: as given; else, as torch does, a small first bucket with the
    default caps (so communication starts early in backward) and bucket_cap_mb when that is
    given."""
    if first_bucket_cap_mb is not None:
        return first_bucket_cap_mb
    return DEFAULT_FIRST_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb


def move_inputs(args: tuple, kwargs: dict, device: torch.device | None) -> tuple[tuple, dict]:
    """The forward's inputs with every tensor moved to `device` (None: as they are)."""
    if device is None:
        return args, kwargs
    return _move(args, device), _move(kwargs, device)


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        moved = [_move(v, device) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value

"""Whole states of a sharded model and its optimizer: what checkpoints hold, at any world size.

    state = full_state_dict(model)                  # collective: the plain module's state_dict
    load_full_state_dict(model, state)              # each rank keeps its pieces
    optim_state = full_optim_state_dict(model, opt)       # collective: the plain optimizer's
    load_full_optim_state_dict(model, opt, optim_state)   # each rank keeps its pieces
    norm = whole_grad_norm(model)                   # collective: the whole gradient's norm
    clip_whole_grad_norm(model, max_norm=1.0)       # collective: ... and clipping to it

The saved layouts are those of the unwrapped module and of the same optimizer built on it: keys
and shapes as `module.state_dict()`, state keyed by parameter index in `param_groups` order with
each tensor of its parameter's shape. So a state saved at one world size loads at any other,
into the plain module and optimizer, or from them. Gathering is per unit: one all_gather of the
unit's flat tensor (or of one optimizer-state key laid out like it) at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddptrain.ddp.norm import exact_norm
from ddptrain.fsdp.unit import Unit, all_gather_single, in_memory_order

if TYPE_CHECKING:
    from ddptrain.fsdp.wrapper import FullyShardedDataParallel


def _shard_index(model: FullyShardedDataParallel) -> dict[int, tuple[Unit, int]]:
    """id(shard parameter) -> (its unit, its index in the unit)."""
    return {id(s): (u, j) for u in model.units for j, s in enumerate(u.shards)}


def full_state_dict(model: FullyShardedDataParallel) -> dict[str, Any]:
    """Collective: the unwrapped module's state_dict with whole parameters (clones)."""
    sharded = model.module.state_dict(keep_vars=True)  # the shards, under the plain keys
    whole: dict[int, torch.Tensor] = {}
    for unit in model.units:
        unit.gather()
        unit.wait()
        for shard, full in zip(unit.shards, unit.full, strict=True):
            whole[id(shard)] = full.detach().clone()
        unit.free()
    out = OrderedDict(
        (key, whole[id(value)] if id(value) in whole else _detach(value))
        for key, value in sharded.items()
    )
    out._metadata = getattr(sharded, "_metadata", None)  # module versions, as torch saves them
    return out


def load_full_state_dict(
    model: FullyShardedDataParallel, state_dict: dict[str, Any], strict: bool = True
) -> Any:
    """Load a whole state_dict: each rank copies its pieces into its shards (not collective)."""
    where = _shard_index(model)
    pieces = OrderedDict(state_dict)
    pieces._metadata = getattr(state_dict, "_metadata", None)
    for key, value in model.module.state_dict(keep_vars=True).items():
        if id(value) not in where or key not in state_dict:
            continue
        unit, j = where[id(value)]
        pieces[key] = _piece(unit, j, state_dict[key], f"parameter {key!r}")
    return model.module.load_state_dict(pieces, strict=strict)


def full_optim_state_dict(
    model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Collective: `optimizer`'s state_dict with every elementwise state tensor whole, in the
    layout the same optimizer over the unwrapped module has."""
    saved = optimizer.state_dict()
    located = _locate(model, optimizer)
    # Which elementwise keys (and dtypes) each unit's parameters hold: the same on every rank
    # (steps and gradients are), but agreed on so that a mistake cannot leave a gather unpaired.
    keys: dict[int, set[tuple[str, torch.dtype]]] = {}
    for index, (unit, j) in enumerate(located):
        for key, value in saved["state"].get(index, {}).items():
            if _elementwise(value, unit.shards[j], key, optimizer):
                keys.setdefault(model.units.index(unit), set()).add((key, value.dtype))
    if model.world_size > 1:
        everyone: list[Any] = [None] * model.world_size
        dist.all_gather_object(everyone, keys, group=model.process_group)
        keys = {
            u: set().union(*(e.get(u, set()) for e in everyone)) for u in range(len(model.units))
        }
    # Copies: the live step counters are incremented in place by the next step().
    state: dict[int, dict[str, Any]] = {
        index: {k: _copy(v) for k, v in entry.items()} for index, entry in saved["state"].items()
    }
    for u, unit in enumerate(model.units):
        members = [(i, j) for i, (owner, j) in enumerate(located) if owner is unit]
        for key, dtype in sorted(keys.get(u, ()), key=lambda kd: (kd[0], str(kd[1]))):
            flat = _gather_state(unit, members, saved["state"], key, dtype)
            for index, j in members:
                if key in saved["state"].get(index, {}):
                    o, shape, stride = unit.layout.offsets[j], unit.full[j].shape, unit.strides[j]
                    state[index][key] = flat.as_strided(shape, stride, o).clone()
    return {"state": dict(sorted(state.items())), "param_groups": saved["param_groups"]}


def load_full_optim_state_dict(
    model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load a plain-layout optimizer state_dict: each rank keeps its pieces (not collective)."""
    located = _locate(model, optimizer)
    state = {}
    for index, entry in state_dict["state"].items():
        if not 0 <= int(index) < len(located):
            raise ValueError(
                f"the optimizer state has an entry for parameter #{index} but the optimizer "
                f"steps {len(located)} parameters; load a state saved for the same parameters"
            )
        unit, j = located[int(index)]
        state[index] = {
            k: _piece(unit, j, v, f"optimizer state {k!r} of parameter #{index}")
            if isinstance(v, torch.Tensor) and v.dim() > 0
            else _copy(v)
            for k, v in entry.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})


def _locate(
    model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer
) -> list[tuple[Unit, int]]:
    """(unit, index in unit) of each parameter the optimizer steps, in its state_dict order."""
    where = _shard_index(model)
    located = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in where:
                raise ValueError(
                    f"the optimizer steps a {list(p.shape)} tensor (group {g}) that is not one of "
                    "this wrapper's parameters; build the optimizer on "
                    "FullyShardedDataParallel(...).parameters() after wrapping"
                )
            located.append(where[id(p)])
    return located


def _elementwise(value: Any, shard: torch.Tensor, key: str, optimizer: Any) -> bool:
    """Whether an optimizer state entry is sharded like its parameter (else: kept as is)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    if value.shape != shard.shape:
        raise ValueError(
            f"{type(optimizer).__name__} keeps state {key!r} of shape {list(value.shape)} for a "
            f"shard of shape {list(shard.shape)}: not elementwise, so it cannot be sharded"
        )
    return True


def _gather_state(
    unit: Unit,
    members: list[tuple[int, int]],
    saved_state: dict[int, dict[str, Any]],
    key: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Collective: one state key of the unit's parameters laid out as the unit's flat tensor."""
    shard = torch.zeros(unit.layout.shard_numel, dtype=dtype, device=unit.device)
    for index, j in members:
        value = saved_state.get(index, {}).get(key)
        if value is not None:
            _, a, b, at = unit.pieces[j]
            shard[at : at + b - a].copy_(value.reshape(-1))
    flat = torch.empty(unit.layout.padded_numel, dtype=dtype, device=unit.device)
    all_gather_single(flat, shard, group=unit.gather_group)
    return flat


def _piece(unit: Unit, j: int, whole: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's piece of a whole tensor shaped like the unit's parameter j."""
    shape = unit.full[j].shape
    if whole.shape != shape:
        raise ValueError(
            f"size mismatch for {what}: the state holds {list(whole.shape)}, the model's "
            f"parameter is {list(shape)}; load a state saved for this model"
        )
    _, a, b, _ = unit.pieces[j]
    return in_memory_order(whole.detach(), unit.strides[j])[a:b].clone()


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def whole_grad_norm(model: FullyShardedDataParallel, norm_type: float = 2.0) -> torch.Tensor:
    """Collective: the norm of the whole gradient from every rank's shards (the sum of their
    p-th powers, or their max for the inf-norm), summed in float64."""
    # A shard can hold none of a parameter's elements: torch's inf-norm refuses empty tensors.
    grads = [s.grad for u in model.units for s in u.shards if s.grad is not None and s.numel()]
    local = torch.nn.utils.get_total_norm(grads, norm_type)
    if model.world_size == 1:
        return local
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=model.process_group)
        return local
    powered = local.double() ** norm_type
    dist.all_reduce(powered, group=model.process_group)
    return (powered ** (1.0 / norm_type)).to(local.dtype)


def clip_whole_grad_norm(
    model: FullyShardedDataParallel, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Collective: scale every shard's gradient so the whole gradient's norm is at most
    max_norm; the norm before clipping (the 2-norm: exact_norm, whose bits do not depend on
    how the gradient is split)."""
    shards = [s for u in model.units for s in u.shards if s.grad is not None]
    if norm_type == 2.0:
        numel = sum(u.numel for u in model.units)
        grads, group = [s.grad for s in shards], model.process_group
        total = exact_norm(grads, group, sharded=True, numel=numel)
    else:
        total = whole_grad_norm(model, norm_type)
    torch.nn.utils.clip_grads_with_norm_(shards, max_norm, total)
    return total

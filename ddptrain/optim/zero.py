"""ZeRO stage 1: every rank keeps and updates only its shard of the optimizer state.

    model = ddptrain.DistributedDataParallel(net)          # or torch's wrapper
    opt = ddptrain.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); opt.step()               # collective: every rank, every step
    state = opt.state_dict()                  # collective; the whole state, as AdamW's own
    opt.load_state_dict(state)                # from any world size, or from a plain AdamW

Each param group's parameters, laid end to end, are cut into world_size near-equal contiguous
ranges (`shard_ranges`). Rank r's inner optimizer steps views of range r only, so it holds
1/world_size of the state; then each range is broadcast from its owner into every replica.
This suits optimizers whose update is elementwise (SGD, Adam, AdamW, ...): a view updates
exactly as the same elements of the whole tensor would, so results equal the unsharded
optimizer's bit for bit. Optimizers with per-tensor norms (LAMB, Adafactor) are not supported.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddptrain.ddp.hooks import resolve
from ddptrain.optim.broadcast import broadcast_calls, plan_broadcasts
from ddptrain.optim.partition import (
    Piece,
    as_groups,
    describe,
    first_difference,
    local_problem,
    shard_ranges,
)


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    """Wraps `optimizer_class` so each rank builds it over its shard of the parameters only.

    Invariants:
    - Every rank passes the same parameters, in the same groups and order (checked at
      construction and by add_param_group: the same clear error on every rank, no hang).
    - `param_groups` are the full groups: LR schedulers act on them and their hyperparameters
      reach the inner optimizer at the start of every step().
    - step() and state_dict() are collective; after step() every replica is identical.
    - Gradients must already be averaged over ranks (DDP does it); every rank keeps all of them.
    - Parameters keep their storage after construction (no `p.data = ...`, no `.to()`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        process_group: Any = None,
        **defaults: Any,
    ) -> None:
        Joinable.__init__(self)
        self._ready = False
        self.optimizer_class = optimizer_class
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        groups = as_groups(params)
        self._verify(groups, [])
        super().__init__(groups, defaults)
        self._params: list[list[torch.Tensor]] = []  # per group
        self._plans: list[list[list[Piece]]] = []  # per group, per rank
        self._local_pieces: list[tuple[int, Piece, torch.Tensor]] = []  # (group, piece, view)
        self._splits: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        local_groups = [self._shard(group) for group in self.param_groups]
        self.local = optimizer_class(local_groups, **defaults)
        self.defaults = dict(self.local.defaults)
        for group, local in zip(self.param_groups, self.local.param_groups, strict=True):
            group.update({k: v for k, v in local.items() if k != "params"})
        self.state = self.local.state  # this rank's shard, keyed by the inner optimizer's views
        self._calls = self._plan_sharing()
        # The optimizer this one replaces (from_optimizer), which LR schedulers were built on.
        self.stands_for: torch.optim.Optimizer | None = None
        self._ready = True

    @classmethod
    def from_optimizer(
        cls, optimizer: torch.optim.Optimizer, process_group: Any = None
    ) -> ZeroRedundancyOptimizer:
        """Shard an optimizer that has not stepped: same class, groups and hyperparameters.

        The result shares `optimizer.param_groups`, so an LR scheduler built on `optimizer`
        still steers it; step the result, never `optimizer`.
        """
        if _has_stepped(optimizer):
            raise ValueError(
                "from_optimizer needs an optimizer that has not stepped yet; load its "
                "state_dict() into the result instead"
            )
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
        zero = cls(groups, type(optimizer), process_group, **defaults)
        zero.param_groups = optimizer.param_groups
        zero.stands_for = optimizer
        return zero

    # ------------------------------------------------------------------------ sharding
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (collective): its parameters are cut evenly across ranks on their own."""
        if not self._ready:
            super().add_param_group(param_group)
            return
        [group] = as_groups([param_group])
        self._verify([group], [p for g in self.param_groups for p in g["params"]])
        super().add_param_group(group)
        self.local.add_param_group(self._shard(self.param_groups[-1]))
        self._calls = self._plan_sharing()

    def _verify(self, groups: list[dict], earlier: list[torch.Tensor]) -> None:
        """Raise the same error on every rank if any rank's parameters are unusable or differ."""
        mine = (local_problem(groups, earlier), describe(groups))
        everyone = [mine]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self.process_group)
        for rank, (problem, _) in enumerate(everyone):
            if problem:
                raise ValueError(f"ZeroRedundancyOptimizer on rank {rank}: {problem}")
        for rank, (_, description) in enumerate(everyone):
            if description != everyone[0][1]:
                raise ValueError(
                    f"ranks give ZeroRedundancyOptimizer different parameters: rank 0 has "
                    f"{first_difference(everyone[0][1], description)} where rank {rank} has "
                    f"{first_difference(description, everyone[0][1])}. Every rank must pass "
                    "the same parameters, in the same groups and order"
                )

    def _shard(self, group: dict[str, Any]) -> dict[str, Any]:
        """Record the group's plan; return its inner-optimizer group (this rank's views)."""
        params = list(group["params"])
        plan = shard_ranges([p.numel() for p in params], self.world_size)
        g = len(self._params)
        self._params.append(params)
        self._plans.append(plan)
        views = []
        for piece in plan[self.rank]:
            j, a, b = piece
            p = params[j]
            if a == 0 and b == p.numel():
                view = p  # whole: the inner optimizer sees the parameter itself
            else:
                view = p.detach().view(-1)[a:b]
                self._splits.append((view, p, a, b))
            views.append(view)
            self._local_pieces.append((g, piece, view))
        return {**{k: v for k, v in group.items() if k != "params"}, "params": views}

    def _plan_sharing(self) -> list[tuple[int, list[torch.Tensor]]]:
        """The broadcasts that share every updated range from its owner, in the same order."""
        by_owner: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for params, plan in zip(self._params, self._plans, strict=True):
            for rank, pieces in enumerate(plan):
                by_owner[rank] += [params[j].detach().view(-1)[a:b] for j, a, b in pieces]
        return plan_broadcasts(by_owner)

    # ------------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step this rank's shard, then share the updated parameters (collective)."""
        Join.notify_join_context(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self.local.param_groups, strict=True):
            for key, value in group.items():
                if key != "params":
                    local[key] = value
        for view, p, a, b in self._splits:
            view.grad = None if p.grad is None else p.grad.reshape(-1)[a:b]
        self.local.step()
        for view, *_ in self._splits:
            view.grad = None  # the views would keep a freed gradient alive
        if self.world_size > 1:
            broadcast_calls(self._calls, self.rank, self.process_group)
        if self.stands_for is not None:
            # An LR scheduler built on the original optimizer checks (through torch's private
            # flag) that it was stepped first: it was, through this one.
            self.stands_for._opt_called = True
        return loss

    # ------------------------------------------------------------------------ join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """torch's Joinable: a joined rank keeps stepping its shard (see _ZeroJoinHook)."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """torch's Joinable: where the join's own collectives run."""
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        """torch's Joinable: the group the join's own collectives run on."""
        return resolve(self.process_group)

    # ------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The whole state in the unsharded optimizer's layout (collective; every rank gets it)."""
        offsets = self._group_offsets()
        mine = []
        for g, (j, a, b), view in self._local_pieces:
            p = self._params[g][j]
            specs = {}
            for key, value in self.local.state.get(view, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.shape != view.shape:
                        raise ValueError(
                            f"{self.optimizer_class.__name__} keeps state {key!r} of shape "
                            f"{list(value.shape)} for a parameter piece of shape "
                            f"{list(view.shape)}: not elementwise, so it cannot be sharded"
                        )
                    specs[key] = ("slice", value.dtype)
                else:
                    specs[key] = ("value", _detached(value))
            mine.append((offsets[g] + j, a, b, tuple(p.shape), specs))
        everyone = [mine]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self.process_group)
        flat_params = [p for params in self._params for p in params]
        state: dict[int, dict[str, Any]] = {}
        by_owner: list[list[torch.Tensor]] = []
        for rank, entries in enumerate(everyone):
            by_owner.append([])
            for index, a, b, shape, specs in entries:
                full = state.setdefault(index, {})
                for key, (kind, value) in specs.items():
                    if kind == "value":
                        full.setdefault(key, value)
                        continue
                    if key not in full:
                        device = flat_params[index].device
                        full[key] = torch.empty(shape, dtype=value, device=device)
                    by_owner[rank].append(full[key].view(-1)[a:b])
        for (_, _, view), entry in zip(self._local_pieces, mine, strict=True):
            index, a, b = entry[:3]
            for key, (kind, _) in entry[4].items():
                if kind == "slice":
                    state[index][key].view(-1)[a:b].copy_(self.local.state[view][key].view(-1))
        if self.world_size > 1:
            broadcast_calls(plan_broadcasts(by_owner), self.rank, self.process_group)
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(o, o + n))}
            for group, o, n in zip(self.param_groups, offsets, map(len, self._params), strict=True)
        ]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (from this class at any world size, or the plain optimizer)."""
        saved_groups = state_dict["param_groups"]
        sizes = [len(params) for params in self._params]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise ValueError(
                f"the state_dict has param groups of sizes {saved_sizes} but this optimizer has "
                f"{sizes}; load a state saved for the same parameters and groups"
            )
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        local_state = {}
        for i, (g, (j, a, b), view) in enumerate(self._local_pieces):
            saved_state = state_dict["state"].get(saved_groups[g]["params"][j])
            if saved_state is not None:
                local_state[i] = {
                    k: _piece_of(v, self._params[g][j], a, b, view) for k, v in saved_state.items()
                }
        local_groups, start = [], 0
        for group, local in zip(self.param_groups, self.local.param_groups, strict=True):
            n = len(local["params"])
            hyper = {k: v for k, v in group.items() if k != "params"}
            local_groups.append({**hyper, "params": list(range(start, start + n))})
            start += n
        self.local.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.local.state

    def _group_offsets(self) -> list[int]:
        offsets = [0]
        for params in self._params[:-1]:
            offsets.append(offsets[-1] + len(params))
        return offsets


def _piece_of(value: Any, param: torch.Tensor, a: int, b: int, view: torch.Tensor) -> Any:
    """This rank's copy of one saved state entry: its slice if elementwise, else all of it."""
    if not isinstance(value, torch.Tensor):
        return value
    if view is param or value.dim() == 0:
        return value.clone()
    if value.shape != param.shape:
        raise ValueError(
            f"saved state of shape {list(value.shape)} for a parameter of shape "
            f"{list(param.shape)} is not elementwise, so it cannot be sharded"
        )
    return value.reshape(-1)[a:b].clone()


def _detached(value: Any) -> Any:
    # A copy: the live step counter is incremented in place by the next step().
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` holds state from a step: any state without a zero "step" count
    (Adagrad fills its state, step 0, when it is built)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or float(step) > 0:
            return True
    return False


class _ZeroJoinHook(JoinHook):
    """A joined rank's part in the others' optimizer steps: its shard must still be updated
    and shared. It steps whenever its parameters hold gradients, which the DDP wrapper's join
    hook, listed before this optimizer in Join([model, optimizer]), leaves there (the mean
    over the ranks still training) after each of their synchronized backwards; then it clears
    them, as zero_grad would. Clipping or skipping that the others do before their step is
    not replayed here."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        params = [p for g in self.zero.param_groups for p in g["params"]]
        if any(p.grad is not None for p in params):
            self.zero.step()
            self.zero.zero_grad(set_to_none=True)

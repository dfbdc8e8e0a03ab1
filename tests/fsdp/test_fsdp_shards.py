"""What each rank of FullyShardedDataParallel holds: its share of the parameters and optimizer
state, whole units only while they are needed, and plain states loaded into its shards.

One spawned world per world size runs every case of this module; the tests read their case's
results from it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddptrain.fsdp.layout import flat_layout
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from support import toy_models, worlds
from support.fsdp_models import MODELS, Wide, make_optimizer, wrap
from support.state_diff import layout, optimizer_state_diff

pytestmark = pytest.mark.timeout(worlds.WORLD_TIMEOUT_S + 60)


# ---------------------------------------------------------------------------- cases
def _case_memory(info) -> dict:
    """Elements each rank holds as parameters and as AdamW state, against the model's."""
    torch.manual_seed(0)
    model = FullyShardedDataParallel(Wide(), unit_min_numel=800)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = toy_models.batch("tanh", 0, info.rank)
    F.nll_loss(model(x), y).backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "state": sum(v.numel() for v in state),
        "total": sum(p.numel() for p in Wide().parameters()),
        "units": model.unit_names,
    }


def _case_gathered(info) -> dict:
    """Bytes each unit of the size-policy Wide holds gathered after a training forward, after
    its backward, after a forward under no_grad, after the whole states are read, inside
    summon_full_params (before and after a forward there) and after it, for ZeRO-2 and
    ZeRO-3."""
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = FullyShardedDataParallel(
            Wide(), unit_min_numel=800, reshard_after_forward=stage == 3
        )
        x, y = toy_models.batch("tanh", 0, info.rank)
        seen = {}
        loss = F.nll_loss(model(x), y)
        seen["after_forward"] = _gathered_bytes(model)
        loss.backward()
        seen["after_backward"] = _gathered_bytes(model)
        with torch.no_grad():
            model(x)
        seen["after_eval"] = _gathered_bytes(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step()
        model.state_dict()
        seen["after_state_dict"] = _gathered_bytes(model)
        model.optim_state_dict(opt)
        seen["after_optim_state_dict"] = _gathered_bytes(model)
        with model.summon_full_params():
            seen["summoned"] = _gathered_bytes(model)
            with torch.no_grad():
                model(x)
            seen["summoned_after_forward"] = _gathered_bytes(model)
        seen["after_summon"] = _gathered_bytes(model)
        out[stage] = seen
    return out


def _gathered_bytes(model: FullyShardedDataParallel) -> dict[str, int]:
    """Bytes of whole parameters each unit holds now (its flat tensor's storage), by name."""
    return {
        name: unit.flat.untyped_storage().nbytes()
        for name, unit in zip(model.unit_names, model.units, strict=True)
    }


def _case_states_at_any_size(info) -> dict:
    """A plain model's state and a plain AdamW's (two local steps: every rank the same) load at
    this world size and come back bitwise from state_dict() and optim_state_dict(); the
    channels_last LeNet keeps its strides."""
    out = {}
    for name in ("wide", "channels_last", "tied"):
        torch.manual_seed(5)
        plain = MODELS[name][0]()
        opt = make_optimizer("adamw", plain)
        for step in range(2):
            x, y = toy_models.batch(MODELS[name][1], step, 0)
            opt.zero_grad()
            toy_models.loss_of(MODELS[name][1], plain, x, y, 0).backward()
            opt.step()
        torch.manual_seed(6 + info.rank)  # other weights: loading must replace them
        ours = wrap(name, MODELS[name][0](), 3, info.rank)
        ours_opt = make_optimizer("adamw", ours)
        ours.load_state_dict(plain.state_dict())
        ours.load_optim_state_dict(ours_opt, opt.state_dict())
        back, back_opt = ours.state_dict(), ours.optim_state_dict(ours_opt)
        plain_state = plain.state_dict()
        out[name] = {
            "model": back.keys() == plain_state.keys()
            and all(torch.equal(back[k], v) for k, v in plain_state.items())
            and all(layout(back[k]) == layout(v) for k, v in plain_state.items()),
            "optimizer": optimizer_state_diff(back_opt, opt.state_dict(), same_layout=True),
        }
    return out


CASES = {
    "memory": _case_memory,
    "states": _case_states_at_any_size,
    "gathered": _case_gathered,
}
world = worlds.fixture(
    CASES,
    {
        2: ["memory", "states", "gathered"],
        3: ["memory", "states", "gathered"],
    },
)


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_holds_its_share_of_parameters_and_state(world, world_size):
    """Each rank holds total / world_size parameters and AdamW state, plus alignment slack."""
    results = worlds.outcome(world(world_size), "memory")
    total = results[0]["total"]
    for r in results:
        assert r["units"] == ["", "layers.0", "layers.1", "layers.2"]
        slack = 64 * (8 + 4)  # per parameter and per unit
        assert abs(r["params"] - total / world_size) <= slack, r
        assert r["state"] == 2 * r["params"], r
    assert sum(r["params"] for r in results) == total


@pytest.mark.parametrize("world_size", [2, 3])
def test_plain_states_load_at_any_world_size_and_come_back_bitwise(world, world_size):
    """Plain model and AdamW states load at ws 2 and 3 and come back bitwise, in plain layouts."""
    for rank, r in enumerate(worlds.outcome(world(world_size), "states")):
        for name, d in r.items():
            assert d["model"] and d["optimizer"] == 0.0, (rank, name, d)


def _unit_bytes(world_size: int) -> dict[str, int]:
    """What each unit of the size-policy Wide holds gathered: its parameters laid out as the
    wrapper lays them (flat_layout: aligned, padded to world_size equal shards), in bytes."""
    units = ["", "layers.0", "layers.1", "layers.2"]
    numels: dict[str, list[int]] = {u: [] for u in units}
    for name, p in Wide().named_parameters():
        owner = max((u for u in units if name.startswith(f"{u}.") or not u), key=len)
        numels[owner].append(p.numel())
    itemsize = torch.float32.itemsize
    return {u: flat_layout(n, world_size).padded_numel * itemsize for u, n in numels.items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero3_frees_units_between_forward_and_backward(world, world_size):
    """Before backward ZeRO-3 holds only the root unit gathered, ZeRO-2 all; afterwards, none."""
    # The root unit stays gathered because its backward runs first.
    whole = _unit_bytes(world_size)
    none = dict.fromkeys(whole, 0)
    root_only = {**none, "": whole[""]}
    for rank, r in enumerate(worlds.outcome(world(world_size), "gathered")):
        assert r[3]["after_forward"] == root_only, (rank, r[3]["after_forward"], whole)
        assert r[2]["after_forward"] == whole, (rank, r[2]["after_forward"], whole)
        for stage in (2, 3):
            for when in ("summoned", "summoned_after_forward"):
                assert r[stage][when] == whole, (rank, stage, when, r[stage][when])
            for when in ("backward", "eval", "state_dict", "optim_state_dict", "summon"):
                assert r[stage][f"after_{when}"] == none, (rank, stage, when, r[stage])

"""ZeRO stage 1 against the unsharded optimizer under the same wrapper, and resumes across sizes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddptrain
from ddptrain.optim.zero import ZeroRedundancyOptimizer
from support import toy_models
from support.state_diff import optimizer_state_diff

STEPS = 20
RESUME_STEPS = 6
# At world size 3 both runs take their gradients from the same wrapper code, but two wrapper
# instances are not promised the same reduction order (official DDP's buckets, gloo's ring), and
# a last-bit difference grows through 20 Adam steps; 1e-5 is far above that and far below a
# real mistake (a missed or doubled update moves weights by ~lr = 1e-3).
WS3_ATOL = 1e-5
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}
# name -> (optimizer, wrapper, options)
CASES = {
    "adamw_ddptrain": ("adamw", "ddptrain", {}),
    "sgd_ddptrain": ("sgd", "ddptrain", {"set_to_none": False}),
    "adamw_torch": ("adamw", "torch", {}),
    "adam_scheduler_ddptrain": ("adam", "ddptrain", {"scheduler": True}),
    "sgd_added_group_torch": ("sgd", "torch", {"add_group": True}),
}


# ---------------------------------------------------------------------------- worlds
def _param_groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3},
    ]


def _optimizer(
    opt_name: str, model: torch.nn.Module, sharded: bool, add_group: bool = False, group=None
):
    cls, defaults = OPTIMIZERS[opt_name]
    groups = _param_groups(model)
    first = groups[:1] if add_group else groups
    if sharded:
        opt = ZeroRedundancyOptimizer(first, cls, process_group=group, **defaults)
    else:
        opt = cls(first, **defaults)
    if add_group:
        opt.add_param_group(groups[1])
    return opt


def _same_on_every_rank(model: torch.nn.Module, group=None) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, flat, group=group)
    return all(torch.equal(t, everyone[0]) for t in everyone)


def _train(model, opt, rank: int, steps: int, first_step: int = 0, group=None, **options):
    scheduler = options.get("scheduler")
    replicas_same = []
    for step in range(first_step, first_step + steps):
        x, y = toy_models.batch("lenet", step, rank)
        torch.manual_seed(100 * step + rank)  # the same dropout masks in both runs
        opt.zero_grad(set_to_none=options.get("set_to_none", True))
        toy_models.loss_of("lenet", model, x, y, rank).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        replicas_same.append(_same_on_every_rank(model, group))
    return replicas_same


def _wrap(wrapper: str, module: torch.nn.Module) -> torch.nn.Module:
    return ddptrain.DistributedDataParallel(module) if wrapper == "ddptrain" else TorchDDP(module)


def _state_elements(opt: torch.optim.Optimizer) -> int:
    values = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(v.numel() for v in values if v.dim() > 0)


def _equivalence_case(name: str, rank: int) -> dict:
    opt_name, wrapper, options = CASES[name]
    torch.manual_seed(1234)
    base = toy_models.make("lenet")
    runs = {}
    for sharded in (True, False):
        model = _wrap(wrapper, copy.deepcopy(base))
        opt = _optimizer(opt_name, model, sharded, options.get("add_group", False))
        if options.get("scheduler"):
            options = {**options, "scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)}
        replicas = _train(model, opt, rank, STEPS, **options)
        runs[sharded] = (model, opt, replicas)
    (zero_model, zero_opt, replicas), (plain_model, plain_opt, _) = runs[True], runs[False]
    pairs = list(zip(zero_model.parameters(), plain_model.parameters(), strict=True))
    return {
        "bitwise": all(torch.equal(a, b) for a, b in pairs),
        "max_diff": max((a - b).abs().max().item() for a, b in pairs),
        "replicas_same": replicas,
        "state_diff": optimizer_state_diff(zero_opt.state_dict(), plain_opt.state_dict()),
        "state_elements": (_state_elements(zero_opt), _state_elements(plain_opt)),
    }


def _save_case(path: str, rank: int) -> list[dict]:
    """Train a few ZeRO steps, write model + ZeRO state_dicts (rank 0); return every rank's."""
    torch.manual_seed(99)
    base = toy_models.make("lenet_nodrop")
    out = {"model": None}
    for opt_name in ("adamw", "sgd"):
        model = ddptrain.DistributedDataParallel(copy.deepcopy(base))
        opt = _optimizer(opt_name, model, sharded=True)
        _train(model, opt, rank, RESUME_STEPS)
        out[opt_name] = opt.state_dict()
        out["model_" + opt_name] = model.module.state_dict()
    if rank == 0:
        torch.save(out, path)
    return [out["adamw"], out["sgd"]]


def _error_cases(rank: int) -> dict:
    """Each bad construction's message (the same collective runs on every rank: no hang)."""
    messages = {}
    layer = torch.nn.Linear(4, 4)
    cases = {
        "twice": lambda: ZeroRedundancyOptimizer([layer.weight, layer.bias, layer.weight]),
        "twice_across_groups": lambda: ZeroRedundancyOptimizer(
            [{"params": [layer.weight]}, {"params": [layer.bias, layer.weight]}]
        ),
        "different": lambda: ZeroRedundancyOptimizer(
            torch.nn.Linear(4, 4 + rank).parameters(), torch.optim.SGD, lr=0.1
        ),
        "fewer": lambda: ZeroRedundancyOptimizer(
            list(layer.parameters())[: 2 - rank], torch.optim.SGD, lr=0.1
        ),
        "not_contiguous": lambda: ZeroRedundancyOptimizer(
            [torch.nn.Parameter(torch.ones(4, 3).t())]
        ),
    }
    for name, build in cases.items():
        try:
            build()
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


def _subgroup_case(rank: int) -> dict | None:
    """Ranks 1 and 2 of 3: the DDP wrapper on their group with ZeRO on it and with the plain
    optimizer, while rank 0 waits. Last in its world: only the group's ranks create the
    wrapper's own groups, so the ranks no longer agree on the next group's number afterwards."""
    group = dist.new_group(ranks=[1, 2])  # every rank must create it; only 1 and 2 join
    out = None
    if rank in (1, 2):
        out = {}
        for opt_name in ("adamw", "sgd"):
            torch.manual_seed(1234 + rank)  # different weights per rank: the wrapper takes 1's
            base = toy_models.make("lenet")
            runs = {}
            for sharded in (True, False):
                model = ddptrain.DistributedDataParallel(copy.deepcopy(base), process_group=group)
                opt = _optimizer(opt_name, model, sharded, group=group)
                replicas = _train(model, opt, dist.get_rank(group), STEPS, group=group)
                runs[sharded] = (model, opt, replicas)
            (zero_model, zero_opt, replicas), (plain_model, plain_opt, _) = runs[True], runs[False]
            pairs = list(zip(zero_model.parameters(), plain_model.parameters(), strict=True))
            out[opt_name] = {
                "bitwise": all(torch.equal(a, b) for a, b in pairs),
                "max_diff": max((a - b).abs().max().item() for a, b in pairs),
                "replicas_same": replicas,
                "state_diff": optimizer_state_diff(zero_opt.state_dict(), plain_opt.state_dict()),
                "state_elements": (_state_elements(zero_opt), _state_elements(plain_opt)),
            }
    dist.barrier()
    return out


def _run_world(
    cases: list[str], save_path: str | None, resume_path: str | None, subgroup: bool = False
) -> dict:
    info = ddptrain.init_distributed()
    out = {name: _equivalence_case(name, info.rank) for name in cases}
    if save_path:
        out["saved"] = _save_case(save_path, info.rank)
        out["errors"] = _error_cases(info.rank)
    if resume_path:
        out["resume"] = _resume_cases(resume_path, info.rank)
    if subgroup:
        out["subgroup"] = _subgroup_case(info.rank)
    return out


def _resume_cases(path: str, rank: int) -> dict:
    """From a ws=2 ZeRO checkpoint: ZeRO vs plain AdamW/SGD continued; plain -> ZeRO -> plain."""
    saved = torch.load(path, weights_only=True)
    out = {}
    for opt_name in ("adamw", "sgd"):
        runs = {}
        for sharded in (True, False):
            module = toy_models.make("lenet_nodrop")
            module.load_state_dict(saved["model_" + opt_name])
            model = ddptrain.DistributedDataParallel(module)
            opt = _optimizer(opt_name, model, sharded)
            opt.load_state_dict(copy.deepcopy(saved[opt_name]))
            _train(model, opt, rank, RESUME_STEPS, first_step=100)
            runs[sharded] = (model, opt)
        (zero_model, _), (plain_model, plain_opt) = runs[True], runs[False]
        pairs = list(zip(zero_model.parameters(), plain_model.parameters(), strict=True))
        reloaded = _optimizer(opt_name, plain_model, sharded=True)
        reloaded.load_state_dict(copy.deepcopy(plain_opt.state_dict()))
        out[opt_name] = {
            "bitwise": all(torch.equal(a, b) for a, b in pairs),
            "max_diff": max((a - b).abs().max().item() for a, b in pairs),
            "round_trip_diff": optimizer_state_diff(reloaded.state_dict(), plain_opt.state_dict()),
        }
    return out


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zero") / "ws2.pt")


@pytest.fixture(scope="module")
def ws2(checkpoint_path) -> list[dict]:
    return ddptrain.spawn(_run_world, 2, list(CASES), checkpoint_path, None, timeout_s=300)


@pytest.fixture(scope="module")
def ws3(ws2, checkpoint_path) -> list[dict]:
    return ddptrain.spawn(_run_world, 3, list(CASES), None, checkpoint_path, True, timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_bitwise_equal_to_unsharded_at_ws2(ws2, case):
    """20 steps at ws=2: parameters and the whole state_dict equal the unsharded run's bitwise."""
    for rank, r in enumerate(ws2):
        print(f"{case} ws=2 rank={rank}: bitwise={r[case]['bitwise']}")
        assert r[case]["bitwise"], (case, rank, r[case]["max_diff"])
        assert r[case]["state_diff"] == 0.0, (case, rank, r[case]["state_diff"])


@pytest.mark.parametrize("case", list(CASES))
def test_close_to_unsharded_at_ws3(ws3, case):
    """20 steps at ws=3: parameters and state within WS3_ATOL of the unsharded run's."""
    for rank, r in enumerate(ws3):
        print(f"{case} ws=3 rank={rank}: max|diff|={r[case]['max_diff']:.3g}")
        assert r[case]["max_diff"] <= WS3_ATOL, (case, rank, r[case]["max_diff"])
        assert r[case]["state_diff"] <= WS3_ATOL, (case, rank, r[case]["state_diff"])


@pytest.mark.parametrize("world", ["ws2", "ws3"])
def test_replicas_identical_after_every_step(world, request):
    """After every sharded step every rank holds bitwise the same parameters."""
    for r in request.getfixturevalue(world):
        for case in CASES:
            assert len(r[case]["replicas_same"]) == STEPS and all(r[case]["replicas_same"]), case


@pytest.mark.parametrize("world", ["ws2", "ws3"])
def test_each_rank_keeps_its_share_of_the_state(world, request):
    """Each rank's state holds total / world_size elements (within 2% on LeNet's 44k)."""
    results = request.getfixturevalue(world)
    for case in CASES:
        shares = [r[case]["state_elements"][0] for r in results]
        total = results[0][case]["state_elements"][1]
        assert sum(shares) == total, case
        for share in shares:
            assert abs(share - total / len(results)) <= 0.02 * total / len(results), case


def test_state_dict_is_the_same_on_every_rank(ws2):
    """state_dict() is collective and every rank gets the whole state."""
    for opt_index in range(2):
        dicts = [r["saved"][opt_index] for r in ws2]
        assert optimizer_state_diff(dicts[0], dicts[1]) == 0.0


def test_parameter_given_twice_is_a_clear_error(ws2):
    """A parameter passed twice (in one group or two) is named, on every rank."""
    for r in ws2:
        assert "is given twice" in r["errors"]["twice"]
        assert "parameter #2 of group 0" in r["errors"]["twice"]
        assert "is given twice" in r["errors"]["twice_across_groups"]


def test_ranks_with_different_parameters_get_the_same_error(ws2):
    """Different shapes or counts across ranks raise the same message on every rank."""
    for name in ("different", "fewer"):
        messages = [r["errors"][name] for r in ws2]
        assert messages[0] and messages[0] == messages[1], name
        assert "different parameters" in messages[0] and "rank 1" in messages[0]
    assert "[4, 4]" in ws2[0]["errors"]["different"]
    assert "not contiguous" in ws2[0]["errors"]["not_contiguous"]


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_on_a_subgroup_bitwise_equal_to_unsharded_on_it(ws3, opt_name):
    """Ranks [1, 2] of 3: 20 steps equal the plain optimizer bitwise, each rank half the state."""
    assert ws3[0]["subgroup"] is None
    shares = []
    for rank, r in enumerate(ws3[1:], start=1):
        d = r["subgroup"][opt_name]
        print(f"subgroup {opt_name} rank={rank}: max|diff|={d['max_diff']:.3g}")
        assert d["bitwise"] and d["state_diff"] == 0.0, (rank, d["max_diff"], d["state_diff"])
        assert len(d["replicas_same"]) == STEPS and all(d["replicas_same"]), rank
        shares.append(d["state_elements"][0])
    total = ws3[1]["subgroup"][opt_name]["state_elements"][1]
    assert sum(shares) == total
    assert all(abs(share - total / 2) <= 0.02 * total / 2 for share in shares), shares


def test_resume_at_ws3_equals_unsharded_resume(ws3):
    """A ws=2 ZeRO checkpoint resumed at ws=3 continues as the plain optimizer resumed from it."""
    _check_resume(ws3, 3)


@pytest.mark.parametrize(
    "world_size",
    [1, pytest.param(4, marks=pytest.mark.slow)],  # 4 processes on 2 cores: slow
)
def test_resume_at_other_world_sizes(ws2, checkpoint_path, world_size):
    """The same at ws=1 and ws=4, and ZeRO's state loads into a plain optimizer and back."""
    results = ddptrain.spawn(_run_world, world_size, [], None, checkpoint_path, timeout_s=300)
    _check_resume(results, world_size)


def _check_resume(results: list[dict], world_size: int) -> None:
    for rank, r in enumerate(results):
        for opt_name, d in r["resume"].items():
            print(f"resume 2 -> {world_size} {opt_name} rank={rank}: {d}")
            # Both runs take the same gradients from the same wrapper; the update is elementwise.
            assert d["bitwise"] if world_size <= 2 else d["max_diff"] <= WS3_ATOL, d
            assert d["round_trip_diff"] == 0.0, d

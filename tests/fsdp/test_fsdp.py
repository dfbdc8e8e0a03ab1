"""FullyShardedDataParallel (ZeRO-2 and ZeRO-3) against ddptrain's DDP wrapper, torch's
fully_shard and the exact mean, with the same optimizer over many steps.

One spawned world per world size runs every case of this module; the tests read their case's
results from it.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddptrain.ddp.wrapper import DistributedDataParallel
from ddptrain.fsdp.unit import in_memory_order
from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from support import toy_models, worlds
from support.fsdp_models import MODELS, Wide, make_optimizer, whole, wrap
from support.state_diff import optimizer_state_diff

pytestmark = pytest.mark.timeout(worlds.WORLD_TIMEOUT_S + 60)

STEPS = 12
MICRO_STEPS = 3
EPS32 = torch.finfo(torch.float32).eps
# ws = 3, one backward from identical weights: both wrappers scale each rank's float32 gradient
# by 1/3 (the same rounding) and sum 3 terms (2 roundings) in an order of their own, so each
# is within 3/2 ulps of mean_r |g_r| of the exact mean (summation bound, u = EPS32 / 2), and
# the two within 3 of each other. Counted in ulps of that magnitude, it holds on any CPU; a
# missing rank or a wrong scale is off by ~1e7 ulps.
WS3_ULPS = 3.0
# ws = 3, STEPS SGD+momentum steps of the smooth tanh MLP: per-step differences of a few ulps
# are carried by momentum (gain <= 10) and lr 0.05 into the weights and stay that size, as in
# the DDP wrapper's own ws = 3 test (measured there 3e-8); 1e-5 is far above rounding and far
# below a missed or doubled update (~lr x gradient, 1e-3).
SMOOTH_ATOL = 1e-5
# The whole gradient's 1- and 2-norm, from the shards against torch's over the DDP wrapper's
# gradients (bitwise the same numbers at ws <= 2): the same float32 values reduced in another
# grouping (per shard, then across ranks in float64), a few ulps apart (~1e-7 relative) with
# torch's pairwise sums; 1e-5 allows a hundred of them, while a wrong norm type or a rank's
# part counted twice or not at all is 10% off or more. The inf-norm is a max: exact.
NORM_RTOL = 1e-5


def _backward(
    model: nn.Module, name: str, step: int, rank: int, micro: int, synced: bool = False
) -> None:
    """`micro` backwards: all but the last under no_sync(), or every one synchronized."""
    data = MODELS[name][1]
    for m in range(micro):
        x, y = toy_models.batch(data, step * micro + m, rank)
        with nullcontext() if synced or m == micro - 1 else model.no_sync():
            (toy_models.loss_of(data, model, x, y, rank) / micro).backward()


def _buffers_after_a_forward(models: list[nn.Module], name: str, rank: int) -> list[dict]:
    """Each model's buffers after one more forward (no_grad, train mode): a forward takes rank
    0's buffers under both wrappers (when they are synchronized in between differs). None
    without buffers."""
    if not list(models[0].module.buffers()):
        return [{} for _ in models]
    x, _ = toy_models.batch(MODELS[name][1], 1000, rank)
    out = []
    for model in models:
        with torch.no_grad():
            model(x)
        out.append({n: b.clone() for n, b in model.module.named_buffers()})
    return out


def _norms(ddp: nn.Module, sharded: FullyShardedDataParallel) -> dict:
    """The whole gradient's norms from the sharded wrapper and from torch over the DDP
    wrapper's gradients; then both clipped to half the inf-norm, and their 2-norms after."""
    grads = [p.grad for p in ddp.module.parameters() if p.grad is not None]
    norms = {
        norm_type: (
            sharded.grad_norm(norm_type).item(),
            torch.nn.utils.get_total_norm(grads, norm_type).item(),
        )
        for norm_type in (1.0, 2.0, math.inf)
    }
    max_norm = norms[math.inf][1] / 2
    torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), max_norm, math.inf)
    sharded.clip_grad_norm_(max_norm, math.inf)
    clipped = (sharded.grad_norm(2.0).item(), torch.nn.utils.get_total_norm(grads, 2.0).item())
    return {"norms": norms, "clipped_2_norm": clipped}


def _check_norms(d: dict, rank: int) -> None:
    for norm_type, (ours, theirs) in d["norms"].items():
        if norm_type == math.inf:
            assert ours == theirs, (rank, norm_type, ours, theirs)
        else:
            assert abs(ours - theirs) <= NORM_RTOL * theirs, (rank, norm_type, ours, theirs)
    ours, theirs = d["clipped_2_norm"]
    assert abs(ours - theirs) <= NORM_RTOL * theirs, (rank, "clipped", ours, theirs)


# ---------------------------------------------------------------------------- cases
def _train_against_ddp(
    name: str, kind: str, stage: int, rank: int, micro: int = 1, group=None, synced: bool = False
) -> dict:
    """STEPS steps of the DDP wrapper and of the sharded one from rank 0's weights (of `group`,
    both on it): whether every step's parameters, which gradients are None, the final
    optimizer state and the buffers a forward then uses agree; the last gradient's norms, and
    after clipping (_norms)."""
    torch.manual_seed(1234 + rank)  # different weights per rank: both take rank 0's
    base = MODELS[name][0]()
    ddp, sharded = wrap(name, base, 0, rank, group), wrap(name, base, stage, rank, group)
    opts = {id(m): make_optimizer(kind, m) for m in (ddp, sharded)}
    steps_equal, max_diff, none_equal = [], 0.0, []
    for step in range(STEPS):
        nones = []
        for model in (ddp, sharded):
            opts[id(model)].zero_grad(set_to_none=True)
            _backward(model, name, step, rank, micro, synced)
            nones.append([n for n, p in model.module.named_parameters() if p.grad is None])
            opts[id(model)].step()
        none_equal.append(nones[0] == nones[1])
        a, b = whole(ddp), whole(sharded)
        steps_equal.append(all(torch.equal(a[k], b[k]) for k in a))
        max_diff = max(max_diff, max((a[k] - b[k]).abs().max().item() for k in a))
    plain_state = opts[id(ddp)].state_dict()
    sharded_state = sharded.optim_state_dict(opts[id(sharded)])
    norms = _norms(ddp, sharded)
    a, b = _buffers_after_a_forward([ddp, sharded], name, rank)
    return {
        **norms,
        "buffers_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
        "steps_equal": steps_equal,
        "max_diff": max_diff,
        "none_equal": none_equal,
        "nones": nones,
        "state_diff": optimizer_state_diff(plain_state, sharded_state, same_layout=True),
    }


# On the subgroup: both stages, and a model with units named by hand.
SUBGROUP = [("wide", "adamw", 3), ("wide", "sgd", 2), ("lenet", "sgd", 3)]
EQUALITY = [
    ("wide", "sgd", 3),
    ("wide", "adamw", 3),
    ("wide", "adamw", 2),
    ("lenet", "adamw", 3),
    ("channels_last", "sgd", 3),
    ("tied", "adamw", 3),
    ("frozen", "sgd", 2),
    ("branch", "sgd", 3),
    ("branch_unit", "sgd", 3),
    ("branch_unit", "adamw", 2),
    ("swapped", "sgd", 3),
    ("batchnorm", "sgd", 3),
    ("syncbn", "sgd", 3),
]


def _case_equal_to_ddp(info) -> dict:
    return {f"{n}-{k}-{s}": _train_against_ddp(n, k, s, info.rank) for n, k, s in EQUALITY}


def _case_accumulation(info) -> dict:
    out = {
        f"{s}": _train_against_ddp("wide", "adamw", s, info.rank, micro=MICRO_STEPS) for s in (2, 3)
    }
    for s in (2, 3):
        out[f"{s}-branch"] = _train_against_ddp(
            "branch_unit", "adamw", s, info.rank, micro=MICRO_STEPS
        )
    for s in (2, 3):
        out[f"{s}-synced"] = _train_against_ddp(
            "tanh", "sgd", s, info.rank, micro=MICRO_STEPS, synced=True
        )
    return out


def _case_fully_shard(info) -> dict:
    """torch's fully_shard on each Linear and the root, AdamW, against ours (ZeRO-3)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)  # fully_shard does not broadcast: the same weights everywhere
    base = Wide()
    theirs = copy.deepcopy(base)
    for layer in [*theirs.layers, theirs.head]:
        fully_shard(layer)
    fully_shard(theirs)
    ours = wrap("wide", base, 3, info.rank)
    opts = {id(m): make_optimizer("adamw", m) for m in (ours, theirs)}
    steps_equal, max_diff = [], 0.0
    for step in range(STEPS):
        for model in (ours, theirs):
            opts[id(model)].zero_grad(set_to_none=True)
            x, y = toy_models.batch("tanh", step, info.rank)
            F.nll_loss(model(x), y).backward()
            opts[id(model)].step()
        a = whole(ours)
        b = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
        steps_equal.append(all(torch.equal(a[k], b[k]) for k in a))
        max_diff = max(max_diff, max((a[k] - b[k]).abs().max().item() for k in a))
    return {"steps_equal": steps_equal, "max_diff": max_diff}


def _case_one_step_ws3(info) -> dict:
    """One backward from identical weights: each shard's gradient vs the DDP wrapper's and the
    float64 mean of every rank's local gradient, in ulps of mean_r |g_r|."""
    torch.manual_seed(1234)
    out = {}
    for name in ("wide", "lenet", "tied", "channels_last", "branch_unit"):
        base = MODELS[name][0]()
        ddp, ours = wrap(name, base, 0, info.rank), wrap(name, base, 3, info.rank)
        plain = copy.deepcopy(base)
        for model in (ddp, ours, plain):
            x, y = toy_models.batch(MODELS[name][1], 0, info.rank)
            toy_models.loss_of(MODELS[name][1], model, x, y, info.rank).backward()
        # A branch this rank skipped counts as zero in the mean.
        local = {
            n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in plain.named_parameters()
        }
        ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
        worst = {"exact": 0.0, "ddp": 0.0}
        for unit in ours.units:
            for j, shard in enumerate(unit.shards):
                n, (_, a, b, _) = unit.names[j], unit.pieces[j]
                if shard.grad is None:  # no rank used it: None, as under the DDP wrapper
                    assert ddp_grads[n] is None, (name, n)
                    continue
                mine = in_memory_order(local[n], unit.strides[j]).double()
                everyone = [torch.empty_like(mine) for _ in range(info.world_size)]
                dist.all_gather(everyone, mine)
                stacked = torch.stack(everyone)[:, a:b]
                scale = EPS32 * stacked.abs().mean(0)
                theirs = in_memory_order(ddp_grads[n], unit.strides[j])[a:b].double()
                for key, other in (("exact", stacked.mean(0)), ("ddp", theirs)):
                    diff = (shard.grad.double() - other).abs()
                    assert bool((diff[scale == 0] == 0).all()), (name, n)
                    if (scale > 0).any():
                        ulps = (diff[scale > 0] / scale[scale > 0]).max().item()
                        worst[key] = max(worst[key], ulps)
        out[name] = worst
    return out


def _case_smooth_ws3(info) -> dict:
    """STEPS steps of the tanh MLP: the sharded wrapper against the DDP wrapper."""
    torch.manual_seed(7)
    base = toy_models.make("tanh")
    models = {
        "ddp": DistributedDataParallel(copy.deepcopy(base)),
        "ours": FullyShardedDataParallel(copy.deepcopy(base), units=[nn.Linear]),
    }
    for model in models.values():
        opt = toy_models.sgd(model)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = toy_models.batch("tanh", step, info.rank)
            F.nll_loss(model(x), y).backward()
            opt.step()
    a, b = whole(models["ddp"]), whole(models["ours"])
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _case_subgroup(info) -> dict | None:
    """Ranks 1 and 2 of 3 train the sharded wrapper and the DDP wrapper on their group while
    rank 0 waits. Last in its world: only the group's ranks create the wrappers' own groups, so
    the ranks no longer agree on the next group's number afterwards."""
    group = dist.new_group(ranks=[1, 2])  # every rank must create it; only 1 and 2 join
    out = None
    if info.rank in (1, 2):
        out = {
            f"{n}-{k}-{s}": _train_against_ddp(n, k, s, dist.get_rank(group), group=group)
            for n, k, s in SUBGROUP
        }
    dist.barrier()
    return out


CASES = {
    "equal_to_ddp": _case_equal_to_ddp,
    "accumulation": _case_accumulation,
    "fully_shard": _case_fully_shard,
    "one_step_ws3": _case_one_step_ws3,
    "smooth_ws3": _case_smooth_ws3,
    "subgroup": _case_subgroup,
}
world = worlds.fixture(
    CASES,
    {
        1: ["equal_to_ddp"],
        2: ["equal_to_ddp", "accumulation", "fully_shard"],
        3: ["one_step_ws3", "smooth_ws3", "subgroup"],
    },
)


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", [f"{n}-{k}-{s}" for n, k, s in EQUALITY])
@pytest.mark.parametrize("world_size", [1, 2])
def test_bitwise_equal_to_the_ddp_wrapper_every_step(world, world_size, case):
    """ws <= 2: params, None grads, state and buffers equal the DDP wrapper's bitwise each step."""
    for rank, r in enumerate(worlds.outcome(world(world_size), "equal_to_ddp")):
        d = r[case]
        print(f"{case} ws={world_size} rank={rank}: max|diff|={d['max_diff']:.3g}")
        assert all(d["steps_equal"]), (rank, d["steps_equal"], d["max_diff"])
        assert all(d["none_equal"]), (rank, d["nones"])
        assert d["state_diff"] == 0.0, (rank, d["state_diff"])
        assert d["buffers_equal"], rank


@pytest.mark.parametrize("case", [f"{n}-{k}-{s}" for n, k, s in EQUALITY])
@pytest.mark.parametrize("world_size", [1, 2])
def test_gradient_norms_and_clipping_equal_the_ddp_wrappers(world, world_size, case):
    """grad_norm(1, 2, inf) and clipping equal the DDP wrapper's within NORM_RTOL (inf exactly)."""
    for rank, r in enumerate(worlds.outcome(world(world_size), "equal_to_ddp")):
        _check_norms(r[case], rank)


def test_unused_and_frozen_parameters_keep_grad_none(world):
    """Unused and frozen layers keep grad None; a branch only rank 1 takes gets its mean on both."""
    for r in worlds.outcome(world(2), "equal_to_ddp"):
        assert r["branch-sgd-3"]["nones"][1] == ["never_used.weight", "never_used.bias"]
        assert r["branch_unit-sgd-3"]["nones"][1] == ["never_used.weight", "never_used.bias"]
        assert r["frozen-sgd-2"]["nones"][1] == ["frozen.weight", "frozen.bias"]


@pytest.mark.parametrize("case", ["2", "3", "2-branch", "3-branch"])
def test_gradient_accumulation_under_no_sync_is_bitwise_equal_to_ddp(world, case):
    """Two of three micro-batches under no_sync, 12 AdamW steps: bitwise the DDP wrapper's."""
    # Also with a branch unit only rank 1 runs: its gradient accumulates there, rank 0 only
    # pairs its gathers.
    for rank, r in enumerate(worlds.outcome(world(2), "accumulation")):
        assert all(r[case]["steps_equal"]), (rank, r[case]["max_diff"])
        assert all(r[case]["none_equal"]), (rank, r[case]["nones"])
        assert r[case]["state_diff"] == 0.0


@pytest.mark.parametrize("stage", ["2", "3"])
def test_synchronized_backwards_accumulate_like_the_ddp_wrapper(world, stage):
    """Synced backwards without zero_grad accumulate like the DDP wrapper, within SMOOTH_ATOL."""
    # The wrappers round the running sum differently: (m1 + g2_r) / 2 summed over ranks
    # against m1 + the mean of g2.
    for rank, r in enumerate(worlds.outcome(world(2), "accumulation")):
        d = r[f"{stage}-synced"]
        print(f"synced accumulation stage {stage} rank={rank}: max|diff|={d['max_diff']:.3g}")
        assert d["max_diff"] <= SMOOTH_ATOL and d["state_diff"] <= SMOOTH_ATOL, (rank, d)


def test_equal_to_torch_fully_shard(world):
    """ZeRO-3 with AdamW equals torch's fully_shard bitwise after each of 12 steps at ws=2."""
    for rank, r in enumerate(worlds.outcome(world(2), "fully_shard")):
        print(f"vs fully_shard rank={rank}: max|diff|={r['max_diff']:.3g}")
        assert all(r["steps_equal"]), (rank, r["steps_equal"], r["max_diff"])


def test_one_step_gradients_at_ws3_within_rounding_of_the_mean_and_ddp(world):
    """At ws=3 each shard's gradient is within WS3_ULPS of the exact mean and the DDP wrapper's."""
    for rank, r in enumerate(worlds.outcome(world(3), "one_step_ws3")):
        for name, worst in r.items():
            exact, ddp = worst["exact"], worst["ddp"]
            print(f"ws=3 rank={rank} {name}: ulps vs the exact mean {exact:.2f}, vs ddp {ddp:.2f}")
            assert worst["exact"] <= WS3_ULPS / 2 and worst["ddp"] <= WS3_ULPS, (name, worst)


def test_smooth_model_at_ws3_stays_within_rounding_of_ddp(world):
    """12 SGD steps of the tanh MLP at ws=3 end within SMOOTH_ATOL of the DDP wrapper."""
    for rank, diff in enumerate(worlds.outcome(world(3), "smooth_ws3")):
        print(f"ws=3 rank={rank}: max|ours - ddp| = {diff:.3g}")
        assert diff <= SMOOTH_ATOL


@pytest.mark.parametrize("case", [f"{n}-{k}-{s}" for n, k, s in SUBGROUP])
def test_on_a_subgroup_bitwise_equal_to_the_ddp_wrapper_on_it(world, case):
    """On process_group=[1, 2] of 3 the sharded wrapper equals the DDP wrapper on it bitwise."""
    results = worlds.outcome(world(3), "subgroup")
    assert results[0] is None
    for rank, r in enumerate(results[1:], start=1):
        d = r[case]
        print(f"subgroup {case} rank={rank}: max|diff|={d['max_diff']:.3g}")
        assert all(d["steps_equal"]), (rank, d["steps_equal"], d["max_diff"])
        assert all(d["none_equal"]), (rank, d["nones"])
        assert d["state_diff"] == 0.0, (rank, d["state_diff"])
        _check_norms(d, rank)

"""Units, their flat layout and their gather order, without processes: every element in one
shard, cuts aligned."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddptrain.fsdp.layout import ALIGN, choose_units, flat_layout, group_parameters
from ddptrain.fsdp.passes import forward_order
from support import toy_models

MLP_NUMELS = [784 * 2240, 2240] + [2240 * 2240, 2240] * 3 + [22400, 10]  # the bench MLP


@pytest.mark.parametrize(
    "numels, world_size",
    [([10, 3000, 7, 500], 2), ([10, 3000, 7, 500], 3), ([5, 0, 1, 2], 4), ([0, 0], 2), ([1], 5)],
)
def test_every_element_lies_in_exactly_one_rank_piece(numels, world_size):
    """The ranks' pieces cover each parameter's elements once, at distinct shard offsets."""
    layout = flat_layout(numels, world_size)
    covered = [[0] * n for n in numels]
    for rank in range(world_size):
        taken = [0] * layout.shard_numel
        for j, a, b, at in layout.pieces(rank):
            assert 0 <= a <= b <= numels[j] and 0 <= at <= at + b - a <= layout.shard_numel
            for i in range(a, b):
                covered[j][i] += 1
            for i in range(at, at + b - a):
                taken[i] += 1
        for start, stop in layout.gaps(rank):
            for i in range(start, stop):
                taken[i] += 1
        assert taken == [1] * layout.shard_numel  # pieces and gaps tile the shard
    assert all(c == 1 for per_param in covered for c in per_param)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_are_equal_balanced_and_cut_on_aligned_elements(world_size):
    """Shards are equal ALIGN multiples near total / world_size, and every piece starts aligned."""
    # Aligned starts let vectorised loops see the whole tensor's alignment.
    layout = flat_layout(MLP_NUMELS, world_size)
    assert layout.shard_numel % ALIGN == 0
    padding = ALIGN * (len(MLP_NUMELS) + 1)
    assert 0 <= layout.shard_numel - sum(MLP_NUMELS) / world_size <= padding
    for rank in range(world_size):
        for _, a, b, at in layout.pieces(rank):
            if b > a:
                assert a % ALIGN == 0 and at % ALIGN == 0


def test_units_named_by_module_or_class_in_pre_order_root_first():
    """units= takes submodules or classes; the root comes first, the rest in module order."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3)))
    assert choose_units(model, [model[2]]) == [model, model[2]]
    assert choose_units(model, [nn.Linear]) == [model, model[0], model[2][0]]
    with pytest.raises(ValueError, match="must name submodules"):
        choose_units(model, [nn.Linear(1, 1)])


def test_size_policy_takes_modules_with_enough_parameters_bottom_up():
    """A module holding min_numel parameters not already in a smaller unit becomes a unit."""
    model = nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 1)))
    # Linear(10, 10) holds 110 parameters, Linear(10, 1) 11, the inner Sequential 121.
    assert choose_units(model, None, min_numel=110) == [model, model[0], model[1][0]]
    assert choose_units(model, None, min_numel=120) == [model, model[1]]
    assert choose_units(model, None, min_numel=10_000) == [model]


def test_containers_are_never_units():
    """A ModuleList is never a unit: its count goes to its caller, and units= refuses it."""
    # A ModuleList has no forward of its own to hook.

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(10, 10) for _ in range(3))

    model = Stack()
    assert choose_units(model, None, min_numel=300) == [model]  # 330 in the list, none alone
    assert choose_units(model, None, min_numel=100) == [model, *model.layers]
    for named in (model.layers, nn.ModuleList):
        with pytest.raises(ValueError, match="container"):
            choose_units(model, [named])


def test_tied_weight_belongs_to_the_unit_around_both_users():
    """TiedNet's shared weight goes to the root unit, listed once with every holder."""
    model = toy_models.make("tied")
    groups = group_parameters(model, [model, model.embed, model.out, model.hidden])
    names = [[ref.name for ref in group] for group in groups]
    assert names == [["embed.weight"], [], [], ["hidden.weight", "hidden.bias"]]
    owners = [(type(m).__name__, attr) for m, attr in groups[0][0].owners]
    assert owners == [("Embedding", "weight"), ("Linear", "weight")]


def test_every_parameter_goes_to_its_innermost_unit():
    """Parameters are grouped by their innermost enclosing unit, in named_parameters() order."""
    model = toy_models.make("lenet")
    groups = group_parameters(model, [model, model.conv2, model.fc1])
    flat = [ref.name for group in groups for ref in group]
    assert sorted(flat) == sorted(n for n, _ in model.named_parameters())
    assert [ref.name for ref in groups[1]] == ["conv2.weight", "conv2.bias"]
    assert [ref.name for ref in groups[0]] == [
        "conv1.weight",
        "conv1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    assert all(isinstance(ref.param, torch.Tensor) for group in groups for ref in group)


@pytest.mark.parametrize(
    "ran, count, expected",
    [
        ([0, 1, 2], 3, [0, 1, 2]),
        ([0, 1], 4, [0, 1, 2, 3]),
        ([0, 2, 1], 4, [0, 2, 3, 1]),
        ([2, 1], 3, [0, 2, 1]),
        ([], 2, [0, 1]),
    ],
)
def test_the_gather_schedule_keeps_the_forwards_order_and_places_skipped_units(
    ran, count, expected
):
    """forward_order keeps the forward's order and puts each skipped unit after its predecessor."""
    assert forward_order(ran, count) == expected

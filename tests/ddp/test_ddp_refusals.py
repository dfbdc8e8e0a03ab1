"""What ddptrain.DDP refuses, each with a message naming the fix, on every rank, never a hang:
different models on different ranks, a second backward, parameters added after wrapping, no
process group.

One spawned world of 2 ranks runs every case (worlds.run_cases).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ddptrain.ddp.wrapper import DistributedDataParallel
from support import worlds

# A hang instead of an error would stop the world at spawn's timeout; a loaded 2-core machine
# starts a world several times slower than a quiet one.
WORLD_TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
WORLD_SIZE = 2


def _raised(call: Callable[[], object]) -> str:
    """The message of the RuntimeError `call()` raised, or "no error"."""
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _case_shape_mismatch(info) -> str:
    width = 8 if info.rank == 0 else 9
    return _raised(lambda: DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, width))))


def test_shape_mismatch_is_a_clear_error_on_every_rank(world):
    """Ranks wrapping different shapes get an error naming the parameter and rank, no hang."""
    # A hang instead of the error would stop the whole world at spawn's timeout.
    for message in worlds.outcome(world(WORLD_SIZE), "shape_mismatch"):
        assert "ranks wrap different models" in message
        assert "0.weight" in message and "rank 1" in message


def _case_backward_twice(info) -> str:
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    loss = model(torch.ones(2, 3)).sum()
    loss.backward(retain_graph=True)
    return _raised(loss.backward)


def test_backward_twice_is_a_clear_error(world):
    """A second backward on one forward raises a clear error instead of double-reducing."""
    for message in worlds.outcome(world(WORLD_SIZE), "backward_twice"):
        assert "backward was called twice" in message


def _case_param_added(info) -> str:
    module = torch.nn.Sequential(torch.nn.Linear(3, 3))
    model = DistributedDataParallel(module)
    module.append(torch.nn.Linear(3, 1))
    return _raised(lambda: model(torch.ones(1, 3)))


def test_parameters_added_after_wrapping_are_refused(world):
    """Adding a parameter after wrapping is refused at the next forward with the fix named."""
    for message in worlds.outcome(world(WORLD_SIZE), "param_added"):
        assert "parameters changed after wrapping" in message


def test_needs_a_process_group():
    """Wrapping without a process group names the call that is missing."""
    with pytest.raises(RuntimeError, match="init_distributed"):
        DistributedDataParallel(torch.nn.Linear(2, 2))


def _case_structure_changes(info) -> str:
    module = torch.nn.Sequential(torch.nn.Linear(3, 3))
    model = DistributedDataParallel(module)
    module.append(torch.nn.ReLU())  # no parameters: still fine
    model(torch.ones(1, 3))
    module[0].register_parameter("extra", torch.nn.Parameter(torch.ones(1)))
    return _raised(lambda: model(torch.ones(1, 3)))


def test_parameter_added_to_an_existing_layer_is_refused_but_a_plain_layer_is_not(world):
    """A new parameter on a wrapped layer is caught; appending a parameter-free layer is fine."""
    for message in worlds.outcome(world(WORLD_SIZE), "structure_changes"):
        assert "parameters changed after wrapping" in message


CASES = {
    "shape_mismatch": _case_shape_mismatch,
    "backward_twice": _case_backward_twice,
    "param_added": _case_param_added,
    "structure_changes": _case_structure_changes,
}
world = worlds.fixture(CASES, {WORLD_SIZE: list(CASES)}, timeout_s=WORLD_TIMEOUT_S)

"""FullyShardedDataParallel's misuses: each a clear error on every rank, never a hang.

One spawned world of 2 runs every misuse; the tests read their case's message from it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddptrain.fsdp.wrapper import FullyShardedDataParallel
from support import worlds

pytestmark = pytest.mark.timeout(worlds.WORLD_TIMEOUT_S + 60)


def _message(fn, *args) -> str | None:
    try:
        fn(*args)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def _case_errors(info) -> dict:
    """Each misuse's message (on every rank alike: no hang)."""
    torch.manual_seed(0)
    out = {}
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = FullyShardedDataParallel(net, units=[net[0], net[1]])
    x = torch.randn(2, 4)
    out["comm_hook"] = _message(lambda: model.register_comm_hook(None, None))
    out["join"] = _message(lambda: model.join())
    out["module_directly"] = _message(lambda: model.module(x))
    loss = model(x).sum()
    out["state_dict_mid_step"] = _message(lambda: model.state_dict())
    loss.backward(retain_graph=True)
    out["backward_twice"] = _message(lambda: loss.backward())

    class Twice(nn.Module):
        """A unit called twice in one forward."""

        def __init__(self) -> None:
            super().__init__()
            self.layer, self.other = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.other(self.layer(self.layer(t)))

    twice = Twice()
    out["unit_twice"] = _message(FullyShardedDataParallel(twice, units=[twice.layer]).__call__, x)
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    out["mixed_dtypes"] = _message(lambda: FullyShardedDataParallel(mixed))
    out["foreign_optimizer"] = _message(
        lambda: model.optim_state_dict(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    )
    out["wrong_shape"] = _message(
        lambda: model.load_state_dict({**model.state_dict(), "0.weight": torch.zeros(5, 4)})
    )

    return out


world = worlds.fixture({"errors": _case_errors}, {2: ["errors"]})


ERRORS = {
    "comm_hook": "reduce-scatters gradients: a DDP comm hook",
    "join": "uneven inputs (torch's Join) are not supported",
    "module_directly": "outside the wrapper's forward",
    "state_dict_mid_step": "state_dict() runs between steps",
    "backward_twice": "backward was called twice on one forward",
    "unit_twice": "ran twice in one forward",
    "mixed_dtypes": "holds parameters of several dtypes",
    "foreign_optimizer": "is not one of this wrapper's parameters",
    "wrong_shape": "size mismatch for parameter '0.weight'",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_misuse_is_a_clear_error_on_every_rank(world, case):
    """Each misuse raises an error naming the fix on every rank, with no hang."""
    messages = [r[case] for r in worlds.outcome(world(2), "errors")]
    assert all(m is not None and ERRORS[case] in m for m in messages), messages

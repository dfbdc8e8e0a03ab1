"""The environment a command-line test runs a main in: a world of one (a pytest fixture).

rank0 = cli_env.rank0      # in a test module; then def test_x(rank0): ...
"""

from __future__ import annotations

import pytest

from ddptrain import cli
from support.idx_files import closed_port_url


@pytest.fixture
def rank0(monkeypatch):
    """A world of one: no launcher variables, no debug switch, no reachable download mirror."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", cli.DEBUG_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DDPTRAIN_MNIST_MIRROR", closed_port_url())

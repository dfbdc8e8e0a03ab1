"""Shared test hygiene: no process group outlives a test."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _destroy_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()

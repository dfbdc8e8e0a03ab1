"""Shared test hygiene: no process group outlives a test; the default suite runs on CPU."""

import os
import re

import pytest
import torch.distributed as dist


def pytest_configure(config):
    # The default suite tests the gloo/CPU path with 2-4 ranks on one host. Hidden before
    # anything asks torch about CUDA, the GPUs stay out of this process and of every rank it
    # spawns or launches: on a machine with fewer GPUs than ranks, init_distributed would
    # otherwise pick NCCL and refuse LOCAL_RANK >= the GPU count. Selecting the gpu marker
    # (`-m gpu`) leaves them visible, so run those tests on their own.
    if not re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(autouse=True)
def _destroy_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()

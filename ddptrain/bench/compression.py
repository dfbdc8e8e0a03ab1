"""The step bench's PowerSGD variants: ddptrain's hook, torch's on ddptrain's wrapper, torch's
on official DDP.

    python -m ddptrain.bench --models mlp --extras powersgd,torch-powersgd,torch-ddp-powersgd
    python -m ddptrain.bench --two-hosts --link 1gbit     # these, bf16 and fp16 by default

Each compresses at `--powersgd-rank` (default 4) from the bench's third step, inside its
warm-up rounds. Official DDP runs torch's hook with one bucket: with several, its callbacks'
all_reduces run concurrently and abort on gloo; ddptrain's wrapper runs the same hook over its
default buckets, one bucket at a time on its communication thread.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddptrain.compress.powersgd import PowerSGDState, powersgd_hook
from ddptrain.ddp.buckets import MB
from ddptrain.ddp.wrapper import DistributedDataParallel

# --extras name -> the variant's name in the results.
EXTRAS = {
    "powersgd": "ddptrain_powersgd",
    "torch-powersgd": "ddptrain_torch-powersgd",
    "torch-ddp-powersgd": "torch_ddp_powersgd",
}
DEFAULT_RANK = 4
# The first step a PowerSGD state may compress with error feedback and warm start (the
# wrappers rebuild their buckets after the first).
START_STEP = 2


def make_variant(variant: str, module: nn.Module, rank: int) -> nn.Module:
    """Collective: `module` wrapped as the variant named EXTRAS[extra]."""
    if variant == "ddptrain_powersgd":
        state = PowerSGDState(matrix_rank=rank, start_step=START_STEP)
        return DistributedDataParallel(module, comm_hook=(state, powersgd_hook))
    torch_state = torch_psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=START_STEP
    )
    if variant == "ddptrain_torch-powersgd":
        model = DistributedDataParallel(module)
    elif variant == "torch_ddp_powersgd":
        model = TorchDDP(module, bucket_cap_mb=_one_bucket_mb(module))
    else:
        raise ValueError(f"unknown compression variant {variant!r}")
    model.register_comm_hook(torch_state, torch_psgd.powerSGD_hook)
    return model


def _one_bucket_mb(module: nn.Module) -> float:
    """A bucket cap every parameter fits under (a cap of its own also sets official DDP's
    first bucket)."""
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return nbytes / MB + 1.0


def compressed_elements(model: nn.Module) -> tuple[int, int] | None:
    """(gradient elements, elements sent) per step of ddptrain's PowerSGD, else None."""
    if not isinstance(model, DistributedDataParallel):
        return None
    state = model.comm_hook[0]
    return state.elements_per_step() if isinstance(state, PowerSGDState) else None

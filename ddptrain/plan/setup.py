"""One training setup a plan predicts: model, per-rank batch, precision, optimizer, strategy,
device.

    s = Setup(model="mlp", strategy="zero1", optimizer="adamw")
    s.label                       # "mlp zero1 adamw" ("... cuda" on a GPU)
    build(s, device)              # on every rank: (wrapped model, optimizer), as --check runs it
    rank_env("cpu")               # what spawned ranks need to compute on that device

Strategies: "ddp" (ddptrain's wrapper, its default transport), "zero1" (the wrapper and
ZeroRedundancyOptimizer), "zero2" and "zero3" (FullyShardedDataParallel), "powersgd" (the
wrapper with the PowerSGD hook at `powersgd_rank`, compressing from the second step).
Devices: "cpu" (gloo; the GPUs hidden from the ranks) and "cuda" (NCCL, one GPU per rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ddptrain.plan.meter import DEVICES
from ddptrain.plan.workloads import Workload, workload

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "powersgd")
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The first step PowerSGD compresses (error feedback and warm start need the buckets the
# wrapper rebuilds after step 1).
POWERSGD_START_STEP = 2


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What one rank trains and how; the world size and the link are the plan's."""

    model: str = "mlp"
    batch_size: int | None = None  # per rank; None: the model's default
    precision: str = "fp32"
    optimizer: str = "sgd"
    strategy: str = "ddp"
    powersgd_rank: int = 4
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}: choose one of {', '.join(DEVICES)}")

    @property
    def label(self) -> str:
        """Short name for tables: model, strategy (with PowerSGD's rank), optimizer."""
        strategy = (
            f"powersgd-r{self.powersgd_rank}" if self.strategy == "powersgd" else self.strategy
        )
        device = "" if self.device == "cpu" else f" {self.device}"
        return f"{self.model} {strategy} {self.optimizer}{device}"

    @property
    def workload(self) -> Workload:
        return workload(self.model, self.batch_size)

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    def as_dict(self) -> dict:
        return asdict(self)


def default_device() -> str:
    """ "cuda" where torch sees a GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def require_device(device: str) -> None:
    """Refuse, in one line, a device this machine lacks."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda': torch.cuda.is_available() is False on this machine (torch "
            f"{torch.__version__}); plan for --device cpu, or run on a machine with a GPU"
        )


def rank_env(device: str) -> dict[str, str]:
    """Environment for ranks spawned to compute on `device`: CPU ranks see no GPU, so
    init_distributed picks gloo and the CPU even on a GPU machine."""
    return {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}


def build(
    setup: Setup, device: torch.device, wrap_hook: Callable[[Any], Any] | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Collective: the model built from seed 0, wrapped per the strategy, and its optimizer;
    `wrap_hook(hook)`: the comm hook the DDP wrapper gets instead of `hook` (marks.py's HookTimer;
    the default transport's hook for ddp and zero1)."""
    from ddptrain.compress.powersgd import PowerSGDState, powersgd_hook
    from ddptrain.ddp.hooks import default_transport, transport_hook
    from ddptrain.ddp.wrapper import DistributedDataParallel
    from ddptrain.fsdp.wrapper import FullyShardedDataParallel
    from ddptrain.optim.zero import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    module = setup.workload.factory().to(device=device, dtype=setup.dtype)
    cls = OPTIMIZERS[setup.optimizer]
    if setup.strategy in ("zero2", "zero3"):
        model: nn.Module = FullyShardedDataParallel(
            module, reshard_after_forward=setup.strategy == "zero3"
        )
    elif setup.strategy == "powersgd":
        state = PowerSGDState(matrix_rank=setup.powersgd_rank, start_step=POWERSGD_START_STEP)
        hook = powersgd_hook if wrap_hook is None else wrap_hook(powersgd_hook)
        model = DistributedDataParallel(module, comm_hook=(state, hook))
    elif wrap_hook is not None:
        transport = default_transport(None, on_cpu=device.type == "cpu")
        model = DistributedDataParallel(module, comm_hook=(transport, wrap_hook(transport_hook)))
    else:
        model = DistributedDataParallel(module)
    if setup.strategy == "zero1":
        return model, ZeroRedundancyOptimizer(model.parameters(), cls, lr=1e-3)
    return model, cls(model.parameters(), lr=1e-3)

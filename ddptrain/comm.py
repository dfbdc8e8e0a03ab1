"""Comm hooks by name: what TrainerConfig.comm_hook and the recipes' --comm-hook accept.

    state, hook = named_hook("bf16")                      # collective: every rank, same order
    model = ddptrain.DDP(net, comm_hook=named_hook("powersgd"))
    TrainerConfig(comm_hook="ring-fp16")                  # the Trainer resolves it here

The DDP wrapper speaks torch's `(state, hook)` only; names live here, above the core, which
knows neither the CPU transports nor the compressing hooks. "default" is the wrapper's own
choice (shared memory for CPU ranks on one host, TCP across hosts, else the backend's
all_reduce); "allreduce" forces the backend; "shm", "tcp" and "ring" force a CPU transport;
"bf16"/"fp16" send half the bytes around the default, "allreduce-bf16", "ring-fp16", ...
around a named one; "powersgd" compresses (rank 4 from step 100 unless given).
"""

from __future__ import annotations

from typing import Any

import torch

from ddptrain import cpu
from ddptrain.compress.half import HalfPrecision
from ddptrain.compress.powersgd import NAMED_RANK, NAMED_START_STEP, PowerSGDState, powersgd_hook
from ddptrain.ddp.hooks import AllReduce, CommHook, Transport, default_transport, transport_hook

TRANSPORTS = (
    "allreduce",
    "shm",
    "tcp",
    "ring",
    "bf16",
    "fp16",
    "allreduce-bf16",
    "allreduce-fp16",
    "ring-bf16",
    "ring-fp16",
)
NAMES = ("default", *TRANSPORTS, "powersgd")


def named_hook(
    name: str,
    process_group: Any = None,
    on_cpu: bool = True,
    *,
    powersgd_rank: int = NAMED_RANK,
    powersgd_start_step: int = NAMED_START_STEP,
) -> tuple[object, CommHook]:
    """Collective: the (state, hook) pair `name` (one of NAMES) stands for; `on_cpu`: the
    model's parameters are on the CPU (the default then may use the CPU transports)."""
    if name == "powersgd":
        state = PowerSGDState(
            process_group,
            matrix_rank=powersgd_rank,
            start_step=powersgd_start_step,
            on_cpu=on_cpu,
        )
        return state, powersgd_hook
    if name == "default":
        return default_transport(process_group, on_cpu), transport_hook
    return make_transport(name, process_group), transport_hook


def make_transport(name: str, process_group: Any = None) -> Transport:
    """Collective: the transport called `name` (one of TRANSPORTS), built on every rank."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown comm hook {name!r}; choose one of {', '.join(NAMES)}")
    if name in ("bf16", "fp16"):
        base, wire = "default", name
    elif name.endswith(("-bf16", "-fp16")):
        base, wire = name.split("-")
    else:
        base, wire = name, ""
    if base == "default":
        inner = default_transport(process_group, on_cpu=True)
    elif base == "allreduce":
        inner = AllReduce(process_group)
    else:
        inner = cpu.transport(base, process_group)
    if not wire:
        return inner
    return HalfPrecision(torch.bfloat16 if wire == "bf16" else torch.float16, inner)

"""CPU transports for the DDP wrapper: shared memory on one host, TCP across hosts, a ring.

    ddptrain.DDP(net)                      # CPU ranks under gloo: one of these by default
    ddptrain.DDP(net, comm_hook="tcp")     # or forced by name: "shm", "tcp", "ring"

Each is a `ddptrain.ddp.hooks.Transport`: the core knows them only through that interface,
and reaches this package in one place (`hooks.default_transport`, `hooks.make_transport`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from ddptrain.cpu.ring import Ring
from ddptrain.cpu.shm import SharedMemory, shared_memory_usable
from ddptrain.cpu.tcp import HOST_ENV, Socket
from ddptrain.ddp.hooks import Transport

__all__ = ["Ring", "SharedMemory", "Socket", "default_transport", "transport"]


def transport(name: str, process_group: Any = None) -> Transport:
    """Collective: the CPU transport called `name` ("shm", "tcp" or "ring")."""
    if name == "shm":
        return SharedMemory(process_group)
    if name == "tcp":
        return Socket(process_group)
    if name == "ring":
        return Ring(process_group)
    raise ValueError(f"unknown CPU transport {name!r}; choose shm, tcp or ring")


def default_transport(process_group: Any = None) -> Transport | None:
    """Collective: shared memory when every rank is on one host, else direct TCP connections;
    None (the backend's all_reduce) where the ranks cannot connect to each other."""
    if shared_memory_usable(process_group):
        return SharedMemory(process_group)
    chosen = Socket.connect(process_group)
    if chosen is None and dist.get_rank(process_group) == 0:
        warnings.warn(
            "ddptrain: the ranks could not open TCP connections to each other; gradients go "
            f"through the backend's all_reduce (set {HOST_ENV} to this host's address)",
            stacklevel=2,
        )
    return chosen

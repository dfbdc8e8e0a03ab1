"""CPU transports for the DDP wrapper: shared memory on one host, TCP across hosts, a ring.

    ddptrain.DDP(net)                                     # CPU ranks under gloo: one by default
    ddptrain.DDP(net, comm_hook=ddptrain.named_hook("tcp"))   # or by name: shm, tcp, ring

Each is a `ddptrain.ddp.hooks.Transport`: the core knows them only through that interface.
Importing this package (`import ddptrain` does) registers with the core
(`hooks.register_cpu_defaults`) `default_transport`, its choice for CPU ranks under gloo, and
`slots_mode`, which has large Linear layers compute their gradients straight into their
bucket slots (linear_slots.py). Names are resolved above the core, in ddptrain/comm.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from ddptrain.cpu.linear_slots import slots_mode
from ddptrain.cpu.ring import Ring
from ddptrain.cpu.shm import SharedMemory, shared_memory_usable
from ddptrain.cpu.tcp import HOST_ENV, Socket
from ddptrain.ddp import hooks
from ddptrain.ddp.hooks import Transport

__all__ = ["Ring", "SharedMemory", "Socket", "default_transport", "slots_mode", "transport"]


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


hooks.register_cpu_defaults(default_transport, slots_mode)

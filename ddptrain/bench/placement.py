"""Where a bench ran: the hosts its ranks sat on, and how the wrapper's buckets were reduced.

    raw_rank["host"] = this_host()                    # on each rank
    raw_rank["models"][m]["transport"] = bucket_transport(ddp_model)   # after a backward
    settings = {"hosts": hosts(raw), "bucket_transport": transport(raw)}   # pure, on rank 0

A one-host run reduces buckets in shared memory by default; ranks on different hosts (or in
fake ones, ddptrain.netns) cannot, and their buckets go over direct TCP connections (or the
backend's all_reduce, where the ranks cannot connect). The settings make the kinds of run
impossible to mistake for each other.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from ddptrain.compress.half import HalfPrecision
from ddptrain.cpu.shm import SHM_DIR
from ddptrain.cpu.tcp import Socket
from ddptrain.ddp.wrapper import DistributedDataParallel


def bucket_transport(model: DistributedDataParallel) -> str:
    """How the wrapper's buckets were reduced in its last backward: "shared_memory", "tcp",
    "backend", "mixed", or "none" (a world of one)."""
    # Each .grad is a view of its bucket after backward, and a bucket the shared-memory
    # transport reduces is a row of a file it mapped in SHM_DIR; any other bucket (a private
    # tensor) goes through the TCP transport or the backend's all_reduce. This reads where the
    # memory is, not which transport was asked for, so a fallback (a full tmpfs, ranks on two
    # hosts) shows; a TCP transport exists only where its connections were made.
    if model.world_size == 1:
        return "none"
    shared = {_in_shared_file(p.grad) for p in model.module.parameters() if p.grad is not None}
    if shared == {True}:
        return "shared_memory"
    if shared == {True, False}:
        return "mixed"
    transport = model.comm_hook[0]
    if isinstance(transport, HalfPrecision):
        transport = transport.inner
    return "tcp" if isinstance(transport, Socket) else "backend"


def _in_shared_file(t: torch.Tensor) -> bool:
    filename = t.untyped_storage().filename
    return filename is not None and filename.startswith(SHM_DIR + "/")


def this_host() -> dict[str, str | None]:
    """This process's host: its hostname and network namespace."""
    # Fake hosts (ddptrain.netns) share the hostname; their network namespaces differ.
    try:
        netns: str | None = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = None
    return {"hostname": socket.gethostname(), "netns": netns}


def hosts(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct hosts of the ranks' raw results, each with its ranks, by first rank (pure)."""
    found: dict[tuple, dict[str, Any]] = {}
    for rank, r in enumerate(raw):
        key = (r["host"]["hostname"], r["host"]["netns"])
        found.setdefault(key, {**r["host"], "ranks": []})["ranks"].append(rank)
    return list(found.values())


def transport(raw: list[dict[str, Any]]) -> str | None:
    """The wrapper's bucket transport over every model and rank (None: no ddptrain variant)."""
    seen = {m["transport"] for r in raw for m in r["models"].values() if "transport" in m}
    if len(seen) > 1:
        return "mixed"
    return seen.pop() if seen else None

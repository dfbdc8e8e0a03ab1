"""A tiny deterministic DDP training job for the multi-node test (tests/test_multinode.py).

    torchrun --standalone --nproc_per_node=4 tests/multinode_job.py --out ref.pt \
        --comm-hook tcp
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
        tests/multinode_job.py --out multi.pt
    mpirun -np 2 python tests/multinode_job.py --out mpi.pt     # or srun -n 2 (test_slurm_mpi)

Every rank trains LeNet (no dropout) under ddptrain.DDP for a few SGD+momentum steps on
synthetic batches seeded by (step, rank), so the result depends only on the world size, the
rank order and the algorithm that sums gradients, not on how ranks are spread over hosts.
Rank 0 saves the final parameters, the comm hook the wrapper used and, per rank, where it ran:
its network namespace, the address it would use to reach MASTER_ADDR, the launcher variables
it saw, and its open TCP connections (gloo's full mesh and the TCP ring's among them).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket

import torch
import torch.nn.functional as F
from torch.distributed import all_gather_object
from torch.distributed.elastic.multiprocessing.errors import record

import ddptrain
from ddptrain.models import LeNet

PER_RANK_BATCH_SIZE = 8
_TCP_ESTABLISHED = "01"


def where_am_i(info: ddptrain.DistInfo) -> dict[str, object]:
    """This rank's placement: launcher variables and hostname-independent network evidence."""
    # srun and mpirun leave MASTER_ADDR unset; ddptrain derives it (loopback on one host).
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    # A UDP connect sends nothing; it only asks the kernel which local address routes to
    # MASTER_ADDR, which is the veth address inside a namespace and loopback on one host.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_addr, 9))
        route_addr = probe.getsockname()[0]
    return {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "group_rank": int(os.environ.get("GROUP_RANK", "-1")),
        "master_addr": master_addr,
        "master_port": os.environ.get("MASTER_PORT", ""),
        "netns": os.readlink("/proc/self/ns/net"),
        "route_addr": route_addr,
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
        "tcp": tcp_connections(),
    }


def tcp_connections() -> list[tuple[str, int, str, int]]:
    """This process's established TCP connections as (local ip, port, remote ip, port)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    connections = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for row in rows:
            local, remote, state, inode = row[1], row[2], row[3], row[9]
            if state == _TCP_ESTABLISHED and inode in inodes:
                connections.append((*_proc_net_address(local), *_proc_net_address(remote)))
    return connections


def _proc_net_address(text: str) -> tuple[str, int]:
    """Decode /proc/net/tcp{,6}'s "HEXIP:HEXPORT" (the IP in host-order 32-bit words)."""
    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(packed) == 4:
        return socket.inet_ntop(socket.AF_INET, packed), int(hex_port, 16)
    ip = ipaddress.IPv6Address(packed)
    return str(ip.ipv4_mapped or ip), int(hex_port, 16)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic batch of `rank` at `step` (the same on any host)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(PER_RANK_BATCH_SIZE, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (PER_RANK_BATCH_SIZE,), generator=g)
    return x, y


def sgd_momentum_step(params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """torch.optim.SGD(lr=0.05, momentum=0.9)'s update, written out: the first torch.optim
    optimizer of a process imports torch._dynamo (~3 s of CPU per rank here), and what this job
    tests is the launch, not the optimizer."""
    with torch.no_grad():
        for p, buf in zip(params, buffers, strict=True):
            buf.mul_(0.9).add_(p.grad)
            p.add_(buf, alpha=-0.05)


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="file rank 0 writes the result to")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--comm-hook",
        choices=["default", "allreduce", "tcp"],
        default="default",
        help="pins the backend's all_reduce or the TCP ring instead of the wrapper's choice",
    )
    args = parser.parse_args(argv)

    info = ddptrain.init_distributed(backend="gloo")
    torch.manual_seed(0)
    hook = None if args.comm_hook == "default" else ddptrain.named_hook(args.comm_hook)
    model = ddptrain.DDP(LeNet(dropout=0.0), comm_hook=hook)
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    for step in range(args.steps):
        x, y = batch(step, info.rank)
        for p in params:
            p.grad = None
        F.nll_loss(model(x), y).backward()
        sgd_momentum_step(params, buffers)

    placements: list[object] = [None] * info.world_size
    all_gather_object(placements, where_am_i(info))
    if info.is_main:
        params = {name: p.detach().clone() for name, p in model.module.named_parameters()}
        transport, _ = model.comm_hook
        result = {
            "world_size": info.world_size,
            "launcher": info.launcher,
            "params": params,
            "placements": placements,
            "comm_hook": type(transport).__name__,
        }
        torch.save(result, args.out)
    ddptrain.shutdown()


if __name__ == "__main__":
    main()

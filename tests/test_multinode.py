"""Multi-node for real: two network namespaces joined by a veth pair act as two hosts.

    pytest tests/test_multinode.py -rs       # needs root and `ip netns`; -rs prints why if skipped

torchrun's agent (--nnodes=2 --nproc_per_node=2; ddptrain-run in one namespace, torchrun in
the other) runs tests/support/multinode_job.py in each namespace with c10d rendezvous over the
veth, and the trained parameters must equal, bit for bit, a single-host world of 4 started by
ddptrain.spawn (tests/support/spawned_refs.py) that sums gradients with the same gloo
all_reduce. Every address used is on the private 10.231.77.0/24 that exists only inside the two
namespaces, which are deleted afterwards; in a run as non-root, or where `ip netns` is not
permitted, the test is skipped with the error.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ddptrain
from ddptrain.netns import RDZV_PORT, HostsUnavailable, kill_tree, torchrun, two_hosts
from support import spawned_refs

JOB = Path(__file__).resolve().parent / "support" / "multinode_job.py"
TIMEOUT_S = 180


@pytest.fixture(name="two_hosts")
def two_hosts_fixture():
    """Two namespaces joined by a veth pair (ddptrain.netns), always deleted afterwards."""
    try:
        with two_hosts("ddpt") as hosts:
            yield hosts
    except HostsUnavailable as exc:
        pytest.skip(str(exc))


def _run_all(
    commands: list[list[str]],
    envs: list[dict[str, str]],
    tmp_path: Path,
    alongside: Callable[[], object],
) -> None:
    """Run the commands concurrently, and `alongside()` here meanwhile; fail with their output
    on any error or timeout."""
    logs = [tmp_path / f"launcher-{i}.log" for i in range(len(commands))]
    procs = []
    try:
        for command, env, log in zip(commands, envs, logs, strict=True):
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(
                        command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT
                    )
                )
        alongside()
        codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
    outputs = [log.read_text() for log in logs]
    report = "\n".join(
        f"--- {' '.join(c)}\n{o[-4000:]}" for c, o in zip(commands, outputs, strict=True)
    )
    assert codes is not None, f"timed out after {TIMEOUT_S} s\n{report}"
    assert codes == [0] * len(commands), f"exit codes {codes}\n{report}"


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _gloo_peers(placement: dict) -> list[str]:
    """Remote addresses of a rank's TCP connections other than those to the rendezvous stores
    and over loopback (the wrapper's ring between two ranks of one host)."""
    store_ports = {int(placement["master_port"]), RDZV_PORT}
    return list(
        remote
        for _, local_port, remote, remote_port in placement["tcp"]
        if not store_ports & {local_port, remote_port} and remote != "127.0.0.1"
    )


def test_two_namespaces_equal_one_host_of_four(two_hosts, tmp_path):
    """2 nodes x 2 ranks over a veth train to bitwise the same parameters as 1 node x 4 ranks."""
    a, b = two_hosts
    multi_out = tmp_path / "two_nodes.pt"
    commands, envs = [], []
    # Host a's agent runs under ddptrain-run, b's under torchrun: the same agent, so they mix.
    for host, launcher in ((a, "ddptrain.run"), (b, "torch.distributed.run")):
        job = [str(JOB), "--out", str(multi_out)]
        rdzv_id = f"ddptrain-multinode-{os.getpid()}"
        commands.append(
            torchrun(
                host, a, nnodes=2, nproc_per_node=2, rdzv_id=rdzv_id, args=job, launcher=launcher
            )
        )
        envs.append(host.env())
    ref_out = tmp_path / "one_node.pt"
    # The single-host reference runs alongside: the launchers mostly wait on start-up and
    # rendezvous, and separate network namespaces keep the runs apart. It pins the TCP ring,
    # the reduction two hosts get by default: one host defaults to a shared-memory reduction
    # that sums in another order (last-bit differences, not a bug).
    ref_args = ["--out", str(ref_out), "--comm-hook", "tcp"]
    ddptrain_env = {"OMP_NUM_THREADS": "1"}

    def reference() -> None:
        ddptrain.spawn(spawned_refs.job, 4, ref_args, timeout_s=TIMEOUT_S, env=ddptrain_env)

    _run_all(commands, envs, tmp_path, alongside=reference)

    multi, ref = _load(multi_out), _load(ref_out)
    assert multi["world_size"] == ref["world_size"] == 4
    assert multi["comm_hook"] == ref["comm_hook"] == "Socket"
    placements = multi["placements"]
    assert [p["rank"] for p in placements] == [0, 1, 2, 3]
    # c10d rendezvous numbers nodes in sorted order of --local-addr, so host a is node 0.
    assert [p["group_rank"] for p in placements] == [0, 0, 1, 1]
    assert [p["local_rank"] for p in placements] == [0, 1, 0, 1]
    assert {p["master_addr"] for p in placements} == {a.addr}
    assert [p["route_addr"] for p in placements] == [a.addr, a.addr, b.addr, b.addr]
    namespaces = [p["netns"] for p in placements]
    assert namespaces[0] == namespaces[1] != namespaces[2] == namespaces[3]
    assert os.readlink("/proc/self/ns/net") not in namespaces
    # gloo's mesh uses the veth addresses only, with at least one connection per remote rank.
    for placement, there in zip(placements, [b, b, a, a], strict=True):
        peers = _gloo_peers(placement)
        assert set(peers) == {a.addr, b.addr} and peers.count(there.addr) >= 2, placement

    assert multi["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        diff = (multi["params"][name] - value).abs().max().item()
        assert torch.equal(multi["params"][name], value), f"{name}: max |diff| {diff}"

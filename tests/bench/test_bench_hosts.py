"""The step bench under an external launcher, and across two fake hosts (ddptrain.netns).

    pytest tests/bench/test_bench_hosts.py -rs     # the two-host tests need root and `ip netns`

Everything stays on loopback or on the private veth between the runner's own namespaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain.bench import hosts as bench_hosts
from ddptrain.bench import placement
from ddptrain.bench import steps as bench
from ddptrain.netns import HostsUnavailable, check_available, namespaces
from support.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
ALL_VARIANTS = list(bench.BASE_VARIANTS) + [f"ddptrain_{e}" for e in bench.EXTRAS]


def _clean_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return child_env(PYTHONPATH=path)


def _one_host_transport() -> str:
    # What SharedMemory.available() finds on one host: a /dev/shm every rank can write;
    # without one, the ranks connect over TCP.
    return "shared_memory" if os.access("/dev/shm", os.W_OK) else "tcp"


@pytest.mark.slow
def test_under_torchrun_rank_0_writes_every_variant(tmp_path):
    """torchrun with 2 ranks on one host: rank 0 alone writes a JSON with every variant."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    bench_args = ["-m", "ddptrain.bench", "--quick", "--no-plot", "--out", str(tmp_path)]
    done = subprocess.run(
        [*torchrun, "--nproc_per_node=2", *bench_args],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # Only rank 0 reports.
    assert done.stdout.count("wrote ") == 1, done.stdout
    saved = json.loads((tmp_path / "bench.json").read_text())
    settings = saved["settings"]
    assert settings["world_size"] == 2 and settings["launcher"] == "torchrun"
    [host] = settings["hosts"]
    assert host["ranks"] == [0, 1] and host["netns"] == os.readlink("/proc/self/ns/net")
    assert settings["bucket_transport"] == _one_host_transport()
    lenet = saved["models"]["lenet"]
    assert list(lenet["variants"]) == ALL_VARIANTS
    for name, row in lenet["variants"].items():
        assert row["median_ms"] > 0 and row["cpu_ms"] > 0, name
    assert lenet["variants"]["torch_ddp"]["vs_torch_ddp"] == 1.0


def test_placement_groups_ranks_by_host_and_flags_mixed_transports():
    """hosts() lists each (hostname, netns) with its ranks; transport() is mixed on disagreement."""

    def rank(netns: str, *transports: str) -> dict:
        models = {f"m{i}": {"transport": t} for i, t in enumerate(transports)}
        return {"host": {"hostname": "h", "netns": netns}, "models": models}

    raw = [rank("n1", "backend"), rank("n2", "backend"), rank("n1", "backend")]
    assert placement.hosts(raw) == [
        {"hostname": "h", "netns": "n1", "ranks": [0, 2]},
        {"hostname": "h", "netns": "n2", "ranks": [1]},
    ]
    assert placement.transport(raw) == "backend"
    assert placement.transport([rank("n1", "backend", "shared_memory")]) == "mixed"
    assert placement.transport([{"host": {}, "models": {"m": {}}}]) is None


@pytest.fixture
def root_and_netns():
    """Skip, with the reason, where this process cannot make network namespaces."""
    try:
        check_available()
    except HostsUnavailable as exc:
        pytest.skip(str(exc))


def _ours(pid: int) -> list[str]:
    return [name for name in namespaces() if name.startswith("ddpb-") and name.endswith(f"-{pid}")]


@pytest.mark.slow
def test_two_hosts_reduce_over_tcp_and_leave_no_namespace(root_and_netns, tmp_path):
    """--two-hosts: a rank per namespace, buckets over TCP (not shared memory), no netns left."""
    argv = ["--two-hosts", "--quick", "--no-plot", "--out", str(tmp_path), "--timeout-s", "150"]
    try:
        result = bench_hosts.main(argv)
    except HostsUnavailable as exc:
        pytest.skip(str(exc))
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved == result
    settings = saved["settings"]
    assert settings["world_size"] == 2 and settings["launcher"] == "torchrun"
    assert settings["bucket_transport"] == "tcp"
    first, second = settings["hosts"]
    assert first["ranks"] == [0] and second["ranks"] == [1]
    here = os.readlink("/proc/self/ns/net")
    assert len({first["netns"], second["netns"], here}) == 3
    link = settings["two_hosts"]
    assert link["ranks_per_host"] == 1 and link["private_dev_shm"]
    assert [h["addr"] for h in link["hosts"]] == ["10.231.77.1", "10.231.77.2"]
    assert list(saved["models"]["lenet"]["variants"]) == ALL_VARIANTS
    # No shared-memory column in the all-reduce sizes: the ranks saw no common /dev/shm.
    [ring] = saved["ring"]
    assert ring["backend_gbps"] > 0 and "shm_ms" not in ring
    left = set(namespaces())
    assert not left & {h["netns"] for h in link["hosts"]}
    assert not _ours(os.getpid())
    # The ranks' scratch folder is gone: only the result is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


@pytest.mark.slow
def test_two_hosts_over_a_shaped_link_record_the_shaping_and_its_measure(root_and_netns, tmp_path):
    """--link 100mbit: tbf on both veth ends, a probe within 2% of the rate, no namespace left."""
    # The probe's 24 KiB burst adds at most 0.5% to its 5 MB; a loaded machine is only slower.
    argv = ["--two-hosts", "--link", "100mbit", "--quick", "--out", str(tmp_path)]
    try:
        result = bench_hosts.main([*argv, "--timeout-s", "150"])
    except HostsUnavailable as exc:
        pytest.skip(str(exc))
    shaping = result["settings"]["two_hosts"]["shaping"]
    assert shaping["qdisc"] == "tbf" and shaping["rate"] == "100mbit"
    [to_b, to_a] = shaping["commands"]
    assert " tbf rate 100mbit " in to_b and " tbf rate 100mbit " in to_a
    assert 0 < shaping["probe"]["mbit_per_s"] <= 100 * 1.02
    assert shaping["probe"]["round_trip_us"] > 0
    variants = result["models"]["lenet"]["variants"]
    assert {"ddptrain_powersgd", "ddptrain_torch-powersgd", "torch_ddp_powersgd"} <= set(variants)
    assert result["settings"]["bucket_transport"] == "tcp"
    hosts = {h["netns"] for h in result["settings"]["two_hosts"]["hosts"]}
    assert not set(namespaces()) & hosts and not _ours(os.getpid())
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_link_flag_sets_the_slow_link_defaults_which_given_flags_override():
    """--link defaults to the MLP and compression extras; given --models wins; bad rates fail."""
    _, _, bench = bench_hosts.parse_args(["--two-hosts", "--link", "1gbit"])
    assert bench.models == ["mlp"] and "powersgd" in bench.extras
    _, _, bench = bench_hosts.parse_args(["--two-hosts", "--link", "1gbit", "--models", "lenet"])
    assert bench.models == ["lenet"] and "torch-ddp-powersgd" in bench.extras
    with pytest.raises(SystemExit):
        bench_hosts.parse_args(["--two-hosts", "--link", "fast"])


def test_a_launcher_that_fails_stops_the_other_and_is_not_called_a_timeout():
    """A launcher exiting 3 stops the other at once: RunFailed with codes [3, None], no timeout."""
    commands = [[sys.executable, "-c", "raise SystemExit(3)"], ["sleep", "60"]]
    with pytest.raises(bench_hosts.RunFailed, match=r"failed \(launcher exit codes \[3, None\]\)"):
        bench_hosts.run_launchers(commands, [dict(os.environ)] * 2, timeout_s=50)


@pytest.mark.slow
def test_two_hosts_timeout_kills_the_launchers_and_deletes_the_namespaces(root_and_netns, tmp_path):
    """A run past --timeout-s raises RunFailed, leaving no namespace, process or file in --out."""
    # A million timed steps: no machine finishes them inside the timeout, so the run is always
    # killed mid-way (a --quick run can finish its JSON just before a short deadline).
    many = ["--models", "lenet", "--steps", "1000000", "--extras", "none", "--ring-reps", "0"]
    argv = ["--two-hosts", *many, "--no-plot", "--out", str(tmp_path), "--timeout-s", "8"]
    try:
        with pytest.raises(bench_hosts.RunFailed, match="timed out after 8 s"):
            bench_hosts.main(argv)
    except HostsUnavailable as exc:
        pytest.skip(str(exc))
    assert not _ours(os.getpid())
    assert not _processes_naming(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def _processes_naming(text: str) -> list[str]:
    """Command lines of live processes that contain `text`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, UnicodeDecodeError):
            continue
        if entry.isdigit() and text in cmdline:
            found.append(cmdline)
    return found

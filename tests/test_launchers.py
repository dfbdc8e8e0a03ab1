"""Launcher detection and parsing from plain dicts (the variables copied from real srun/mpirun).

The dicts below hold what Open MPI 4.1's mpirun, Slurm 22.05's srun and sbatch set on this
machine (trimmed to the variables that matter); tests/test_slurm_mpi.py runs the engines.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

import ddptrain
from ddptrain.launch.env import (
    DERIVED_PORT_BASE,
    DERIVED_PORT_SPAN,
    INIT_METHOD_ENV,
    MPI_DEFAULT_MASTER_PORT,
    derived_port,
    detect_launcher,
    expand_nodelist,
    parse_env,
)

# `mpirun --allow-run-as-root --oversubscribe -np 2 env`, rank 1.
OMPI_RANK1 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_MCA_ess_base_jobid": "1164115969",
    "OMPI_MCA_orte_num_nodes": "1",
    "PMIX_NAMESPACE": "1164115969",
    "PMIX_RANK": "1",
}
# `srun -n 2` on two nodes, task 1 (on node02 of the step's node list).
SRUN_TASK1 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_JOB_NODELIST": "node[01-04]",
}
# The sbatch script itself (no srun): sbatch sets SLURM_PROCID=0 there, and no step id.
BATCH_SCRIPT = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_NODELIST": "node[01-02]",
}
TORCHRUN_RANK3 = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("rack1-node[001-003]", ["rack1-node001", "rack1-node002", "rack1-node003"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("gpu[3],cpu[1-2],login", ["gpu3", "cpu1", "cpu2", "login"]),
        ("a,,b", ["a", "b"]),
    ],
)
def test_nodelist_expands_like_scontrol(nodelist, hosts):
    """Compressed SLURM node lists expand in order, keeping the lower bound's zero padding."""
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "match"),
    [
        ("n[1-", "unbalanced"),
        ("n[1-2]]", "unbalanced"),
        ("n[[1-2]]", "unbalanced"),
        ("n[3-1]", "backwards"),
        ("n[a-b]", "bad range"),
        ("n[]", "bad range"),
    ],
)
def test_malformed_nodelist_is_refused(nodelist, match):
    """A node list the parser cannot read raises ValueError naming it (scontrol refuses it too)."""
    with pytest.raises(ValueError, match=match):
        expand_nodelist(nodelist)


def test_nodelist_parser_agrees_with_scontrol(tmp_path):
    """expand_nodelist gives the hosts `scontrol show hostnames` gives (real scontrol)."""
    if shutil.which("scontrol") is None:
        pytest.skip("slurm-client is not installed (no `scontrol` on PATH)")
    # scontrol reads a configuration before anything else; a minimal one needs no daemon.
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost\nPartitionName=p Nodes=ALL\n"
    )
    lists = ["node[01-04,07]", "a[1-2],b3", "rack1-node[001-003]", "r[1-2]-n[08-10],login"]
    for nodelist in lists:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert expand_nodelist(nodelist) == out.stdout.split(), nodelist


def test_srun_task_is_a_slurm_rank():
    """srun's SLURM_PROCID/NTASKS/LOCALID give the rank; rank 0's host is the step's first node."""
    env = parse_env(SRUN_TASK1)
    assert env.launcher == "slurm"
    assert (env.rank, env.local_rank, env.world_size, env.init_method) == (1, 0, 2, "env://")
    assert env.master_addr == "node01"
    assert env.master_port == DERIVED_PORT_BASE + 4242 % DERIVED_PORT_SPAN


def test_slurm_job_nodelist_is_the_fallback_and_master_vars_win():
    """Without a step node list the job's is used; MASTER_ADDR/MASTER_PORT override both."""
    no_step_list = {k: v for k, v in SRUN_TASK1.items() if k != "SLURM_STEP_NODELIST"}
    assert parse_env({**no_step_list, "SLURM_JOB_NODELIST": "c[7-9]"}).master_addr == "c7"
    env = parse_env({**SRUN_TASK1, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "12345"})
    assert (env.master_addr, env.master_port) == ("10.1.2.3", 12345)


def test_single_task_srun_needs_no_port():
    """srun -n 1 is a world of one with the same private file:// store as a plain run."""
    env = parse_env({**SRUN_TASK1, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.launcher, env.world_size, env.init_method) == ("slurm", 1, None)


def test_mpirun_rank_on_one_host_defaults_to_loopback():
    """Open MPI's OMPI_COMM_WORLD_* give the rank; one host means 127.0.0.1 and a job-id port."""
    env = parse_env(OMPI_RANK1)
    assert env.launcher == "mpi"
    assert (env.rank, env.local_rank, env.world_size, env.init_method) == (1, 1, 2, "env://")
    assert env.master_addr == "127.0.0.1"
    assert env.master_port == derived_port("1164115969")


def test_mpich_variables():
    """MPICH/Hydra's PMI_RANK/PMI_SIZE/MPI_LOCALRANKID; no shared job id means port 29500."""
    env = parse_env(
        {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}
    )
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("mpi", 2, 2, 3)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", MPI_DEFAULT_MASTER_PORT)


def test_mpirun_over_several_hosts_needs_master_addr():
    """Ranks on several hosts have no loopback rendezvous: MASTER_ADDR is required and named."""
    spread = {**OMPI_RANK1, "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set.*LOCAL_SIZE=2 of .*SIZE=4"):
        parse_env(spread)
    env = parse_env({**spread, "MASTER_ADDR": "node01", "MASTER_PORT": "29600"})
    assert (env.master_addr, env.master_port, env.world_size) == ("node01", 29600, 4)


@pytest.mark.parametrize(
    ("env", "launcher", "rank"),
    [
        # torchrun started by srun or mpirun (one agent per host): torchrun's own ranks count.
        ({**SRUN_TASK1, **OMPI_RANK1, **TORCHRUN_RANK3}, "torchrun", 3),
        ({**TORCHRUN_RANK3, INIT_METHOD_ENV: "file:///tmp/x"}, "spawn", 3),
        # mpirun inside sbatch: ranks inherit the batch script's SLURM_PROCID=0.
        ({**BATCH_SCRIPT, **OMPI_RANK1}, "mpi", 1),
        # mpirun across nodes starts its daemons with srun: SLURM_PROCID is the daemon's.
        ({**SRUN_TASK1, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", **OMPI_RANK1}, "mpi", 1),
        # Hydra's proxies under srun: PMI_RANK differs from the proxy's SLURM_PROCID.
        (
            {**SRUN_TASK1, "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}
            | {"MASTER_ADDR": "node01"},
            "mpi",
            3,
        ),
        # srun --mpi=pmi2 sets PMI_RANK itself, equal to SLURM_PROCID: srun's launch.
        ({**SRUN_TASK1, "PMI_RANK": "1", "PMI_SIZE": "2"}, "slurm", 1),
        (SRUN_TASK1, "slurm", 1),
        # salloc's shell: a job, but no task of srun.
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}, "single", 0),
        ({**BATCH_SCRIPT, "SLURM_NTASKS": "1"}, "single", 0),
        ({}, "single", 0),
    ],
)
def test_launcher_precedence(env, launcher, rank):
    """torchrun > mpirun > srun > none: the launcher whose ranks these are decides."""
    assert detect_launcher(env) == launcher
    parsed = parse_env(env)
    assert (parsed.launcher, parsed.rank) == (launcher, rank)


def test_a_torchrun_agent_is_recognised_by_its_run_id():
    """TORCHELASTIC_RUN_ID marks a torchrun agent's worker; hand-set RANK/WORLD_SIZE do not."""
    agent = {**TORCHRUN_RANK3, "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    parsed = parse_env(agent)
    assert (parsed.elastic_agent, parsed.agent_store) == (True, True)
    assert parse_env(TORCHRUN_RANK3).elastic_agent is False


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (BATCH_SCRIPT, "batch script .*SLURM_NTASKS=2.*srun python"),
        ({**SRUN_TASK1, "SLURM_NTASKS": None}, "SLURM_PROCID is set but SLURM_NTASKS is missing"),
        ({**SRUN_TASK1, "SLURM_LOCALID": None}, "SLURM_LOCALID is missing"),
        ({**SRUN_TASK1, "SLURM_PROCID": "2"}, "SLURM_PROCID=2 is outside SLURM_NTASKS=2"),
        ({**SRUN_TASK1, "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not an integer"),
        ({**SRUN_TASK1, "SLURM_NTASKS": "0", "SLURM_PROCID": "0"}, "SLURM_NTASKS=0 must be"),
        (
            {**SRUN_TASK1, "SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None},
            "SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST",
        ),
        ({**SRUN_TASK1, "SLURM_STEP_NODELIST": ","}, "names no host"),
        ({**SRUN_TASK1, "SLURM_JOB_ID": None}, "SLURM_JOB_ID is missing"),
        (
            {**OMPI_RANK1, "OMPI_COMM_WORLD_SIZE": None},
            "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is missing",
        ),
        (
            {**OMPI_RANK1, "OMPI_COMM_WORLD_RANK": "2"},
            "OMPI_COMM_WORLD_RANK=2 is outside OMPI_COMM_WORLD_SIZE=2",
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "PMI_RANK is set but MPI_LOCALRANKID is missing"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, "MPI_LOCALNRANKS is not set"),
        ({**OMPI_RANK1, "MASTER_PORT": "x"}, "MASTER_PORT='x' is not an integer"),
    ],
)
def test_partial_or_conflicting_variables_name_the_variable(env, match):
    """Each incomplete or inconsistent launcher environment raises one error naming the variable."""
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(RuntimeError, match=match):
        parse_env(env)


def test_derived_port_is_deterministic_and_in_range():
    """Every rank derives the same port from the shared job id, below the ephemeral range."""
    ports = {derived_port(str(job)) for job in range(1000, 1100)}
    assert len(ports) == 100
    assert all(DERIVED_PORT_BASE <= p < DERIVED_PORT_BASE + DERIVED_PORT_SPAN for p in ports)
    assert derived_port("prterun-vm-1234@1") == derived_port("prterun-vm-1234@1")
    assert DERIVED_PORT_BASE <= derived_port("prterun-vm-1234@1") < 32768


def test_init_distributed_reports_the_launcher():
    """A one-task srun environment gives DistInfo.launcher == 'slurm' on a real group of one."""
    info = ddptrain.init_distributed(env={**SRUN_TASK1, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (info.launcher, info.rank, info.world_size) == ("slurm", 0, 1)
    ddptrain.shutdown()

"""Which launcher started this process, and where it sits: pure functions of a mapping.

    parse_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", ...})   # -> LaunchEnv(launcher="slurm")
    expand_nodelist("node[01-02,07],gpu3")   # ['node01', 'node02', 'node07', 'gpu3']

ddptrain.dist is the only caller that hands these functions the real environment. The first
launcher whose variables are present wins:

    torchrun  RANK, WORLD_SIZE (torchrun, or set by hand; "spawn" when ddptrain.spawn set them)
    mpi       OMPI_COMM_WORLD_RANK (Open MPI) or PMI_RANK (MPICH, Intel MPI)
    slurm     SLURM_PROCID inside a job step (SLURM_STEP_ID set): a task that srun started
    single    none of them: a world of size 1

Why this order: torchrun started by srun or mpirun (one agent per host) sees the outer
launcher's variables too, and its own RANK is the one the processes must use. mpirun inside a
SLURM allocation starts its daemons with srun, so every MPI rank inherits its daemon's
SLURM_PROCID (0 for every rank on one node); the MPI rank is the real one. The one exception is
`srun --mpi=pmi2`, where srun itself sets PMI_RANK: when PMI_RANK/PMI_SIZE equal
SLURM_PROCID/SLURM_NTASKS inside a step, it is srun's launch, whose node list names rank 0's host.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import product

INIT_METHOD_ENV = "DDPTRAIN_INIT_METHOD"
LAUNCHERS = ("torchrun", "spawn", "mpi", "slurm", "single")
# Derived rendezvous ports stay below Linux's ephemeral range (32768+), where the kernel hands
# out client ports that could already hold the number, and clear of torchrun's 29400/29500.
DERIVED_PORT_BASE = 20000
DERIVED_PORT_SPAN = 9000
# mpirun on one host: every rank reaches rank 0 over loopback.
MPI_DEFAULT_MASTER_ADDR = "127.0.0.1"
MPI_DEFAULT_MASTER_PORT = 29500


class LaunchError(RuntimeError):
    """The launch cannot work as set up (variables, backend, device, port); names the fix."""


@dataclass(frozen=True)
class LaunchEnv:
    """The launcher variables, parsed and checked (pure: built from a mapping)."""

    rank: int
    local_rank: int
    world_size: int
    init_method: str | None
    master_addr: str | None = None
    master_port: int | None = None
    agent_store: bool = False
    elastic_agent: bool = False  # a torchrun agent started this process: it is the parent
    launcher: str = "single"


def detect_launcher(env: Mapping[str, str]) -> str:
    """The launcher whose variables decide rank and world size (see the module docstring)."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return "spawn" if INIT_METHOD_ENV in env else "torchrun"
    if "OMPI_COMM_WORLD_RANK" in env:
        return "mpi"
    in_step = "SLURM_PROCID" in env and "SLURM_STEP_ID" in env
    if "PMI_RANK" in env:
        srun_pmi = (
            in_step
            and env.get("PMI_RANK") == env.get("SLURM_PROCID")
            and env.get("PMI_SIZE") == env.get("SLURM_NTASKS")
        )
        return "slurm" if srun_pmi else "mpi"
    if in_step:
        return "slurm"
    return "single"


def parse_env(
    env: Mapping[str, str], expand_hosts: Callable[[str], list[str]] | None = None
) -> LaunchEnv:
    """Parse the detected launcher's variables; no variables means a world of size 1.

    `expand_hosts` turns a SLURM node list into host names (default: expand_nodelist).
    """
    launcher = detect_launcher(env)
    if launcher in ("torchrun", "spawn"):
        return _parse_torchrun(env, launcher)
    if launcher == "mpi":
        return _parse_mpi(env)
    if launcher == "slurm":
        return _parse_slurm(env, expand_hosts or expand_nodelist)
    _refuse_batch_script(env)
    return LaunchEnv(rank=0, local_rank=0, world_size=1, init_method=env.get(INIT_METHOD_ENV))


def _parse_torchrun(env: Mapping[str, str], launcher: str) -> LaunchEnv:
    keys = ("RANK", "WORLD_SIZE")
    present = [k for k in keys if k in env]
    if len(present) != len(keys):
        missing = [k for k in keys if k not in env]
        raise LaunchError(
            f"launcher environment is incomplete: {present} set but {missing} missing; "
            "launch with torchrun (which sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, "
            "MASTER_PORT) or unset them all for a single process"
        )
    rank, world_size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
    local_rank = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    _check_ranks(rank, world_size, local_rank, ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    init_method = env.get(INIT_METHOD_ENV)
    if init_method is None and world_size > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise LaunchError(
                f"WORLD_SIZE={world_size} but {missing} not set; launch with torchrun or pass "
                "init_method='tcp://host:port' or 'file:///shared/path'"
            )
        init_method = "env://"
    return LaunchEnv(
        rank,
        local_rank,
        world_size,
        init_method,
        master_addr=env.get("MASTER_ADDR"),
        master_port=_port_var(env) if "MASTER_PORT" in env else None,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        elastic_agent="TORCHELASTIC_RUN_ID" in env,
        launcher=launcher,
    )


def _parse_mpi(env: Mapping[str, str]) -> LaunchEnv:
    # (rank, size, local rank, ranks on this host): Open MPI's; MPICH/Intel MPI Hydra's;
    # Cray PALS's PMI_LOCAL_* where Hydra's local variables are absent.
    if "OMPI_COMM_WORLD_RANK" in env:
        prefix = "OMPI_COMM_WORLD_"
        keys = (f"{prefix}RANK", f"{prefix}SIZE", f"{prefix}LOCAL_RANK", f"{prefix}LOCAL_SIZE")
    elif "PMI_LOCAL_RANK" in env:
        keys = ("PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")
    else:
        keys = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    names = keys[:3]
    rank_key, size_key, local_key = names
    local_size_key = keys[3]
    _require(env, rank_key, (size_key, local_key), "mpirun")
    rank, world_size, local_rank = (_int_var(env, k) for k in names)
    _check_ranks(rank, world_size, local_rank, names)
    master_addr = env.get("MASTER_ADDR")
    if master_addr is None:
        one_host = local_size_key in env and _int_var(env, local_size_key) == world_size
        if not one_host:
            spread = (
                f"{local_size_key}={env[local_size_key]} of {size_key}={world_size}"
                if local_size_key in env
                else f"{local_size_key} is not set"
            )
            raise LaunchError(
                f"MASTER_ADDR is not set and mpirun's ranks may span several hosts ({spread}); "
                "export MASTER_ADDR=<rank 0's host> MASTER_PORT=<free port> and pass them to "
                "every rank (Open MPI: mpirun -x MASTER_ADDR -x MASTER_PORT; MPICH: -genvall)"
            )
        master_addr = MPI_DEFAULT_MASTER_ADDR
    if "MASTER_PORT" in env:
        master_port = _port_var(env)
    else:
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
        master_port = derived_port(job) if job else MPI_DEFAULT_MASTER_PORT
    return _rendezvous(rank, local_rank, world_size, master_addr, master_port, "mpi", env)


def _parse_slurm(env: Mapping[str, str], expand_hosts: Callable[[str], list[str]]) -> LaunchEnv:
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    _require(env, names[0], names[1:], "srun")
    rank, world_size, local_rank = (_int_var(env, k) for k in names)
    _check_ranks(rank, world_size, local_rank, names)
    master_addr = env.get("MASTER_ADDR")
    if master_addr is None:
        key = next((k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if k in env), None)
        if key is None:
            raise LaunchError(
                "SLURM_PROCID is set but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST "
                "is, so rank 0's host is unknown; export MASTER_ADDR=<rank 0's host>"
            )
        hosts = expand_hosts(env[key])
        if not hosts:
            raise LaunchError(f"{key}={env[key]!r} names no host; export MASTER_ADDR")
        # srun places task 0 on the first node of the step (block and cyclic distributions).
        master_addr = hosts[0]
    if "MASTER_PORT" in env:
        master_port = _port_var(env)
    elif "SLURM_JOB_ID" in env:
        master_port = derived_port(env["SLURM_JOB_ID"])
    else:
        raise LaunchError("SLURM_PROCID is set but SLURM_JOB_ID is missing; export MASTER_PORT")
    return _rendezvous(rank, local_rank, world_size, master_addr, master_port, "slurm", env)


def _refuse_batch_script(env: Mapping[str, str]) -> None:
    """A multi-task sbatch script that runs python without srun would train alone: refuse."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return
    ntasks = _int_var(env, "SLURM_NTASKS")
    if ntasks > 1:
        raise LaunchError(
            f"SLURM_PROCID is set without SLURM_STEP_ID: this is the batch script of a job of "
            f"SLURM_NTASKS={ntasks} tasks, not a task started by srun, and would train alone; "
            "start the ranks with `srun python ...` (or torchrun / mpirun) inside the script"
        )


def _rendezvous(
    rank: int,
    local_rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    launcher: str,
    env: Mapping[str, str],
) -> LaunchEnv:
    # A world of one needs no store on a port: the same private in-memory store as a plain run.
    init_method = "env://" if world_size > 1 else env.get(INIT_METHOD_ENV)
    return LaunchEnv(
        rank,
        local_rank,
        world_size,
        init_method,
        master_addr=master_addr,
        master_port=master_port,
        launcher=launcher,
    )


def _require(env: Mapping[str, str], present: str, needed: tuple[str, ...], tool: str) -> None:
    missing = [k for k in needed if k not in env]
    if missing:
        raise LaunchError(
            f"{present} is set but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing; {tool} sets them all for every "
            f"rank, so this environment is incomplete: launch with {tool}, or unset {present} "
            "for a single process"
        )


def _check_ranks(rank: int, world_size: int, local_rank: int, names: tuple[str, ...]) -> None:
    rank_key, size_key, local_key = names
    if world_size < 1:
        raise LaunchError(f"{size_key}={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise LaunchError(
            f"{rank_key}={rank} is outside {size_key}={world_size}; "
            f"ranks run from 0 to {world_size - 1}"
        )
    if local_rank < 0:
        raise LaunchError(f"{local_key}={local_rank} must be >= 0")


def _int_var(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise LaunchError(f"{key}={env[key]!r} is not an integer") from None


def _port_var(env: Mapping[str, str]) -> int:
    port = _int_var(env, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port; use one in 1..65535")
    return port


def derived_port(job_id: str) -> int:
    """A rendezvous port every rank of one job computes alike, from a value they all share.

    Numeric ids (SLURM job ids, Open MPI job ids) map by remainder, so consecutive jobs on a
    node get different ports; other ids (a PMIx namespace) by CRC-32.
    """
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return DERIVED_PORT_BASE + key % DERIVED_PORT_SPAN


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list in full: "a[01-03,07],b-[1-2]x" -> a01 a02 a03 a07 b-1x b-2x.

    Zero padding follows the lower bound ("[08-10]" -> 08 09 10); several bracket groups in one
    name expand as their product, as `scontrol show hostnames` does.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        parts = re.split(r"(\[[^\[\]]*\])", item)
        choices = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1], nodelist))
            elif "[" in part or "]" in part:
                raise ValueError(f"unbalanced brackets in node list {nodelist!r}")
            elif part:
                choices.append([part])
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in node list {nodelist!r}")
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in node list {nodelist!r}")
    items.append(nodelist[start:])
    # Empty items ("a,,b") are skipped, as scontrol does.
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(spec: str, nodelist: str) -> list[str]:
    out = []
    for piece in spec.split(","):
        match = _RANGE.match(piece.strip())
        if not match:
            raise ValueError(f"bad range {piece!r} in node list {nodelist!r}")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"range {piece!r} runs backwards in node list {nodelist!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out

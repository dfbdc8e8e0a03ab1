"""The env:// rendezvous: the store every rank of a job meets at, keys private to one round.

    store = env_store(launch, timedelta(seconds=300))   # once WORLD_SIZE ranks have reached it
    dist.init_process_group("gloo", store=store, rank=launch.rank, world_size=...)
    address_in_use("env://", launch)                    # the one line for a taken port

ddptrain.dist calls these for init_method "env://" (torchrun, srun, mpirun).
"""

from __future__ import annotations

import datetime
import secrets
import time
from urllib.parse import urlsplit

import torch.distributed as dist

from ddptrain.launch.env import LaunchEnv, LaunchError

# Rendezvous waits are cut into tries this long, so Ctrl-C (checked between tries) stops a
# rank waiting for its peers; torch's store waits in C++, where Python never sees the signal.
_RENDEZVOUS_TRY_S = 1.0
_RENDEZVOUS_POLL_S = 0.05
_REFUSAL_READ_S = 5.0


def env_store(launch: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """The env:// store, with keys private to this process group, returned once all WORLD_SIZE
    ranks have reached it.

    Under torchrun the agent hosts one store for every round of the job; without a prefix a
    restarted rank can read the dead round's addresses and fail to connect, or hang (and so can
    a second group created in the same processes). The prefix is a token rank 0 draws and every
    rank confirms (`_agree_on_token`): not the agent's restart count, which agents that joined
    an elastic job at different times count differently.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    is_master = launch.rank == 0 and not launch.agent_store
    while True:
        try_s = max(min(_RENDEZVOUS_TRY_S, deadline - time.monotonic()), 0.1)
        try:
            store = dist.TCPStore(
                launch.master_addr,
                launch.master_port,
                launch.world_size,
                is_master=is_master,
                timeout=datetime.timedelta(seconds=try_s),
                wait_for_workers=False,
                multi_tenant=True,
            )
            break
        except dist.DistNetworkError as e:
            if is_master or "timed out" not in str(e):
                raise
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"rank {launch.rank} could not reach the rendezvous store at "
                    f"{launch.master_addr}:{launch.master_port} within "
                    f"{timeout.total_seconds():.0f} s: start rank 0 too, and check that "
                    "MASTER_ADDR and MASTER_PORT name rank 0's host and a port it can open"
                ) from None
    store.set_timeout(timeout)
    handshake = dist.PrefixStore("ddptrain/rendezvous", store)
    token = _agree_on_token(handshake, launch, deadline, timeout.total_seconds())
    return dist.PrefixStore(f"ddptrain/{token}", store)


def _agree_on_token(store: dist.Store, launch: LaunchEnv, deadline: float, timeout_s: float) -> str:
    """Rank 0's fresh token, once every rank has confirmed it (in Python, so Ctrl-C works);
    refuse ranks launched with different WORLD_SIZE values.

    The store may hold earlier rounds' keys (a dead round's token among them), so a rank cannot
    tell a stale token from a fresh one by reading it: each rank answers the token it reads with
    a nonce of its own, re-answers whenever the token changes, and goes on only when rank 0
    echoes its nonce under that token, which rank 0 does for the token it drew alone.
    """
    where = f"{launch.master_addr}:{launch.master_port}"
    if launch.rank == 0:
        token = secrets.token_hex(8)
        store.set("token", f"{token} {launch.world_size}")
        _wait_for_answers(store, token, launch, deadline, timeout_s)
        for r in range(1, launch.world_size):
            nonce = store.get(f"{token}/answer/{r}").decode().split()[0]
            store.set(f"{token}/go/{r}", nonce)
        return token
    nonce, seen, token = secrets.token_hex(8), "", ""
    try:
        while time.monotonic() < deadline:
            current = store.get("token").decode() if store.check(["token"]) else ""
            if current and current != seen:
                seen = current
                token, announced = current.split()
                store.set(f"{token}/answer/{launch.rank}", f"{nonce} {launch.world_size}")
                store.add(f"{token}/answered", 1)
                if announced != str(launch.world_size):
                    store.compare_set(
                        f"{token}/mismatch",
                        "",
                        f"ranks were launched with different WORLD_SIZE values ({announced} and "
                        f"{launch.world_size}, rendezvous {where}); every process must get the "
                        "same one",
                    )
            elif token:
                if store.check([f"{token}/refused"]):
                    store.add(f"{token}/refusal_read", 1)
                    raise LaunchError(store.get(f"{token}/refused").decode())
                go = f"{token}/go/{launch.rank}"
                if store.check([go]) and store.get(go).decode() == nonce:
                    return token
            time.sleep(_RENDEZVOUS_POLL_S)
    except dist.DistNetworkError:
        raise LaunchError(
            f"rank 0's rendezvous store at {where} went away while rank {launch.rank} waited "
            "for the others: rank 0 stopped (its output says why)"
        ) from None
    raise LaunchError(
        f"rank {launch.rank} reached the rendezvous at {where}, but not all of WORLD_SIZE="
        f"{launch.world_size} ranks did within {timeout_s:.0f} s: start {launch.world_size} "
        "processes (torchrun --nproc_per_node, srun -n, mpirun -np), or set WORLD_SIZE to the "
        "number you start"
    )


def _wait_for_answers(
    store: dist.Store, token: str, launch: LaunchEnv, deadline: float, timeout_s: float
) -> None:
    """Rank 0: wait until every other rank has answered `token`; refuse a WORLD_SIZE mismatch."""
    answers = [f"{token}/answer/{r}" for r in range(1, launch.world_size)]
    while True:
        if store.check([f"{token}/mismatch"]):
            message = store.get(f"{token}/mismatch").decode()
            store.set(f"{token}/refused", message)
            # The store goes with this process: stay until the ranks that answered have read
            # the refusal (a few seconds at most), so they say why too.
            answered = store.add(f"{token}/answered", 0)
            until = time.monotonic() + _REFUSAL_READ_S
            while store.add(f"{token}/refusal_read", 0) < answered and time.monotonic() < until:
                time.sleep(_RENDEZVOUS_POLL_S)
            raise LaunchError(message)
        arrived = 1 + store.add(f"{token}/answered", 0)
        if arrived >= launch.world_size and store.check(answers):
            return
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"only {arrived} of WORLD_SIZE={launch.world_size} ranks reached the rendezvous "
                f"at {launch.master_addr}:{launch.master_port} within {timeout_s:.0f} s: start "
                f"{launch.world_size} processes (torchrun --nproc_per_node, srun -n, mpirun "
                "-np), or set WORLD_SIZE to the number you start"
            )
        time.sleep(_RENDEZVOUS_POLL_S)


def address_in_use(method: str, launch: LaunchEnv) -> str:
    """The message for a rendezvous port that another process already listens on."""
    if method.startswith("env://"):
        host, port = launch.master_addr, launch.master_port
        where = f"MASTER_PORT {port} on {host}"
        fix = f"MASTER_PORT=PORT, or torchrun --master-port PORT / --rdzv-endpoint {host}:PORT"
        if launch.launcher in ("slurm", "mpi"):
            fix = "export MASTER_PORT=PORT before srun/mpirun, which pass it to every rank"
    else:
        url = urlsplit(method)
        host, port = url.hostname, url.port
        where = f"port {port} on {host} (init_method {method!r})"
        fix = f"init_method='{url.scheme}://{host}:PORT'"
    return (
        f"{where} is already in use (EADDRINUSE), so rank 0 cannot host the rendezvous store "
        f"there; pick a free port ({fix}) or stop the process holding it (a previous run "
        "still alive?)"
    )

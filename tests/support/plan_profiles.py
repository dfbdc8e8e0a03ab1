"""Hand-made profiles and links for the planner's pure tests (no process, no measurement)."""

from __future__ import annotations

from ddptrain.plan.links import BusLink, LocalLink
from ddptrain.plan.profile import Profile

MIB = 1 << 20


def ddp_profile(**overrides: object) -> Profile:
    """A DDP step: forward 10 ms, backward 20 ms (buckets ready 5 and 15 ms into it), optimizer
    2 ms; two parameters of 2.5 Mi float32 elements, one bucket each (10 MiB)."""
    numel = 10 * MIB // 4
    fields: dict[str, object] = {
        "setup": {"model": "toy", "strategy": "ddp"},
        "param_names": ["a", "b"],
        "param_numels": [numel, numel],
        "param_shapes": [[numel], [numel]],
        "element_bytes": 4,
        "step_s": 0.032,
        "wall_step_s": 0.032,
        "forward_s": 0.010,
        "backward_s": 0.020,
        "optimizer_s": 0.002,
        "buckets": [[1], [0]],
        "bucket_ready_s": [0.005, 0.015],
        "hook_s": [0.0, 0.0],
        "rss_before_model_bytes": 100 * MIB,
        "peak_rss_bytes": 200 * MIB,
        "optimizer_state_bytes": 40 * MIB,
    }
    fields.update(overrides)
    return Profile(**fields)  # type: ignore[arg-type]


def bus(bytes_per_s: float = 10 * MIB / 0.010, latency_s: float = 0.0) -> BusLink:
    """A GPU-style link: no CPU; by default a 10 MiB message's ring share takes 10 ms at ws 2."""
    return BusLink(bytes_per_s, latency_s, "toy-bus")


def local(cpu_s_per_byte: float, cores: float = 2.0, wall_s_per_byte: float = 0.0) -> LocalLink:
    """A one-host link whose every operation costs `cpu_s_per_byte` of CPU and lasts at least
    `wall_s_per_byte` at every world size."""
    ops = ("reduce", "reduce_tcp", "all_gather", "reduce_scatter", "broadcast")

    def table(per_byte: float) -> dict[str, dict[int, list[tuple[int, float]]]]:
        points = [(0, 0.0), (64 * MIB, 64 * MIB * per_byte)]
        return {op: {w: list(points) for w in (1, 2, 3, 4)} for op in ops}

    return LocalLink(table(cpu_s_per_byte), cores, wall_table=table(wall_s_per_byte))


def meeting_of_a_sleep(compute_s: float, sleep_s: float) -> tuple[float, float]:
    """In a spawned rank: meeting.py's (idle, busy) seconds of an operation that sleeps
    `sleep_s`, none of it counted as measured from a barrier, in cycles whose "compute" sleeps
    `compute_s` (wall time, as other programs' load would not stretch it)."""
    import time

    import ddptrain
    from ddptrain.plan.meeting import measure_meeting

    ddptrain.init_distributed()
    try:
        op = lambda: time.sleep(sleep_s)  # noqa: E731
        return measure_meeting(op, 0.0, 1.0, compute_s=compute_s, cycles=12, compute=time.sleep)
    finally:
        ddptrain.shutdown()


def uneven_share_of_a_sleep(compute_s: tuple[float, ...], sleep_s: float) -> list:
    """In a spawned rank: meeting.py's uneven-share points of an operation that sleeps
    `sleep_s`, in cycles whose "compute" sleeps each length in `compute_s`."""
    import time

    import ddptrain
    from ddptrain.plan.meeting import measure_uneven_share

    ddptrain.init_distributed()
    try:
        op = lambda: time.sleep(sleep_s)  # noqa: E731
        return measure_uneven_share(
            op, 0.0, 1.0, compute_s=compute_s, seconds=0.1, compute=time.sleep
        )
    finally:
        ddptrain.shutdown()

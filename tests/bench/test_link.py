"""The shaped link between two fake hosts (bench/link.py): its token bucket and segments.

    pytest tests/bench/test_link.py -rs     # the namespace test needs root and `ip netns`

Traffic stays on the private veth between the test's own namespaces.
"""

from __future__ import annotations

import subprocess

import pytest

from ddptrain.bench import link
from ddptrain.netns import HostsUnavailable, two_hosts


def test_segments_are_a_millisecond_of_the_rate_within_bounds():
    """The segment cap is BURST_S of the rate, within MIN_SEGMENT_BYTES and GSO_BYTES (64 KiB)."""
    assert link.segment_bytes("100mbit") == int(100e6 / 8 * link.BURST_S)
    assert link.segment_bytes("10mbit") == link.MIN_SEGMENT_BYTES
    assert link.segment_bytes("1gbit") == link.GSO_BYTES
    assert link.segment_bytes("10gbit") == link.GSO_BYTES


def test_a_message_after_an_idle_moment_pays_most_of_its_serialization_at_100mbit():
    """At 100mbit a 128 KiB message after an idle moment takes >= 75% of its time at the rate."""
    # The bucket lets at most ~2 ms of bytes skip the rate; with 64 KiB segments it held 6 ms
    # and the message took ~4.5 ms of its 10.5.
    try:
        with two_hosts("lk") as (a, b):
            shaping = link.shape_link(a, b, "100mbit")
            shown = subprocess.run(
                ["ip", "-n", a.netns, "-d", "link", "show", a.ifname],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
    except HostsUnavailable as exc:
        pytest.skip(str(exc))
    segment = shaping["segment_bytes"]
    assert segment == link.segment_bytes("100mbit")
    assert f"gso_max_size {segment} " in shown
    assert shaping["burst_bytes"] == segment + int(100e6 / 8 * link.BURST_S)
    probe = shaping["probe"]
    at_rate_s = probe["idle_message_bytes"] * 8 / 100e6
    assert probe["idle_message_s"] >= 0.75 * at_rate_s, probe
    assert 0 < probe["mbit_per_s"] <= 100 * 1.02


@pytest.mark.parametrize(
    ("cached_burst", "measured_again"),
    [
        (link.burst_bytes("100mbit"), False),  # made with capped segments
        (link.burst_bytes("100mbit", link.GSO_BYTES), False),  # a kernel that refused the cap
        (None, True),  # made before the bucket was recorded
        (123, True),  # another bucket
    ],
)
def test_a_cached_shaped_link_is_measured_again_only_under_another_bucket(
    monkeypatch, cached_burst, measured_again
):
    """A cached 100mbit calibration is kept if its bucket is one made now, else measured again."""
    from ddptrain.plan import calibrate

    entry = {"cpu": {}, "wall": {}, "meet": {}, "round_trip_s": 1e-4, "source": "cached"}
    if cached_burst is not None:
        entry["burst_bytes"] = cached_burst
    fresh = {**entry, "source": "measured", "burst_bytes": link.burst_bytes("100mbit")}
    monkeypatch.setattr(calibrate, "_cached", lambda name: entry)
    monkeypatch.setattr(calibrate, "local_link", lambda sizes: None)
    monkeypatch.setattr(calibrate, "_calibrate_two_hosts", lambda rate: fresh)
    monkeypatch.setattr(calibrate, "_store", lambda name, value: None)
    shaped = calibrate.measured_shaped_link("100mbit")
    assert shaped.source == ("measured" if measured_again else "cached")

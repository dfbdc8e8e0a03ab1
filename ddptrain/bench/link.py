"""A slow link between the two fake hosts: shaped with tc tbf, then measured with plain TCP.

    shaping = shape_link(a, b, "1gbit")      # both directions of the veth: 1 Gbit/s
    shaping["probe"]["mbit_per_s"]           # what one TCP stream a -> b achieved
    shaping["probe"]["round_trip_us"]        # median round trip of a 1-byte message

A veth pair runs at memory speed; real links do not. Each host's end gets a token bucket
filter (ddptrain.netns.shape): bytes leave at the rate, and up to LIMIT_BYTES wait in the
queue, more than our TCP streams ever queue (the kernel keeps at most tcp_limit_output_bytes,
4 MiB here, of one socket's data in the qdisc), so no packet is dropped and no step waits out
a retransmission timeout. The bucket holds the largest segment TCP hands the qdisc plus
BURST_S of the rate: a qdisc timer that fires late (a VM's may, by ~0.5 ms) would otherwise
lose the tokens the bucket could not hold (a 64 KiB burst at 1gbit: 709 Mbit/s measured).
The price: after an idle moment the bucket's bytes leave at once, at memory speed. TCP's
segments (GSO) are 64 KiB, 5 ms at 100mbit, which would let a whole 85 KiB bucket skip most
of its serialization; so the veth's segments are capped at BURST_S of the rate where that is
less (segment_bytes; 12.5 KB at 100mbit, a burst of 2 ms; from 1gbit on they stay 64 KiB, a
burst of 1-1.5 ms). No delay is added (netem, which would add one, is not in every kernel;
this one lacks it): the veth's own round trip, which the probe measures, stands in for a
rack's.

The probe then sends one IDLE_MESSAGE_BYTES message after an idle moment (what the burst
saves shows there), about PROBE_S seconds' worth of bytes from a to b in one TCP stream, and
times 1-byte round trips, so a result says what the link really gave.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

from ddptrain.netns import Host, cap_segments, kill_tree, shape

GSO_BYTES = 64 * 1024
# Smaller segments cost the sender CPU: 4 KiB ones carry ~1.6 Gbit/s on a 2-core Zen 4 VM.
MIN_SEGMENT_BYTES = 4096
BURST_S = 1e-3
IDLE_MESSAGE_BYTES = 128 * 1024
_IDLE_S = 0.05
LIMIT_BYTES = 16 * 1024 * 1024
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}
# The probe's bytes: PROBE_S at the shaped rate, within these bounds.
PROBE_S = 0.4
_PROBE_BYTES = (1 << 20, 256 << 20)
_ROUND_TRIPS = 50
_TIMEOUT_S = 60

_RECEIVE = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 20)

def take(left):
    while left > 0:
        n = conn.recv_into(buf, min(left, len(buf)))
        if n == 0:
            sys.exit("the sender closed early")
        left -= n
    conn.sendall(b"k")

for _ in range(int(sys.argv[3])):
    conn.sendall(conn.recv(1))
take(int(sys.argv[4]))
take(int(sys.argv[2]))
"""
_SEND = """
import socket, statistics, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
trips = []
for _ in range(int(sys.argv[4])):
    start = time.perf_counter()
    conn.sendall(b"p")
    conn.recv(1)
    trips.append(time.perf_counter() - start)
time.sleep(float(sys.argv[6]))
start = time.perf_counter()
conn.sendall(bytes(int(sys.argv[5])))
conn.recv(1)
idle_message_s = time.perf_counter() - start
left, chunk = int(sys.argv[3]), bytes(1 << 20)
start = time.perf_counter()
while left > 0:
    conn.sendall(chunk[: min(left, len(chunk))])
    left -= len(chunk)
conn.recv(1)
print(time.perf_counter() - start, statistics.median(trips), idle_message_s)
"""


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as "100mbit", "1gbit" or "2.5gbit"."""
    match = _RATE.match(rate)
    if match is None:
        raise ValueError(f"link rate {rate!r}: use tc's form, e.g. 100mbit, 1gbit, 10gbit")
    return float(match.group(1)) * _UNITS[match.group(2)]


def segment_bytes(rate: str) -> int:
    """The segment size the veth is capped at for `rate`: BURST_S of the rate, within
    MIN_SEGMENT_BYTES and GSO_BYTES (the module docstring)."""
    return int(min(GSO_BYTES, max(MIN_SEGMENT_BYTES, rate_bits(rate) / 8 * BURST_S)))


def burst_bytes(rate: str, segment: int | None = None) -> int:
    """The token bucket for `rate`: one segment (segment_bytes unless given) and BURST_S."""
    segment = segment_bytes(rate) if segment is None else segment
    return segment + int(rate_bits(rate) / 8 * BURST_S)


def shape_link(a: Host, b: Host, rate: str) -> dict[str, Any]:
    """Shape both directions of the veth to `rate` and measure it; what was done and found."""
    segment = segment_bytes(rate)
    capped = [cap_segments(host, segment) for host in (a, b)] if segment < GSO_BYTES else []
    if None in capped:  # the kernel keeps 64 KiB segments: the bucket must hold one
        segment, capped = GSO_BYTES, []
    burst = burst_bytes(rate, segment)
    commands = [shape(host, rate, burst, LIMIT_BYTES) for host in (a, b)]
    nbytes = int(min(max(rate_bits(rate) / 8 * PROBE_S, _PROBE_BYTES[0]), _PROBE_BYTES[1]))
    seconds, round_trip_s, idle_message_s = probe(a, b, nbytes)
    return {
        "qdisc": "tbf",
        "rate": rate,
        "burst_bytes": burst,
        "segment_bytes": segment,
        "limit_bytes": LIMIT_BYTES,
        "added_delay_us": 0,
        "commands": [" ".join(c) for c in commands],
        "segment_commands": [" ".join(c) for c in capped if c is not None],
        "probe": {
            "what": "one TCP stream a -> b, from the first byte sent to the receiver's reply; "
            f"median of {_ROUND_TRIPS} 1-byte round trips before it; before those, one "
            f"{IDLE_MESSAGE_BYTES // 1024} KiB message sent after {_IDLE_S * 1e3:.0f} ms idle, "
            "to the receiver's reply",
            "bytes": nbytes,
            "seconds": seconds,
            "mbit_per_s": nbytes * 8 / seconds / 1e6,
            "round_trip_us": round_trip_s * 1e6,
            "idle_message_bytes": IDLE_MESSAGE_BYTES,
            "idle_message_s": idle_message_s,
        },
    }


def probe(a: Host, b: Host, nbytes: int) -> tuple[float, float, float]:
    """(seconds one TCP stream takes to carry `nbytes` from host a to host b and hear back,
    median seconds of a 1-byte round trip, seconds of one IDLE_MESSAGE_BYTES message sent
    after an idle moment and answered)."""
    message = str(IDLE_MESSAGE_BYTES)
    receive = [b.addr, str(nbytes), str(_ROUND_TRIPS), message]
    receiver = subprocess.Popen(
        b.command([sys.executable, "-c", _RECEIVE, *receive]), stdout=subprocess.PIPE, text=True
    )
    try:
        port = receiver.stdout.readline().strip()
        argv = [b.addr, port, str(nbytes), str(_ROUND_TRIPS), message, str(_IDLE_S)]
        sender = subprocess.run(
            a.command([sys.executable, "-c", _SEND, *argv]),
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
        if sender.returncode != 0 or receiver.wait(timeout=_TIMEOUT_S) != 0:
            raise RuntimeError(f"the link probe failed: {sender.stderr.strip()[-500:]}")
        seconds, round_trip_s, idle_message_s = map(float, sender.stdout.split())
        return seconds, round_trip_s, idle_message_s
    finally:
        if receiver.poll() is None:
            kill_tree(receiver)


def describe(shaping: dict[str, Any]) -> str:
    """One line: how the link was shaped and what the probe measured."""
    p = shaping["probe"]
    return (
        f"link: tc tbf rate {shaping['rate']}, burst {shaping['burst_bytes'] / 1024:.1f} KiB "
        f"(segments of {shaping['segment_bytes'] / 1024:.1f} KiB), queue "
        f"{shaping['limit_bytes'] >> 20} MiB, both directions; one TCP stream a -> b carried "
        f"{p['bytes'] / 1e6:.1f} MB in {p['seconds']:.3f} s = {p['mbit_per_s']:.0f} Mbit/s; "
        f"1-byte round trip {p['round_trip_us']:.0f} us (median); "
        f"{p['idle_message_bytes'] // 1024} KiB after idle: {p['idle_message_s'] * 1e3:.2f} ms"
    )

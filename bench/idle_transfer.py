"""Does TCP slow a model's transfer down after an idle spell on the testbed's links? One TCP connection between a
client namespace and the server namespace sends a model-sized burst each way after idle spells of 0.2–3 s, with
Linux's ``net.ipv4.tcp_slow_start_after_idle`` on (the default) and off in both namespaces.

If the restart after idle cost a model's transfer round trips (as on a connection that has never carried one),
the transfers after 3 s idle would take as long as the first; the README's message path section reads the result.

    python bench/idle_transfer.py [--profile long-distance] [--bytes 424000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from results import table_text, write_result

from edgefl.processes import interrupt_on_signals
from netem.profiles import Link, LinkError, resolve_links
from netem.testbed import SERVER_IP, Testbed

PORT = 7791
IDLE_S = (0.2, 3.0, 3.0, 3.0, 1.0, 3.0, 0.5, 3.0, 3.0, 3.0)

# Both ends in a few lines each: the server echoes every burst back (upload, then download of the same size).
SERVER = """
import socket, sys
size = int(sys.argv[2])
with socket.create_server((sys.argv[1], PORT)) as listener:
    print("ready", flush=True)
    peer, _ = listener.accept()
    while data := peer.recv(size):
        while len(data) < size:
            data += peer.recv(size - len(data))
        peer.sendall(data)
""".replace("PORT", str(PORT))
CLIENT = """
import socket, sys, time
host, size, idle = sys.argv[1], int(sys.argv[2]), [float(s) for s in sys.argv[3].split(",")]
burst = b"x" * size
with socket.create_connection((host, PORT)) as conn:
    for spell in idle:
        time.sleep(spell)
        started = time.monotonic()
        conn.sendall(burst)
        got = 0
        while got < size:
            got += len(conn.recv(size))
        print(f"{spell} {time.monotonic() - started:.3f}", flush=True)
""".replace("PORT", str(PORT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="long-distance")
    parser.add_argument("--bytes", type=int, default=424_000, help="a burst (edgefl's model message: ~424 kB)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-idle-transfer"))
    args = parser.parse_args()
    try:
        links = resolve_links(args.profile, 1)
    except LinkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.bytes <= 0:
        print(f"error: --bytes must be positive, got {args.bytes}", file=sys.stderr)
        return 2
    interrupt_on_signals()
    rows, figures = [], {}
    for setting in (1, 0):
        print(f"tcp_slow_start_after_idle={setting} ...", flush=True)
        times = _transfers(links, args.bytes, setting)
        after_idle = [seconds for spell, seconds in times[1:] if spell >= 3.0]
        first, median, worst = times[0][1], statistics.median(after_idle), max(after_idle)
        figures[f"slow_start_after_idle_{setting}"] = {
            "first_s": first, "after_3s_idle_median_s": median, "after_3s_idle_max_s": worst,
        }  # fmt: skip
        rows.append(f"| {setting} | {first:.2f} | {median:.2f} | {worst:.2f} |")
    intro = (f"{args.bytes} bytes up and back down over {args.profile}, one TCP connection, this host's congestion "
             f"control ({_congestion_control()}):")  # fmt: skip
    columns = ["tcp_slow_start_after_idle", "first transfer s", "after 3 s idle: median s", "after 3 s idle: max s"]
    write_result(args.out, table_text(intro, columns, rows), figures)
    return 0


def _transfers(links: list[Link], size: int, slow_start_after_idle: int) -> list[tuple[float, float]]:
    """(idle spell, seconds for the burst up and back) for each spell of ``IDLE_S``."""
    with Testbed(links, tag=f"idle{os.getpid() % 100000}") as bed:
        for ns in (bed.server_ns, bed.client_ns[0]):
            sysctl = ["sysctl", "-qw", f"net.ipv4.tcp_slow_start_after_idle={slow_start_after_idle}"]
            subprocess.run(bed.netns_argv(ns, sysctl), check=True)
        server_argv = bed.netns_argv(bed.server_ns, [sys.executable, "-c", SERVER, SERVER_IP, str(size)])
        server = subprocess.Popen(server_argv, stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout is None or server.stdout.readline().strip() != "ready":
                raise RuntimeError("the echo server did not start")
            spells = ",".join(str(s) for s in IDLE_S)
            client_argv = [sys.executable, "-c", CLIENT, SERVER_IP, str(size), spells]
            out = subprocess.run(bed.netns_argv(bed.client_ns[0], client_argv), capture_output=True, text=True,
                                 check=True, timeout=120).stdout  # fmt: skip
        finally:
            server.kill()
            server.wait()
    return [(float(spell), float(seconds)) for spell, seconds in (line.split() for line in out.splitlines())]


def _congestion_control() -> str:
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


if __name__ == "__main__":
    sys.exit(main())

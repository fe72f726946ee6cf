"""How many TCP connections each device opened to the server's gateway over a run, and how its models and updates
met them, from the gateway's log (``edgefl.gateway``: every request with its connection's number, its bytes and
seconds): a device whose pooled connections close between its messages opens new ones, and each starts from TCP's
initial window; so does a direction of a connection that has not carried a model or an update that way yet.

    python bench/connections.py RUN_DIR [RUN_DIR ...] [--out runs/bench-connections]

Per run: its rounds (``rounds.jsonl``), per device address the connections it opened, and its bulk transfers (an
object of more than ``BULK_BYTES``: an update up, ``push-object``; a model down, ``pull-object``): how many were
the first of their direction on their connection ("cold") and the median seconds nginx took for the cold and the
others. result.json: per run folder ``rounds``, ``connections`` (address → opened) and ``bulk`` (direction →
``cold``, ``warm``, ``cold_median_s``, ``warm_median_s``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from results import table_text, write_result

from contract.run_folder import read_rounds

REQUEST = re.compile(r"\S+ (?P<address>\S+) conn=(?P<connection>\d+)/(?P<nth>\d+) ")


def connections(access_log: Path) -> dict[str, int]:
    """Device address → connections it opened (requests that were the first on their connection)."""
    opened: dict[str, int] = {}
    for line in access_log.read_text().splitlines():
        if (match := REQUEST.match(line)) and match["nth"] == "1":
            opened[match["address"]] = opened.get(match["address"], 0) + 1
    return opened


BULK_BYTES = 100_000
TIMED = re.compile(
    r'conn=(?P<connection>\d+)/\d+ "POST \S+/(?P<call>push-object|pull-object) [^"]*" \d+ (?P<sent>\d+) .* '
    r"took=(?P<took>[\d.]+) .* in=(?P<received>\d+)"
)


def bulk_transfers(access_log: Path) -> dict[str, dict[str, float | int | None]]:
    """Per direction (``up``: push-object, ``down``: pull-object), its transfers of more than ``BULK_BYTES`` split by
    whether each was the first of its direction on its connection; empty for a log without the timings."""
    seconds: dict[tuple[str, bool], list[float]] = {}
    carried: set[tuple[str, str]] = set()  # (connection, direction) that carried a bulk transfer already
    for line in access_log.read_text().splitlines():
        if not (match := TIMED.search(line)):
            continue
        up = match["call"] == "push-object"
        if int(match["received"] if up else match["sent"]) <= BULK_BYTES:
            continue
        direction = "up" if up else "down"
        cold = (match["connection"], direction) not in carried
        carried.add((match["connection"], direction))
        seconds.setdefault((direction, cold), []).append(float(match["took"]))
    found: dict[str, dict[str, float | int | None]] = {}
    for direction in ("up", "down"):
        cold, warm = seconds.get((direction, True), []), seconds.get((direction, False), [])
        if cold or warm:
            found[direction] = {"cold": len(cold), "warm": len(warm),
                                "cold_median_s": statistics.median(cold) if cold else None,
                                "warm_median_s": statistics.median(warm) if warm else None}  # fmt: skip
    return found


def _bulk_cell(bulk: dict[str, dict[str, float | int | None]], direction: str) -> str:
    if direction not in bulk:
        return "—"
    b = bulk[direction]
    shown = [
        f"{b['cold']} cold" + (f" ({b['cold_median_s']:.2f} s)" if b["cold_median_s"] is not None else ""),
        f"{b['warm']} warm" + (f" ({b['warm_median_s']:.2f} s)" if b["warm_median_s"] is not None else ""),
    ]
    return ", ".join(shown)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-connections"))
    args = parser.parse_args()
    rows, figures = [], {}
    for run in args.runs:
        log = run / "logs" / "gateway" / "access.log"
        if not log.exists():
            print(f"error: {log} does not exist (a run whose devices dialled the gateway has it)", file=sys.stderr)
            return 2
        rounds, opened = len(read_rounds(run)), connections(log)
        if not opened:
            print(f"error: {log} holds no request with its connection's number (a gateway older than this one?)",
                  file=sys.stderr)  # fmt: skip
            return 2
        bulk = bulk_transfers(log)
        figures[str(run)] = {"rounds": rounds, "connections": opened, "bulk": bulk}
        per_device = ", ".join(f"{address} {count}" for address, count in sorted(opened.items()))
        rows.append(f"| {run} | {rounds} | {min(opened.values())}–{max(opened.values())} | {per_device} | "
                    f"{_bulk_cell(bulk, 'up')} | {_bulk_cell(bulk, 'down')} |")  # fmt: skip
    intro = ("Connections each device opened to the gateway over the run (its first request on each), and its "
             f"updates up and models down (objects over {BULK_BYTES:,} bytes): the first of their direction on their "
             "connection (cold) and the others (warm), with the median seconds nginx took for each:")  # fmt: skip
    columns = ["run", "rounds", "connections a device", "per device", "updates up", "models down"]
    write_result(args.out, table_text(intro, columns, rows), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How many TCP connections each device opened to the server's gateway over a run, from the gateway's log
(``edgefl.gateway``: every request with its connection's number): a device whose pooled connections close
between its messages opens new ones, and each starts from TCP's initial window.

    python bench/connections.py RUN_DIR [RUN_DIR ...] [--out runs/bench-connections]

Per run: its rounds (``rounds.jsonl``) and per device address the connections it opened. result.json: per run
folder ``rounds`` and ``connections`` (address → opened).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from results import write_result

from contract.run_folder import read_rounds

REQUEST = re.compile(r"\S+ (?P<address>\S+) conn=(?P<connection>\d+)/(?P<nth>\d+) ")


def connections(access_log: Path) -> dict[str, int]:
    """Device address → connections it opened (requests that were the first on their connection)."""
    opened: dict[str, int] = {}
    for line in access_log.read_text().splitlines():
        if (match := REQUEST.match(line)) and match["nth"] == "1":
            opened[match["address"]] = opened.get(match["address"], 0) + 1
    return opened


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
        figures[str(run)] = {"rounds": rounds, "connections": opened}
        per_device = ", ".join(f"{address} {count}" for address, count in sorted(opened.items()))
        rows.append(f"| {run} | {rounds} | {min(opened.values())}–{max(opened.values())} | {per_device} |")
    text = "\n".join([
        "Connections each device opened to the gateway over the run (its first request on each):",
        "",
        "| run | rounds | connections a device | per device |",
        "|---|---|---|---|",
        *rows,
    ])  # fmt: skip
    write_result(args.out, text, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

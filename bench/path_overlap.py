"""Where a message's path goes, and what a device's other message in flight costs it, from a deployed run's own
records: each training message's way down (the server pushed it → the device's agent claimed it) and way up (the
agent handed its reply to the SuperNode → the server had it), split by whether the same device's other message was
moving the other way meanwhile (its reply going up while this model came down, or the next model coming down while
this reply went up). Under FedAvg a device has one message at a time; under DGA its reply of round r goes up while
round r + 1's model comes down, so on a long link both directions of its connection carry data at once. A model
that comes down beside an upload may also have been pushed before the device handed over the reply going up —
``after_handover_median_s`` is its way down counted from the later of its push and that hand-over,
``waited_median_s`` how long before the hand-over it was pushed — and ``held_at_push`` counts how many messages its
agent held (claimed, reply not yet handed over) when it was pushed: an agent that holds every message the server
keeps at it (``ClientJob.most_held``, ``most_held``) takes no other, so a model pushed then waits at the SuperLink.

    python bench/path_overlap.py RUN_DIR [RUN_DIR ...] [--out runs/bench-path-overlap]

The times are the host's monotonic clock on both ends (``messages.jsonl``'s ``sent_at`` and ``round_trip_s``, the
agents' "served task" lines: ``claimed``, ``pushed``): a run of the namespaced testbed, where server and devices
share the host. A message's path (``path_s``) is its way down plus its way up plus the agent's hand-overs (tens of
milliseconds). result.json: per run folder, per direction (``down``, ``up``), ``overlapped`` and ``alone`` each
with ``count`` and ``median_s`` (``down``'s ``overlapped`` also ``after_handover_median_s``, ``waited_median_s``
and ``held_at_push``: messages held → how many times), ``path_median_s`` and ``most_held``."""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results import table_text, write_result

from contract.errors import EdgeflError
from contract.run_folder import CONFIG, MESSAGES, read_rounds
from contract.settings import load_config

SERVED = re.compile(r"served task (\{.*\})")  # edge's TaskServer: one line per message it served (fl_client.tasks)


@dataclass(frozen=True)
class Trip:
    """One message of one device, on the host's monotonic clock."""

    partition: int
    sent: float  # the server pushed it
    claimed: float  # the device's agent had it
    pushed: float  # the agent handed its reply to the SuperNode
    back: float  # the server had the reply
    trained: bool
    path_s: float


def trips(run: Path) -> list[Trip]:
    """The run's messages that its agents served, joined with what the server recorded of them."""
    served: dict[str, dict[str, float]] = {}
    for log in sorted((run / "logs").glob("agent-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if found := SERVED.search(line):
                record = json.loads(found.group(1))
                served[record["message_id"]] = record
    joined = []
    for m in read_rounds(run, MESSAGES):
        if (s := served.get(m["message_id"])) is not None and m.get("round_trip_s") is not None:
            back = m["sent_at"] + m["round_trip_s"]
            joined.append(Trip(m["partition"], m["sent_at"], s["claimed"], s["pushed"], back, m["train_s"] > 0,
                               m["path_s"]))  # fmt: skip
    return joined


def split(run_trips: list[Trip]) -> dict[str, Any]:
    """Per direction, the training messages' seconds with the device's other message moving the other way meanwhile
    (``overlapped``) and without (``alone``); for a way down beside an upload, also from the later of its push and
    the upload's hand-over; and their median path."""
    seconds: dict[str, dict[str, list[float]]] = {d: {"overlapped": [], "alone": []} for d in ("down", "up")}
    after_handover, waited, held = [], [], collections.Counter()
    trained = [t for t in run_trips if t.trained]
    for t in trained:
        others = [o for o in run_trips if o.partition == t.partition and o is not t]
        uploads = [o for o in others if o.pushed < t.claimed and o.back > t.sent]
        up_shared = any(o.sent < t.back and o.claimed > t.pushed for o in others)
        seconds["down"]["overlapped" if uploads else "alone"].append(t.claimed - t.sent)
        seconds["up"]["overlapped" if up_shared else "alone"].append(t.back - t.pushed)
        if uploads:
            handover = max(o.pushed for o in uploads)
            after_handover.append(t.claimed - max(t.sent, handover))
            waited.append(max(0.0, handover - t.sent))
            held[sum(1 for o in others if o.claimed <= t.sent < o.pushed)] += 1
    figures: dict[str, Any] = {
        direction: {kind: _summary(v) for kind, v in kinds.items()} for direction, kinds in seconds.items()
    }
    figures["down"]["overlapped"]["after_handover_median_s"] = statistics.median(after_handover) if waited else None
    figures["down"]["overlapped"]["waited_median_s"] = statistics.median(waited) if waited else None
    figures["down"]["overlapped"]["held_at_push"] = {str(n): held[n] for n in sorted(held)}
    figures["path_median_s"] = statistics.median(t.path_s for t in trained) if trained else None
    return figures


def _summary(seconds: list[float]) -> dict[str, float | int | None]:
    return {"count": len(seconds), "median_s": statistics.median(seconds) if seconds else None}


def _cell(figures: dict, direction: str, kind: str) -> str:
    part = figures[direction][kind]
    return "—" if part["median_s"] is None else f"{part['median_s']:.2f} s ({part['count']})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-path-overlap"))
    args = parser.parse_args()
    rows, figures = [], {}
    for run in args.runs:
        found = trips(run) if (run / MESSAGES).exists() else []
        if not any(t.trained for t in found):
            print(f"error: {run} has no training message served by an agent whose log says so (a deployed run's folder "
                  "with logs/agent-*.log and messages.jsonl)", file=sys.stderr)  # fmt: skip
            return 2
        try:
            most = load_config(run / CONFIG).client_job().most_held
        except (OSError, EdgeflError) as exc:
            print(f"error: {run}'s {CONFIG} does not give its run's settings ({exc})", file=sys.stderr)
            return 2
        figures[str(run)] = part = split(found)
        part["most_held"] = most
        beside = part["down"]["overlapped"]
        holding = ", ".join(f"{n}: {count}" for n, count in beside["held_at_push"].items()) or "—"
        handed = (
            "—"
            if beside["waited_median_s"] is None
            else (f"{beside['after_handover_median_s']:.2f} s (pushed {beside['waited_median_s']:.2f} s before)")
        )
        rows.append(f"| {run} | {part['path_median_s']:.2f} s | {_cell(part, 'down', 'alone')} | "
                    f"{_cell(part, 'down', 'overlapped')} | {handed} | {_cell(part, 'up', 'alone')} | "
                    f"{_cell(part, 'up', 'overlapped')} | {holding} (of {most}) |")  # fmt: skip
    intro = ("Training messages' way down (server push → agent) and way up (agent → server), median seconds "
             "(messages), alone or while the same device's other message moved the other way:")  # fmt: skip
    columns = ["run", "path", "down, alone", "down, beside an upload", "the same from the later of its push and the "
               "upload's hand-over", "up, alone", "up, beside a download",
               "held at a model's push beside an upload: times (of the most the agent holds)"]  # fmt: skip
    write_result(args.out, table_text(intro, columns, rows), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

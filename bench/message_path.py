"""Where a message round trip goes: Flower's stock path against edgefl's, side by side in one run.

For each link, three real deployments with the same data, model, partition, seed and local steps, FedAvg:
- ``flower``: Flower's own FedAvg (``--strategy flower-fedavg``): a ClientApp process per message, which imports
  torch and loads its partition, and Flower's fixed waits;
- ``agent, stock waits``: edgefl's engine and edge agent serving its SuperNode (``--isolation process``), with
  Flower's waits as shipped (``EDGEFL_TRANSPORT=stock``);
- ``agent, tuned``: the same with Flower's waits tuned (``contract.transport``) — edgefl's default.

A round trip is server push → reply pulled (``messages.jsonl``); the path is that minus the client's training.
For edgefl's path the agents' task timings split it: server push → task claimed by the agent (SuperLink →
SuperNode over the link, the SuperNode's poll, the agent's claim) → message pulled from the SuperNode → the
ClientApp → reply pushed to the SuperNode → reply pulled by the server (SuperNode → SuperLink over the link,
the server's poll). Round 1 (start-up) is left out. Sequential requests per message cycle over the link are
counted from the protocol: PullMessages, the message's objects in rounds of the concurrency, Confirm,
PushMessages, the reply's objects likewise.

    python bench/message_path.py [--profile loopback --profile long-distance] [--rounds 6] [--clients 4]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

from results import write_result

from contract.run_folder import MESSAGES, read_rounds
from contract.settings import build_config
from contract.transport import CONCURRENCY, STOCK, STOCK_ENV
from edgefl.compare import run_dir_for
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals
from fl_client.tasks import TaskTiming

PATHS = {  # name: (strategy, EDGEFL_TRANSPORT)
    "flower": ("flower-fedavg", ""),
    "agent, stock waits": ("fedavg", STOCK),
    "agent, tuned": ("fedavg", ""),
}
TARGETS_S = {"loopback": 1.0, "long-distance": 3.0}  # the path's median, from the issue
STEPS = ("to agent", "pull", "ClientApp", "push", "to server")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def sequential_requests(objects_down: int, objects_up: int, concurrency: int) -> int:
    """PullMessages, ⌈objects/concurrency⌉ pulls, Confirm, PushMessages, ⌈objects/concurrency⌉ pushes."""
    return 3 + math.ceil(objects_down / concurrency) + math.ceil(objects_up / concurrency)


def measure(run_dir: Path, path: str, clients: int) -> dict:
    """Medians over the messages after round 1."""
    trips = read_rounds(run_dir, MESSAGES)
    if path != "flower":  # edgefl first asks each node which partition it trains: no training, no model
        trips = [t for t in trips if t["rounds"]]
    trips = trips[clients:]  # round 1: one message per client, start-up included
    tasks = {
        t.message_id: t for log in (run_dir / "logs").glob("agent-*.log") for t in TaskTiming.from_log(log.read_text())
    }
    steps = {name: [] for name in STEPS}
    for trip in trips:
        if (task := tasks.get(trip["message_id"])) is None:
            continue
        pulled = trip["sent_at"] + trip["round_trip_s"]
        spans = (task.claimed - trip["sent_at"], task.pulled - task.claimed, task.answered - task.pulled,
                 task.pushed - task.answered, pulled - task.pushed)  # fmt: skip
        for name, span in zip(STEPS, spans, strict=True):
            steps[name].append(span)
    concurrency = min(2, os.cpu_count() or 1) if path != "agent, tuned" else CONCURRENCY
    down, up = trips[0]["objects_down"], trips[0]["objects_up"]
    return {
        "messages": len(trips),
        "round_trip_s": median([t["round_trip_s"] for t in trips]),
        "train_s": median([t["train_s"] for t in trips]),
        "path_s": median([t["round_trip_s"] - t["train_s"] for t in trips]),
        "objects": [down, up],
        "sequential_requests": sequential_requests(down, up, concurrency),
        "kb_per_message": median([(t["bytes_down"] + t["bytes_up"]) / 2e3 for t in trips]),
        "steps_s": {name: median(spans) for name, spans in steps.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--profile", action="append", help="link profile (repeatable; default loopback and long-distance)"
    )
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-message-path"))
    args = parser.parse_args()
    interrupt_on_signals()
    profiles = args.profile or ["loopback", "long-distance"]
    measured: dict[str, dict[str, dict]] = {}
    for profile in profiles:
        measured[profile] = {}
        for path, (strategy, transport) in PATHS.items():
            os.environ[STOCK_ENV] = transport
            config = build_config(
                None, strategy=strategy, profile=profile, dataset=args.dataset, partition=args.partition,
                clients=args.clients, rounds=args.rounds, local_steps=args.local_steps, eval_examples=1000,
                out=str(run_dir_for(args.out, profile, path.replace(", ", "-").replace(" ", "-"))),
            )  # fmt: skip
            print(f"== {path} over {profile}", flush=True)
            run_dir = run(config, lambda line: print("   " + line, flush=True))
            measured[profile][path] = measure(run_dir, path, args.clients)
    os.environ.pop(STOCK_ENV, None)
    lines = [
        f"{args.dataset} {args.partition}, {args.clients} clients, {args.local_steps} local steps, FedAvg, "
        f"medians over rounds 2..{args.rounds}",
        "",
        "| link | path | round trip s | training s | path s (round trip − training) | objects down/up "
        "| sequential requests per cycle | kB per message |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for profile, paths in measured.items():
        for path, m in paths.items():
            lines.append(
                f"| {profile} | {path} | {m['round_trip_s']:.2f} | {m['train_s']:.2f} | {m['path_s']:.2f} "
                f"| {m['objects'][0]}/{m['objects'][1]} | {m['sequential_requests']} | {m['kb_per_message']:.0f} |"
            )
    lines += ["", "edgefl's path, step by step (medians, s):", "",
              "| link | path | " + " | ".join(STEPS) + " |", "|---|---|" + "---|" * len(STEPS)]  # fmt: skip
    for profile, paths in measured.items():
        for path in ("agent, stock waits", "agent, tuned"):
            steps = paths[path]["steps_s"]
            lines.append(f"| {profile} | {path} | " + " | ".join(f"{steps[s]:.3f}" for s in STEPS) + " |")
    lines.append("")
    figures: dict[str, dict] = {}
    for profile, paths in measured.items():
        flower, tuned = paths["flower"], paths["agent, tuned"]
        target = TARGETS_S.get(profile)
        met = "" if target is None else f" (target ≤ {target:g} s: {'met' if tuned['path_s'] <= target else 'NOT met'})"
        lines.append(
            f"{profile}: message path {flower['path_s']:.2f} s with Flower's stock path, {tuned['path_s']:.2f} s "
            f"with edgefl's ({flower['path_s'] / tuned['path_s']:.1f}x shorter){met}; round trip with training "
            f"{flower['round_trip_s']:.2f} s vs {tuned['round_trip_s']:.2f} s; sequential requests per cycle "
            f"{flower['sequential_requests']} vs {tuned['sequential_requests']}"
        )
        figures[profile] = {"target_path_s": target, "paths": paths}
    write_result(args.out, "\n".join(lines), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

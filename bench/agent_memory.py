"""Where an edge agent's memory goes: its process's peak resident memory (ru_maxrss) after each stage of
starting a session and training a round, in one fresh process, as on a device.

    python bench/agent_memory.py [--dataset fashion-mnist] [--partition dirichlet:0.3] [--clients 4]
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

from results import write_result


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-agent-memory"))
    args = parser.parse_args()
    stages = {"python": peak_mb()}
    import torch

    torch.set_num_threads(1)
    stages["+ torch"] = peak_mb()
    import fl_client.tasks  # noqa: F401  (Flower's runtime client, as the agent's process holds it)

    stages["+ Flower's runtime client"] = peak_mb()
    from contract.settings import build_config
    from edge.agent import Session
    from ml.models import get_flat_params

    job = build_config(dataset=args.dataset, partition=args.partition, clients=args.clients,
                       local_steps=args.local_steps).client_job()  # fmt: skip
    session = Session(job, 0, args.clients)
    stages["+ a session: its partition (uint8), model, torch optimizer, codec"] = peak_mb()
    session.train_one_round(1, get_flat_params(session.model))  # from the model as built: the first global model
    stages["+ one round of training"] = peak_mb()
    lines = [f"{args.dataset} {args.partition}, partition 0 of {args.clients} ({session.num_examples} examples)", "",
             "| stage | peak RSS MB | added MB |", "|---|---|---|"]  # fmt: skip
    previous = 0.0
    for stage, mb in stages.items():
        lines.append(f"| {stage} | {mb:.0f} | {mb - previous:+.0f} |")
        previous = mb
    write_result(args.out, "\n".join(lines), {"peak_rss_mb": previous, "stages_mb": stages})
    return 0


if __name__ == "__main__":
    sys.exit(main())

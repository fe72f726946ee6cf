"""Deep Gradient Compression's ablation (Lin et al. 2018, ResNet-110 / CIFAR-10 at 99.9% sparsity: baseline
92.92; naive pruning does not converge; + local accumulation 91.36; + momentum correction 92.56; + warm-up
91.89; full DGC 93.28) in the per-step setting: every round is ONE local step (K = 1) of every client, so the
update a client sends is −η·∇ and the server's mean is the data-parallel gradient step.

Rows: dense momentum SGD; naive top-k without residual (dgc:S:naive); + local accumulation (the residual, with
the clients' optimizer momentum); + momentum correction (the codec holds the momentum, clients run plain SGD);
+ warm-up (sparsity 75% → 93.75% → 98.4% → 99.6% → S over --warmup-steps, and the learning rate ramped linearly
over the same steps); full DGC (+ momentum factor masking); then two rows with global momentum (gm=MOMENTUM: the
server applies the momentum to the mean update, the clients keep only their residual): DGC's sparsity schedule
and STC at --stc-density (also without gm: the clients' own momentum SGD).
--clip adds local gradient clipping to the DGC rows.
The in-process simulation of bench/sim.py (IID Fashion-MNIST, 4 clients by default).

    python bench/dgc_ablation.py [--steps 2000] [--sparsity 0.999] [--stc-density 0.01] [--warmup-steps 200]
        [--lr 0.05] [--rows dense,full]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from results import print_row_done, write_result
from sim import simulate

from contract.settings import build_config
from strategies.codecs import CodecError

ROWS = ("dense", "naive", "accumulate", "momentum", "warmup", "full", "gm", "stc", "stc-gm")


def rows(args: argparse.Namespace, keys: list[str]) -> list[tuple[str, str, bool]]:
    """(name, uplink codec, learning-rate warm-up) of the ablation's rows named by keys (of ROWS)."""
    extra = f":clip={args.clip}" if args.clip else ""
    dgc, warmup, momentum = f"dgc:{args.sparsity}", args.warmup_steps, args.momentum
    every = {
        "dense": ("dense momentum SGD", "none", False),
        "naive": ("naive top-k, no residual", f"{dgc}:naive{extra}", False),
        "accumulate": ("+ local accumulation", f"{dgc}:accumulate{extra}", False),
        "momentum": ("+ momentum correction", f"{dgc}:momentum{extra}", False),
        "warmup": ("+ warm-up", f"{dgc}:warmup:warmup={warmup}{extra}", True),
        "full": ("full DGC (+ momentum masking)", f"{dgc}:full:warmup={warmup}{extra}", True),
        "gm": ("DGC, global momentum", f"{dgc}:full:warmup={warmup}{extra}:gm={momentum}", True),
        "stc": ("STC, local momentum", f"stc:{args.stc_density}", False),
        "stc-gm": ("STC, global momentum", f"stc:{args.stc_density}:gm={momentum}", True),
    }
    return [every[key] for key in keys]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000, help="rounds of one local step each")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--sparsity", type=float, default=0.999)
    parser.add_argument("--warmup-steps", type=int, default=200, help="sparsity and learning-rate warm-up")
    parser.add_argument("--stc-density", type=float, default=0.01, help="STC's density p (1 %%: ~350x)")
    parser.add_argument("--clip", type=float, help="DGC's local gradient clipping at this global norm")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"a comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-dgc-ablation"))
    args = parser.parse_args()
    keys = args.rows.split(",")
    if unknown := sorted(set(keys) - set(ROWS)):
        parser.error(f"unknown rows {','.join(unknown)}; use a subset of {','.join(ROWS)}")
    torch.set_num_threads(2)

    def warmed_lr(step: int) -> float:
        return args.lr * min(1.0, step / args.warmup_steps)

    lines = [
        f"{args.dataset} {args.partition}, {args.clients} clients, {args.steps} steps of K = 1 (batch "
        f"{args.batch_size} per client), lr {args.lr}, momentum {args.momentum}, warm-up {args.warmup_steps} steps",
        "",
        "| method | codec | final acc | best acc | bytes / update | compression | after warm-up |",
        "|---|---|---|---|---|---|---|",
    ]
    figures: dict[str, dict] = {}
    for name, codec, lr_warmup in rows(args, keys):
        started = time.monotonic()
        config = build_config(
            dataset=args.dataset, partition=args.partition, clients=args.clients, rounds=args.steps, local_steps=1,
            batch_size=args.batch_size, lr=args.lr, momentum=args.momentum, seed=args.seed, compress=codec,
        )  # fmt: skip
        try:
            result = simulate(config, warmed_lr if lr_warmup else None, args.eval_every)
        except CodecError as exc:  # the client's codec refuses a NaN/Inf update: training diverged
            lines.append(f"| {name} | {codec} | diverged ({exc}) | | | | |")
            figures[name] = {"codec": codec, "diverged": str(exc)}
            print(f"{name}: diverged ({exc})", flush=True)
            continue
        acc, size = result.accuracy, result.bytes_per_update
        steady = sum(result.bytes_up[args.warmup_steps :]) / (len(result.bytes_up[args.warmup_steps :]) * args.clients)
        lines.append(
            f"| {name} | {codec} | {acc[-1]:.4f} | {max(acc):.4f} | {size:.0f} | {result.dense_bytes / size:.0f}x "
            f"| {result.dense_bytes / steady:.0f}x |"
        )
        figures[name] = {
            "codec": codec,
            "final_accuracy": acc[-1],
            "best_accuracy": max(acc),
            "compression": result.dense_bytes / size,
            "compression_after_warmup": result.dense_bytes / steady,
        }
        print_row_done(name, acc, started)
    write_result(args.out, "\n".join(lines), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FedAvg, DGA and FedBuff on Flower's Simulation Engine: a population of virtual clients, a sample a round,
a mixed fleet on mixed links, timed by the virtual clock.

Each strategy is one ``edgefl run --federation simulation`` (Ray on this machine) with the same data (non-IID
Fashion-MNIST, dirichlet:0.3), population, sample, seed and K; the fleet repeats ``--device-profile`` and
``--profile`` over the clients in order (4 devices × 3 links: 12 kinds of client). Printed side by side: accuracy
against modelled time, rounds and bytes (plots), time and bytes to the target, and how many real seconds the
simulation took. FedBuff steps once per K updates, so it runs R·M/K steps: every strategy trains the same number
of client updates. The clock's unit, this host's seconds per local step, is measured once and given to every run
(``--clock-step-s``), so all strategies are timed alike. result.json holds each strategy's figures and the
speedups to target against the first.

    python bench/simulation.py [--clients 100] [--per-round 10] [--rounds 40] [--strategies fedavg,dga:2,fedbuff:5]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from results import write_result

from contract.run_folder import MESSAGES, read_rounds
from contract.settings import build_config
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals
from edgefl.report import load_run, plot_runs, ratio
from fl_server.simulation import host_step_s

FLEET_DEVICES = "rpi3,rpi4,rpi5,laptop"
FLEET_LINKS = "home-wifi,cellular-4g,long-distance"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", default="10", help="clients sampled a round (a count or a fraction)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--strategies", default="fedavg,dga:2,fedbuff:5")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--profile", default=FLEET_LINKS)
    parser.add_argument("--device-profile", default=FLEET_DEVICES)
    parser.add_argument("--target-accuracy", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-simulation"))
    args = parser.parse_args()
    interrupt_on_signals()
    runs, in_flight = [], []
    strategies = args.strategies.split(",")
    step_s = host_step_s(build_config(None, dataset="fashion-mnist", seed=args.seed))
    print(f"the clock's unit: {step_s * 1000:.2f} ms a local step on one core of this host", flush=True)
    for i, strategy in enumerate(strategies, 1):
        config = build_config(
            None, federation="simulation", strategy=strategy, dataset="fashion-mnist", partition=args.partition,
            clients=args.clients, clients_per_round=args.per_round, rounds=args.rounds, local_steps=args.local_steps,
            seed=args.seed, profile=args.profile, device_profile=args.device_profile,
            target_accuracy=args.target_accuracy, eval_examples=2000, clock_step_s=step_s,
            out=str(args.out / strategy.replace(":", "-")),
        )  # fmt: skip
        if buffer := config.strategy_spec.buffer:  # as many client updates as the others: R·M / K steps
            config = dataclasses.replace(config, rounds=args.rounds * config.per_round // buffer)
        print(f"== [{i}/{len(strategies)}] {strategy}, {config.rounds} rounds", flush=True)
        run_dir = run(config, lambda line: print("   " + line, flush=True))
        runs.append(load_run(run_dir))
        in_flight.append(mean_in_flight(run_dir))
    summaries = [summary for summary, _ in runs]
    first = summaries[0]
    lines = [
        f"| {s['strategy']} | {s['rounds']} | {s['final_accuracy']:.4f} | {s['best_accuracy']:.4f} | "
        f"{_num(s['time_to_target_s'])} | {_num(s['bytes_to_target'], 1e6, 1)} | {s['seconds_per_round']:.2f} | "
        f"{s['wall_clock_s']:.0f} | {flying:.1f} | {s['real_s']:.0f} | {_times(ratio(first, s, 'time_to_target_s'))} |"
        for s, flying in zip(summaries, in_flight, strict=True)
    ]
    header = (f"{args.clients} virtual clients, {args.per_round} a round, {args.rounds} rounds of {args.local_steps} "
              f"local steps (FedBuff: as many client updates), Fashion-MNIST {args.partition}, devices "
              f"{args.device_profile}, links {args.profile}, target {args.target_accuracy}; times are modelled "
              f"seconds, 'real s' this host's")  # fmt: skip
    text = "\n".join([
        header,
        "",
        "| strategy | rounds | final acc | best acc | s to target | MB to target | s/round | s, all rounds "
        "| clients in flight | real s | speedup to target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *lines,
    ])  # fmt: skip
    plot_runs(runs, args.out, f"{args.clients} clients ({args.per_round} a round), {args.partition}, mixed fleet")
    write_result(args.out, text, {
        "clients": args.clients, "per_round": config.per_round, "rounds": args.rounds,
        "strategies": {s["strategy"]: {key: s[key] for key in (
            "rounds", "final_accuracy", "best_accuracy", "time_to_target_s", "bytes_to_target", "seconds_per_round",
            "wall_clock_s", "real_s", "bytes_up", "bytes_down")} | {"mean_in_flight": flying}
            for s, flying in zip(summaries, in_flight, strict=True)},
        "speedup_to_target_vs_first": {s["strategy"]: ratio(first, s, "time_to_target_s") for s in summaries[1:]},
    })  # fmt: skip
    return 0


def mean_in_flight(run_dir: Path) -> float:
    """Training messages in flight, averaged over the run's modelled time (from messages.jsonl)."""
    events = []
    for trip in read_rounds(run_dir, MESSAGES):
        if trip["rounds"]:
            events += [(trip["sent_at"], 1), (trip["sent_at"] + trip["round_trip_s"], -1)]
    events.sort()
    area, count, last = 0.0, 0, events[0][0]
    for at, step in events:
        area, count, last = area + count * (at - last), count + step, at
    return area / (events[-1][0] - events[0][0])


def _num(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "—" if value is None else f"{value / scale:.{digits}f}"


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    sys.exit(main())

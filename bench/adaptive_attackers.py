"""Two adaptive attackers among eight clients, from the first round on: what the server's bound on one client's
influence holds, and what it costs, measured in-process on the server's own round engine.

Each run is the deployment's arithmetic without the network, as ``bench/sim.py`` runs it: the server's
``strategies.rounds.RoundEngine`` (the bound of ``strategies.validation``, float64 sums, a step that is not finite
refused whole, and ``--aggregate``'s robust rules from ``fl_server.robust``) takes the updates of the deployment's
own client sessions (``edge.agent.Session``: partition, trainer, codec). Clients ``ATTACKERS`` are adversaries from
round 1 on that know everything the server knows — their exact bound from round 2 on (in round 1 the engine bounds
the held updates by all the round's others, the other attacker's included, which they set from the honest ones
alone: a bound at most that large), every honest update of the round (they collude and see the others) — answer
first, and claim their partition's whole size as their weight. Each run is repeated with every client honest
(clean) under the same seed and rule.

Attacks (every round, both attackers):
- ``flip-at-bound``: its own honest update, sign-flipped, at its bound;
- ``colluding-flip``: the honest clients' mean update, sign-flipped, at the bound (the strongest a bound allows
  against the mean: it points exactly against the round's progress);
- ``noise-at-bound``: a random direction at the bound;
- ``ratchet``: its own honest update at its bound (looks honest; tries to widen the bound round after round);
- ``huge-first``: every value 3e38 (float32's largest order), answered first: the round-1 path with no history;
- ``alie``: "a little is enough" (Baruch et al., NeurIPS 2019), per coordinate μ_j − z·σ_j of the honest updates with
  z = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − f (n = 8, f = 2: z = 0.32), at most at the bound: inside the honest spread,
  where the robust rules' trimming and clipping do not reach it;
- ``ipm``: inner-product manipulation (Xie et al., UAI 2020), −ε·μ with ε = 0.1: a short update against the
  round's progress, close to the honest ones.
- ``withheld``: no attack, its data withheld: it sends the honest clients' mean. What any rule loses when two
  clients' data (on non-IID partitions, much of some classes) stops counting, the floor under every attack's cost.

Criteria: ``influence_bound_held`` — every accepted update of an attacker has an L2 norm of at most
``norm_factor`` times the largest recent norm of an honest client (the attackers never widened their bound);
``model_finite_every_round``; the final accuracy (mean of the last 3 rounds) within 2 points of the clean run's,
as the mean over seeds with its 95 % interval, per attack and rule.

    python bench/adaptive_attackers.py [--seeds 3] [--rounds 30] [--rules mean,trimmed-mean:0.25]
        [--norm-factors 2] [--attacks NAME,NAME] [--dataset digits] [--partition dirichlet:0.3] [--compress none]
        [--strategy fedavg]
        [--out runs/bench-adaptive-attackers]

Writes OUT/result.md, OUT/result.json (``clients``, ``attackers``, ``seeds``, ``rounds``, ``influence_bound_held``,
``model_finite_every_round``, and per rule, norm factor and attack ``accuracy_delta_points`` as [mean, low, high])
and OUT/accuracy.png (each attack's accuracy, the mean over seeds, under the default rule)."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import numpy as np
from results import write_result

from contract.settings import RunConfig, build_config
from edge.agent import Session
from edgefl.report import mean_interval
from fl_server.engine import strategy_half
from fl_server.robust import make_aggregator
from ml.data import load_dataset
from ml.models import build_model, get_flat_params, set_flat_params
from ml.trainer import evaluate
from strategies.codecs import CodecError
from strategies.codecs.dense import NoCompression, dense_payload
from strategies.rounds import RoundEngine, Update
from strategies.spec import parse_aggregate
from strategies.validation import NORM_FACTOR, InfluenceBound, l2_norm

CLIENTS = 8
ATTACKERS = (6, 7)
WINDOW = 3  # rounds averaged: a run's final accuracy
HUGE = 3e38
MARGIN = 1 - 1e-6  # an attacker aims just under its bound (float32 rounding must not push it over)
_SUPPORTERS = CLIENTS // 2 + 1 - len(ATTACKERS)  # ALIE's s: honest clients the attackers need on their side
ALIE_Z = NormalDist().inv_cdf((CLIENTS - _SUPPORTERS) / CLIENTS)
IPM_EPSILON = 0.1
ALLOWED_LOSS_POINTS = 2.0  # the bar for adaptive attackers under the default rule


@dataclass(frozen=True)
class Round:
    """What an attacker sees when it answers: its own honest update, its bound, the honest clients' updates."""

    own: np.ndarray
    bound: float
    honest: list[np.ndarray]
    rng: np.random.Generator


def _at(bound: float, direction: np.ndarray) -> np.ndarray:
    return (direction.astype(np.float64) * (MARGIN * bound / l2_norm(direction))).astype(np.float32)


def _alie(r: Round) -> np.ndarray:
    honest = np.stack(r.honest).astype(np.float64)
    vector = honest.mean(axis=0) - ALIE_Z * honest.std(axis=0)
    return vector.astype(np.float32) if l2_norm(vector) <= r.bound else _at(r.bound, vector)


ATTACKS: dict[str, Callable[[Round], np.ndarray]] = {
    "flip-at-bound": lambda r: _at(r.bound, -r.own),
    "colluding-flip": lambda r: _at(r.bound, -np.mean(r.honest, axis=0)),
    "noise-at-bound": lambda r: _at(r.bound, r.rng.standard_normal(r.own.size).astype(np.float32)),
    "ratchet": lambda r: _at(r.bound, r.own),
    "huge-first": lambda r: np.full(r.own.size, HUGE, dtype=np.float32),
    "alie": _alie,
    "withheld": lambda r: np.mean(r.honest, axis=0).astype(np.float32),
    "ipm": lambda r: (-IPM_EPSILON * np.mean(r.honest, axis=0)).astype(np.float32),
}


@dataclass
class RunResult:
    rule: str
    norm_factor: float
    attack: str  # "clean": every client honest
    seed: int
    accuracy: list[float] = field(default_factory=list)  # after each round
    finite_every_round: bool = True
    steps_refused: int = 0
    bound_held: bool = True
    ended_at: int | None = None  # the round the run could not close: honest clients' training no longer finite
    worst_ratio: float = 0.0  # an attacker's accepted norm / the largest recent honest norm, at most
    honest_clipped: int = 0  # honest updates the bound clipped
    honest_updates: int = 0


def _bound_for(engine: RoundEngine, client: int, norms: dict[int, float]) -> float:
    """The bound the engine sets ``client`` this round: from the recorded norms, or (none yet: the run's first
    replies, held until the round closes) from the round's other updates, or the global model's norm."""
    validator = engine.validator
    assert validator is not None
    bound = validator.bound(client) or validator.bound(client, norms)
    return bound if bound is not None else l2_norm(engine.global_params)


def run_one(config: RunConfig, rule: str, norm_factor: float, attack: str) -> RunResult:
    """One run of ``config`` on the round engine, clients ATTACKERS playing ``attack`` ("clean": honest)."""
    job = config.client_job()
    clients = [Session(job, j, config.clients) for j in range(config.clients)]
    dataset = load_dataset(config.dataset, config.data_dir or None)
    model = build_model(dataset, config.seed, config.model)
    start = get_flat_params(model)
    server = strategy_half(config, start.size)
    engine = RoundEngine(
        start, clients[0].layout, config.rounds, config.clients, aggregator=make_aggregator(parse_aggregate(rule)),
        validator=InfluenceBound(norm_factor=norm_factor), strategy=server,
        partition_sizes={c.partition_id: c.num_examples for c in clients},
    )  # fmt: skip
    rng = np.random.default_rng(config.seed + 1000)
    result = RunResult(rule, norm_factor, attack, config.seed)
    attackers = ATTACKERS if attack != "clean" else ()
    honest_reach: dict[int, list[float]] = {}
    history = {0: start}  # the global models a client may still be sent
    for client in clients:
        client.strategy.receive_global(0, start, server.message_state(client.partition_id))
    for r in range(1, config.rounds + 1):
        updates: dict[int, Update] = {}
        dense: dict[int, np.ndarray] = {}
        held = r - engine.delay - 1  # round r is trained from the global model of round r − D − 1 (bench/sim.py)
        for client in clients:
            j = client.partition_id
            request = engine.assign(j, r, held, history[held]) if held >= 0 else engine.assign(j, r, None, None)
            if request.global_params is not None:
                client.strategy.receive_global(held, request.global_params, request.state)
            try:
                update, sent = client.train_one_round(r, client.strategy.start_params(), None)
            except CodecError:  # trained from a wrecked model: the agent's reply is an error (edge.agent)
                engine.fail(j)
                continue
            client.strategy.record_sent(r, sent)
            updates[j], dense[j] = update, sent  # sent: the update as the server decodes it
        honest = [dense[j] for j in dense if j not in attackers]
        if not honest:
            result.ended_at = r
            break
        norms = {j: l2_norm(v) for j, v in dense.items() if j not in attackers}
        for a in attackers:
            bound = _bound_for(engine, a, norms)
            own = dense.get(a, np.mean(honest, axis=0))
            vector = ATTACKS[attack](Round(own, bound, honest, rng))
            updates[a] = Update(r, NoCompression.stype, dense_payload(vector), clients[a].num_examples)
        for j in (*attackers, *(j for j in updates if j not in attackers)):  # the attackers answer first
            refused = engine.receive(j, [updates[j]], j)
            assert not refused, f"round {r}: {refused}"
        closed = engine.close_rounds(now=float(r))
        if not closed:  # an honest client failed: with every client due, the round waits for it for good
            result.ended_at = r
            break
        history[r] = engine.global_params
        history.pop(held, None)
        result.steps_refused += closed[0].step_refused is not None
        result.finite_every_round &= bool(np.isfinite(engine.global_params).all())
        result.honest_clipped += sum(j not in attackers for j in closed[0].clipped)
        result.honest_updates += len(norms)
        if r == 1:  # the held round: each bounded by the round's others
            honest_reach = {j: [norm] for j, norm in norms.items()}
        ceiling = norm_factor * max(max(n[-engine.validator.per_client :]) for n in honest_reach.values())
        for a in attackers:
            accepted = engine.validator.norms[a][-1]
            result.worst_ratio = max(result.worst_ratio, accepted / (ceiling / norm_factor))
            result.bound_held &= accepted <= ceiling * (1 + 1e-6)
        for j, norm in norms.items():  # recorded after the round: the next round's bound is set from them
            if r > 1:
                honest_reach.setdefault(j, []).append(norm)
        set_flat_params(model, engine.global_params)
        result.accuracy.append(evaluate(model, dataset.x_test, dataset.y_test)[1])
    if result.ended_at is not None:  # the model the server is left with, for the rounds the run did not reach
        set_flat_params(model, engine.global_params)
        accuracy = evaluate(model, dataset.x_test, dataset.y_test)[1]
        result.accuracy += [accuracy] * (config.rounds - len(result.accuracy))
    return result


def _work(args: tuple[RunConfig, str, float, str]) -> RunResult:
    import torch

    torch.set_num_threads(1)  # two runs side by side, one core each
    return run_one(*args)


def report(results: list[RunResult], args: argparse.Namespace) -> tuple[str, dict, dict[str, object]]:
    """The table (markdown), result.json's figures, and each attack's mean accuracy curve under the first rule and
    norm factor (for the plot)."""
    final = {(r.rule, r.norm_factor, r.attack, r.seed): float(np.mean(r.accuracy[-WINDOW:])) for r in results}
    attacks = [a for a in args.attacks if a != "clean"]
    lines = [
        f"# Two adaptive attackers among {CLIENTS} clients from round 1: {args.dataset} ({args.partition}), "
        f"{args.rounds} rounds of {args.local_steps} local steps, {args.strategy}, codec {args.compress}, seeds "
        f"{', '.join(map(str, args.seeds))}",
        "",
        "Final accuracy: the mean of the last 3 rounds; the change against the clean run of the same seed, rule and "
        "norm factor as the mean over seeds with its 95 % interval. Worst: an attacker's accepted L2 norm over the "
        "largest recent honest norm (the bound allows the norm factor). A run is stuck when honest clients can no "
        "longer train a finite update from the global model (their agents reply with an error, and a round that "
        "waits for every client never closes); its accuracy is then the stuck model's for the remaining rounds.",
        "",
        "| rule | norm factor | attack | final accuracy | change (points) [95 % interval] | within 2 points | "
        "worst norm / honest | bound held | finite every round | steps refused | honest updates clipped | "
        "runs stuck (round) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    figures: dict = {"clients": CLIENTS, "attackers": list(ATTACKERS), "seeds": args.seeds, "rounds": args.rounds,
                     "dataset": args.dataset, "partition": args.partition, "local_steps": args.local_steps,
                     "compress": args.compress, "strategy": args.strategy,
                     "default_norm_factor": NORM_FACTOR, "clean": [], "rows": []}  # fmt: skip
    for rule, factor in itertools.product(args.rules, args.norm_factors):
        clean = [final[(rule, factor, "clean", s)] for s in args.seeds]
        runs = [r for r in results if (r.rule, r.norm_factor, r.attack) == (rule, factor, "clean")]
        lines.append(f"| {rule} | {factor:g} | clean | {np.mean(clean):.4f} | | | | | | | {_clipped(runs)} | |")
        figures["clean"].append({"rule": rule, "norm_factor": factor, "accuracy": float(np.mean(clean)),
                                 "honest_clipped_fraction": _fraction(runs)})  # fmt: skip
        for attack in attacks:
            runs = [r for r in results if (r.rule, r.norm_factor, r.attack) == (rule, factor, attack)]
            base = {seed: final[(rule, factor, "clean", seed)] for seed in args.seeds}
            delta = mean_interval([100 * (final[(rule, factor, attack, r.seed)] - base[r.seed]) for r in runs])
            held, finite = all(r.bound_held for r in runs), all(r.finite_every_round for r in runs)
            worst, refused = max(r.worst_ratio for r in runs), sum(r.steps_refused for r in runs)
            stuck = [r.ended_at for r in runs if r.ended_at is not None]
            within = delta[0] >= -ALLOWED_LOSS_POINTS
            accuracy = np.mean([final[(rule, factor, attack, r.seed)] for r in runs])
            lines.append(
                f"| {rule} | {factor:g} | {attack} | {accuracy:.4f} | {delta[0]:+.2f} [{delta[1]:+.2f}, "
                f"{delta[2]:+.2f}] | {'yes' if within else 'NO'} | {worst:.2f} | {'yes' if held else 'NO'} | "
                f"{'yes' if finite else 'NO'} | {refused} | {_clipped(runs)} | {', '.join(map(str, stuck)) or 'none'} |"
            )
            figures["rows"].append({"rule": rule, "norm_factor": factor, "attack": attack,
                                    "accuracy_delta_points": delta, "within_2_points": within,
                                    "worst_norm_over_honest": worst, "influence_bound_held": held,
                                    "model_finite_every_round": finite, "steps_refused": refused,
                                    "runs_stuck_at": stuck, "honest_clipped_fraction": _fraction(runs)})  # fmt: skip
    figures["influence_bound_held"] = all(row["influence_bound_held"] for row in figures["rows"])
    figures["model_finite_every_round"] = all(row["model_finite_every_round"] for row in figures["rows"])
    default = [row for row in figures["rows"] if row["rule"] == "mean" and row["norm_factor"] == NORM_FACTOR]
    figures["default_rule_within_2_points"] = bool(default) and all(row["within_2_points"] for row in default)
    lines += ["", f"Influence bound held in every run: {'yes' if figures['influence_bound_held'] else 'NO'}; "
              f"the global model finite after every round: {'yes' if figures['model_finite_every_round'] else 'NO'}; "
              f"the default rule (mean, norm factor {NORM_FACTOR:g}) within 2 points under every attack: "
              f"{'yes' if figures['default_rule_within_2_points'] else 'NO' if default else 'not run'}."]  # fmt: skip
    rule, factor = args.rules[0], args.norm_factors[0]
    curves = {a: np.mean([r.accuracy for r in results if (r.rule, r.norm_factor, r.attack) == (rule, factor, a)],
                         axis=0) for a in args.attacks}  # fmt: skip
    return "\n".join(lines), figures, {"rule": rule, "norm_factor": factor, "curves": curves}


def _fraction(runs: list[RunResult]) -> float:
    """Of the honest updates in ``runs``, the fraction the bound clipped."""
    return sum(r.honest_clipped for r in runs) / max(1, sum(r.honest_updates for r in runs))


def _clipped(runs: list[RunResult]) -> str:
    return f"{100 * _fraction(runs):.1f} %"


def plot(out: Path, curves: dict[str, object]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for attack, accuracy in curves["curves"].items():
        ax.plot(range(1, len(accuracy) + 1), accuracy, label=attack, lw=2.2 if attack == "clean" else 1.3)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (mean over seeds)")
    ax.set_title(f"2 adaptive attackers of {CLIENTS}: {curves['rule']}, norm factor {curves['norm_factor']:g}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--compress", default="none", help="the devices' codec (the attackers send dense updates)")
    parser.add_argument("--strategy", default="fedavg", help="fedavg or dga:D (every client every round)")
    parser.add_argument("--rules", default="mean,trimmed-mean:0.25", help="--aggregate rules, comma-separated")
    parser.add_argument("--norm-factors", default=f"{NORM_FACTOR:g}", help="the bound's factors, comma-separated")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=Path("runs/bench-adaptive-attackers"))
    args = parser.parse_args()
    try:
        args.rules = [rule.strip() for rule in args.rules.split(",")]
        for rule in args.rules:
            parse_aggregate(rule)
        args.norm_factors = [float(f) for f in args.norm_factors.split(",")]
    except ValueError as exc:
        print(f"bad --rules or --norm-factors: {exc}", file=sys.stderr)
        return 2
    attacks = [a.strip() for a in args.attacks.split(",")]
    if unknown := [a for a in attacks if a not in ATTACKS]:
        print(f"unknown attacks {unknown}; choose from {', '.join(ATTACKS)}", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.rounds < WINDOW or any(f <= 1 for f in args.norm_factors):
        print(f"--seeds must be at least 1, --rounds at least {WINDOW}, every norm factor above 1", file=sys.stderr)
        return 2
    args.attacks, args.seeds = ["clean", *attacks], list(range(args.seeds))
    try:
        configs = {seed: build_config(None, dataset=args.dataset, partition=args.partition, clients=CLIENTS,
                                      rounds=args.rounds, local_steps=args.local_steps, compress=args.compress,
                                      strategy=args.strategy,
                                      seed=seed) for seed in args.seeds}  # fmt: skip
    except ValueError as exc:  # ConfigError, SpecError: one line each
        print(f"bad settings: {exc}", file=sys.stderr)
        return 2
    grid = itertools.product(args.rules, args.norm_factors, args.attacks, args.seeds)
    jobs = [(configs[seed], rule, factor, attack) for rule, factor, attack, seed in grid]
    print(f"{len(jobs)} runs of {args.rounds} rounds ({args.workers} at a time)", flush=True)
    started, results = time.monotonic(), []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, done in enumerate(as_completed([pool.submit(_work, job) for job in jobs]), 1):
            r = done.result()
            print(f"[{i}/{len(jobs)}] {r.rule}, factor {r.norm_factor:g}, {r.attack}, seed {r.seed}: final "
                  f"{np.mean(r.accuracy[-WINDOW:]):.4f} ({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
            results.append(r)
    text, figures, curves = report(results, args)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(args.out, curves)
    write_result(args.out, text, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``edgefl`` command.

    edgefl run [--config FILE] [--strategy fedavg|dga:D|flower-fedavg] [--dataset ...] ...
    edgefl report runs/A runs/B ... [--out DIR]
    edgefl netem apply|show|clear|verify ...
    edgefl certs --out DIR [--host NAME_OR_IP ...] [--node-keys N] [--submitters N]
    edgefl server --listen HOST:PORT (--certs DIR | --insecure) (--auth-keys node-*.pub | --allow-any-device)
    edgefl client --server HOST:PORT --partition-id I --num-partitions N (--root-cert FILE | --insecure) ...
    edgefl run|compare --federation remote --server HOST:PORT (--root-cert FILE --submitter-cert FILE | --insecure)

A user error prints one line (``edgefl: error: ...``) and exits 2; Ctrl-C stops everything and exits 130."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

from contract.errors import EdgeflError
from contract.run_folder import CONFIG
from contract.settings import ConfigError, RunConfig, build_config, build_config_from, load_config
from edgefl.processes import interrupt_on_signals
from strategies.dga import with_flags as dga_flags

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def add_run_options(p: argparse.ArgumentParser, several_profiles: bool = False) -> None:
    """The settings of a run, as flags that override ``--config``; None means 'not given'."""
    p.add_argument("--config", type=Path, help="TOML file with the same settings (flags override it)")
    p.add_argument("--strategy", help="fedavg | dga:D | dga:D:nocorrection | fedbuff:K | fedprox:MU | scaffold | "
                   "flower-fedavg")  # fmt: skip
    p.add_argument("--delay", type=int, help="DGA's delay D (same as --strategy dga:D)")
    p.add_argument("--no-correction", action="store_true", help="DGA ablation: apply stale averages uncorrected")
    p.add_argument("--dataset", help="digits | fashion-mnist | mnist | shakespeare | hf:NAME")
    p.add_argument("--model", help="auto (the data set's small model) | cnn | resnet8 | char-lstm | leaf-lstm "
                   "(ml/catalog.py)")  # fmt: skip
    p.add_argument("--data-dir", help="folder with the data set's files (mnist, or a local fashion-mnist)")
    p.add_argument("--partition", help="iid | dirichlet:ALPHA | pathological:K | natural")
    p.add_argument("--clients", type=int)
    p.add_argument(
        "--clients-per-round",
        help="partial participation: all (default), a count M, or a fraction "
        "such as 0.5; a seeded sample without replacement each round",
    )
    p.add_argument("--rounds", type=int)
    p.add_argument("--local-steps", type=int, help="K: local SGD steps per round")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--momentum", type=float)
    p.add_argument("--lr-schedule", help="constant | cosine (annealed over the run's rounds)")
    p.add_argument("--seed", type=int)
    p.add_argument("--target-accuracy", type=float)
    link_help = (
        "link profile: loopback (no namespaces), or e.g. long-distance, or a list over the clients in order, "
        "repeated when shorter: home-wifi,satellite"
    )
    if several_profiles:
        p.add_argument("--profile", action="append", help=link_help + "; repeat to compare over several")
    else:
        p.add_argument("--profile", help=link_help)
    p.add_argument("--profiles", dest="profiles_file", help="TOML file with your own link profiles")
    p.add_argument("--device-profile", help="emulated device CPU per client (local runs): laptop, rpi3, rpi4, "
                   "rpi5, or a list over the clients like --profile: rpi3,rpi4,laptop")  # fmt: skip
    p.add_argument("--compress", help="update codec: none, topk:R, dgc:S, powersgd:R, onebit, terngrad, ...")
    p.add_argument("--compress-down", help="codec of the global model's deltas sent to clients (same names)")
    p.add_argument("--quorum", type=float, help="fraction of clients that closes a round after its deadline")
    p.add_argument("--round-deadline-s", type=float, help="seconds a round waits for stragglers")
    p.add_argument("--port", type=int, help="SuperLink port (default: a free one)")
    p.add_argument("--federation", choices=("local", "remote", "simulation"),
                   help="local (default): start everything here; remote: submit to an edgefl server; simulation: "
                   "virtual clients on Flower's Simulation Engine (Ray) with a modelled clock")  # fmt: skip
    p.add_argument("--ray-address", help="simulation: join this Ray cluster (auto, or the head's HOST:PORT) "
                   "instead of starting Ray here")  # fmt: skip
    p.add_argument("--clock-step-s", type=float, help="simulation: the virtual clock's seconds per local step on one "
                   "core (default: measured on this host when the run starts)")  # fmt: skip
    p.add_argument("--server", help="remote: the SuperLink's HOST:PORT")
    p.add_argument("--root-cert", help="remote: the server's CA certificate (ca.pem from edgefl certs)")
    p.add_argument("--submitter-cert", help="remote over TLS: your submitter certificate (submitter-I.pem from "
                   "edgefl certs --submitters N; its .key beside it)")  # fmt: skip
    p.add_argument("--insecure", action="store_true", default=None, help="remote: plain text to a --insecure server, "
                   "on the server machine")  # fmt: skip
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, metavar="S",
                   help="remote: seconds to wait for an unreachable server (default 30)")  # fmt: skip
    p.add_argument(
        "--aggregate",
        help="mean (default) | median | trimmed-mean:BETA | krum:F | centered-clip:TAU (robust aggregation); "
        "':nnm' after a robust rule mixes each update with its nearest neighbours first",
    )
    p.add_argument("--eval-every", type=int, help="evaluate the global model every this many rounds and after the "
                   "last (default 1)")  # fmt: skip
    p.add_argument("--eval-examples", type=int, help="evaluate the global model on a fixed sample of this many "
                   "test examples (default 0: the whole test split)")  # fmt: skip


def config_from_args(args: argparse.Namespace, defaults: dict[str, object] | None = None) -> RunConfig:
    strategy = args.strategy
    if args.delay is not None or args.no_correction:
        strategy = dga_flags(strategy, args.delay, correction=not args.no_correction)
    keys = (
        "dataset",
        "model",
        "data_dir",
        "partition",
        "clients",
        "clients_per_round",
        "rounds",
        "local_steps",
        "batch_size",
        "lr",
        "momentum",
        "lr_schedule",
        "seed",
        "target_accuracy",
        "profile",
        "profiles_file",
        "device_profile",
        "compress",
        "compress_down",
        "quorum",
        "round_deadline_s",
        "port",
        "eval_examples",
        "eval_every",
        "aggregate",
        "federation",
        "server",
        "root_cert",
        "insecure",
        "submitter_cert",
        "connect_timeout_s",
        "ray_address",
        "clock_step_s",
    )
    overrides = {k: getattr(args, k) for k in keys}
    if isinstance(args.profile, list):  # compare: the runs' profiles are passed to compare() separately
        overrides["profile"] = args.profile[0]
    return build_config(args.config, defaults, **overrides, strategy=strategy, out=args.out)


def preflight(config: RunConfig, profiles: list[str] | None = None) -> None:
    """Fail before anything starts: the data set is installed, the model and the partition fit it, the links
    exist, the submitter's certificate and key are there. The split is made once, here, into the partition cache
    (``ml.data.one_partition``) that the server and the devices on this machine then read, and so is the model's
    card (``ml.model_card``) that a server on this machine reads."""
    from edgefl.gateway import Submitter
    from ml.catalog import resolve_model
    from ml.data import load_dataset, one_partition
    from ml.model_card import model_card
    from netem.fleet import devices_for, links_for

    if config.federation == "simulation" and importlib.util.find_spec("ray") is None:
        raise ConfigError("--federation simulation needs Ray: pip install 'flwr[simulation]==1.42.0'")
    dataset = load_dataset(config.dataset, config.data_dir or None)
    resolve_model(config.model, dataset.kind, dataset.name)
    one_partition(dataset, config.partition_spec, config.clients, config.seed, 0)
    if config.federation != "remote":  # a remote run's server is another machine's
        model_card(dataset, config.seed, config.model)
    for profile in profiles or [config.profile]:
        links_for(dataclasses.replace(config, profile=profile))
    devices_for(config)
    if config.submitter_cert:
        Submitter.from_cert(Path(config.submitter_cert))


def cmd_run(args: argparse.Namespace) -> int:
    from edgefl.launcher import run

    if args.resume:  # the interrupted run's own settings
        config = dataclasses.replace(load_config(args.resume / CONFIG), out=str(args.resume))
    else:
        config = config_from_args(args)
    preflight(config)
    run_dir = run(config, resume=bool(args.resume))
    from edgefl.report import load_run, plot_single, table  # matplotlib: after the run, not before round 1

    plots = plot_single(run_dir)
    summary, _ = load_run(run_dir)
    print(table([summary]))
    print(f"results: {run_dir}  plots: {', '.join(str(p) for p in plots)}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from edgefl.compare import DEFAULT_PROFILES, DEFAULT_STRATEGIES, DEFAULTS, compare, estimates

    if args.seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {args.seeds}")
    base = config_from_args(args, DEFAULTS)
    names = (args.strategies or ",".join(DEFAULT_STRATEGIES)).split(",")
    strategies = [build_config_from({**base.as_dict(), "strategy": name}).strategy for name in names]  # each checked
    profiles = args.profile or (["loopback"] if base.federation == "remote" else list(DEFAULT_PROFILES))
    preflight(base, profiles)
    if base.federation == "local":
        for line in estimates(base, profiles):
            print(line, flush=True)
    text, plots = compare(base, strategies, profiles, seeds=args.seeds)
    print(text)
    print(f"report: {Path(base.out) / 'report.md'}  plots: {', '.join(str(p) for p in plots)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from edgefl.report import report

    text, plots = report(args.runs, args.out)
    print(text)
    print(f"plots: {', '.join(str(p) for p in plots)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgefl", description="Federated learning for edge devices on Flower.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run one federation on this machine (real SuperLink + SuperNodes)")
    add_run_options(p)
    p.add_argument("--out", help="results folder (default runs/default)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue an interrupted run from its last checkpoint, with its own settings")  # fmt: skip
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="several strategies on identical data, seeds and links; one report")
    add_run_options(p, several_profiles=True)
    p.add_argument("--strategies", help="comma-separated, e.g. fedavg,dga:4,fedprox:0.01,scaffold (default "
                   "fedavg,dga:2)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds each strategy runs over, from --seed on: means, 95%% intervals (default 1)")  # fmt: skip
    p.add_argument("--out", help="report folder (default runs/compare)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("report", help="one table and one plot across finished runs")
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("runs/report"))
    p.set_defaults(func=cmd_report)

    from edge.cli import register as register_edge
    from edgefl.remote import register as register_remote
    from netem.cli import register as register_netem

    register_netem(sub)
    register_edge(sub)
    register_remote(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    interrupt_on_signals()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgeflError as exc:
        print(f"edgefl: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("edgefl: interrupted; every process this run started has been stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

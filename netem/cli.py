"""``edgefl netem apply|show|clear|verify``: shape a real interface, or check profiles on a throwaway testbed.

The lead's ``edgefl/cli.py`` calls :func:`register`.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import sys
from collections.abc import Callable
from pathlib import Path

from netem import tc
from netem.profiles import Link, LinkError, load_links, resolve_links
from netem.testbed import Testbed
from netem.verify import LinkMeasurement, measure

Handler = Callable[[argparse.Namespace], int]


def _reporting_link_errors(action: Handler) -> Handler:
    """LinkError → one line on stderr and exit code 2."""

    @functools.wraps(action)
    def handler(args: argparse.Namespace) -> int:
        try:
            return action(args)
        except LinkError as error:
            print(f"edgefl netem: {error}", file=sys.stderr)
            return 2

    return handler


def _links(spec: str, count: int, profiles: Path | None) -> list[Link]:
    return resolve_links(spec, count, load_links(profiles) if profiles else None)


def _client_links(pairs: list[str], profiles: Path | None) -> dict[str, Link]:
    """``IP=PROFILE`` pairs → {ip: link}."""
    clients = {}
    for pair in pairs:
        ip, sep, name = pair.partition("=")
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            raise LinkError(f"--client expects IPv4=PROFILE, got {pair!r}") from None
        if not sep:
            raise LinkError(f"--client expects IPv4=PROFILE, got {pair!r}")
        (clients[ip],) = _links(name, 1, profiles)
    return clients


@_reporting_link_errors
def apply_command(args: argparse.Namespace) -> int:
    if args.client:
        clients = _client_links(args.client, args.profiles)
        tc.shape_clients(args.dev, clients)
        print(f"{args.dev}: shaped per client: " + ", ".join(f"{ip} {link.name}" for ip, link in clients.items()))
        return 0
    if not args.profile:
        raise LinkError("give --profile NAME (the whole interface) or --client IP=PROFILE (per client)")
    (link,) = _links(args.profile, 1, args.profiles)
    tc.apply(args.dev, link)
    print(f"{args.dev}: {link.name} applied ({link.source})")
    return 0


@_reporting_link_errors
def show_command(args: argparse.Namespace) -> int:
    print(tc.show(args.dev) or "no qdiscs")
    return 0


@_reporting_link_errors
def clear_command(args: argparse.Namespace) -> int:
    tc.clear(args.dev)
    print(f"{args.dev}: edgefl shaping removed")
    return 0


def _round_trip_loss_pct(link: Link) -> float:
    """Probe loss expected over a round trip: 1 - (1 - p_up)(1 - p_down)."""
    return 100 * (1 - (1 - link.up.loss_pct / 100) * (1 - link.down.loss_pct / 100))


def _rate(rate_mbit: float | None) -> str:
    return "-" if rate_mbit is None else f"{rate_mbit:g}"


TABLE_COLUMNS: list[tuple[str, Callable[[Link, LinkMeasurement], str]]] = [
    ("link", lambda link, m: link.name),
    ("RTT ms", lambda link, m: f"{link.rtt_ms:g}"),
    ("p50", lambda link, m: f"{m.rtt_p50_ms:.2f}"),
    ("p90", lambda link, m: f"{m.rtt_p90_ms:.2f}"),
    ("sd", lambda link, m: f"{m.rtt_sd_ms:.2f}"),
    ("loss %", lambda link, m: f"{_round_trip_loss_pct(link):.2g}"),
    ("measured", lambda link, m: f"{100 * m.loss_fraction:.2g}"),
    ("up Mbit/s", lambda link, m: _rate(link.up.rate_mbit)),
    ("measured", lambda link, m: f"{m.up_mbit:.1f}"),
    ("down Mbit/s", lambda link, m: _rate(link.down.rate_mbit)),
    ("measured", lambda link, m: f"{m.down_mbit:.1f}"),
]


def format_table(links: list[Link], measurements: list[LinkMeasurement]) -> str:
    """One row per client: each profile value followed by what was measured."""
    rows = [["client", *(title for title, _ in TABLE_COLUMNS)]]
    for i, (link, measured) in enumerate(zip(links, measurements, strict=True)):
        rows.append([str(i), *(cell(link, measured) for _, cell in TABLE_COLUMNS)])
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


@_reporting_link_errors
def verify_command(args: argparse.Namespace) -> int:
    clients = len(args.profile.split(",")) if args.clients is None else args.clients
    links = _links(args.profile, clients, args.profiles)
    with Testbed(links, tag=f"v{os.getpid()}") as testbed:
        print(f"testbed backend: {testbed.backend}; measuring {len(links)} link(s)...", flush=True)
        measurements = [measure(testbed, i) for i in range(len(links))]
    print(format_table(links, measurements))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``netem`` with its subcommands; each sets ``func`` to a handler returning the exit code."""
    netem = subparsers.add_parser("netem", help="shape links (netem) and verify link profiles")
    commands = netem.add_subparsers(dest="netem_command", required=True, metavar="COMMAND")

    apply = commands.add_parser("apply", help="shape an interface with a link profile (needs netem and root)")
    apply.add_argument("--dev", required=True, help="interface, e.g. eth0")
    apply.add_argument("--profile", help="link profile name for the whole interface, e.g. home-wifi")
    apply.add_argument("--client", action="append", metavar="IP=PROFILE",
                       help="server side: shape traffic to and from one client address (repeatable)")  # fmt: skip
    apply.add_argument("--profiles", type=Path, help="TOML file with your own link profiles")
    apply.set_defaults(func=apply_command)

    show = commands.add_parser("show", help="show qdiscs and classes")
    show.add_argument("--dev", help="interface (default: all)")
    show.set_defaults(func=show_command)

    clear = commands.add_parser("clear", help="remove edgefl's shaping from an interface")
    clear.add_argument("--dev", required=True, help="interface, e.g. eth0")
    clear.set_defaults(func=clear_command)

    verify = commands.add_parser("verify", help="measure link profiles on a throwaway namespaced testbed")
    verify.add_argument("--profile", required=True, help="a profile for all clients, or a,b,c: one per client")
    verify.add_argument("--clients", type=int, help="number of clients (default: one per profile given)")
    verify.add_argument("--profiles", type=Path, help="TOML file with your own link profiles")
    verify.set_defaults(func=verify_command)

"""Link profiles: what a client's link to the server looks like, one direction at a time.

User profiles live in a TOML file; each top-level table is one link, both directions are required and every
number except ``delay_ms`` is optional (defaults: no jitter, no loss, no rate limit, no correlation)::

    [home-dsl]
    source = "ping and iperf3 from the lab Pi to the server, 2024-05-02"

    [home-dsl.up]                # client -> server
    delay_ms = 12.0              # one way, milliseconds
    jitter_ms = 2.0              # uniform +-jitter around delay_ms, at most delay_ms
    loss_pct = 0.1               # percent of packets dropped, 0-100
    rate_mbit = 5                # megabit/s; leave out for no limit
    correlation_pct = 25         # how much each delay/loss draw depends on the previous one, 0-100

    [home-dsl.down]              # server -> client
    delay_ms = 12.0
    rate_mbit = 50
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from contract.errors import EdgeflError

MAX_DELAY_MS = 10_000.0
MAX_RATE_MBIT = 100_000.0  # 100 Gbit/s
_LINK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class LinkError(EdgeflError):
    """A link that cannot be used or set up; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link: delay ± uniform jitter (ms), random loss (%), optional rate cap (Mbit/s)."""

    delay_ms: float
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float | None = None
    correlation_pct: float = 0.0

    def __post_init__(self) -> None:
        _check_range("delay_ms", self.delay_ms, 0.0, MAX_DELAY_MS)
        _check_range("jitter_ms", self.jitter_ms, 0.0, MAX_DELAY_MS)
        if self.jitter_ms > self.delay_ms:
            raise LinkError(f"jitter_ms ({self.jitter_ms:g}) must not exceed delay_ms ({self.delay_ms:g})")
        _check_range("loss_pct", self.loss_pct, 0.0, 100.0)
        _check_range("correlation_pct", self.correlation_pct, 0.0, 100.0)
        if self.rate_mbit is not None:
            _check_range("rate_mbit", self.rate_mbit, 0.0, MAX_RATE_MBIT)
            if self.rate_mbit == 0:
                raise LinkError("rate_mbit must be above 0 (leave it out for no rate limit)")

    @property
    def shaped(self) -> bool:
        """Whether this direction differs from a plain wire."""
        return bool(self.delay_ms or self.jitter_ms or self.loss_pct or self.rate_mbit is not None)


@dataclass(frozen=True)
class Link:
    """A client's link to the server; ``up`` is client → server, ``down`` server → client."""

    name: str
    up: LinkProfile
    down: LinkProfile
    source: str

    def __post_init__(self) -> None:
        if not _LINK_NAME.fullmatch(self.name):
            raise LinkError(f"bad link name {self.name!r}: use letters, digits, '.', '_' and '-'")
        if not self.source.strip():
            raise LinkError(f"link {self.name!r} needs a source (where its numbers come from)")

    @property
    def shaped(self) -> bool:
        return self.up.shaped or self.down.shaped

    @property
    def rtt_ms(self) -> float:
        """Round-trip time the link adds: up delay + down delay."""
        return self.up.delay_ms + self.down.delay_ms


def _check_range(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LinkError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise LinkError(f"{name} must be between {low:g} and {high:g}, got {value:g}")


def _symmetric(name: str, profile: LinkProfile, source: str) -> Link:
    return Link(name, profile, profile, source)


_RURAL_LTE_UP = LinkProfile(delay_ms=50.0, jitter_ms=5.0, loss_pct=0.5, rate_mbit=1.0)
_RURAL_LTE_DOWN = LinkProfile(delay_ms=50.0, jitter_ms=5.0, loss_pct=0.5, rate_mbit=4.0)
_RURAL_LTE_SOURCE = (
    "Rural LTE/3G at the cell edge as regulators' mobile drive tests report it (e.g. Ofcom's Connected Nations "
    "rural figures): a few Mbit/s down, ~1 Mbit/s up, ~100 ms round trip, some loss; 1 up, 4 down, 50±5 ms "
    "each way, 0.5% loss, so that bandwidth binds"
)

BUILTIN_LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        _symmetric(
            "lan",
            LinkProfile(delay_ms=0.0),
            "MIT 6.5940 lectures: datacenter links ~100 Gb/s and ~1 µs, below what emulation adds: unshaped",
        ),
        Link(
            "home-wifi",
            up=LinkProfile(delay_ms=1.0, rate_mbit=15.0),
            down=LinkProfile(delay_ms=1.0, rate_mbit=30.0),
            source="Browser dev-tools 'Wi-Fi' preset: 30 Mbit/s down, 15 Mbit/s up, 2 ms latency "
            "(round trip, 1 ms each way)",
        ),
        _symmetric(
            "cellular-4g",
            LinkProfile(delay_ms=25.0, jitter_ms=5.0, loss_pct=1.0, rate_mbit=20.0),
            "Published FL testbed 4G profile: 50±10 ms, 20 Mbit/s, 1% loss on one shaped end; "
            "delay and jitter halved per direction because both directions are shaped",
        ),
        _symmetric(
            "long-distance",
            LinkProfile(delay_ms=150.0),
            "MIT 6.5940 lectures: Shanghai→Boston 162 ms, cross-world training 3.5–5.8x slower; "
            "~300 ms round trip, bandwidth left to the access link",
        ),
        _symmetric(
            "satellite",
            LinkProfile(delay_ms=300.0, jitter_ms=25.0, loss_pct=2.0, rate_mbit=5.0),
            "Published FL testbed satellite profile: 600±50 ms, 5 Mbit/s, 2% loss on one shaped end; "
            "delay and jitter halved per direction because both directions are shaped",
        ),
        Link("rural-lte", up=_RURAL_LTE_UP, down=_RURAL_LTE_DOWN, source=_RURAL_LTE_SOURCE),
        Link(
            "iot-uplink",
            up=LinkProfile(delay_ms=100.0, jitter_ms=10.0, loss_pct=1.0, rate_mbit=0.25),
            down=LinkProfile(delay_ms=100.0, jitter_ms=10.0, loss_pct=1.0, rate_mbit=1.0),
            source="LTE-M (3GPP Rel-13 Cat-M1): 1 Mbit/s peak each way, a few hundred kbit/s up in practice and "
            "100-200 ms latency: 0.25 Mbit/s up, 1 Mbit/s down, ~200 ms round trip, 1% loss",
        ),
        Link(
            "rural-lte-long",
            up=replace(_RURAL_LTE_UP, delay_ms=150.0),
            down=replace(_RURAL_LTE_DOWN, delay_ms=150.0),
            source="rural-lte's rates, jitter and loss with long-distance's 150 ms each way: a rural Pi "
            "talking to a server on another continent (~300 ms round trip)",
        ),
    )
}

_PROFILE_KEYS = {f.name for f in fields(LinkProfile)}


def _profile_from_toml(where: str, table: object) -> LinkProfile:
    if not isinstance(table, dict):
        raise LinkError(f"{where} must be a table of numbers like delay_ms = 20")
    unknown = sorted(set(table) - _PROFILE_KEYS)
    if unknown:
        raise LinkError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_PROFILE_KEYS))}")
    if "delay_ms" not in table:
        raise LinkError(f"{where} needs delay_ms")
    try:
        return LinkProfile(**table)
    except LinkError as error:
        raise LinkError(f"{where}: {error}") from None


def load_links(path: str | Path) -> dict[str, Link]:
    """Read user link profiles from a TOML file (format in this module's docstring)."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise LinkError(f"cannot read link profiles from {path}: {error.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise LinkError(f"{path} is not valid TOML: {error}") from None
    links: dict[str, Link] = {}
    for name, table in document.items():
        where = f"{path} [{name}]"
        if not isinstance(table, dict):
            raise LinkError(f"{where} must be a table with source, up and down")
        unknown = sorted(set(table) - {"source", "up", "down"})
        missing = sorted({"source", "up", "down"} - set(table))
        if unknown or missing:
            problem = f"unknown key {unknown[0]!r}" if unknown else f"missing {missing[0]!r}"
            raise LinkError(f"{where}: {problem} (a link has exactly source, up and down)")
        if not isinstance(table["source"], str):
            raise LinkError(f"{where}: source must be a string")
        up = _profile_from_toml(f"{where}.up", table["up"])
        down = _profile_from_toml(f"{where}.down", table["down"])
        try:
            links[name] = Link(name, up, down, table["source"])
        except LinkError as error:
            raise LinkError(f"{where}: {error}") from None
    return links


def resolve_links(spec: str, num_clients: int, extra: dict[str, Link] | None = None) -> list[Link]:
    """One link per client from ``"home-wifi"`` (all clients) or ``"lan,satellite"`` (in order, repeated over the
    clients when shorter).

    Profiles in ``extra`` (from :func:`load_links`) take precedence over built-ins of the same name.
    """
    if num_clients < 1:
        raise LinkError(f"need at least one client, got {num_clients}")
    known = {**BUILTIN_LINKS, **(extra or {})}
    names = [name.strip() for name in spec.split(",")]
    for name in names:
        if name not in known:
            shown = repr(name) if name else "an empty name"
            raise LinkError(f"unknown link profile {shown}; known: {', '.join(sorted(known))}")
    if len(names) > num_clients:
        raise LinkError(f"{len(names)} link profiles given for {num_clients} clients; give at most one per client")
    return [known[names[j % len(names)]] for j in range(num_clients)]

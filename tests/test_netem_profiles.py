"""Link profiles, their validation, and the tc requests built from them (no root, no kernel needed)."""

from __future__ import annotations

import argparse
import ipaddress
import math
from dataclasses import replace

import pytest
from pyroute2.iproute.linux import get_arguments_processor
from pyroute2.protocols import ETH_P_ALL, ETH_P_IP

from netem import cli, tc
from netem.profiles import BUILTIN_LINKS, Link, LinkError, LinkProfile, load_links, resolve_links
from netem.verify import LinkMeasurement

SATELLITE = BUILTIN_LINKS["satellite"]


def test_builtin_links_have_sources_and_the_required_round_trips() -> None:
    assert {"lan", "home-wifi", "cellular-4g", "long-distance", "satellite"} <= set(BUILTIN_LINKS)
    for name, link in BUILTIN_LINKS.items():
        assert link.name == name
        assert len(link.source) > 20
    assert BUILTIN_LINKS["long-distance"].up.delay_ms == BUILTIN_LINKS["long-distance"].down.delay_ms
    assert BUILTIN_LINKS["long-distance"].rtt_ms == pytest.approx(300, rel=0.1)
    assert not BUILTIN_LINKS["lan"].shaped
    assert all(link.shaped for name, link in BUILTIN_LINKS.items() if name != "lan")


@pytest.mark.parametrize(("name", "up", "down", "rtt"), [("rural-lte", 1, 4, 100), ("iot-uplink", 0.25, 1, 200),
                                                          ("rural-lte-long", 1, 4, 300)])  # fmt: skip
def test_bandwidth_bound_links_have_a_slow_uplink_and_loss_both_ways(name: str, up: float, down: float, rtt: float):
    link = BUILTIN_LINKS[name]
    assert (link.up.rate_mbit, link.down.rate_mbit, link.rtt_ms) == (up, down, rtt)
    assert link.up.loss_pct > 0 and link.down.loss_pct > 0 and link.up.jitter_ms > 0


def test_the_long_rural_link_differs_from_rural_lte_only_in_delay() -> None:
    rural, long = BUILTIN_LINKS["rural-lte"], BUILTIN_LINKS["rural-lte-long"]
    for near, far in ((rural.up, long.up), (rural.down, long.down)):
        assert replace(near, delay_ms=far.delay_ms) == far and far.delay_ms == 3 * near.delay_ms


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"delay_ms": -1.0}, "delay_ms"),
        ({"delay_ms": 10_001.0}, "delay_ms"),
        ({"delay_ms": math.nan}, "delay_ms"),
        ({"delay_ms": "20"}, "delay_ms"),
        ({"delay_ms": True}, "delay_ms"),
        ({"delay_ms": 10.0, "jitter_ms": 20.0}, "jitter_ms"),
        ({"delay_ms": 10.0, "jitter_ms": -1.0}, "jitter_ms"),
        ({"delay_ms": 10.0, "loss_pct": -0.1}, "loss_pct"),
        ({"delay_ms": 10.0, "loss_pct": 100.1}, "loss_pct"),
        ({"delay_ms": 10.0, "rate_mbit": 0.0}, "rate_mbit"),
        ({"delay_ms": 10.0, "rate_mbit": -5.0}, "rate_mbit"),
        ({"delay_ms": 10.0, "rate_mbit": 100_001.0}, "rate_mbit"),
        ({"delay_ms": 10.0, "rate_mbit": math.inf}, "rate_mbit"),
        ({"delay_ms": 10.0, "correlation_pct": 101.0}, "correlation_pct"),
    ],
)
def test_absurd_profile_values_raise_one_line_naming_the_field(fields: dict, complaint: str) -> None:
    with pytest.raises(LinkError, match=complaint) as raised:
        LinkProfile(**fields)
    assert "\n" not in str(raised.value)


def test_link_names_must_be_usable_in_a_comma_separated_spec() -> None:
    with pytest.raises(LinkError, match="bad link name"):
        Link("wifi,lan", SATELLITE.up, SATELLITE.down, "a source")
    with pytest.raises(LinkError, match="needs a source"):
        Link("wifi", SATELLITE.up, SATELLITE.down, " ")


USER_PROFILES = """
[home-dsl]
source = "ping and iperf3 from the lab Pi to the server"

[home-dsl.up]
delay_ms = 12
jitter_ms = 2.5
loss_pct = 0.1
rate_mbit = 5

[home-dsl.down]
delay_ms = 12
rate_mbit = 50
"""


def test_load_links_reads_the_documented_format(tmp_path) -> None:
    path = tmp_path / "links.toml"
    path.write_text(USER_PROFILES)
    links = load_links(path)
    assert links == {
        "home-dsl": Link(
            "home-dsl",
            LinkProfile(delay_ms=12, jitter_ms=2.5, loss_pct=0.1, rate_mbit=5),
            LinkProfile(delay_ms=12, rate_mbit=50),
            "ping and iperf3 from the lab Pi to the server",
        )
    }
    assert tc.netem_requests(links["home-dsl"].up)  # the numbers go through to tc


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        (USER_PROFILES.replace("jitter_ms", "jitter"), r"\[home-dsl\]\.up: unknown key 'jitter'"),
        (USER_PROFILES.replace("loss_pct = 0.1", "loss_pct = 120"), r"\[home-dsl\]\.up: loss_pct must be"),
        (USER_PROFILES.split("[home-dsl.down]")[0], "missing 'down'"),
        (USER_PROFILES.replace("delay_ms = 12\nrate_mbit = 50", "rate_mbit = 50"), "down needs delay_ms"),
        (USER_PROFILES.replace('source = "', "source = "), "not valid TOML"),
        ("[x]\nsource = 3\nup = {delay_ms = 1}\ndown = {delay_ms = 1}\n", "source must be a string"),
    ],
)
def test_load_links_rejects_bad_files_with_one_line_naming_the_place(tmp_path, text: str, complaint: str) -> None:
    path = tmp_path / "links.toml"
    path.write_text(text)
    with pytest.raises(LinkError, match=complaint) as raised:
        load_links(path)
    assert str(path) in str(raised.value)
    assert "\n" not in str(raised.value)


def test_load_links_on_a_missing_file(tmp_path) -> None:
    with pytest.raises(LinkError, match="cannot read link profiles"):
        load_links(tmp_path / "nope.toml")


def test_resolve_links_one_for_all_or_one_per_client() -> None:
    assert resolve_links("home-wifi", 3) == [BUILTIN_LINKS["home-wifi"]] * 3
    assert resolve_links(" lan, satellite ", 2) == [BUILTIN_LINKS["lan"], SATELLITE]
    assert resolve_links("lan,satellite", 5) == [BUILTIN_LINKS["lan"], SATELLITE] * 2 + [BUILTIN_LINKS["lan"]]


def test_resolve_links_prefers_user_profiles_over_builtins() -> None:
    mine = Link("lan", SATELLITE.up, SATELLITE.down, "my own lan measurement")
    assert resolve_links("lan", 1, {"lan": mine}) == [mine]


@pytest.mark.parametrize(
    ("spec", "clients", "complaint"),
    [
        ("wifi", 2, "unknown link profile 'wifi'; known: cellular-4g, home-wifi, iot-uplink, lan"),
        ("lan,,lan", 3, "unknown link profile an empty name"),
        ("lan,satellite,lan", 2, "3 link profiles given for 2 clients"),
        ("lan", 0, "at least one client"),
    ],
)
def test_resolve_links_errors(spec: str, clients: int, complaint: str) -> None:
    with pytest.raises(LinkError, match=complaint):
        resolve_links(spec, clients)


# --- tc requests -------------------------------------------------------------------------------------------


def test_unshaped_direction_needs_no_requests() -> None:
    assert tc.netem_requests(LinkProfile(delay_ms=0.0)) == []


def test_netem_root_takes_integer_microseconds_and_percent() -> None:
    profile = LinkProfile(delay_ms=25.5, jitter_ms=5.25, loss_pct=1.5)
    [(command, kind, kwargs)] = tc.netem_requests(profile)
    assert (command, kind) == ("add", "netem")
    assert kwargs["root"] is True and kwargs["handle"] == tc.ROOT_HANDLE
    assert kwargs["delay"] == 25_500 and isinstance(kwargs["delay"], int)
    assert kwargs["jitter"] == 5_250 and isinstance(kwargs["jitter"], int)
    assert kwargs["loss"] == 1.5
    assert "rate" not in kwargs
    assert "delay_corr" not in kwargs and "loss_corr" not in kwargs


def test_netem_queue_holds_a_gigabit_line_during_the_delay() -> None:
    [(_, _, kwargs)] = tc.netem_requests(LinkProfile(delay_ms=300.0))
    packets_in_flight = 1e9 / 8 / 1500 * 0.3
    assert kwargs["limit"] >= packets_in_flight


def test_rate_goes_to_a_tbf_child_of_netem() -> None:
    (_, _, netem), (command, kind, tbf) = tc.netem_requests(SATELLITE.up)
    assert "rate" not in netem
    assert (command, kind) == ("add", "tbf")
    assert tbf["parent"] == tc.ROOT_HANDLE | 1
    assert tbf["handle"] not in (tc.ROOT_HANDLE, 0)
    assert tbf["rate"] == f"{SATELLITE.up.rate_mbit * 1000:.0f}kbit"
    bytes_per_s = SATELLITE.up.rate_mbit * 1e6 / 8
    assert tbf["burst"] >= 2 * 1514
    assert tbf["limit"] >= bytes_per_s * 2 * SATELLITE.up.delay_ms / 1000  # one RTT of buffer


def test_rate_alone_is_a_tbf_root_that_needs_no_netem() -> None:
    [(command, kind, kwargs)] = tc.netem_requests(LinkProfile(delay_ms=0.0, rate_mbit=8.0))
    assert (command, kind) == ("add", "tbf")
    assert kwargs["root"] is True and kwargs["handle"] == tc.ROOT_HANDLE
    assert kwargs["rate"] == "8000kbit"
    assert kwargs["limit"] >= 8e6 / 8 * tc.MIN_QUEUE_MS / 1000


def test_correlation_applies_to_what_is_random() -> None:
    [(_, _, jitter_only)] = tc.netem_requests(LinkProfile(delay_ms=10.0, jitter_ms=2.0, correlation_pct=25.0))
    assert jitter_only["delay_corr"] == 25.0 and "loss_corr" not in jitter_only
    [(_, _, loss_only)] = tc.netem_requests(LinkProfile(delay_ms=10.0, loss_pct=2.0, correlation_pct=25.0))
    assert loss_only["loss_corr"] == 25.0 and "delay_corr" not in loss_only


def test_ingress_goes_through_an_ifb_by_a_match_all_u32_mirred_redirect() -> None:
    (qdisc, filter_) = tc.redirect_requests(ifb_index=7)
    assert qdisc[:2] == ("add", "ingress")
    command, kind, kwargs = filter_
    assert (command, kind) == ("add-filter", "u32")
    assert kwargs["parent"] == tc.INGRESS_HANDLE
    assert kwargs["protocol"] == ETH_P_ALL
    assert kwargs["keys"] == ["0x0/0x0+0"]
    assert kwargs["action"] == {"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": 7}


CLIENTS = {"10.1.2.3": SATELLITE, "192.168.0.20": BUILTIN_LINKS["home-wifi"]}


def test_per_client_shaping_is_htb_classes_with_netem_leaves_and_u32_by_address() -> None:
    egress, ingress = tc.client_shaping_requests(CLIENTS)
    for requests, offset, direction in ((egress, 16, "down"), (ingress, 12, "up")):
        (command, kind, root), *rest = requests
        assert (command, kind, root["handle"], root["default"]) == ("add", "htb", tc.ROOT_HANDLE, 0)
        classes = [kwargs for command, kind, kwargs in rest if command == "add-class"]
        leaves = [kwargs for command, kind, kwargs in rest if kind == "netem"]
        filters = [kwargs for command, kind, kwargs in rest if command == "add-filter"]
        assert len(classes) == len(leaves) == len(filters) == len(CLIENTS)
        assert len({c["handle"] for c in classes}) == len(CLIENTS)
        for (address, link), klass, leaf, match in zip(CLIENTS.items(), classes, leaves, filters, strict=True):
            profile = getattr(link, direction)
            assert klass["parent"] == tc.ROOT_HANDLE
            assert klass["rate"] == klass["ceil"] == f"{profile.rate_mbit * 1000:.0f}kbit"
            assert leaf["parent"] == klass["handle"]
            assert leaf["delay"] == round(profile.delay_ms * 1000)
            assert "rate" not in leaf
            assert match["target"] == klass["handle"] and match["protocol"] == ETH_P_IP
            assert match["keys"] == [f"{int(ipaddress.IPv4Address(address)):#010x}/0xffffffff+{offset}"]


def test_per_client_shaping_of_an_unlimited_client_uses_a_class_that_never_binds() -> None:
    egress, _ = tc.client_shaping_requests({"10.0.0.2": BUILTIN_LINKS["long-distance"]})
    [klass] = [kwargs for command, _, kwargs in egress if command == "add-class"]
    assert klass["rate"] == f"{tc.UNLIMITED_RATE_MBIT * 1000:.0f}kbit"


def test_per_client_shaping_rejects_non_ipv4_addresses() -> None:
    with pytest.raises(LinkError, match="'fe80::1' is not an IPv4 address"):
        tc.client_shaping_requests({"fe80::1": SATELLITE})


def test_every_request_passes_pyroute2_argument_processing_without_a_top_level_rate() -> None:
    """pyroute2 0.9.7 (pinned) turns a leftover top-level ``rate`` into TCA_RATE, which the kernel rejects."""
    egress, ingress = tc.client_shaping_requests(CLIENTS)
    requests = tc.netem_requests(SATELLITE.up) + tc.redirect_requests(3) + egress + ingress
    requests += tc.netem_requests(LinkProfile(delay_ms=0.0, rate_mbit=3.0))
    for command, kind, kwargs in requests:
        message = dict(get_arguments_processor("tc", command, {"kind": kind, "index": 1, **kwargs}))
        assert "rate" not in message, (command, kind)
        if kind != "ingress":
            assert message["options"], (command, kind)


# --- CLI (the parts that need no root) ---------------------------------------------------------------------


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edgefl")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_reports_a_link_error_on_one_line_and_exits_2(capsys) -> None:
    assert _run_cli(["netem", "verify", "--profile", "lan,warp-drive"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "unknown link profile 'warp-drive'" in captured.err


def test_cli_profiles_file_errors_are_one_line_too(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[x]\nsource = 'a'\nup = {delay_ms = -3}\ndown = {delay_ms = 1}\n")
    assert _run_cli(["netem", "apply", "--dev", "eth0", "--profile", "x", "--profiles", str(bad)]) == 2
    assert "delay_ms must be between" in capsys.readouterr().err


def test_verify_table_puts_each_profile_value_next_to_the_measurement() -> None:
    links = [SATELLITE, BUILTIN_LINKS["long-distance"]]
    measured = [
        LinkMeasurement(611.5, 640.0, 15.2, 0.041, 50, 0.7, 0.8),
        LinkMeasurement(300.1, 301.0, 0.4, 0.0, 50, 41.2, 41.7),
    ]
    header, satellite_row, distance_row = cli.format_table(links, measured).splitlines()
    assert header.split()[:3] == ["client", "link", "RTT"]
    expected = ["0", "satellite", "600", "611.50", "640.00", "15.20", "4", "4.1", "5", "0.7", "5", "0.8"]
    assert satellite_row.split() == expected
    assert distance_row.split()[1:4] == ["long-distance", "300", "300.10"]
    assert distance_row.split()[8] == "-"  # no rate limit in the profile

"""Link shaping on real hosts with the kernel's netem, through pyroute2 (never the ``tc`` binary).

Layout on a shaped interface ``dev`` (every root qdisc edgefl installs has handle ``ef1:``, which is how
:func:`clear` recognises its own work and refuses to touch anybody else's)::

    dev egress  : netem ef1: (delay, jitter, loss) [-> tbf ef2: (rate)]            the link's up profile
    dev ingress : ingress ffff: -> u32 match-all -> mirred redirect -> efl-ifb<index>
    ifb egress  : netem ef1: [-> tbf ef2:]                                           the link's down profile

A direction with only a rate gets a lone tbf root (it works on kernels without netem); an unshaped direction
gets nothing. netem's own ``rate`` is not used: pyroute2 0.9.7 sends it as a top-level TCA_RATE. Note that
netem sorts its queue by send time, so with jitter larger than the packet spacing it reorders packets (only
its own ``rate`` would keep them in order); the testbed's user-space forwarder (:mod:`netem.tunlink`) does not.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import os
from collections.abc import Iterator
from contextlib import contextmanager

from pyroute2 import IPRoute, NetlinkError, netns
from pyroute2.netlink.rtnl.tcmsg.common import tick_in_usec
from pyroute2.protocols import ETH_P_ALL, ETH_P_IP

from netem import contain_pyroute2_children
from netem.profiles import Link, LinkError, LinkProfile

Request = tuple[str, str, dict]

TC_H_ROOT = 0xFFFFFFFF
INGRESS_HANDLE = 0xFFFF0000
ROOT_HANDLE = 0xEF1 << 16  # "ef1:", the root qdisc of everything edgefl installs
RATE_CHILD_HANDLE = 0xEF2 << 16  # "ef2:", the tbf under a netem root
CLIENT_LEAF_MAJOR = 0x1000  # netem leaf of client i in shape_clients: "(1000+i):"
UNLIMITED_RATE_MBIT = 10_000.0  # htb classes need a rate; this one never binds
LINE_RATE_PPS = 1e9 / 8 / 1500  # full-size packets per second of a 1 Gbit/s line
MIN_QUEUE_MS = 50.0


def _kbit(rate_mbit: float) -> str:
    return f"{round(rate_mbit * 1000)}kbit"


def _burst_bytes(rate_mbit: float) -> int:
    """Token bucket depth: 4 ms at the rate, at least two full frames (tc-tbf: burst >= rate / HZ)."""
    return max(3028, round(rate_mbit * 1e6 / 8 * 0.004))


def _netem_options(profile: LinkProfile) -> dict:
    """netem's delay/jitter in integer µs, loss and correlations in percent.

    The queue limit holds everything a 1 Gbit/s line can put in flight during delay + jitter (netem's default
    of 1000 packets would drop on fast, long links).
    """
    options = {
        "delay": round(profile.delay_ms * 1000),
        "jitter": round(profile.jitter_ms * 1000),
        "loss": profile.loss_pct,
        "limit": 1000 + round(LINE_RATE_PPS * (profile.delay_ms + profile.jitter_ms) / 1000),
    }
    if profile.correlation_pct and profile.jitter_ms:
        options["delay_corr"] = profile.correlation_pct
    if profile.correlation_pct and profile.loss_pct:
        options["loss_corr"] = profile.correlation_pct
    return options


def _tbf_options(rate_mbit: float, delay_ms: float) -> dict:
    """tbf at ``rate_mbit`` whose queue holds max(50 ms, 2 x delay) of traffic.

    A bottleneck buffer of about one round trip (estimated as twice this direction's delay) lets loss-based
    TCP such as cubic keep the link busy, as the buffers of home routers and modems do.
    """
    burst = _burst_bytes(rate_mbit)
    queue_s = max(MIN_QUEUE_MS, 2 * delay_ms) / 1000
    return {"rate": _kbit(rate_mbit), "burst": burst, "limit": round(rate_mbit * 1e6 / 8 * queue_s) + burst}


def _needs_netem(profile: LinkProfile) -> bool:
    return bool(profile.delay_ms or profile.jitter_ms or profile.loss_pct)


def netem_requests(profile: LinkProfile) -> list[Request]:
    """The ``IPRoute.tc(command, kind, index=..., **kwargs)`` calls that shape one direction of one device."""
    if not profile.shaped:
        return []
    if not _needs_netem(profile):
        return [("add", "tbf", {"handle": ROOT_HANDLE, "root": True, **_tbf_options(profile.rate_mbit, 0.0)})]
    requests = [("add", "netem", {"handle": ROOT_HANDLE, "root": True, **_netem_options(profile)})]
    if profile.rate_mbit is not None:
        tbf = _tbf_options(profile.rate_mbit, profile.delay_ms)
        requests.append(("add", "tbf", {"parent": ROOT_HANDLE | 1, "handle": RATE_CHILD_HANDLE, **tbf}))
    return requests


def redirect_requests(ifb_index: int) -> list[Request]:
    """Send everything arriving on a device to the egress of ifb ``ifb_index`` (where it gets shaped)."""
    mirred = {"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": ifb_index}
    match_all = {
        "parent": INGRESS_HANDLE,
        "prio": 1,
        "protocol": ETH_P_ALL,
        "target": 0,
        "keys": ["0x0/0x0+0"],
    }
    return [("add", "ingress", {}), ("add-filter", "u32", {**match_all, "action": mirred})]


def _client_requests(addresses: list[str], profiles: list[LinkProfile], ip_offset: int) -> list[Request]:
    """htb root, per client a class (rate) with a netem leaf, and a u32 filter on the IP at ``ip_offset``."""
    requests = [("add", "htb", {"handle": ROOT_HANDLE, "root": True, "default": 0})]
    for i, (address, profile) in enumerate(zip(addresses, profiles, strict=True)):
        class_handle = ROOT_HANDLE | (i + 1)
        rate = _kbit(profile.rate_mbit or UNLIMITED_RATE_MBIT)
        burst = _burst_bytes(profile.rate_mbit or UNLIMITED_RATE_MBIT)
        requests.append(
            (
                "add-class",
                "htb",
                {"parent": ROOT_HANDLE, "handle": class_handle, "rate": rate, "ceil": rate, "burst": burst},
            )
        )
        if _needs_netem(profile):
            leaf = {
                "parent": class_handle,
                "handle": (CLIENT_LEAF_MAJOR + i) << 16,
                **_netem_options(profile),
            }
            requests.append(("add", "netem", leaf))
        key = f"0x{int(ipaddress.IPv4Address(address)):08x}/0xffffffff+{ip_offset}"
        match = {
            "parent": ROOT_HANDLE,
            "prio": 1,
            "protocol": ETH_P_IP,
            "target": class_handle,
            "keys": [key],
        }
        requests.append(("add-filter", "u32", match))
    return requests


def client_shaping_requests(clients: dict[str, Link]) -> tuple[list[Request], list[Request]]:
    """Server-side shaping per client IPv4 address: (egress requests by destination IP → each client's down
    profile, ifb requests by source IP → each client's up profile)."""
    for address in clients:
        try:
            ipaddress.IPv4Address(address)
        except ValueError:
            raise LinkError(f"client address {address!r} is not an IPv4 address") from None
    addresses = list(clients)
    egress = _client_requests(addresses, [link.down for link in clients.values()], ip_offset=16)
    ingress = _client_requests(addresses, [link.up for link in clients.values()], ip_offset=12)
    return egress, ingress


@contextmanager
def _iproute(namespace: str | None) -> Iterator[IPRoute]:
    contain_pyroute2_children()
    if namespace is not None and namespace not in netns.listnetns():
        raise LinkError(f"no network namespace {namespace!r}")
    with IPRoute(netns=namespace) as ip:
        yield ip


def _index(ip: IPRoute, dev: str, namespace: str | None) -> int:
    found = ip.link_lookup(ifname=dev)
    if not found:
        raise LinkError(f"no network interface {dev!r}" + (f" in namespace {namespace}" if namespace else ""))
    return found[0]


def _ifb_name(index: int) -> str:
    return f"efl-ifb{index}"


def _qdisc(ip: IPRoute, index: int, parent: int) -> dict | None:
    return next((q for q in ip.get_qdiscs(index=index) if q["parent"] == parent), None)


def _ingress(ip: IPRoute, index: int) -> dict | None:
    return next((q for q in ip.get_qdiscs(index=index) if q["handle"] == INGRESS_HANDLE), None)


def _netlink_error(error: NetlinkError, what: str, dev: str) -> LinkError:
    if error.code == errno.EPERM:
        return LinkError(f"shaping {dev} needs root (CAP_NET_ADMIN); it was left unchanged")
    if error.code == errno.ENOENT and what == "netem":
        return LinkError(
            f"this kernel has no netem (sch_netem): {dev} was left unchanged; "
            "try 'modprobe sch_netem', or use the namespaced testbed (tbf+tun backend)"
        )
    return LinkError(f"cannot add {what} on {dev}: {os.strerror(error.code)}; it was left unchanged")


def _run(ip: IPRoute, index: int, requests: list[Request], dev: str) -> None:
    for command, kind, kwargs in requests:
        try:
            ip.tc(command, kind, index=index, **kwargs)
        except NetlinkError as error:
            raise _netlink_error(error, kind, dev) from None


def _add_ifb(ip: IPRoute, index: int, dev: str) -> int:
    try:
        ip.link("add", ifname=_ifb_name(index), kind="ifb")
        ifb = ip.link_lookup(ifname=_ifb_name(index))[0]
        ip.link("set", index=ifb, state="up")
    except NetlinkError as error:
        raise _netlink_error(error, "an ifb device", dev) from None
    return ifb


def _check_not_foreign(ip: IPRoute, index: int, dev: str) -> None:
    root = _qdisc(ip, index, TC_H_ROOT)
    if root is not None and root["handle"] not in (0, ROOT_HANDLE):
        raise LinkError(
            f"{dev} has a {root.get_attr('TCA_KIND')} root qdisc that edgefl did not install; "
            f"remove it first (tc qdisc del dev {dev} root)"
        )
    if _ingress(ip, index) is not None and not ip.link_lookup(ifname=_ifb_name(index)):
        raise LinkError(f"{dev} has an ingress qdisc that edgefl did not install; remove it first")


def _remove_ours(ip: IPRoute, index: int) -> None:
    root = _qdisc(ip, index, TC_H_ROOT)
    if root is not None and root["handle"] == ROOT_HANDLE:
        ip.tc("del", index=index, handle=ROOT_HANDLE, root=True)
    ifb = ip.link_lookup(ifname=_ifb_name(index))
    if ifb:
        if _ingress(ip, index) is not None:
            ip.tc("del", "ingress", index=index)
        ip.link("del", index=ifb[0])


def _shape(dev: str, namespace: str | None, egress: list[Request], ifb_side: list[Request]) -> None:
    """Replace edgefl's shaping on ``dev``; on any failure remove what was added and raise LinkError."""
    with _iproute(namespace) as ip:
        index = _index(ip, dev, namespace)
        _check_not_foreign(ip, index, dev)
        _remove_ours(ip, index)
        try:
            _run(ip, index, egress, dev)
            if ifb_side:
                ifb = _add_ifb(ip, index, dev)
                _run(ip, ifb, ifb_side, dev)
                _run(ip, index, redirect_requests(ifb), dev)
        except BaseException:
            _remove_ours(ip, index)
            raise


def apply(dev: str, link: Link, namespace: str | None = None) -> None:
    """Shape ``dev``: egress with ``link.up``, ingress (through an ifb) with ``link.down``. Idempotent."""
    _shape(dev, namespace, netem_requests(link.up), netem_requests(link.down))


def shape_clients(dev: str, clients: dict[str, Link], namespace: str | None = None) -> None:
    """Shape a server's ``dev`` per client IPv4 address, so the clients need no root: traffic to a client gets
    its down profile, traffic from it (through an ifb) its up profile; other traffic passes unshaped."""
    egress, ingress = client_shaping_requests(clients)
    _shape(dev, namespace, egress, ingress)


def clear(dev: str, namespace: str | None = None) -> None:
    """Remove edgefl's root and ingress qdiscs and its ifb from ``dev``; anything else stays as it is."""
    with _iproute(namespace) as ip:
        index = _index(ip, dev, namespace)
        try:
            _remove_ours(ip, index)
        except NetlinkError as error:
            raise _netlink_error(error, "clear", dev) from None


def _handle(value: int) -> str:
    if value == TC_H_ROOT:
        return "root"
    major, minor = value >> 16, value & 0xFFFF
    return f"{major:x}:{minor:x}" if minor else f"{major:x}:"


def _details(kind: str, options: object) -> str:
    if options is None:
        return ""
    if kind == "netem":
        delay_ms = options["delay"] / tick_in_usec / 1000
        jitter_ms = options["jitter"] / tick_in_usec / 1000
        loss_pct = options["loss"] / 0xFFFFFFFF * 100
        return f" delay {delay_ms:g} ms ±{jitter_ms:g} ms loss {loss_pct:.3g}% limit {options['limit']}"
    if kind == "tbf":
        return f" rate {options.get_attr('TCA_TBF_PARMS')['rate'] * 8 / 1e6:g} Mbit/s"
    if kind == "htb" and options.get_attr("TCA_HTB_PARMS") is not None:
        parms = options.get_attr("TCA_HTB_PARMS")
        rate = options.get_attr("TCA_HTB_RATE64") or parms["rate"]
        return f" rate {rate * 8 / 1e6:g} Mbit/s"
    return ""


def _describe(ip: IPRoute, index: int, name: str) -> list[str]:
    lines = []
    for noun, entries in (("qdisc", ip.get_qdiscs(index=index)), ("class", ip.get_classes(index=index))):
        for entry in entries:
            kind = entry.get_attr("TCA_KIND")
            parent = "ingress" if entry["handle"] == INGRESS_HANDLE else _handle(entry["parent"])
            details = _details(kind, entry.get_attr("TCA_OPTIONS"))
            lines.append(f"{name}: {noun} {kind} {_handle(entry['handle'])} parent {parent}{details}")
    return lines


def show(dev: str | None = None, namespace: str | None = None) -> str:
    """Qdiscs and classes of ``dev`` and its edgefl ifb (all interfaces when ``dev`` is None)."""
    with _iproute(namespace) as ip:
        if dev is None:
            devices = [(link["index"], link.get_attr("IFLA_IFNAME")) for link in ip.get_links()]
        else:
            index = _index(ip, dev, namespace)
            devices = [(index, dev)]
            devices += [(ifb, _ifb_name(index)) for ifb in ip.link_lookup(ifname=_ifb_name(index))]
        return "\n".join(line for index, name in devices for line in _describe(ip, index, name))


@functools.cache
def kernel_has_netem() -> bool:
    """Try a netem qdisc on a veth inside a throwaway namespace (removed afterwards)."""
    probe = f"efl-probe{os.getpid()}"
    contain_pyroute2_children()
    try:
        netns.create(probe)
    except OSError as error:
        raise LinkError(f"probing for netem needs root (network namespaces): {error.strerror}") from None
    try:
        with IPRoute(netns=probe) as ip:
            ip.link("add", ifname="probe0", kind="veth", peer={"ifname": "probe1"})
            try:
                ip.tc("add", "netem", index=ip.link_lookup(ifname="probe0")[0], delay=1000)
            except NetlinkError as error:
                if error.code == errno.ENOENT:
                    return False
                raise
            return True
    finally:
        netns.remove(probe)

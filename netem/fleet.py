"""A run's fleet: each client's link and emulated device, from its settings (``--profile``, ``--device-profile``).

Either setting is one name for every client or a comma-separated list given in order, repeated over the
clients when shorter (client j takes entry j mod k): ``rpi3,rpi4,laptop`` over 100 clients is a mixed fleet.
The testbed applies them (``edgefl.launcher``); a simulation's clock models them (``netem.clock``)."""

from __future__ import annotations

from contract.devices import DeviceProfile, device_profile
from contract.settings import ConfigError, RunConfig
from netem.profiles import Link, load_links, resolve_links


def links_for(config: RunConfig) -> list[Link] | None:
    """The clients' links, or None for plain loopback; raises LinkError for unknown or invalid profiles."""
    if config.profile == "loopback":
        return None
    extra = load_links(config.profiles_file) if config.profiles_file else None
    return resolve_links(config.profile, config.clients, extra)


def devices_for(config: RunConfig) -> list[DeviceProfile]:
    """One emulated device per client; raises ConfigError for more names than clients, DeviceError for unknown."""
    names = [name.strip() for name in config.device_profile.split(",")]
    if len(names) > config.clients:
        raise ConfigError(f"{len(names)} device profiles for {config.clients} clients; give at most one per client")
    profiles = [device_profile(name) for name in names]
    return [profiles[j % len(profiles)] for j in range(config.clients)]

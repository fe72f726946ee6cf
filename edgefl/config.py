"""One run's settings: defaults, a TOML file (``--config``), then command-line flags, in that order.

The resolved config is written to ``runs/NAME/config.toml``; it is the single source every process of the run
reads (the ServerApp loads it by path), and it can be fed back with ``--config`` to repeat the run."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import tomli_w

from contract.settings import ClientJob
from strategies.codecs import parse_codec
from strategies.spec import StrategyError, StrategySpec, parse_strategy

LR_SCHEDULES = ("constant", "cosine")  # see edge.trainer.scheduled_lr


class ConfigError(ValueError):
    """A setting that cannot be used; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class RunConfig:
    strategy: str = "fedavg"
    dataset: str = "fashion-mnist"
    partition: str = "dirichlet:0.3"
    clients: int = 4
    rounds: int = 20
    local_steps: int = 20
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    lr_schedule: str = "constant"  # or "cosine": decays over the run's rounds (edge.trainer.scheduled_lr)
    seed: int = 0
    target_accuracy: float | None = None
    out: str = "runs/default"
    data_dir: str = ""
    profile: str = "loopback"
    profiles_file: str = ""
    device_profile: str = "laptop"
    link_backend: str = "loopback"
    compress: str = "none"
    compress_down: str = "none"  # codec of the global model's deltas sent to clients (strategies.downlink)
    quorum: float = 0.5
    round_deadline_s: float = 120.0
    port: int = 0
    aggregate: str = "mean"  # mean | median | trimmed-mean:BETA | krum:F (fl_server.robust)
    eval_examples: int = 0  # server-side evaluation on this many test examples (a fixed sample); 0 = all
    federation: str = "local"  # local: this machine starts every process | remote: submit to a running SuperLink
    server: str = ""  # remote: the SuperLink's HOST:PORT
    root_cert: str = ""  # remote: the CA certificate (PEM) that signed the SuperLink's certificate
    insecure: bool = False  # remote: plain-text connection to a SuperLink started with --insecure

    @property
    def strategy_spec(self) -> StrategySpec:
        return parse_strategy(self.strategy)

    @property
    def name(self) -> str:
        return Path(self.out).name


_FIELDS = {f.name: f for f in fields(RunConfig)}
FEDERATIONS = ("local", "remote")


def _check(config: RunConfig) -> RunConfig:
    try:
        spec = parse_strategy(config.strategy)
        parse_codec(config.compress)
        parse_codec(config.compress_down)
        from fl_server.robust import make_aggregator  # imports Flower: only when a config is checked

        make_aggregator(config.aggregate)
    except (StrategyError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    positive = {
        "clients": config.clients,
        "rounds": config.rounds,
        "local_steps": config.local_steps,
        "batch_size": config.batch_size,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key.replace('_', '-')} must be at least 1, got {value}")
    if not config.lr > 0:
        raise ConfigError(f"lr must be positive, got {config.lr}")
    if not 0 <= config.momentum < 1:
        raise ConfigError(f"momentum must be in [0, 1), got {config.momentum}")
    if config.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr-schedule {config.lr_schedule!r}; use {' or '.join(LR_SCHEDULES)}")
    if config.eval_examples < 0:
        raise ConfigError(f"eval-examples must be 0 (all) or positive, got {config.eval_examples}")
    if config.target_accuracy is not None and not 0 < config.target_accuracy <= 1:
        raise ConfigError(f"target-accuracy must be in (0, 1], got {config.target_accuracy}")
    if not 0 < config.quorum <= 1:
        raise ConfigError(f"quorum must be in (0, 1], got {config.quorum}")
    if config.round_deadline_s <= 0:
        raise ConfigError(f"round-deadline-s must be positive, got {config.round_deadline_s}")
    if not 0 <= config.port < 65536:
        raise ConfigError(f"port must be in 0..65535, got {config.port}")
    # The canonical spelling, so that a resolved config names DGA as dga:D.
    _check_federation(config)
    return dataclasses.replace(config, strategy=spec.label)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as (host, port); raises ConfigError."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{address!r} is not HOST:PORT with a port in 1..65535")
    return host, int(port)


def _check_federation(config: RunConfig) -> None:
    if config.federation not in FEDERATIONS:
        raise ConfigError(f"unknown federation {config.federation!r}: use {' or '.join(FEDERATIONS)}")
    if config.federation == "local":
        if config.server or config.root_cert or config.insecure:
            raise ConfigError("--server, --root-cert and --insecure are for --federation remote")
        return
    if not config.server:
        raise ConfigError("--federation remote needs --server HOST:PORT")
    parse_address(config.server)
    if config.root_cert and config.insecure:
        raise ConfigError("give --root-cert (TLS) or --insecure (plain text), not both")
    if not (config.root_cert or config.insecure):
        raise ConfigError("--federation remote needs --root-cert FILE (the server's CA certificate) or --insecure")
    if config.profile != "loopback":
        raise ConfigError("link profiles shape the local testbed; a remote federation runs over the real network")
    if config.device_profile != "laptop":
        raise ConfigError("device profiles emulate local clients; a remote federation's devices are real")


def _coerce(key: str, value: Any) -> Any:
    field = _FIELDS[key]
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{key.replace('_', '-')} cannot be empty")
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key.replace('_', '-')} must be true or false, got {value!r}")
        return value
    try:
        if kind.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key.replace('_', '-')} must be a number, got {value!r}") from None
    return str(value)


def build_config(file: str | Path | None = None, defaults: dict[str, Any] | None = None, **overrides: Any) -> RunConfig:
    """RunConfig's defaults ← ``defaults`` (a command's own) ← TOML file ← overrides (None: 'not given')."""
    values: dict[str, Any] = dict(defaults or {})
    if file is not None:
        values.update(load_toml(file))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return _check(RunConfig(**{key: _coerce(key, value) for key, value in values.items()}))


def load_toml(file: str | Path) -> dict[str, Any]:
    path = Path(file)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting {unknown[0]!r}")
    return values


def save_config(config: RunConfig, path: Path) -> None:
    data = {k.replace("_", "-"): v for k, v in dataclasses.asdict(config).items() if v is not None}
    path.write_text(tomli_w.dumps(data))


def load_config(path: Path) -> RunConfig:
    return build_config(path)


def client_job(config: RunConfig) -> ClientJob:
    """What every client needs to know to train this run."""
    spec = config.strategy_spec
    return ClientJob(
        run=config.name, dataset=config.dataset, data_dir=config.data_dir, partition=config.partition,
        seed=config.seed, rounds=config.rounds, local_steps=config.local_steps, batch_size=config.batch_size,
        lr=config.lr, momentum=config.momentum, lr_schedule=config.lr_schedule, delay=spec.delay,
        correction=spec.correction, codec=config.compress,
    )  # fmt: skip

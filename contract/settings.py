"""A run's settings as typed records, the one home both ends import: ``RunConfig`` (what the server and the
command read) and ``ClientJob`` (what every device is told). Defaults, then a TOML file (``--config``), then
command-line flags, in that order; every ``NAME:VALUE`` setting is parsed once, when the record is made, into
its spec (``RunConfig.strategy_spec``, ``codec_spec``, ...), which is what travels.

The resolved config is written to ``runs/NAME/config.toml`` and can be fed back with ``--config`` to repeat the
run; the ServerApp receives it in the app's run config (``RunConfig.to_run_config``), so it needs no file."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w

from contract.errors import EdgeflError, PeerError
from ml.catalog import DATASET_KINDS, PARTITIONS, ModelError, check_model_for, resolve_model
from strategies.codecs import CodecSpec, parse_codec
from strategies.registry import app_of, mean_only, parse_strategy
from strategies.rounds import most_in_flight, pipeline_window
from strategies.sampling import Sampler, parse_clients_per_round
from strategies.spec import Spec, label, parse_aggregate, parse_spec
from strategies.strategy import StrategySettings

LR_SCHEDULES = ("constant", "cosine")  # see ml.schedule.scheduled_lr
FEDERATIONS = ("local", "remote", "simulation")


class ConfigError(EdgeflError, ValueError):
    """A setting that cannot be used; ``str()`` is one line for the user."""


class JobError(PeerError, ValueError):
    """A job from the server (``ClientJob.from_json``) that a device cannot take; ``str()`` is the one-line
    reason."""


@dataclass(frozen=True)
class RunConfig:
    strategy: str = "fedavg"
    dataset: str = "fashion-mnist"
    model: str = "auto"  # a name in ml.catalog.MODELS, or auto: the data set's small model
    partition: str = "dirichlet:0.3"
    clients: int = 4
    clients_per_round: str = "all"  # all | a count M | a fraction of the clients (strategies.sampling)
    rounds: int = 20
    local_steps: int = 20
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    lr_schedule: str = "constant"  # or "cosine": decays over the run's rounds (ml.schedule.scheduled_lr)
    seed: int = 0
    target_accuracy: float | None = None
    out: str = "runs/default"
    data_dir: str = ""
    profile: str = "loopback"
    profiles_file: str = ""
    device_profile: str = "laptop"
    link_backend: str = "loopback"  # recorded by the launcher: how the links were emulated
    device_backend: str = "none"  # recorded by the launcher: how the devices were emulated (edgefl.launcher)
    compress: str = "none"
    compress_down: str = "none"  # codec of the global model's deltas sent to clients (strategies.downlink)
    quorum: float = 0.5
    round_deadline_s: float = 120.0
    port: int = 0
    aggregate: str = "mean"  # mean | median | trimmed-mean:BETA | krum:F | centered-clip:TAU [:nnm] (fl_server.robust)
    eval_examples: int = 0  # server-side evaluation on this many test examples (a fixed sample); 0 = all
    eval_every: int = 1  # evaluate the global model every this many rounds (and after the last)
    federation: str = "local"  # local: this machine starts every process | remote: submit to a running SuperLink
    server: str = ""  # remote: the SuperLink's HOST:PORT
    root_cert: str = ""  # remote: the CA certificate (PEM) that signed the SuperLink's certificate
    insecure: bool = False  # remote: plain-text connection to a SuperLink started with --insecure
    submitter_cert: str = ""  # remote over TLS: this submitter's certificate (its key beside it), edgefl.gateway
    connect_timeout_s: float = 30.0  # remote: how long the SuperLink may stay unreachable before the run gives up
    ray_address: str = ""  # simulation: a Ray cluster to join (auto | HOST:PORT); "" starts Ray on this machine
    clock_step_s: float = 0.0  # simulation: the virtual clock's seconds per local step on one core; 0: measure here
    # Parsed once, from the fields above, when the record is made:
    strategy_spec: StrategySettings = field(init=False, repr=False, compare=False)
    codec_spec: CodecSpec = field(init=False, repr=False, compare=False)
    downlink_spec: CodecSpec = field(init=False, repr=False, compare=False)
    aggregate_spec: Spec = field(init=False, repr=False, compare=False)
    partition_spec: Spec = field(init=False, repr=False, compare=False)  # what ml.data and ml.partition take
    per_round: int = field(init=False, repr=False, compare=False)  # clients_per_round as a count

    def __post_init__(self) -> None:
        """Parse the specs, and write the strategy, codecs and partition in their canonical form (dga:D,
        topk:0.01, dirichlet:0.3)."""
        parsed = {
            "strategy_spec": parse_strategy(self.strategy),
            "codec_spec": parse_codec(self.compress),
            "downlink_spec": parse_codec(self.compress_down),
            "aggregate_spec": parse_aggregate(self.aggregate),
            "partition_spec": parse_partition(self.partition),
            "per_round": parse_clients_per_round(self.clients_per_round, max(1, self.clients)),
        }
        for name, value in parsed.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "strategy", parsed["strategy_spec"].label)
        object.__setattr__(self, "compress", parsed["codec_spec"].label)
        object.__setattr__(self, "compress_down", parsed["downlink_spec"].label)
        object.__setattr__(self, "partition", label(parsed["partition_spec"].name, parsed["partition_spec"].value))

    @property
    def name(self) -> str:
        return Path(self.out).name

    @property
    def step_key(self) -> tuple[str, str, int]:
        """(model, data set, batch size), the model's name resolved from ``auto``: what a device profile file's
        measured training step must be of for the clock to take it (``contract.devices.DeviceProfile.step_s``)."""
        kind = DATASET_KINDS.get(self.dataset)
        model = resolve_model(self.model, kind, self.dataset).name if kind else self.model
        return model, self.dataset, self.batch_size

    def evaluates(self, round_: int) -> bool:
        """Whether the global model after ``round_`` is evaluated: every ``eval_every`` rounds and the last."""
        return round_ % self.eval_every == 0 or round_ >= self.rounds

    def as_dict(self) -> dict[str, Any]:
        """The settings as written (keys with underscores), without the parsed specs."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def client_job(self) -> ClientJob:
        """What every client needs to know to train this run."""
        return ClientJob(
            run=self.name, dataset=self.dataset, model=self.model, data_dir=self.data_dir, partition=self.partition,
            clients=self.clients, clients_per_round=self.per_round, seed=self.seed, rounds=self.rounds,
            local_steps=self.local_steps, batch_size=self.batch_size, lr=self.lr, momentum=self.momentum,
            lr_schedule=self.lr_schedule, strategy=self.strategy, compress=self.compress,
        )  # fmt: skip

    def to_run_config(self) -> dict[str, str]:
        """The record as the app's Flower run config (one TOML string), which Flower hands the ServerApp."""
        return {"edgefl-config": tomli_w.dumps(_toml_values(self))}

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunConfig:
        return build_config_from(tomllib.loads(str(run_config["edgefl-config"])))


@dataclass(frozen=True)
class ClientJob:
    """What a device needs to train one run; every message carries it as JSON, the device parses it once."""

    run: str
    dataset: str
    model: str  # ml.catalog: a model name, or auto
    data_dir: str
    partition: str
    clients: int  # the run's number of partitions: a device of another split is refused
    clients_per_round: int  # M: round t trains strategies.sampling.Sampler's sample of M partitions
    seed: int
    rounds: int
    local_steps: int
    batch_size: int
    lr: float
    momentum: float
    lr_schedule: str
    strategy: str  # the run's --strategy, as RunConfig writes it (strategies.registry)
    compress: str
    strategy_spec: StrategySettings = field(init=False, repr=False, compare=False)
    codec_spec: CodecSpec = field(init=False, repr=False, compare=False)
    partition_spec: Spec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy_spec", parse_strategy(self.strategy))
        object.__setattr__(self, "codec_spec", parse_codec(self.compress))
        object.__setattr__(self, "partition_spec", parse_partition(self.partition))

    def sampler(self) -> Sampler:
        return Sampler(self.seed, self.clients, self.clients_per_round)

    @property
    def window(self) -> int:
        """Messages the server keeps in flight at each device of this run (``strategies.rounds.pipeline_window``)."""
        spec = self.strategy_spec
        return pipeline_window(spec.delay, spec.buffer, self.sampler().everyone)

    @property
    def most_held(self) -> int:
        """The most messages a device of this run holds at once (``strategies.rounds.most_in_flight``)."""
        return most_in_flight(self.window)

    @property
    def local_momentum(self) -> float:
        """The momentum of the device's optimizer: none where the codec keeps it elsewhere (``plain_sgd``)."""
        return 0.0 if self.codec_spec.plain_sgd else self.momentum

    def as_dict(self) -> dict[str, Any]:
        """Keys as users write them (``local-steps``)."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self) if f.init}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClientJob:
        """Raises JobError (a ValueError) for anything but exactly this record's keys with values of its types."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise JobError("the job is not a JSON object")
        values = {key.replace("-", "_"): value for key, value in raw.items()}
        kinds = {f.name: f.type for f in fields(cls) if f.init}
        if set(values) != set(kinds):
            raise JobError(f"the job's keys {sorted(values)} are not {sorted(kinds)}")
        for name, kind in kinds.items():
            value = values[name]
            ok = {"str": isinstance(value, str), "bool": isinstance(value, bool)}.get(
                kind, isinstance(value, int | float) and not isinstance(value, bool)
            )
            if not ok or (kind == "int" and not float(value).is_integer()):
                raise JobError(f"the job's {name.replace('_', '-')} is {value!r}, not a {kind}")
        return cls(**{k: int(v) if kinds[k] == "int" else v for k, v in values.items()})


_FIELDS = {f.name: f for f in fields(RunConfig) if f.init}


def parse_partition(text: str) -> Spec:
    """A partition scheme (``--partition``: iid, dirichlet:ALPHA, pathological:K, natural; ``ml.catalog``) as the
    Spec ``ml.data`` and ``ml.partition`` take; raises SpecError, one line."""
    return parse_spec(text, "partition", PARTITIONS)


def _check(config: RunConfig) -> RunConfig:
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
    try:
        check_model_for(config.model, config.dataset)
    except ModelError as exc:
        raise ConfigError(str(exc)) from None
    if config.eval_every < 1:
        raise ConfigError(f"eval-every must be at least 1, got {config.eval_every}")
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
    flower = app_of(config.strategy_spec) == "flower"
    if flower and (config.compress, config.compress_down) != ("none", "none"):
        raise ConfigError("flower-fedavg is Flower's own FedAvg and sends dense arrays: drop --compress and "
                          "--compress-down")  # fmt: skip
    if flower and config.federation == "simulation":
        raise ConfigError("flower-fedavg runs Flower's own apps in a deployment; a simulation runs edgefl's fedavg")
    if config.strategy_spec.buffer > config.per_round:
        raise ConfigError(f"{config.strategy} buffers {config.strategy_spec.buffer} updates a step, more than the "
                          f"{config.per_round} clients a round samples")  # fmt: skip
    if (why := mean_only(config.strategy_spec)) and config.aggregate_spec.name != "mean":
        raise ConfigError(f"{config.strategy} {why}: it takes --aggregate mean, not {config.aggregate}")
    if config.downlink_spec.global_momentum is not None:
        raise ConfigError(f"gm=BETA is global momentum on the clients' updates: put it on --compress, not on "
                          f"--compress-down {config.compress_down!r}")  # fmt: skip
    _check_federation(config)
    return config


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
    if config.federation != "simulation" and (config.ray_address or config.clock_step_s):
        raise ConfigError("--ray-address and --clock-step-s are for --federation simulation")
    if config.clock_step_s < 0:
        raise ConfigError(f"clock-step-s must not be negative (0: measured on this host), got {config.clock_step_s}")
    if not config.connect_timeout_s > 0:
        raise ConfigError(f"connect-timeout must be positive, got {config.connect_timeout_s:g}")
    if config.federation in ("local", "simulation"):
        if config.server or config.root_cert or config.insecure or config.submitter_cert:
            raise ConfigError("--server, --root-cert, --submitter-cert and --insecure are for --federation remote")
        return
    if not config.server:
        raise ConfigError("--federation remote needs --server HOST:PORT")
    parse_address(config.server)
    if config.root_cert and config.insecure:
        raise ConfigError("give --root-cert (TLS) or --insecure (plain text), not both")
    if not (config.root_cert or config.insecure):
        raise ConfigError("--federation remote needs --root-cert FILE (the server's CA certificate) or --insecure")
    if config.root_cert and not config.submitter_cert:
        raise ConfigError(
            "a TLS server takes runs only from a submitter: give --submitter-cert FILE (edgefl certs --submitters N)"
        )
    if config.insecure and config.submitter_cert:
        raise ConfigError("--submitter-cert needs TLS: give --root-cert instead of --insecure")
    if config.profile != "loopback":
        raise ConfigError("link profiles shape the local testbed; a remote federation runs over the real network")
    if config.device_profile != "laptop":
        raise ConfigError("device profiles emulate local clients; a remote federation's devices are real")


def _coerce(key: str, value: Any) -> Any:
    field_ = _FIELDS[key]
    kind = field_.type if isinstance(field_.type, str) else field_.type.__name__
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
                raise ConfigError(f"{key.replace('_', '-')} must be a number, got {value!r}")
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key.replace('_', '-')} must be a number, got {value!r}") from None
    return str(value)


def build_config_from(values: dict[str, Any]) -> RunConfig:
    """A checked RunConfig from settings written with ``-`` or ``_`` in their keys."""
    values = {key.replace("-", "_"): value for key, value in values.items()}
    if unknown := sorted(set(values) - set(_FIELDS)):
        raise ConfigError(f"unknown setting {unknown[0]!r}")
    return _check(RunConfig(**{key: _coerce(key, value) for key, value in values.items()}))


def build_config(file: str | Path | None = None, defaults: dict[str, Any] | None = None, **overrides: Any) -> RunConfig:
    """RunConfig's defaults ← ``defaults`` (a command's own) ← TOML file ← overrides (None: 'not given')."""
    values: dict[str, Any] = dict(defaults or {})
    if file is not None:
        values.update(load_toml(file))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return build_config_from(values)


def load_toml(file: str | Path) -> dict[str, Any]:
    path = Path(file)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    if unknown := sorted(set(values) - set(_FIELDS)):
        raise ConfigError(f"config file {path}: unknown setting {unknown[0]!r}")
    return values


def _toml_values(config: RunConfig) -> dict[str, Any]:
    return {k.replace("_", "-"): v for k, v in config.as_dict().items() if v is not None}


def save_config(config: RunConfig, path: Path) -> None:
    path.write_text(tomli_w.dumps(_toml_values(config)))


def load_config(path: Path) -> RunConfig:
    return build_config(path)

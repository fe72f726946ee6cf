"""Settings written ``NAME`` or ``NAME:VALUE[:OPTION...]`` — a strategy (``dga:2``), a codec (``topk:0.01``), an
aggregation rule (``krum:1``), a partition (``dirichlet:0.3``) — parsed by one function against each setting's
table of names, so that every such setting says the same thing about the same mistake."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from contract.errors import EdgeflError


class SpecError(EdgeflError, ValueError):
    """A ``NAME:VALUE`` setting that cannot be used; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class Parameter:
    """The VALUE of a ``NAME:VALUE`` setting: what it must be, in words, and the test it must pass."""

    what: str
    valid: Callable[[float], bool]
    integer: bool = False


@dataclass(frozen=True)
class Spec:
    name: str
    value: float | None = None  # None for a name without a parameter
    options: tuple[str, ...] = ()


def parse_spec(text: str, setting: str, table: Mapping[str, Parameter | None], options: bool = False) -> Spec:
    """``text`` against ``table`` (name → its parameter, None for none); ``options``: whether anything may
    follow the value (the caller checks it). Raises SpecError naming ``setting``."""
    name, *args = text.strip().lower().split(":")
    if name not in table:
        raise SpecError(f"unknown {setting} {text!r}; known: {', '.join(_forms(table))}")
    parameter = table[name]
    if parameter is None:
        if args and not options:
            raise SpecError(f"{setting} {name!r} takes no parameter, got {text!r}")
        return Spec(name, None, tuple(args))
    value = _number(args[0]) if args else None
    if value is None or not parameter.valid(value) or (parameter.integer and not value.is_integer()):
        raise SpecError(f"{setting} {name!r} needs {parameter.what} as in '{name}:VALUE', got {text!r}")
    if len(args) > 1 and not options:
        raise SpecError(f"{setting} {name!r} takes one parameter, got {text!r}")
    return Spec(name, value, tuple(args[1:]))


def _forms(table: Mapping[str, Parameter | None]) -> list[str]:
    return [name if parameter is None else f"{name}:VALUE" for name, parameter in table.items()]


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def label(name: str, value: float | None, *options: str) -> str:
    """The canonical text of a spec: ``dga:2``, ``topk:0.01``, ``dgc:0.999:momentum``."""
    parts = [name] if value is None else [name, f"{int(value)}" if float(value).is_integer() else f"{value:g}"]
    return ":".join([*parts, *options])


# ----- the strategy ---------------------------------------------------------------------------------------------
MAX_DELAY = 64
STRATEGIES: dict[str, Parameter | None] = {
    "fedavg": None,
    "dga": Parameter(f"a whole number of rounds D in 0..{MAX_DELAY}", lambda d: 0 <= d <= MAX_DELAY, integer=True),
    "flower-fedavg": None,
    "fedbuff": Parameter("a buffer of K ≥ 1 updates per server step", lambda k: k >= 1, integer=True),
}


@dataclass(frozen=True)
class StrategySpec:
    """``delay`` is DGA's D (0 for FedAvg); ``correction`` is off only in the DGA ablation; ``buffer`` is FedBuff's
    K (0: synchronous rounds) and ``server_lr`` its η_g (``strategies.fedbuff``)."""

    name: str
    delay: int = 0
    correction: bool = True
    buffer: int = 0
    server_lr: float = 1.0

    @property
    def label(self) -> str:
        if self.name == "dga":
            return label("dga", self.delay, *([] if self.correction else ["nocorrection"]))
        if self.name == "fedbuff":
            return label("fedbuff", self.buffer, *([] if self.server_lr == 1.0 else [f"slr={self.server_lr:g}"]))
        return self.name


def parse_strategy(text: str, delay: int | None = None, correction: bool = True) -> StrategySpec:
    """``fedavg``, ``dga:D``, ``dga:D:nocorrection``, ``fedbuff:K``, ``fedbuff:K:slr=η`` or ``flower-fedavg``;
    ``delay``/``correction`` are the separate ``--delay``/``--no-correction`` flags for ``dga`` without a D."""
    if text.strip().lower() == "dga" and delay is not None:
        text = f"dga:{delay}"
    spec = parse_spec(text, "strategy", STRATEGIES, options=True)
    if spec.name != "dga" and (delay or not correction):
        raise SpecError(f"strategy {spec.name!r} takes no delay and no correction switch (only dga:D does)")
    if spec.name == "fedbuff":
        return StrategySpec("fedbuff", buffer=int(spec.value or 0), server_lr=_server_lr(text, spec.options))
    if spec.name != "dga":
        if spec.options:
            raise SpecError(f"strategy {spec.name!r} takes no parameter, got {text!r}")
        return StrategySpec(spec.name)
    if spec.options not in ((), ("nocorrection",)):
        raise SpecError(f"malformed strategy {text!r}; expected dga:D or dga:D:nocorrection")
    return StrategySpec("dga", int(spec.value or 0), correction and not spec.options)


def _server_lr(text: str, options: tuple[str, ...]) -> float:
    if not options:
        return 1.0
    value = _number(options[0].removeprefix("slr=")) if options[0].startswith("slr=") else None
    if len(options) > 1 or value is None or not value > 0:
        raise SpecError(f"malformed strategy {text!r}; expected fedbuff:K or fedbuff:K:slr=η with η > 0")
    return value


# ----- the aggregation rule --------------------------------------------------------------------------------------
AGGREGATES: dict[str, Parameter | None] = {
    "mean": None,
    "median": None,
    "trimmed-mean": Parameter("a fraction BETA in [0, 0.5)", lambda b: 0 <= b < 0.5),
    "krum": Parameter("a whole number F ≥ 0 of Byzantine clients", lambda f: f >= 0, integer=True),
}


def parse_aggregate(text: str) -> Spec:
    """``mean``, ``median``, ``trimmed-mean:BETA`` or ``krum:F`` (see ``fl_server.robust``)."""
    return parse_spec(text, "aggregation", AGGREGATES)

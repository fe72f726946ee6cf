"""The strategy table: one row per strategy (``strategies.strategy.Strategy``), each declared by the strategy's
own module; the ``--strategy`` parser and both halves are read off it. Adding a strategy is one module and one row.

Settings: ``fedavg``, ``dga:D[:nocorrection]``, ``fedbuff:K[:slr=η]``, ``fedprox:MU``, ``scaffold`` and
``flower-fedavg`` (Flower's own FedAvg apps, the baseline: ``fl_server.baseline``)."""

from __future__ import annotations

from strategies import dga, fedavg, fedbuff, fedprox, scaffold
from strategies.spec import SpecError, parse_spec
from strategies.strategy import ClientHalf, Plain, ServerHalf, ServerSetup, Strategy, StrategySettings


def _flower_halves(*_: object) -> ClientHalf:
    raise SpecError("flower-fedavg runs Flower's own ServerApp and ClientApp, not edgefl's halves")


FLOWER_FEDAVG = Strategy(
    "flower-fedavg",
    None,
    lambda spec, text: Plain("flower-fedavg"),
    _flower_halves,
    _flower_halves,  # type: ignore[arg-type]
    app="flower",
)

STRATEGIES: dict[str, Strategy] = {
    row.name: row
    for row in (fedavg.FEDAVG, dga.DGA, fedbuff.FEDBUFF, fedprox.FEDPROX, scaffold.SCAFFOLD, FLOWER_FEDAVG)
}


def parse_strategy(text: str) -> StrategySettings:
    """A ``--strategy`` setting as its strategy's record. Raises SpecError."""
    spec = parse_spec(text, "strategy", {name: row.parameter for name, row in STRATEGIES.items()}, options=True)
    if spec.options and not STRATEGIES[spec.name].options:
        raise SpecError(f"strategy {spec.name!r} takes {'no' if spec.value is None else 'one'} parameter, got {text!r}")
    return STRATEGIES[spec.name].parse(spec, text)


def client_half(settings: StrategySettings) -> ClientHalf:
    """The device's half of the run's strategy."""
    return STRATEGIES[settings.name].client(settings)


def server_half(settings: StrategySettings, setup: ServerSetup) -> ServerHalf:
    """The server's half of the run's strategy."""
    return STRATEGIES[settings.name].server(settings, setup)


def app_of(settings: StrategySettings) -> str:
    """Whose apps run the strategy: ``edgefl`` or ``flower`` (Flower's own FedAvg)."""
    return STRATEGIES[settings.name].app


def mean_only(settings: StrategySettings) -> str:
    """Why the strategy takes only the plain mean (``--aggregate mean``), or "" when it takes any rule."""
    return STRATEGIES[settings.name].mean_only

"""Parse a strategy name as users write it: ``fedavg``, ``dga:D``, ``dga:D:nocorrection``, ``flower-fedavg``."""

from __future__ import annotations

from dataclasses import dataclass

STRATEGY_NAMES = ("fedavg", "dga", "flower-fedavg")


class StrategyError(ValueError):
    """A strategy name that cannot be used; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class StrategySpec:
    """``delay`` is DGA's D (0 for FedAvg); ``correction`` is off only in the DGA ablation."""

    name: str
    delay: int = 0
    correction: bool = True

    @property
    def label(self) -> str:
        if self.name != "dga":
            return self.name
        return f"dga:{self.delay}" + ("" if self.correction else ":nocorrection")


def parse_strategy(text: str, delay: int | None = None, correction: bool = True) -> StrategySpec:
    """``delay``/``correction`` are the separate ``--delay``/``--no-correction`` flags; the spec wins if both."""
    name, *args = text.strip().lower().split(":")
    if name not in STRATEGY_NAMES:
        raise StrategyError(f"unknown strategy {text!r}; choose one of: fedavg, dga:D, flower-fedavg")
    if name != "dga":
        if args or delay:
            raise StrategyError(f"strategy {name!r} takes no delay (only dga:D does)")
        return StrategySpec(name)
    if len(args) > 2 or (len(args) == 2 and args[1] != "nocorrection"):
        raise StrategyError(f"malformed strategy {text!r}; expected dga:D or dga:D:nocorrection")
    if args:
        try:
            delay = int(args[0])
        except ValueError:
            raise StrategyError(f"DGA delay must be an integer, got {args[0]!r}") from None
    if delay is None:
        raise StrategyError("dga needs a delay: dga:D or --delay D")
    if not 0 <= delay <= 64:
        raise StrategyError(f"DGA delay must be between 0 and 64 rounds, got {delay}")
    return StrategySpec("dga", delay, correction and len(args) < 2)

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
    value = parse_number(args[0]) if args else None
    if value is None or not parameter.valid(value) or (parameter.integer and not value.is_integer()):
        raise SpecError(f"{setting} {name!r} needs {parameter.what} as in '{name}:VALUE', got {text!r}")
    if len(args) > 1 and not options:
        raise SpecError(f"{setting} {name!r} takes one parameter, got {text!r}")
    return Spec(name, value, tuple(args[1:]))


def _forms(table: Mapping[str, Parameter | None]) -> list[str]:
    return [name if parameter is None else f"{name}:VALUE" for name, parameter in table.items()]


def parse_number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def label(name: str, value: float | None, *options: str) -> str:
    """The canonical text of a spec: ``dga:2``, ``topk:0.01``, ``dgc:0.999:momentum``."""
    parts = [name] if value is None else [name, f"{int(value)}" if float(value).is_integer() else repr(float(value))]
    return ":".join([*parts, *options])


# ----- the aggregation rule --------------------------------------------------------------------------------------
AGGREGATES: dict[str, Parameter | None] = {
    "mean": None,
    "median": None,
    "trimmed-mean": Parameter("a fraction BETA in [0, 0.5)", lambda b: 0 <= b < 0.5),
    "krum": Parameter("a whole number F ≥ 0 of Byzantine clients", lambda f: f >= 0, integer=True),
    "centered-clip": Parameter("a factor TAU > 0 of the round's median distance", lambda t: t > 0),
}


MIXING = "nnm"  # the robust rules' one option: nearest-neighbour mixing first (fl_server.robust)


def parse_aggregate(text: str) -> Spec:
    """``mean``, ``median``, ``trimmed-mean:BETA``, ``krum:F`` or ``centered-clip:TAU``, the robust ones optionally
    followed by ``:nnm`` (see ``fl_server.robust``)."""
    spec = parse_spec(text, "aggregation", AGGREGATES, options=True)
    if spec.options and (spec.options != (MIXING,) or spec.name == "mean"):
        robust = [name for name in AGGREGATES if name != "mean"]
        if AGGREGATES[spec.name] is None and spec.options[0] != MIXING:
            raise SpecError(f"aggregation {spec.name!r} takes no parameter, got {text!r}")
        raise SpecError(
            f"aggregation {text!r}: the only option is ':{MIXING}', after one of {', '.join(robust)} (e.g. "
            f"'centered-clip:1:{MIXING}')"
        )
    return spec

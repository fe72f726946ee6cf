"""What a strategy is: a client half (what a device does with a global model and its data) and a server half (how
the updates of a round become the next global model), both plain numpy, declared by the strategy's own module as
one ``Strategy`` row of ``strategies.registry.STRATEGIES``. FedAvg's halves (``strategies.fedavg``) are the base
the others extend.

The round engine (``strategies.rounds``) does the scheduling — rounds, quorum, deadline, rejoin, sampling — and
asks the server half only what the strategy decides: its staleness bound D and FedBuff's buffer K (``delay`` and
``buffer``, which set the schedule), how a round's updates are summed, the step a closed round applies, and a
vector that travels to a client with each global model (``message_state``: SCAFFOLD's correction). The device's
agent (``edge.agent``) asks the client half which round may start, from which model, and what the local steps
minimise (``LocalObjective``, which ``ml.trainer`` applies to torch's gradients)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from strategies.spec import Parameter, Spec


@dataclass(frozen=True)
class LocalObjective:
    """What K local steps minimise beyond the data's loss f: each step's gradient is

        ∇f(w) + μ (w − w_anchor) + drift,

    FedProx's proximal term μ/2 ‖w − wᵍ‖² (``anchor``: the global model the round started from) and SCAFFOLD's
    constant correction c − c_i (``drift``). The default adds nothing: FedAvg's local SGD."""

    mu: float = 0.0
    anchor: np.ndarray | None = None
    drift: np.ndarray | None = None

    @property
    def plain(self) -> bool:
        return (self.mu == 0.0 or self.anchor is None) and self.drift is None


PLAIN = LocalObjective()


class StrategySettings(Protocol):
    """A strategy's parsed ``NAME:VALUE[:OPTION]`` setting (``RunConfig.strategy_spec``): its own typed record,
    with what the schedule needs."""

    @property
    def name(self) -> str: ...

    @property
    def label(self) -> str:
        """The canonical text (``dga:2``), as configs, runs and reports write it."""
        ...

    @property
    def delay(self) -> int:
        """The staleness bound D: round t may start from the global model of round t − D − 1 (0: the newest)."""
        ...

    @property
    def buffer(self) -> int:
        """FedBuff's K updates per server step (0: synchronous rounds)."""
        ...


@dataclass(frozen=True)
class Plain:
    """The settings of a strategy that takes no parameter (``fedavg``, ``scaffold``)."""

    name: str
    delay: int = 0
    buffer: int = 0

    @property
    def label(self) -> str:
        return self.name


@dataclass(frozen=True)
class Contribution:
    """One accepted update as the server half sees it, beside its decoded vector."""

    source: int  # the partition it came from
    round: int  # the round it trained
    step: int  # the round (FedBuff: the server step) it enters; step − round is its staleness
    num_examples: int


class RoundSum(Protocol):
    """A round's updates, summed as they arrive (one dense accumulator, not one vector per client)."""

    def mean(self) -> np.ndarray: ...


@dataclass(frozen=True)
class ServerSetup:
    """What a server half may need of the run: the model's size, the number N of partitions, K local steps, the
    clients' momentum β and learning rate of each round (``lr_at``, 1-based)."""

    size: int
    clients: int
    local_steps: int = 1
    momentum: float = 0.0
    lr_at: Callable[[int], float] = lambda _round: 1.0


class ServerHalf(Protocol):
    """How a round's updates become the next global model (``strategies.fedavg.FedAvgServer`` is the base)."""

    @property
    def delay(self) -> int: ...

    @property
    def buffer(self) -> int: ...

    def open(self, size: int) -> RoundSum:
        """An empty sum for a round that opens."""
        ...

    def add(self, summed: RoundSum, update: np.ndarray, contribution: Contribution) -> None:
        """Add one accepted update (decoded once, validated) to its round's sum."""
        ...

    def close(self, summed: RoundSum, mean: np.ndarray) -> np.ndarray:
        """A round closes with ``mean`` (its sum's, or a robust rule's): the step the global model takes (the
        engine's global momentum, if any, acts on it)."""
        ...

    def message_state(self, source: int) -> np.ndarray | None:
        """The vector sent to partition ``source`` with each global model (None: nothing)."""
        ...

    def state(self) -> dict[str, np.ndarray]:
        """What a resumed run needs besides the global model; its arrays are never changed in place afterwards, so
        the dict is a snapshot (the checkpoint is written from another thread)."""
        ...

    def restore(self, state: dict[str, np.ndarray]) -> None:
        """Take ``state()`` of a checkpoint back."""
        ...


class ClientHalf(Protocol):
    """What a device does with the global model and its data (``strategies.fedavg.FedAvgClient`` is the base)."""

    @property
    def global_round(self) -> int:
        """The round of the newest global model held (−1: none)."""
        ...

    def receive_global(self, round_: int, params: np.ndarray, state: np.ndarray | None = None) -> None:
        """The global model after round ``round_`` and the vector the server half's ``message_state`` sent."""
        ...

    def record_sent(self, round_: int, update: np.ndarray) -> None:
        """Round ``round_``'s update Δ as the server will decode it (after compression)."""
        ...

    def can_start(self, round_: int) -> bool:
        """Whether round ``round_`` may start now (the staleness bound)."""
        ...

    def start_params(self) -> np.ndarray:
        """The model a new local round starts from."""
        ...

    def objective(self, start: np.ndarray) -> LocalObjective:
        """What the local steps of a round that starts from ``start`` minimise."""
        ...


@dataclass(frozen=True)
class Strategy:
    """One row of the strategy table: the name users write, its VALUE (None: none), how its setting is parsed into
    its record, and the two halves made from that record. ``app``: whose apps run it (``flower`` for Flower's own
    FedAvg, whose halves are Flower's)."""

    name: str
    parameter: Parameter | None
    parse: Callable[[Spec, str], StrategySettings]  # the parsed spec and the text as written → the record
    client: Callable[[StrategySettings], ClientHalf]
    server: Callable[[StrategySettings, ServerSetup], ServerHalf]
    options: bool = False  # whether anything may follow the VALUE (its ``parse`` checks what)
    mean_only: str = ""  # why it takes only --aggregate mean, in words ("": any rule of fl_server.robust)
    app: str = "edgefl"

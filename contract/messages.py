"""The two messages of a training exchange as typed records (no Flower here; ``contract.wire`` lays them out in
Flower's). Down, server → device: the run's job, the rounds the device may train and, when it does not hold it
yet, the global model as a ``Broadcast``. Up, device → server: every update it has ready, one ``Update``
record each, all the way from the agent to the server's ``RoundEngine``, and the size of its partition."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strategies.downlink import Broadcast
from strategies.rounds import Update


@dataclass(frozen=True)
class TrainInstruction:
    job: str  # contract.settings.ClientJob as JSON: parsed once per run, by the device
    next_round: int
    last_round: int
    broadcast: Broadcast | None  # None when the device already holds the newest global model
    # A fresh secret per message, echoed by the reply: only whoever received the message can answer it (Flower's
    # SuperLink does not check that a reply's sender is the node the message went to).
    reply_key: str = field(default_factory=lambda: secrets.token_hex(16))
    # A reply of the device's was lost (``strategies.rounds.RoundEngine.lost``): it sends again every update it kept.
    resend: bool = False
    # With a broadcast: the strategy's vector for this device, float32 (``ServerHalf.message_state``: SCAFFOLD's
    # correction c − c_i); None: none.
    state: np.ndarray | None = None

    @classmethod
    def identify(cls, job: str) -> TrainInstruction:
        """Asks for no round and brings no model: the device answers at once with its partition (or refuses the
        run, if its partition does not fit the run's split)."""
        return cls(job, 0, 0, None)

    @property
    def asks_for_rounds(self) -> bool:
        return self.last_round >= 1


@dataclass(frozen=True)
class TrainReply:
    partition_id: int
    updates: tuple[Update, ...]
    health: dict[str, Any] = field(default_factory=dict)  # edge.health.health_snapshot()
    transport: str = "stock"  # contract.transport: how this device's SuperNode moves messages
    held_s: float = 0.0  # how long the agent held the message before answering (training, waiting for an update)
    partition_size: int = 0  # the training examples of its partition, as the device declares them (0: none said):
    # what bounds each update's num_examples (fl_server.membership)
    reply_key: str = ""  # the instruction's, echoed by the device's ClientApp (fl_client.app)

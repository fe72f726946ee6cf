"""Which SuperNodes train which partition of a run (no Flower here).

A run trains exactly its N partitions. Flower tells the server a node's id, not its partition, so a node that
joins is first asked who it is (``TrainInstruction.identify``: no model, no rounds) and its answer decides:
admitted, when its partition is free; a spare, when another live node trains that partition (it takes over if
that node leaves, and then trains that partition); refused, when its agent refused the run (its partition is out
of range or its split has another N: the agent's reason comes back as an error) or its answer does not fit the
run. An answer lost on its way (Flower's error: the node went offline, its task expired) refuses nothing: the
node is asked again once it is seen connected again. Every decision is logged with its reason.

A node's answer also declares how many training examples its partition has: what bounds the ``num_examples`` of
that partition's updates (``strategies.rounds``). When the server has the data it makes the run's split itself
(``sizes`` from it, ``split``) and a node must declare its partition's size exactly; otherwise the first
declaration for a partition is its size for the rest of the run, and a node declaring another is refused."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from contract.errors import PeerError

log = logging.getLogger("edgefl.server")


class PushRefused(PeerError, RuntimeError):
    """The SuperLink did not take a message the server pushed to a node; ``str()`` is the one-line reason."""


class RoundStuck(RuntimeError):
    """The run stops: its oldest open round can never close, too few clients being able to still send an update
    (``str()`` says why, with the last reason of a failed or refused reply)."""


@dataclass
class Membership:
    sizes: dict[int, int] = field(default_factory=dict)  # partition → its training examples (see the docstring)
    split: bool = False  # ``sizes`` is the run's split as the server made it, not the nodes' declarations
    admitted: dict[int, int] = field(default_factory=dict)  # node → partition, the nodes that train
    spares: dict[int, int] = field(default_factory=dict)  # node → partition, waiting for it to be free
    unknown: set[int] = field(default_factory=set)  # joined, not identified yet
    asked: set[int] = field(default_factory=set)  # of those, the ones asked who they are
    refused: set[int] = field(default_factory=set)

    def connected(self, nodes: set[int]) -> list[int]:
        """Take in the nodes connected now (a spare takes over the partition of an admitted node that left);
        returns the admitted nodes that left."""
        known = set(self.admitted) | set(self.spares) | self.unknown | self.refused
        for node in sorted(nodes - known):
            log.info("node %d joined; asking it which partition it trains", node)
            self.unknown.add(node)
        left = sorted(set(self.admitted) - nodes)
        for node in left:
            partition = self.admitted.pop(node)
            log.warning("node %d (partition %d) left; its messages in flight are abandoned", node, partition)
            if spare := next((s for s, p in sorted(self.spares.items()) if p == partition and s in nodes), None):
                self.admitted[spare] = self.spares.pop(spare)
                log.info("spare node %d takes over partition %d", spare, partition)
        for gone in (set(self.spares) | self.unknown | self.refused) - nodes:
            self.spares.pop(gone, None)
            self.unknown.discard(gone)
            self.asked.discard(gone)
            self.refused.discard(gone)
        return left

    def to_ask(self) -> list[int]:
        """Nodes to ask who they are (once each)."""
        fresh = sorted(self.unknown - self.asked)
        self.asked |= set(fresh)
        return fresh

    def partition(self, node: int) -> int | None:
        """The partition ``node`` trains or waits for (None: not identified)."""
        return self.admitted.get(node, self.spares.get(node))

    def identified(self, node: int, partition: int, examples: int) -> bool:
        """Its answer, declaring ``examples`` training examples: True when it is admitted, False when it waits as
        a spare or is refused (its declaration does not fit the partition's size)."""
        if reason := self._size_refusal(partition, examples):
            self.refuse(node, reason)
            return False
        self.unknown.discard(node)
        self.asked.discard(node)
        self.sizes.setdefault(partition, examples)
        holder = next((n for n, p in self.admitted.items() if p == partition), None)
        if holder is None:
            self.admitted[node] = partition
            log.info("node %d trains partition %d (%d examples)", node, partition, examples)
            return True
        self.spares[node] = partition
        log.warning(
            "node %d also claims partition %d, trained by node %d: it waits as a spare", node, partition, holder
        )
        return False

    def _size_refusal(self, partition: int, examples: int) -> str | None:
        size = self.sizes.get(partition)
        declares = f"it declares {examples} training examples for partition {partition}"
        if examples < 1:
            return declares
        if size is None or examples == size:
            return None
        if self.split:
            return f"{declares}, which has {size} in the run's split"
        return f"{declares}, first declared with {size}: a partition's size may not change"

    def refuse(self, node: int, reason: str) -> None:
        self.unknown.discard(node)
        self.asked.discard(node)
        self.refused.add(node)
        log.warning("refused node %d: %s", node, reason)

    def retry(self, node: int, reason: str) -> None:
        """Its answer was lost (``reason``: Flower's error): it is asked again once it is seen connected again."""
        self.unknown.discard(node)
        self.asked.discard(node)
        log.warning("node %d did not answer which partition it trains (%s); it is asked again when seen", node, reason)

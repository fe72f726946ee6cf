"""Which SuperNodes train which partition of a run (no Flower here).

A run trains exactly its N partitions. Flower tells the server a node's id, not its partition, so a node that
joins is first asked who it is (``TrainInstruction.identify``: no model, no rounds) and its answer decides:
admitted, when its partition is free; a spare, when another live node trains that partition (it takes over if
that node leaves); refused, when its agent refused the run (its partition is out of range or its split has
another N: the agent's reason comes back as an error). Every decision is logged with its reason."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("edgefl.server")


@dataclass
class Membership:
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

    def identified(self, node: int, partition: int) -> bool:
        """Its answer: True when it is admitted, False when it waits as a spare."""
        self.unknown.discard(node)
        self.asked.discard(node)
        holder = next((n for n, p in self.admitted.items() if p == partition), None)
        if holder is None:
            self.admitted[node] = partition
            log.info("node %d trains partition %d", node, partition)
            return True
        self.spares[node] = partition
        log.warning(
            "node %d also claims partition %d, trained by node %d: it waits as a spare", node, partition, holder
        )
        return False

    def refuse(self, node: int, reason: str) -> None:
        self.unknown.discard(node)
        self.asked.discard(node)
        self.refused.add(node)
        log.warning("refused node %d: %s", node, reason)

"""Flower's SuperNode with its fixed waits tuned (``contract.transport``); every argument is
``flower-supernode``'s but ``--parent-pid PID``, given first: it stops (as on SIGTERM) once that process is gone
(``contract.parent``). edgefl starts it with ``--isolation process``: the edge agent serves its tasks.

    python -m fl_client.supernode [--parent-pid PID] --insecure --superlink HOST:PORT --isolation process ...
"""

from __future__ import annotations

import logging
import sys

from contract.parent import watch_parent
from contract.transport import tune


def preload() -> None:
    """Import Flower's SuperNode (``edgefl.forkserver``: SuperNodes forked from one process that imported it
    once)."""
    from contract.flower import flower_supernode  # noqa: F401


def main() -> None:
    if sys.argv[1:2] == ["--parent-pid"]:
        watch_parent(int(sys.argv[2]))
        del sys.argv[1:3]
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log = logging.getLogger("edgefl")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.info("Flower's message path: %s", tune())
    from contract.flower import flower_supernode

    flower_supernode()


if __name__ == "__main__":
    main()

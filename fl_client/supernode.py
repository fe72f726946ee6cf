"""Flower's SuperNode with its fixed waits tuned (``contract.transport``); every argument is
``flower-supernode``'s. edgefl starts it with ``--isolation process``: the edge agent serves its tasks.

    python -m fl_client.supernode --insecure --superlink HOST:PORT --isolation process --port 9094 ...
"""

from __future__ import annotations

import logging

from contract.transport import tune


def main() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log = logging.getLogger("edgefl")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.info("Flower's message path: %s", tune())
    from flwr.supernode.cli.flower_supernode import flower_supernode

    flower_supernode()


if __name__ == "__main__":
    main()

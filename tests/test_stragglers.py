"""A client that stops answering mid-run (its edge agent frozen with SIGSTOP) holds each round only until the
round's deadline: the run finishes with the others, and the rounds say so."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import processes_of, start_edgefl, wait_for_first_round

pytestmark = pytest.mark.federation


def test_a_silent_client_does_not_stall_the_run(run_dir: Path) -> None:
    proc = start_edgefl(
        "run", "--strategy", "dga:1", "--dataset", "digits", "--partition", "iid", "--clients", "3",
        "--rounds", "6", "--local-steps", "5", "--quorum", "0.6", "--round-deadline-s", "4", "--out", str(run_dir),
    )  # fmt: skip
    wait_for_first_round(proc, run_dir)
    agent = next(line for line in processes_of(run_dir) if "fl_client.node" in line and ".node-2.ready" in line)
    os.kill(int(agent.split()[0]), signal.SIGSTOP)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(len(r["clients"]) >= 2 for r in rows)  # quorum: ceil(0.6 · 3)
    # Frozen after round 1, client 2 can have trained at most D + 1 = 2 rounds ahead of the model it held:
    # the last rounds close at their deadline without it.
    assert all(r["closed_by"] == "deadline" and 2 not in r["clients"] for r in rows[-2:])

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
    agent = next(line for line in processes_of(run_dir) if ".agent-2.sock" in line)
    os.kill(int(agent.split()[0]), signal.SIGSTOP)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    late = [r for r in rows if r["closed_by"] == "deadline"]
    assert late and all(r["clients"] == [0, 1] for r in late)
    assert rows[-1]["closed_by"] == "deadline"

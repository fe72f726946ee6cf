"""Shared helpers: run the real ``edgefl`` command, and find processes a run left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def edgefl(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess[str]:
    """``edgefl ARGS`` as a user types it, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "edgefl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        **kwargs,
    )


def processes_of(run_dir: Path) -> list[str]:
    """Every live process that belongs to the run in ``run_dir``: Flower processes carry FLWR_HOME under it,
    agents carry their socket path in it on their command line."""
    marker = str(run_dir.resolve()).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        except OSError:
            continue
        if state != "Z" and int(pid) != os.getpid() and (marker in environ or marker in cmdline):
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {command}")
    return found


@pytest.fixture
def flower_task() -> Iterator[None]:
    """Flower builds a Message only inside a task (its run, node and task ids): pretend to be one."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    yield path
    left = processes_of(path)
    for line in left:
        os.kill(int(line.split()[0]), 9)
    assert not left, f"processes left running: {left}"


def start_edgefl(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "edgefl.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_for_first_round(proc: subprocess.Popen[str], run_dir: Path, timeout_s: float = 180) -> None:
    """Until rounds.jsonl has a row: the federation is up and every client has contributed once."""
    rounds = run_dir / "rounds.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (rounds.exists() and rounds.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)

"""``bench/path_overlap.py`` on a run folder written here: two training messages of one device, the second's model
coming down while the first's reply goes up — each way counted alone or beside the other, with its seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from contract.run_folder import CONFIG
from contract.settings import build_config, save_config
from tests.conftest import REPO


def _message(message_id: str, sent: float, back: float, train_s: float) -> dict:
    return {"message_id": message_id, "partition": 0, "sent_at": sent, "round_trip_s": back - sent,
            "train_s": train_s, "held_s": 0.0, "path_s": back - sent - train_s}  # fmt: skip


def _served(message_id: str, claimed: float, pushed: float) -> str:
    record = {"message_id": message_id, "claimed": claimed, "pulled": claimed, "answered": pushed, "pushed": pushed}
    return f"2026-11-29 03:59:35,091 edgefl.tasks INFO served task {json.dumps(record)}\n"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "bench/path_overlap.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_a_way_beside_the_devices_other_message_is_counted_apart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    # a: down 0 → 1, trains, up 5 → 6; b: pushed at 4.5, before a's reply was handed over (5), down → 7 (beside
    # a's upload), trains, up 10 → 11 (alone)
    rows = [_message("a", 0.0, 6.0, 4.0), _message("b", 4.5, 11.0, 3.0), _message("idle", 20.0, 20.5, 0.0)]
    (run / "messages.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run / "logs" / "agent-0.log").write_text(_served("a", 1.0, 5.0) + _served("b", 7.0, 10.0) + "other line\n")
    save_config(build_config(None, strategy="dga:2", dataset="digits", clients=1), run / CONFIG)
    done = _bench(str(run), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "out" / "result.json").read_text())[str(run)]
    assert figures["down"]["alone"] == {"count": 1, "median_s": 1.0}
    assert figures["down"]["overlapped"] == {"count": 1, "median_s": 2.5, "after_handover_median_s": 2.0,
                                             "waited_median_s": 0.5, "held_at_push": {"1": 1}}  # fmt: skip
    assert figures["most_held"] == 3  # DGA, every client every round: two in flight and a new global model
    assert figures["up"]["overlapped"] == {"count": 1, "median_s": 1.0}  # a's reply, while b's model came down
    assert figures["up"]["alone"] == {"count": 1, "median_s": 1.0}
    assert figures["path_median_s"] == 2.75  # (2.0 + 3.5) / 2: the idle message carried no training


def test_a_folder_without_served_messages_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = _bench(str(tmp_path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "has no training message served" in done.stderr


def test_a_folder_without_its_settings_is_one_line_and_exit_2(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "messages.jsonl").write_text(json.dumps(_message("a", 0.0, 6.0, 4.0)) + "\n")
    (run / "logs" / "agent-0.log").write_text(_served("a", 1.0, 5.0))
    done = _bench(str(run), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "config.toml does not give its run's settings" in done.stderr

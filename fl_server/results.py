"""The files a run leaves in ``runs/NAME/``: ``rounds.jsonl`` (one object per closed round),
``summary.json``, ``checkpoint.npz`` (the global model after the newest round), ``global.onnx`` (the final
model) and ``server_error.txt`` when the server failed."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

ROUNDS = "rounds.jsonl"
SUMMARY = "summary.json"
CHECKPOINT = "checkpoint.npz"
GLOBAL_ONNX = "global.onnx"
SERVER_ERROR = "server_error.txt"


def append_round(run_dir: Path, row: dict[str, Any]) -> None:
    with open(run_dir / ROUNDS, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / ROUNDS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def save_checkpoint(run_dir: Path, round_: int, params: np.ndarray) -> None:
    """Written to a temporary file and renamed, so a crash never leaves half a checkpoint."""
    tmp = run_dir / (CHECKPOINT + ".tmp.npz")
    np.savez(tmp, params=params, round=np.int64(round_))
    os.replace(tmp, run_dir / CHECKPOINT)


def load_checkpoint(run_dir: Path) -> tuple[int, np.ndarray]:
    with np.load(run_dir / CHECKPOINT) as data:
        return int(data["round"]), data["params"]


def summarize(config: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run in one object; ``config`` is the resolved config as a dict."""
    accuracies = [r["test_accuracy"] for r in rows]
    wall = rows[-1]["wall_s"] if rows else 0.0
    target = config.get("target_accuracy")
    reached = [r["wall_s"] for r in rows if target is not None and r["test_accuracy"] >= target]
    steps = sum(len(r["clients"]) for r in rows) * config["local_steps"]
    return {
        "strategy": config["strategy"],
        "dataset": config["dataset"],
        "partition": config["partition"],
        "clients": config["clients"],
        "rounds": len(rows),
        "local_steps": config["local_steps"],
        "compress": config["compress"],
        "seed": config["seed"],
        "final_accuracy": accuracies[-1] if rows else None,
        "best_accuracy": max(accuracies) if rows else None,
        "final_loss": rows[-1]["test_loss"] if rows else None,
        "wall_clock_s": wall,
        "seconds_per_round": wall / len(rows) if rows else None,
        "rounds_per_hour": 3600 * len(rows) / wall if wall > 0 else None,
        "local_steps_per_s": steps / wall if wall > 0 else None,
        "bytes_up": sum(r["bytes_up"] for r in rows),
        "bytes_down": sum(r["bytes_down"] for r in rows),
        "target_accuracy": target,
        "time_to_target_s": reached[0] if reached else None,
        "rejected_updates": sum(len(r["rejected"]) for r in rows),
        "link_profile": config["profile"],
        "link_backend": config["link_backend"],
    }


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
    (run_dir / SUMMARY).write_text(json.dumps(clean, indent=2) + "\n")

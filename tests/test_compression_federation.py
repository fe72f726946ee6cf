"""Compressed updates through the real deployment: what crosses the link shrinks, and training still works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ml.data import load_dataset
from ml.models import build_model
from tests.conftest import edgefl

pytestmark = pytest.mark.federation


def test_topk_uplink_is_a_fraction_of_dense(tmp_path: Path) -> None:
    sizes = {}
    for codec in ("none", "topk:0.05"):
        out = tmp_path / codec.replace(":", "-")
        done = edgefl("run", "--dataset", "digits", "--partition", "iid", "--clients", "2", "--rounds", "3",
                      "--local-steps", "10", "--compress", codec, "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["compress"] == codec and summary["rejected_updates"] == 0
        sizes[codec] = summary["bytes_up"]
        rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"]
    # 5% of the entries as (uint16 index, fp16 value) + headers and Flower's per-message overhead.
    assert sizes["topk:0.05"] < 0.2 * sizes["none"]


def test_compressed_both_ways_cuts_the_downlink(tmp_path: Path) -> None:
    """top-k up and int8 deltas down: after the first round (every client gets the model dense once) each
    round's downlink is a fraction of what the dense model alone would cost."""
    out = tmp_path / "both"
    done = edgefl("run", "--dataset", "digits", "--partition", "iid", "--clients", "2", "--rounds", "4",
                  "--local-steps", "10", "--compress", "topk:0.01", "--compress-down", "int8",
                  "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rejected_updates"] == 0
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and rows[-1]["test_accuracy"] > rows[0]["test_accuracy"]
    params = sum(p.numel() for p in build_model(load_dataset("digits"), 0).parameters())
    dense_round = 2 * 4 * params  # the float32 model to each of 2 clients, without any message overhead
    assert all(row["bytes_down"] < 0.35 * dense_round for row in rows[1:])

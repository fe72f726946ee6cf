"""Compressed updates through the real deployment: what crosses the link shrinks both ways, and training still
works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ml.data import load_dataset
from ml.models import build_model
from strategies.codecs import dense_payload_size

pytestmark = pytest.mark.federation


@pytest.mark.xdist_group("federation-2-loopback")
def test_compressed_both_ways_cuts_the_uplink_and_the_downlink(tmp_path: Path, shared_federation) -> None:
    """top-k 5 % up and int8 deltas down. Up: 5 % of the entries as (uint16 index, fp16 value) plus headers and
    Flower's per-message overhead, against the dense float32 update. Down: after the first round (every client
    gets the model dense once) each round is a fraction of what the dense model alone would cost."""
    out = tmp_path / "both"
    shared_federation(2).run(out, partition="iid", rounds=4, local_steps=10, compress="topk:0.05", compress_down="int8")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compress"] == "topk:0.05" and summary["rejected_updates"] == 0
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and rows[-1]["test_accuracy"] > rows[0]["test_accuracy"]
    params = sum(p.numel() for p in build_model(load_dataset("digits"), 0).parameters())
    dense_round = 2 * dense_payload_size(params)  # one dense update from each of 2 clients, without any overhead
    assert all(row["bytes_up"] < 0.2 * dense_round for row in rows)
    assert all(row["bytes_down"] < 0.35 * dense_round for row in rows[1:])

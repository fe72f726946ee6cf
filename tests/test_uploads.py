"""The object-upload bound a run posts for the gateway (``contract.uploads``): its arithmetic and who counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from contract.messages import TrainReply
from contract.settings import RunConfig
from contract.uploads import NO_RUN_LIMIT, POSTED, current_limit, reply_bytes_at_most
from contract.wire import reply_content
from edge.health import health_snapshot
from ml.data import load_dataset
from ml.models import build_model, param_layout
from strategies.codecs import dense_payload_size
from strategies.codecs.base import layout_info
from strategies.rounds import Update


def test_the_largest_reply_a_run_allows_fits_and_a_decoder_bomb_does_not() -> None:
    """A DGA:4 reply answering a resend (2(D + 1) dense updates of the digits CNN) is within its run's bound, as it
    goes on the wire; the hostile bench's 15 MB reply is far beyond a FedAvg run's bound for the same model."""
    config = RunConfig(strategy="dga:4", dataset="digits", partition="iid", clients=2)
    layout = param_layout(build_model(load_dataset("digits"), config.seed))
    size = layout_info(layout).size
    dense = dense_payload_size(size)
    updates = tuple(Update(r, "dense", b"\0" * dense, 10, 0.1, 1.0) for r in range(2 * (4 + 1)))
    reply = TrainReply(0, updates, health_snapshot(), "fast", 1.0, 10, "k" * 64)  # the device's real health report
    (record,) = reply_content(reply).config_records.values()  # the one object that holds them all
    carried = len(record.deflate())
    assert carried <= reply_bytes_at_most(4, dense) < 2 * carried
    assert reply_bytes_at_most(0, dense) < 15_000_000 / 10


def test_the_limit_is_the_largest_bound_of_the_runs_under_way(tmp_path: Path) -> None:
    """A bound posted by a process that is gone (a ServerApp killed before its end) is not counted."""
    assert current_limit(tmp_path) == NO_RUN_LIMIT
    (tmp_path / POSTED).mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / POSTED / gone.stdout.strip()).write_text("900000000")
    (tmp_path / POSTED / str(os.getpid())).write_text("300000")
    (tmp_path / POSTED / str(os.getppid())).write_text("500000")
    assert current_limit(tmp_path) == 500000

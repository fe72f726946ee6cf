"""The edge agent on a device (no Flower): where it finds its data, what a reply carries."""

from __future__ import annotations

import pytest

from edge.agent import EdgeAgent, Session
from edge.data import FASHION_MNIST_DIR, DataError, load_dataset
from edge.models import build_model, get_flat_params, param_layout
from edgefl.config import RunConfig, client_job
from strategies.downlink import BroadcastEncoder


def test_the_devices_data_dir_wins_over_the_runs() -> None:
    """The run was submitted on a machine whose data lives elsewhere: ``edge.agent --data-dir`` points at
    this device's copy."""
    if not FASHION_MNIST_DIR.exists():
        pytest.skip("dataset-fashion-mnist is not installed")
    job = client_job(
        RunConfig(dataset="fashion-mnist", partition="iid", data_dir="/nonexistent/fashion-mnist", clients=2)
    )
    with pytest.raises(DataError, match="/nonexistent/fashion-mnist"):
        Session(job, 0, 2)
    session = Session(job, 0, 2, data_dir=str(FASHION_MNIST_DIR))
    assert session.num_examples > 0


def test_a_reply_carries_every_round_the_global_model_unlocks() -> None:
    """DGA with D = 2: the message that brings the global model of round 0 is answered with rounds 1..3, all
    of them (the staleness bound), not just the first one ready; a message that brings nothing new is
    answered at once with nothing."""
    job = client_job(
        RunConfig(strategy="dga:2", dataset="digits", partition="iid", clients=2, rounds=10, local_steps=2)
    )
    model = build_model(load_dataset("digits"), job["seed"])
    params, layout = get_flat_params(model), param_layout(model)
    broadcast = BroadcastEncoder("none", params, layout).broadcast(0, params)
    header = {"op": "train", "partition-id": 0, "num-partitions": 2, "job": job, "next-round": 1, "last-round": 3}
    agent = EdgeAgent()
    try:
        reply, blob = agent.handle_train(
            {**header, "global-round": 0, "broadcast": broadcast.header()}, broadcast.blob()
        )
        assert [u["round"] for u in reply["updates"]] == [1, 2, 3]
        assert len(blob) == sum(u["size"] for u in reply["updates"])
        reply, blob = agent.handle_train({**header, "global-round": -1}, b"")
        assert reply["updates"] == [] and blob == b""
    finally:
        agent.stop()

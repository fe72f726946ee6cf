"""The edge agent's session on a device (no Flower): where it finds its data."""

from __future__ import annotations

import pytest

from edge.agent import Session
from edge.data import FASHION_MNIST_DIR, DataError
from edgefl.config import RunConfig, client_job


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

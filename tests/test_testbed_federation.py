"""Federations across the namespaced testbed: Flower's SuperLink in one network namespace, each SuperNode with
its agent in its own, joined by shaped links (netem where the kernel has it, else kernel tbf for rate plus the
user-space TUN forwarder for delay, jitter and loss). Needs root, as CI has."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from contract.run_folder import read_rounds
from strategies.sampling import Sampler
from tests.conftest import namespaces_of, start_edgefl

pytestmark = [
    pytest.mark.federation,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]
FAST = ["--dataset", "digits", "--partition", "iid", "--local-steps", "5"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """``edgefl run ARGS`` as a user types it; the namespaces its testbed made (tagged with its pid) are gone."""
    proc = start_edgefl("run", *args)
    out, err = proc.communicate(timeout=600)
    assert not namespaces_of(proc.pid), "namespaces left behind"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_four_clients_two_per_round_with_dga_over_long_distance(run_dir: Path) -> None:
    """Partial participation in a deployment: each round is trained and closed by exactly its sampled pair, and
    no training message goes to a client for rounds it sits out."""
    done = _run(*FAST, "--clients", "4", "--clients-per-round", "2", "--strategy", "dga:1", "--rounds", "3",
                "--profile", "long-distance", "--out", str(run_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["link_profile"] == "long-distance"
    assert summary["link_backend"] in ("netem", "tbf+tun")
    sampler = Sampler(seed=0, population=4, per_round=2)
    rows = read_rounds(run_dir)
    assert [(r["clients"], r["closed_by"]) for r in rows] == [(sorted(sampler.clients(t)), "all") for t in (1, 2, 3)]
    for message in read_rounds(run_dir, "messages.jsonl"):
        assert all(message["partition"] in sampler.clients(t) for t in message["rounds"])


def test_fedbuff_over_per_client_links_from_a_profiles_file(run_dir: Path, tmp_path: Path) -> None:
    """FedBuff with K = 1 over a fast and a slow link: every step is one client's update, and the run ends."""
    links = tmp_path / "links.toml"
    links.write_text(
        '[pi-on-4g]\nsource = "this test"\n'
        "[pi-on-4g.up]\ndelay_ms = 40\nrate_mbit = 8\n[pi-on-4g.down]\ndelay_ms = 40\nrate_mbit = 20\n"
    )
    done = _run(*FAST, "--clients", "2", "--rounds", "4", "--strategy", "fedbuff:1",
                "--profile", "home-wifi,pi-on-4g", "--profiles", str(links), "--out", str(run_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = read_rounds(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert all(r["closed_by"] == "buffer" and len(r["clients"]) == 1 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "fedbuff:1" and summary["link_profile"] == "home-wifi,pi-on-4g"

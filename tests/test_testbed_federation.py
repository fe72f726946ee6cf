"""Federations across the namespaced testbed: Flower's SuperLink in one network namespace, each SuperNode with
its agent in its own, joined by shaped links (netem where the kernel has it, else kernel tbf for rate plus the
user-space TUN forwarder for delay, jitter and loss). Needs root, as CI has."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pyroute2 import netns

from tests.conftest import edgefl

pytestmark = [
    pytest.mark.federation,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]
FAST = ["--dataset", "digits", "--partition", "iid", "--local-steps", "5"]


def _namespaces() -> set[str]:
    return {name for name in netns.listnetns() if name.startswith("efl-")}


def test_four_clients_fedavg_over_long_distance(run_dir: Path) -> None:
    before = _namespaces()
    done = edgefl("run", *FAST, "--clients", "4", "--rounds", "2", "--profile", "long-distance", "--out", str(run_dir))
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["link_profile"] == "long-distance"
    assert summary["link_backend"] in ("netem", "tbf+tun")
    assert _namespaces() == before


def test_dga_over_per_client_links_from_a_profiles_file(run_dir: Path, tmp_path: Path) -> None:
    links = tmp_path / "links.toml"
    links.write_text(
        '[pi-on-4g]\nsource = "this test"\n'
        "[pi-on-4g.up]\ndelay_ms = 40\nrate_mbit = 8\n[pi-on-4g.down]\ndelay_ms = 40\nrate_mbit = 20\n"
    )
    before = _namespaces()
    done = edgefl("run", *FAST, "--clients", "2", "--rounds", "4", "--strategy", "dga:2",
                  "--profile", "home-wifi,pi-on-4g", "--profiles", str(links), "--out", str(run_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4] and all(r["clients"] == [0, 1] for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "dga:2" and summary["link_profile"] == "home-wifi,pi-on-4g"
    assert _namespaces() == before

"""``bench/hostile_clients.py``, short: a real 4-client federation on the namespaced testbed in which clients 2 and 3
(``bench/hostile_agent.py``: edgefl's own agent, its replies swapped for attacks) attack from round 1 on, in every
odd round, while a stranger in client 2's network namespace tries the server's Control and ServerAppIo APIs and
holds slow connections from both addresses. Every round completes, none held to its deadline; every attack is
refused, with the server's (or the SuperLink's) reason; the stranger is refused everywhere; nothing is left
running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pyroute2 import netns

from tests.conftest import REPO, processes_of

pytestmark = [
    pytest.mark.federation,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

# One of each kind: a field overflowing or not finite, a weight far above the partition, a replayed and a future
# round, another device's partition, malformed payloads and a decoder bomb, a non-finite value, and replies to
# messages the device was not sent (a made-up one, another node's, one in another node's name: refused by its
# reply key; when it beats that node's own reply to the SuperLink, which then refuses that one as a duplicate,
# the node is asked to send its update again, and the round still closes without waiting for its deadline).
ATTACKS = [
    "size=1e400",
    "round=Infinity",
    "num-examples=10**400",
    "partition-id=NaN",
    "replayed update (the round before)",
    "future round (+2)",
    "partition-id of another device",
    "reply_to a made-up message",
    "reply_to another node's message",
    "reply_to another node's message in its name",
    "num-examples=2**31-1",
    "stc: k=2**32-1",
    "none: NaN value",
    "15 MB reply (decoder bomb)",  # over what the run allows: refused at the gateway (413), counted as a failure
]
ROUNDS = 11  # a round each for all but the forged attacks of each attacker, every other round honest
TIMEOUT_S = 600


def test_a_hostile_device_and_a_stranger_are_refused_and_every_round_completes(tmp_path: Path) -> None:
    argv = [sys.executable, "bench/hostile_clients.py", "--no-clean", "--clients", "4", "--attackers", "2",
            "--rounds", str(ROUNDS), "--attacks", ",".join(ATTACKS), "--out", str(tmp_path)]  # fmt: skip
    bench = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = bench.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        bench.terminate()  # it stops its federation and its testbed on SIGTERM
        out, err = bench.communicate(timeout=60)
        pytest.fail(f"the bench took over {TIMEOUT_S} s:\n{out[-3000:]}{err[-3000:]}")
    assert bench.returncode == 0, out[-3000:] + err[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())

    assert result["rounds_completed"] == ROUNDS and not result["hostile_run_error"], result
    assert result["rounds_closed_by_deadline"] == [], "an attack held a round to its deadline"
    attacks = result["attacks"]
    assert (result["clients"], result["attackers"]) == (4, [2, 3])
    assert sorted(a["attack"] for a in attacks) == sorted(ATTACKS)
    assert {a["client"] for a in attacks} == {2, 3}
    assert {a["client"] for a in attacks if a["round"] == 1} == {2, 3}, "both attack the run's first round"
    assert all(a["sent"] for a in attacks), [a for a in attacks if not a["sent"]]
    assert result["attacks_tried"] == len(ATTACKS)
    taken = [f"round {a['round']} {a['attack']}: {a['reason']}" for a in attacks if a["sent"] and not a["refused"]]
    assert not taken, "attacks not refused:\n" + "\n".join(taken)
    assert result["attacks_refused"] == result["attacks_tried"]
    assert all(a["reason"] and a["by"] != "—" for a in attacks if a["sent"])

    assert result["stranger_refused"] and not result["stranger_error"], result["stranger"]
    assert any(p["probe"].startswith("ServerAppIo") for p in result["stranger"])
    assert any(p["probe"] == "flwr supernode register (its own node key)" for p in result["stranger"])
    access = (tmp_path / "hostile" / "logs" / "gateway" / "access.log").read_text()
    assert '"POST /v1/control/register-node HTTP/1.1" 403' in access
    [huge] = [a for a in attacks if a["attack"].startswith("15 MB")]
    assert huge["by"].startswith("gateway (413"), huge  # the run's ServerApp bounded the uploads at the gateway
    peak = result["server_peak_rss_mb"]["hostile"]
    assert peak["SuperLink"] < 250, peak  # 294 MB when a 15 MB reply reached it

    assert not processes_of(tmp_path / "hostile")
    testbed = f"efl-{bench.pid % 100000}-"  # the launcher's testbed tag: its process id
    assert not [name for name in netns.listnetns() if name.startswith(testbed)]

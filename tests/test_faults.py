"""Faults a federation must survive: clients that vanish and come back (under a new node id), a server killed and
resumed from its checkpoint, and links that go down, lose packets or stall.

The engine and link-model tests are plain and fast. The federation tests run real Flower processes; those over
the namespaced testbed need root. Every test checks that it leaves no process, namespace or qdisc behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Error

from contract.flower import ErrorCode
from contract.run_folder import (
    CHECKPOINT,
    ROUNDS,
    Checkpoint,
    RunFolder,
    read_rounds,
    truncate_rounds,
)
from contract.settings import RunConfig, build_config, save_config
from contract.transport import UNDELIVERED
from edgefl.launcher import (
    JOINED,
    NodeRuntime,
    follow,
    local_federation,
    prepare_run_dir,
    supernode_argv,
)
from edgefl.processes import LaunchError, ProcessGroup, tail, tail_from
from fl_client.tasks import ABANDONED
from fl_server.engine import counts_against
from netem.profiles import LinkProfile
from netem.testbed import Testbed
from netem.tunlink import DelayLine, inject
from strategies.codecs import make_client_codec, parse_codec
from strategies.dga import DGAServer
from strategies.downlink import model_digest
from strategies.rounds import MAX_FAILED_REPLIES, RoundEngine, Update
from tests.conftest import (
    edgefl,
    host_testbed_links,
    namespaces_of,
    processes_of,
    rows_so_far,
    start_edgefl,
    wait_for_rows,
)

LAYOUT = (("w", (2,)),)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


# ----- the engine: nodes that come and go ------------------------------------------------------------------
def _update(values: list[float], round_: int) -> Update:
    encoded = make_client_codec(parse_codec("none"), LAYOUT, seed=0).encode(np.array(values, dtype=np.float32), round_)
    stype, payload = encoded.stype, encoded.payload
    return Update(round_, stype, payload, 1)


def test_a_partition_back_under_a_new_node_id_cannot_contribute_a_round_twice() -> None:
    engine = RoundEngine(np.zeros(2, np.float32), LAYOUT, rounds=3, num_clients=2, strategy=DGAServer(1))
    engine.next_request(10)
    assert engine.receive(10, [_update([1, 1], 1)], partition=0) == []
    engine.retire(10)  # its SuperNode died; it comes back as node 11, same partition
    fresh = engine.next_request(11)
    assert fresh is not None and fresh.global_round == 0 and fresh.next_round == 1  # a fresh client
    [repeat] = engine.receive(11, [_update([5, 5], 1), _update([2, 2], 2)], partition=0)
    assert repeat.round == 1 and repeat.client == 0 and repeat.reason.startswith("repeated")
    engine.next_request(20)
    assert engine.receive(20, [_update([3, 3], 1)], partition=1) == []
    [closed] = engine.close_rounds(now=0.0)
    assert closed.clients == [0, 1]
    np.testing.assert_allclose(closed.global_params, [2, 2])  # (1 + 3) / 2: the repeat was not counted


def test_a_retired_nodes_messages_in_flight_are_forgotten() -> None:
    engine = RoundEngine(np.zeros(2, np.float32), LAYOUT, rounds=4, num_clients=2, strategy=DGAServer(1))
    assert engine.next_request(1) is not None
    assert engine.next_request(1) is None  # one message in flight: the limit
    engine.retire(1)
    again = engine.next_request(1)  # the same id seen anew starts from nothing in flight, with the global model
    assert again is not None and again.global_round == 0


def test_a_client_whose_update_came_late_is_asked_for_the_newest_round() -> None:
    engine = RoundEngine(
        np.zeros(2, np.float32), LAYOUT, rounds=6, num_clients=2, strategy=DGAServer(1), quorum=0.5, deadline_s=1
    )
    engine.start_clock(0.0)
    engine.next_request(1)
    engine.next_request(2)
    assert engine.receive(1, [_update([1, 1], 1)], partition=0) == []
    assert [c.round for c in engine.close_rounds(now=5.0)] == [1]  # at its deadline, without client 2
    [late] = engine.receive(2, [_update([1, 1], 1)], partition=1)
    assert late.reason.startswith("late")
    catch_up = engine.next_request(2)
    # Round 2 will close before its reply arrives: it trains round 3, the newest the global model of 1 allows.
    assert catch_up is not None and catch_up.global_round == 1 and catch_up.next_round == 3


def test_a_failed_message_sends_the_global_model_again() -> None:
    engine = RoundEngine(np.zeros(2, np.float32), LAYOUT, rounds=2, num_clients=1)
    first = engine.next_request(1)
    assert first is not None and first.global_round == 0
    engine.fail(1)  # e.g. the ClientApp could not reach its agent: the model may never have arrived
    retry = engine.next_request(1)
    assert retry is not None and retry.global_round == 0 and retry.global_params is not None


def test_the_engine_is_stuck_once_too_few_clients_can_reach_a_quorum() -> None:
    """A client's own failures and updates refused as unusable count, in a row; lost messages and a late update do
    not, and one usable update starts the count again. Quorum 0.5 of 4: stuck when 3 clients cannot contribute."""
    engine = RoundEngine(np.zeros(2, np.float32), LAYOUT, rounds=3, num_clients=4, quorum=0.5)
    truncated = dataclasses.replace(_update([1, 1], 1), payload=b"\x00")
    for client in range(4):
        engine.next_request(client)
    for client in (0, 1):
        for _ in range(MAX_FAILED_REPLIES):
            engine.fail(client)
    for _ in range(3 * MAX_FAILED_REPLIES):
        engine.fail(2, raised=False)  # the SuperLink lost the messages: not the client's failure
    assert not engine.stuck
    for _ in range(MAX_FAILED_REPLIES - 1):
        engine.fail(3)
    [refused] = engine.receive(3, [truncated], partition=3)
    assert refused.reason.startswith("malformed") and refused.invalid and engine.stuck
    assert engine.receive(1, [_update([1, 1], 1)], partition=1) == []  # client 1 trains again
    assert not engine.stuck


def test_the_engine_is_stuck_when_failing_clients_leave_a_round_short_of_its_quorum() -> None:
    """Two clients fail for good, a third's update for the round was refused: the round has one usable update of
    the two it needs and no client left that could give another (TernGrad both ways, seen in bench/codecs.py)."""
    engine = RoundEngine(np.zeros(2, np.float32), LAYOUT, rounds=3, num_clients=4, quorum=0.5)
    truncated = dataclasses.replace(_update([1, 1], 1), payload=b"\x00")
    for client in range(4):
        engine.next_request(client)
    assert engine.receive(0, [_update([1, 1], 1)], partition=0) == []
    for _ in range(MAX_FAILED_REPLIES):
        engine.fail(2)
    assert not engine.stuck  # clients 1 and 3 may still answer round 1
    assert engine.receive(1, [truncated], partition=1)[0].invalid
    assert not engine.stuck
    for _ in range(MAX_FAILED_REPLIES):
        engine.fail(3)
    assert engine.stuck and engine.close_rounds(now=1e9) == []


# ----- checkpoints and rounds.jsonl ------------------------------------------------------------------------
def test_checkpoint_holds_what_resume_needs(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    assert folder.read_checkpoint() is None
    params = np.arange(6, dtype=np.float32)
    folder.save_checkpoint(Checkpoint(4, params, 12.5, np.array([0.5, 0.25]), params / 2))
    checkpoint = folder.read_checkpoint()
    assert checkpoint.round == 4 and checkpoint.wall_s == 12.5
    np.testing.assert_array_equal(checkpoint.params, params)
    np.testing.assert_array_equal(checkpoint.recent_norms, [0.5, 0.25])
    np.testing.assert_array_equal(checkpoint.momentum, params / 2)
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]  # no temporary file left


def test_rows_after_the_checkpoint_and_a_torn_line_are_cut(tmp_path: Path) -> None:
    rows = [json.dumps({"round": r}) for r in (1, 2, 3)]
    (tmp_path / ROUNDS).write_text("\n".join(rows) + '\n{"round": 4, "wal')  # killed mid-write
    truncate_rounds(tmp_path, 2)
    assert [r["round"] for r in read_rounds(tmp_path)] == [1, 2]


# ----- the user-space link's faults ------------------------------------------------------------------------
@pytest.fixture
def wire() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A datagram socket pair stands in for the TUN device a DelayLine writes to (no root needed)."""
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    receiver.setblocking(False)
    with sender, receiver:
        yield sender, receiver


def test_a_loss_burst_drops_its_fraction_then_ends(wire) -> None:
    line = DelayLine(LinkProfile(delay_ms=0.0), wire[0].fileno(), random.Random(7))
    inject("loss 20 10", [line], now=100.0)
    for _ in range(5000):
        line.push(b"x", now=105.0)
    assert 0.17 < 1 - len(line.queue) / 5000 < 0.23
    line.queue.clear()
    for _ in range(1000):
        line.push(b"x", now=110.5)  # the burst is over
    assert len(line.queue) == 1000


def test_a_stall_holds_everything_then_releases_it_in_order(wire) -> None:
    sender, receiver = wire
    line = DelayLine(LinkProfile(delay_ms=10.0), sender.fileno(), random.Random(1))
    line.push(b"a", now=0.0)
    inject("stall 5", [line], now=0.001)
    line.push(b"b", now=1.0)
    assert line.next_release() == pytest.approx(5.001)
    line.release(now=4.9)
    with pytest.raises(BlockingIOError):
        receiver.recv(8)
    line.release(now=5.1)
    assert [receiver.recv(8), receiver.recv(8)] == [b"a", b"b"]


@pytest.mark.parametrize("command", ["loss 20", "loss 120 5", "stall -1", "stall x", "reboot"])
def test_malformed_fault_commands_are_refused(wire, command: str) -> None:
    line = DelayLine(LinkProfile(delay_ms=0.0), wire[0].fileno(), random.Random(1))
    with pytest.raises(ValueError):
        inject(command, [line], now=0.0)


# ----- federations -----------------------------------------------------------------------------------------
FAST = {"dataset": "digits", "partition": "iid", "local_steps": 5}


@contextlib.contextmanager
def federation(
    config: RunConfig, before_submit: Callable[[str, ProcessGroup], None] = lambda address, procs: None
) -> Iterator[tuple[Testbed, ProcessGroup, Path]]:
    """What ``edgefl run`` does, in this process, so that the test holds the testbed and the processes (to take
    links down and to kill and restart clients; ``before_submit`` gets the SuperLink's address to start more);
    ``follow`` then waits for the end."""
    run_dir = prepare_run_dir(config)
    with local_federation(config, run_dir, lambda line: None) as local:
        save_config(local.config, run_dir / "config.toml")
        before_submit(local.address, local.procs)
        local.submit(local.config, run_dir)
        local.place_devices()
        yield local.place.testbed, local.procs, run_dir


def _finish(config: RunConfig, procs: ProcessGroup, run_dir: Path) -> list[dict]:
    follow(config, run_dir, procs, lambda line: None)
    rows = read_rounds(run_dir)
    assert [r["round"] for r in rows] == list(range(1, config.rounds + 1))
    return rows


@pytest.fixture
def clean_testbed() -> Iterator[None]:
    """The test leaves no namespace behind, nor a device (with its qdiscs) on the host."""
    namespaces, links = namespaces_of(), host_testbed_links()
    yield
    assert namespaces_of() == namespaces, "namespaces left behind"
    assert host_testbed_links() == links, "devices left behind on the host"


TESTBED = {**FAST, "strategy": "dga:1", "clients": 3, "quorum": 0.6, "round_deadline_s": 8.0}  # over home-wifi


def _testbed_config(run_dir: Path, **settings) -> RunConfig:
    return build_config(**{**TESTBED, **settings}, profile="home-wifi", out=str(run_dir))


def _wait_ready(agent: subprocess.Popen[bytes], ready: Path) -> None:
    """Until a restarted agent is ready (its data loaded); not procs.wait_until: that fails on the killed processes
    still listed."""
    deadline = time.monotonic() + 180  # its start-up: torch and the data, on a loaded host
    while not ready.exists():
        assert agent.poll() is None and time.monotonic() < deadline, "the restarted agent did not come up"
        time.sleep(0.2)


def _trained(row: dict, client: int) -> bool:
    """Whether ``client`` brought a trained update to this round: counted, or refused as late (on a loaded host
    a client that lost a round's head start may stay a deadline behind; its reply still says it trains)."""
    late = any(r["client"] == client and r["reason"].startswith("late:") for r in row["rejected"])
    return client in row["clients"] or late


@contextlib.contextmanager
def _logs_on_failure(log_dir: Path, *names: str) -> Iterator[None]:
    """A failed wait says what the named processes last logged (their logs are gone with the test's folder)."""
    try:
        yield
    except AssertionError as exc:
        logs = "".join(f"\n--- {name}.log:\n{tail(log_dir / f'{name}.log', 40)}" for name in names)
        raise AssertionError(f"{exc}{logs}") from None


COMEBACK_S = 300.0  # how long a killed client may take to train again: start-up, Flower's 60 s, a loaded host
RESTART_S = 10.0  # systemd's RestartSec in edgefl client's unit: how soon a device starts a SuperNode again


def _restart_until_joined(procs: ProcessGroup, name: str, argv: list[str]) -> None:
    """Start the SuperNode ``argv`` again until the SuperLink accepts it, as ``edgefl client``'s systemd unit does:
    under node authentication Flower refuses a device's key while the node it names is still active (the SuperNode
    exits, code 305) until it drops it, after ~60 s without its heartbeats."""
    log, deadline = procs.log_dir / f"{name}.log", time.monotonic() + COMEBACK_S
    while True:
        offset = log.stat().st_size if log.exists() else 0
        proc = procs.start(name, argv)
        while proc.poll() is None and JOINED not in tail_from(log, offset):
            assert time.monotonic() < deadline, f"{name} neither joined nor exited within {COMEBACK_S:.0f} s"
            time.sleep(0.2)
        if proc.poll() is None:
            return
        assert time.monotonic() + RESTART_S < deadline, f"{name} was refused for {COMEBACK_S:.0f} s:\n{tail(log)}"
        time.sleep(RESTART_S)


@pytest.mark.federation
@pytest.mark.root
@needs_root
def test_a_killed_agent_and_a_killed_supernode_both_come_back(run_dir: Path, clean_testbed: None) -> None:
    """kill -9 of client 3's agent while it holds a task (its SuperNode lives on; the agent, restarted, answers
    the task it held with an error at once, and the server sends the model again) and of client 2's SuperNode under
    a running agent (its device starts it again until it is accepted: its key names the dead node, refused until
    Flower drops it, 60 s without its heartbeats; then it trains again). The run has rounds enough for both
    comebacks on a loaded host: the test waits for each (bounded), then stops it. Client 3 trains on a Raspberry
    Pi 3's core (a cgroup CPU cap), so that it holds each task for seconds while the others train briefly: the
    minute of waiting for Flower costs the machine little."""
    config = _testbed_config(run_dir, rounds=1000, clients=4, quorum=0.5, round_deadline_s=4.0, local_steps=60,
                             device_profile="laptop,laptop,laptop,rpi3")  # fmt: skip
    with federation(config) as (_, procs, run_dir):
        wait_for_rows(run_dir, lambda rows: len(rows) >= 2, "round 2")
        named = dict(procs.procs)
        killed = {"agent": named["agent-3"], "supernode": named["supernode-2"]}
        agent_argv = killed["agent"].args
        held = Path(agent_argv[agent_argv.index("--held-tasks") + 1])
        before, deadline = set(held.glob("*.task")), time.monotonic() + 60
        # A task's file is written once its message is pulled, just after its claim and first heartbeat: killed
        # then, the agent leaves a task Flower keeps for 60 s, the longest its restart may take (it trains for
        # seconds). Not while an earlier task's reply is on its way to the SuperNode (its file is removed once
        # the task is served): Flower's SuperNode waits without end for the objects of a reply it got only in
        # part (README, "Faults").
        while not ((now := set(held.glob("*.task"))) - before and not now & before):
            assert time.monotonic() < deadline, "agent 3 never took a new task with the earlier ones served"
            time.sleep(0.01)
        for proc in killed.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        killed_after = len(rows_so_far(run_dir))
        # Its device starts the agent again at once (same namespace, port and held tasks) as ``edgefl client``
        # does: without the launcher's preload of the coming run (its data loads with its first message). Its
        # start-up (tens of seconds on a loaded host) must end within Flower's 60 s task expiry for it to answer
        # the task it held itself.
        ready = Path(agent_argv[agent_argv.index("--ready-file") + 1])
        ready.unlink()
        agent = procs.start("agent-restarted", agent_argv[: agent_argv.index("--job")])
        # The run goes on without them: a round closes at its deadline with the quorum, without client 2 (its node
        # is gone until Flower drops it; client 3, restarted and no longer on its device's core, may be back first).
        wait_for_rows(
            run_dir,
            lambda rows: any(r["closed_by"] == "deadline" and 2 not in r["clients"] for r in rows[killed_after:]),
            "a quorum without client 2",
        )
        restarted_after = len(rows_so_far(run_dir))
        _restart_until_joined(procs, "supernode-restarted", killed["supernode"].args)
        _wait_ready(agent, ready)
        ready_after = len(rows_so_far(run_dir))
        with _logs_on_failure(procs.log_dir, "agent-restarted", "supernode-3", "supernode-restarted"):
            wait_for_rows(
                run_dir, lambda rows: any(_trained(r, 3) for r in rows[ready_after:]), "client 3 back", COMEBACK_S
            )
            rows = wait_for_rows(
                run_dir,
                lambda rows: any(_trained(r, 2) for r in rows[restarted_after + 1 :]),
                "client 2 back",
                COMEBACK_S,
            )
        server_log = (run_dir / "server.log").read_text()
    # Client 3 came back through its held task, answered with an error (not after Flower's 60 s task expiry).
    assert ABANDONED in (procs.log_dir / "agent-restarted.log").read_text()
    assert f"client error: {ABANDONED}" in json.dumps(rows[killed_after:])
    assert all(len(r["clients"]) >= 2 and len(set(r["clients"])) == len(r["clients"]) for r in rows)
    # Partition 2 is trained again once its device's SuperNode came back: under node authentication its key is one
    # node of Flower's, refused while the dead one is still active and taken again once Flower dropped it.
    trainers = re.findall(r"node (\d+) (?:trains|takes over) partition 2", server_log)
    assert len(trainers) == 2 and len(set(trainers)) == 1, trainers


@pytest.mark.federation
@pytest.mark.root
@needs_root
@pytest.mark.xdist_group("federation-3-home-wifi")
def test_a_client_whose_link_is_down_for_20_s_rejoins(run_dir: Path, shared_federation) -> None:
    """On the testbed federation the next test submits its run to too (``SharedFederation``)."""
    shared = shared_federation(3, "home-wifi")
    testbed, procs = shared.federation.place.testbed, shared.federation.procs
    config = shared.submit(run_dir, **TESTBED, rounds=16)
    wait_for_rows(run_dir, lambda rows: len(rows) >= 2, "round 2")
    testbed.set_link_up(1, False)
    down_at, down_after = time.monotonic(), len(rows_so_far(run_dir))
    # The outage lasts 20 s and at least one round closes without client 1 meanwhile.
    wait_for_rows(
        run_dir,
        lambda rows: time.monotonic() - down_at >= 20 and any(1 not in r["clients"] for r in rows[down_after:]),
        "20 s without client 1",
    )
    testbed.set_link_up(1, True)
    up_after = len(rows_so_far(run_dir))
    wait_for_rows(run_dir, lambda rows: any(1 in r["clients"] for r in rows[up_after:]), "client 1 back", 120)
    rows = _finish(config, procs, run_dir)
    assert any(1 not in r["clients"] for r in rows[down_after:up_after])


@pytest.mark.federation
@pytest.mark.root
@needs_root
@pytest.mark.xdist_group("federation-3-home-wifi")
def test_a_loss_burst_and_a_stall_slow_their_client_not_the_run(run_dir: Path, shared_federation) -> None:
    shared = shared_federation(3, "home-wifi")
    testbed, procs = shared.federation.place.testbed, shared.federation.procs
    config = shared.submit(run_dir, **TESTBED, rounds=12)
    before = wait_for_rows(run_dir, lambda rows: len(rows) >= 3, "round 3")
    testbed.loss_burst(0, 20, seconds=15)
    testbed.stall(1, seconds=5)
    burst_after = len(before)
    rows = _finish(config, procs, run_dir)
    walls = [r["wall_s"] for r in rows]
    normal_gap = max(np.diff(walls[:burst_after]))
    burst_gaps = np.diff(walls[burst_after - 1 :])
    # No round waits on the slowed clients for longer than its deadline (plus an ordinary round's time).
    assert max(burst_gaps) <= config.round_deadline_s + 2 * normal_gap + 1.0, (list(burst_gaps), normal_gap)
    assert all(len(r["clients"]) >= 2 for r in rows)
    for client in (0, 1):  # slowed, not lost: each contributes again after its fault began
        assert any(client in r["clients"] for r in rows[burst_after:]), client


# ----- who trains which partition ---------------------------------------------------------------------------
@pytest.mark.federation
def test_a_run_trains_exactly_its_partitions_and_keeps_a_second_claim_as_a_spare(run_dir: Path) -> None:
    """Two more devices join a 2-partition run: one claims partition 1 again (it waits as a spare), one comes
    from a 3-partition split (its agent refuses the run, the server logs why). Only partitions 0 and 1 train."""
    config = build_config(**FAST, clients=2, rounds=30, eval_examples=100, out=str(run_dir))
    extras = {"again": "partition-id=1 num-partitions=2", "odd": "partition-id=2 num-partitions=3"}
    preload = {"again": ["--job", str(run_dir / ".job.json"), "--partition-id", "1", "--num-partitions", "2"]}

    def start_extras(address: str, procs: ProcessGroup) -> None:
        """Both extras are connected before the run starts, so the server meets four nodes at once."""
        runtimes = {name: NodeRuntime.create(run_dir, name) for name in extras}
        for name, runtime in runtimes.items():  # both start up side by side
            procs.start(f"agent-{name}", runtime.agent_argv(*preload.get(name, [])))
        for name, runtime in runtimes.items():
            procs.wait_until(f"agent {name}", runtime.ready_file.exists, 90)
            procs.start(f"supernode-{name}", supernode_argv(address, None, extras[name], serve=runtime))
        for name in [*extras, "0", "1"]:
            log = procs.log_dir / f"supernode-{name}.log"
            procs.wait_until(f"SuperNode {name}", lambda log=log: "SuperNode ID:" in tail(log, 200), 90)

    with federation(config, start_extras) as (_, procs, run_dir):
        rows = _finish(config, procs, run_dir)
    assert all(r["clients"] == [0, 1] and r["rejected"] == [] for r in rows)
    server_log = (run_dir / "server.log").read_text()
    assert "also claims partition 1" in server_log and "waits as a spare" in server_log
    refusal = "this device is partition 2 of 3; the run 'run' trains partitions 0..1 of 2"
    assert "refused node" in server_log and refusal in server_log
    assert refusal in (run_dir / "logs" / "agent-odd.log").read_text()


# ----- the launcher killed, and the run resumed -------------------------------------------------------------
@dataclasses.dataclass
class KilledRun:
    run_dir: Path
    rounds: int
    running: list[str]  # the run's processes just before its launcher was killed
    left: list[str]  # those still running 20 s after it


ONE_KILLED_RUN = pytest.mark.xdist_group("killed-run")  # the tests of one killed run: on one pytest-xdist worker


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledRun]:
    """kill -9 of ``edgefl run`` mid-run (what an OOM kill or a power cut of the launcher does), once round 3's row
    is written; then, for 20 s, which of its processes still run. The two tests below read this one run: that
    nothing outlives the launcher, and that ``--resume`` goes on from its checkpoint."""
    run_dir, rounds = tmp_path_factory.mktemp("killed") / "run", 12
    args = ["--strategy", "dga:1", "--dataset", "digits", "--partition", "iid", "--clients", "2",
            "--rounds", str(rounds), "--local-steps", "5", "--eval-examples", "100"]  # fmt: skip
    launcher = start_edgefl("run", *args, "--out", str(run_dir))
    try:
        wait_for_rows(run_dir, 3, "round 3", proc=launcher)
        running = processes_of(run_dir)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while (left := processes_of(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        launcher.kill()
        launcher.wait()
        for line in processes_of(run_dir):  # what outlived it (the test below fails then): as a power cut would
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
    yield KilledRun(run_dir, rounds, running, left)
    assert not processes_of(run_dir)


@pytest.mark.federation
@ONE_KILLED_RUN
def test_a_launcher_killed_with_sigkill_leaves_nothing_running(killed_run: KilledRun) -> None:
    """Every process of its federation — SuperLink, SuperExec, ServerApp, both agents and both SuperNodes — ends
    within 20 s of ``edgefl run``'s kill -9 (each is signalled by the kernel or watches its launcher's PID; Flower's
    own processes follow the process that started them)."""
    assert len(killed_run.running) >= 7, killed_run.running
    assert not killed_run.left, f"still running 20 s after the launcher was killed: {killed_run.left}"


@pytest.mark.federation
@ONE_KILLED_RUN
def test_a_server_killed_mid_run_resumes_from_its_checkpoint(killed_run: KilledRun) -> None:
    run_dir, rounds = killed_run.run_dir, killed_run.rounds
    checkpoint = RunFolder(run_dir).read_checkpoint()
    assert 3 <= checkpoint.round < rounds
    done = edgefl("run", "--resume", str(run_dir))
    assert done.returncode == 0, done.stderr
    rows = read_rounds(run_dir)
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    # The resumed run starts from exactly the checkpointed model, and the clients are sent that model.
    started = f"from the global model of round {checkpoint.round} (sha256 {model_digest(checkpoint.params)})"
    assert started in (run_dir / "server.log").read_text()
    for client in (0, 1):  # the resumed agent's first reply: trained from the global model of the checkpoint
        resumed = (run_dir / "logs" / f"agent-{client}.log").read_text().rsplit("new session", 1)[1]
        first_reply = next(line for line in resumed.splitlines() if "reply: rounds" in line)
        assert f"global model of round {checkpoint.round}, held" in first_reply, first_reply
    # The clock went on: rounds closed by one reply share a time, and the resumed rounds come after the killed one.
    assert all(rows[i]["wall_s"] <= rows[i + 1]["wall_s"] for i in range(rounds - 1))
    assert rows[checkpoint.round]["wall_s"] > rows[checkpoint.round - 1]["wall_s"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == rounds and summary["final_accuracy"] == rows[-1]["test_accuracy"]
    assert not processes_of(run_dir)


@pytest.mark.federation
@pytest.mark.xdist_group("federation-2-loopback")
def test_a_run_whose_training_diverges_on_every_client_stops_with_the_reason(run_dir: Path, shared_federation) -> None:
    """Resending the global model cannot help a client whose training gives NaN: the run ends, with one line (the
    one ``edgefl run`` prints after ``edgefl: error:``)."""
    with pytest.raises(LaunchError) as stopped:
        shared_federation(2).run(run_dir, partition="iid", rounds=5, local_steps=5, lr=1e30, eval_examples=100)
    reason = str(stopped.value)
    assert "cannot close" in reason and "NaN or Inf" in reason, reason
    assert len(reason.strip().splitlines()) == 1, reason


def test_resume_needs_an_unfinished_run_with_a_checkpoint(tmp_path: Path, edgefl_main) -> None:
    run = tmp_path / "run"
    run.mkdir()
    save_config(build_config(**FAST, out=str(run)), run / "config.toml")
    done = edgefl_main("run", "--resume", str(run))
    assert done.returncode == 2 and "nothing to resume" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = edgefl_main("run", "--resume", str(tmp_path / "missing"))
    assert done.returncode == 2 and "does not exist" in done.stderr


UNSENT = Error(ErrorCode.MESSAGE_UNAVAILABLE, f"{UNDELIVERED} The sender may not have completed the upload.")
LOST = Error(ErrorCode.MESSAGE_UNAVAILABLE, "Error: Message Unavailable - it may have expired due to its TTL")


def test_a_round_with_its_quorum_waits_for_the_silent_but_not_for_one_that_failed() -> None:
    """Three of four clients answered round 1: it waits for the fourth while that one has only been slow, and closes
    at once when it fails (one error, or a reply it listed and never uploaded, e.g. refused at the gateway as larger
    than the run allows) — a node failing on purpose cannot hold each round to its deadline."""
    for fails in (lambda e: e.fail(3), lambda e: e.malformed(3), lambda e: e.fail(3, raised=counts_against(UNSENT))):
        engine = RoundEngine(np.zeros(2, np.float32), LAYOUT, rounds=3, num_clients=4, quorum=0.5, deadline_s=60.0)
        engine.start_clock(0.0)
        for client in range(4):
            engine.next_request(client)
        for client in range(3):
            assert engine.receive(client, [_update([1, 1], 1)], partition=client) == []
        assert engine.close_rounds(now=1.0) == []
        fails(engine)
        [closed] = engine.close_rounds(now=2.0)
        assert (closed.clients, closed.closed_by) == ([0, 1, 2], "all")
    assert not counts_against(LOST)  # the message expired or its node went away: Flower's doing, not the node's


def test_a_node_whose_replies_fail_is_sent_a_bounded_number_of_messages_a_round() -> None:
    """Malformed and error replies each count as the node's failure; after ``MAX_FAILED_REPLIES`` of them while the
    global model stays put it is sent nothing more until the model moves (before, each was answered with a new
    message at once: thousands inside one open round). A reply with another message's key counts for nobody: any
    node may push it."""
    engine = RoundEngine(np.zeros(2, np.float32), LAYOUT, rounds=3, num_clients=2, quorum=0.5, deadline_s=1.0)
    engine.start_clock(0.0)
    failed = 0
    while engine.next_request(1) is not None:
        engine.lost(1)  # not its failure: it is asked again
        assert engine.next_request(1) is not None
        if failed % 2:
            engine.malformed(1)
        else:
            engine.fail(1)
        failed += 1
        assert failed <= MAX_FAILED_REPLIES
    assert failed == MAX_FAILED_REPLIES
    assert engine.next_request(0) is not None and engine.receive(0, [_update([1, 1], 1)], partition=0) == []
    [closed] = engine.close_rounds(now=0.5)  # it has its quorum: it does not wait out the deadline for node 1
    assert (closed.clients, closed.closed_by) == ([0], "all")
    assert engine.next_request(1) is not None  # the model moved: it is asked again

"""Hostile devices in a real federation, and a stranger at the server's door.

A real deployment of ``--clients`` devices (8) on the namespaced testbed (``--profile lan``: the SuperLink on the
server namespace's loopback behind the gateway, each device in a namespace of its own), run twice with the same seed:
clean, and with the last ``--attackers`` (2) hostile (``bench/hostile_agent.py``: edgefl's own agent whose replies
carry attacks). The attacks are dealt among the hostile devices; each attacks from round 1 on, in every round but
every ``--honest-every``-th, one attack per reply: overflowing and non-finite fields, inflated weights, replayed and
future rounds, malformed and oversized payloads of every codec's wire type, decoder bombs, non-finite values, replies
for messages it was not sent. Meanwhile a stranger in the first hostile device's network namespace tries the server's
Control and ServerAppIo APIs through the gateway, every other port the server namespace listens on, and Flower's own
``flwr supernode register``, ``flwr ls`` and ``flwr run``, then holds ``--slow-connections`` slow connections on the
gateway from each hostile device's address at once for SLOW_HOLD_S. Criteria: every round completes; every attack is
refused, with the server's reason; the final accuracy (the mean of the last 3 evaluations) is within 1 point of the
clean run's; the server's peak RSS (VmHWM, the sum of SuperLink, SuperExec and ServerApp) is within 20 % of the clean
run's; the stranger is refused everywhere; the honest devices' messages (median round trip) are at most 1.5x slower
while the slow connections are held than before. ``--list`` shows the attacks. A reply over what the run allows (15 and
17 MB; ``upload_bound_bytes`` is this run's bound) is refused at the gateway before the SuperLink stores any of it
(``contract.uploads``). Updates within the bound that point the wrong way are ``bench/adaptive_attackers.py``'s.

    python bench/hostile_clients.py [--clients 8] [--attackers 2] [--rounds N] [--honest-every 2]
        [--attacks NAME,NAME] [--slow-connections 1000] [--no-clean] [--dataset digits] [--local-steps 5]
        [--out runs/bench-hostile-clients]

Writes OUT/result.md and OUT/result.json (``clients``, ``attackers``, ``attacks_tried``, ``attacks_refused``,
``rounds``, ``rounds_completed``, ``accuracy_delta_points``, ``stranger_refused``, ``server_peak_rss_mb``,
``upload_bound_bytes``, ``slow_connections_round_ratio``, and a row per attack and per probe); the two runs' folders
are OUT/clean and OUT/hostile (the attacks each hostile client sent: OUT/hostile/attacks-CLIENT.jsonl)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tomli_w
from hostile_agent import ATTACKS, FINAL, FORGED, Plan, rounds_needed, schedule
from results import write_result

from contract.run_folder import CONFIG, MESSAGES, ROUNDS, SERVER_LOG, SUMMARY, read_rounds
from contract.settings import RunConfig, build_config
from contract.transport import UNDELIVERED
from edgefl.certs import make_node_keys
from edgefl.forkserver import ForkedProcess, ForkServer
from edgefl.launcher import (
    FEDERATION,
    WARM_SERVERAPP,
    LocalFederation,
    app_project,
    flower_env,
    local_federation,
    run_flwr,
    run_on,
    write_flwr_home,
)
from edgefl.processes import LaunchError, ProcessGroup, interrupt_on_signals, process_tree

HOSTILE_AGENT = Path(__file__).resolve().parent / "hostile_agent.py"
CLIENTS, ATTACKERS = 8, 2  # defaults: the devices, and how many of them (the last partitions) are hostile
VICTIM = 0  # the device whose messages the hostile ones answer in their forged replies
WINDOW = 3  # evaluations averaged: a run's final accuracy
SERVER_ROLES = {"flower-superlink": "SuperLink", "flower-superexec": "SuperExec", "flwr-serverapp": "ServerApp"}
RSS_POLL_S = 0.2

# The stranger's requests, from its namespace: for each [port, path], "tcp" connects to the port; a path is POSTed
# over TLS (the server's CA: it is public, every device has it) with no client certificate. A JSON line each.
PROBE = """
import http.client, json, socket, ssl, sys
host, ca, probes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for port, path in probes:
    try:
        if path == "tcp":
            socket.create_connection((host, port), timeout=5).close()
            print(json.dumps({"status": "connected"}))
            continue
        conn = http.client.HTTPSConnection(host, port, context=ssl.create_default_context(cafile=ca), timeout=10)
        conn.request("POST", path, body=b"", headers={"Content-Type": "application/protobuf"})
        response = conn.getresponse()
        body = response.read().decode(errors="replace").strip()
        print(json.dumps({"status": response.status, "body": body.splitlines()[0][:160] if body else ""}))
    except (OSError, ssl.SSLError) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""
# Slow connections, from the stranger's namespace: COUNT connections to the gateway held for HOLD_S seconds, half of
# them bare TCP (no TLS handshake), half a TLS handshake and a request's first header line, never finished; one nginx
# closes is opened again. Prints one JSON line: the monotonic clock's start and end of the hold (the host's one
# clock: messages.jsonl's sent_at is on it too), how many were open at the end, opened and closed by the gateway.
SLOW = """
import json, socket, ssl, sys, time
host, port, ca, count, hold_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
context = ssl.create_default_context(cafile=ca)
def connect(i):
    sock = socket.create_connection((host, port), timeout=10)
    if i % 2:
        sock = context.wrap_socket(sock, server_hostname=host)
        sock.sendall(b"POST /v1/fleet/push-object HTTP/1.1\\r\\n")
    sock.setblocking(False)
    return sock
held, opened, closed, failed = {}, 0, 0, 0
start = time.monotonic()
while time.monotonic() - start < hold_s:
    for i in range(count):
        sock = held.get(i)
        if sock is not None:
            try:
                if sock.recv(1) == b"":
                    raise ConnectionError
                continue
            except (BlockingIOError, ssl.SSLWantReadError):
                continue
            except OSError:
                sock.close()
                closed += 1
        try:
            held[i] = connect(i)
            opened += 1
        except OSError:
            held.pop(i, None)
            failed += 1
    time.sleep(0.5)
end = time.monotonic()
print(json.dumps({"start": start, "end": end, "open": len(held), "opened": opened, "closed_by_gateway": closed,
                  "failed": failed}))
"""
SLOW_CONNECTIONS, SLOW_HOLD_S = 1000, 40.0
SLOW_RATIO_BAR = 1.5  # honest devices' messages at most this much slower while the slow connections are held
HTTP_PROBES = {
    "Control API: list runs (flwr ls)": "/v1/control/list-runs",
    "Control API: start a run (flwr run)": "/v1/control/start-run",
    "Control API: stop a run": "/v1/control/stop-run",
    "Control API: stream a run's logs": "/v1/control/stream-logs",
    "ServerAppIo: claim the ServerApp's task": "/v1/runtime/acquire-task",
    "ServerAppIo: list the nodes": "/v1/runtime/get-nodes",
    "ServerAppIo: pull the devices' replies": "/v1/runtime/pull-messages",
    "ServerAppIo: push messages to devices": "/v1/runtime/push-messages",
    "path trick: /v1/fleet/../control/": "/v1/fleet/../control/list-runs",
    "path trick: /v1/fleet/%2e%2e/control/": "/v1/fleet/%2e%2e/control/list-runs",
    "path trick: /v1/fleet/..%2fcontrol/": "/v1/fleet/..%2fcontrol/list-runs",
}


class WithHostileAgent(ProcessGroup):
    """A federation's processes, each hostile client's agent started as the hostile agent instead of forked (the
    same command line, with ``bench/hostile_agent.py --plan PLAN`` in place of ``-m fl_client.node``)."""

    def __init__(self, log_dir: Path, env: dict[str, str], plans: dict[int, Path]) -> None:
        super().__init__(log_dir, env)
        self.plans = {f"agent-{client}": plan for client, plan in plans.items()}

    def fork(self, server: ForkServer, name: str, module: str, args: list[str], netns: str | None,
             command: list[str]) -> ForkedProcess | subprocess.Popen[bytes]:  # fmt: skip
        if name not in self.plans:
            return super().fork(server, name, module, args, netns, command)
        at = command.index("fl_client.node")
        plan = str(self.plans[name])
        return self.start(name, [*command[: at - 1], str(HOSTILE_AGENT), "--plan", plan, *command[at + 1 :]])


@contextlib.contextmanager
def federation(
    config: RunConfig, plans: dict[int, Path], progress: Callable[[str], None]
) -> Iterator[tuple[LocalFederation, str]]:
    """``edgefl.launcher.local_federation`` for ``config`` (home: its run folder), with the hostile agents of
    ``plans`` (client → its plan's file); yields it and the address devices dial (the gateway's)."""
    processes = functools.partial(WithHostileAgent, plans=plans) if plans else ProcessGroup
    with local_federation(config, Path(config.out).resolve(), progress, processes) as fed:
        yield fed, fed.device_address


class PeakRss(threading.Thread):
    """Polls the peak RSS (VmHWM) of the SuperLink and its descendants (SuperExec, the ServerApp: forked warm by
    the fork server of ``roots``, named by its ``comm``) until stopped: the highest seen of each role, in MB."""

    def __init__(self, roots: list[int]) -> None:
        super().__init__(daemon=True, name="peak-rss")
        self.roots = roots
        self.peaks: dict[str, float] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(RSS_POLL_S):
            self.sample()

    def sample(self) -> None:
        for pid in process_tree(self.roots):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                command += " " + Path(f"/proc/{pid}/comm").read_text().strip()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            role = next((role for name, role in SERVER_ROLES.items() if name in command), None)
            found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
            if role and found:
                self.peaks[role] = max(self.peaks.get(role, 0.0), int(found.group(1)) / 1024)

    def result(self) -> dict[str, float]:
        self.halt.set()
        self.join()
        self.sample()
        return {**{role: round(self.peaks.get(role, 0.0), 1) for role in SERVER_ROLES.values()},
                "sum": round(sum(self.peaks.values()), 1)}  # fmt: skip


class Stranger(threading.Thread):
    """Someone in the hostile devices' network namespaces who is no submitter: once the run has closed its first
    round, tries every API but the Fleet API through the gateway, every other port the server namespace listens on,
    and Flower's CLI (from the first one's), then holds ``slow_connections`` slow connections on the gateway from each
    of them at once (``SLOW``). ``probes``: what each try got, and whether it was refused."""

    def __init__(
        self, fed: LocalFederation, gateway: str, run_dir: Path, clients: list[int], slow_connections: int
    ) -> None:
        super().__init__(daemon=True, name="stranger")
        self.fed, self.gateway, self.run_dir = fed, gateway, run_dir
        self.prefixes = [fed.place.client_prefixes[client] for client in clients]
        self.prefix = self.prefixes[0]
        self.slow_connections = slow_connections
        self.probes: list[dict[str, Any]] = []
        self.slow: dict[str, float] = {}  # SLOW's lines, summed: when every address held its slow connections
        self.error = ""
        self.halt = threading.Event()  # the run is over

    def run(self) -> None:
        try:
            while not read_rounds(self.run_dir):
                if self.halt.wait(0.2):
                    self.error = "the run closed no round"
                    return
            self.try_everything()
        except Exception as exc:  # the bench reports it: no probe result is not "refused"
            self.error = f"{type(exc).__name__}: {exc}"

    def try_everything(self) -> None:
        host, port = self.gateway.rsplit(":", 1)
        ca = self.fed.certs.ca if self.fed.certs else Path()
        probes = [(name, int(port), path) for name, path in HTTP_PROBES.items()]
        for listening in self._server_ports():
            if listening != int(port):
                probes.append((f"the server namespace's port {listening} (not the gateway's)", listening, "tcp"))
        self._requests(host, ca, probes)
        home = self.run_dir / ".stranger"
        env = flower_env(home)
        write_flwr_home(Path(env["FLWR_HOME"]), self.gateway, ca)
        key = make_node_keys(home / "keys", 1)[0].with_suffix(".pub")
        app = home / "app"
        app.mkdir(parents=True, exist_ok=True)
        (app / "pyproject.toml").write_text(tomli_w.dumps(app_project("edgefl", self.fed.config, None)))
        for name, args in (("flwr supernode register (its own node key)", ["supernode", "register", str(key)]),
                           ("flwr ls", ["ls"]), ("flwr run (its own ServerApp)", ["run", str(app)])):  # fmt: skip
            try:
                answer = run_flwr([*args, FEDERATION], env, self.prefix)
                self.probes.append({"probe": name, "answer": json.dumps(answer)[:160], "refused": False})
            except LaunchError as exc:
                self.probes.append({"probe": name, "answer": str(exc)[:200], "refused": True})
        self._join_as_a_device(ca, key.with_suffix(".key"), home)
        self._slow_connections(host, int(port), ca)

    def _slow_connections(self, host: str, port: int, ca: Path) -> None:
        """``slow_connections`` held open on the gateway for SLOW_HOLD_S from each address at once (stopped early
        when the run ends); ``slow``: the span all of them held theirs, and their counts summed."""
        argv = [sys.executable, "-c", SLOW, host, str(port), str(ca), str(self.slow_connections), str(SLOW_HOLD_S)]
        procs: list[subprocess.Popen[str]] = []
        try:
            for prefix in self.prefixes:
                procs.append(subprocess.Popen([*prefix, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))  # fmt: skip
            while any(proc.poll() is None for proc in procs):
                if self.halt.wait(0.5):
                    for proc in procs:
                        proc.kill()
            said = [proc.communicate() for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        lines = [[line for line in out.splitlines() if line.startswith("{")] for out, _ in said]
        if all(proc.returncode == 0 for proc in procs) and all(lines):
            held = [json.loads(found[-1]) for found in lines]
            counts = {key: sum(h[key] for h in held) for key in ("open", "opened", "closed_by_gateway", "failed")}
            self.slow = {"start": max(h["start"] for h in held), "end": min(h["end"] for h in held), **counts,
                         "addresses": len(held)}  # fmt: skip
        elif not self.halt.is_set():
            errors = " | ".join(err.strip()[-300:] for _, err in said if err.strip())
            raise RuntimeError(f"the slow connections failed: {errors}")

    def _join_as_a_device(self, ca: Path, key: Path, home: Path) -> None:
        """``edgefl client`` from the stranger's namespace with a key of its own, claiming partition 0: the
        federation authenticates its devices, so its SuperNode is refused and the command ends in one line."""
        config = self.fed.config
        argv = [*self.prefix, sys.executable, "-m", "edgefl.cli", "client", "--server", self.gateway,
                "--root-cert", str(ca), "--auth-key", str(key), "--partition-id", "0",
                "--num-partitions", str(config.clients), "--dataset", config.dataset, "--out", str(home / "client"),
                "--connect-timeout", "30"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        refused = done.returncode != 0 and "refused this SuperNode" in said
        self.probes.append({"probe": "a SuperNode of its own (edgefl client, its own key)", "answer": said[:200],
                            "refused": refused})  # fmt: skip

    def _requests(self, host: str, ca: Path, probes: list[tuple[str, int, str]]) -> None:
        """The PROBE requests, from the stranger's namespace."""
        wanted = json.dumps([[port, path] for _, port, path in probes])
        argv = [*self.prefix, sys.executable, "-c", PROBE, host, str(ca), wanted]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if len(answers) != len(probes):
            raise RuntimeError(f"the probes from the stranger's namespace failed: {done.stderr.strip()[-300:]}")
        for (name, _, _), answer in zip(probes, answers, strict=True):
            status = answer.get("status")
            refused = "error" in answer or (isinstance(status, int) and status >= 400)
            text = answer.get("error") or f"{status} {answer.get('body', '')}".strip()
            self.probes.append({"probe": name, "answer": text, "refused": refused})

    def _server_ports(self) -> list[int]:
        """The TCP ports something listens on in the server's namespace."""
        argv = [*self.fed.place.server_prefix, "cat", "/proc/net/tcp", "/proc/net/tcp6"]
        lines = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.splitlines()
        listening = {int(f[1].rsplit(":", 1)[1], 16) for line in lines if len(f := line.split()) > 3 and f[3] == "0A"}
        return sorted(listening)


MEASURED = "measured.json"  # what a run folder does not hold: the server's peak RSS, the stranger's tries, the error


@dataclasses.dataclass
class Run:
    """One run as measured: its rounds, messages, the server's peak RSS, its error if it failed, and the stranger's
    tries (the hostile run's)."""

    folder: Path
    rows: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    peak_rss_mb: dict[str, float]
    error: str = ""
    probes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stranger_error: str = ""
    slow: dict[str, float] = dataclasses.field(default_factory=dict)
    attackers: list[int] = dataclasses.field(default_factory=list)  # the hostile clients (the hostile run's)

    def slow_connections_ratio(self) -> tuple[float | None, int]:
        """The median round trip of the honest devices' messages sent while the slow connections were held over that
        of their messages sent before, and how many were sent while they were held (None: none, or none before)."""
        if not self.slow:
            return None, 0
        honest = [m for m in self.messages
                  if m.get("partition") not in self.attackers and m.get("round_trip_s") is not None]  # fmt: skip
        during = [m["round_trip_s"] for m in honest if self.slow["start"] <= m["sent_at"] <= self.slow["end"]]
        before = [m["round_trip_s"] for m in honest if m["sent_at"] < self.slow["start"]]
        if not during or not before:
            return None, len(during)
        return statistics.median(during) / statistics.median(before), len(during)

    @classmethod
    def load(cls, folder: Path) -> Run:
        measured = json.loads((folder / MEASURED).read_text())
        return cls(folder, read_rounds(folder), read_rounds(folder, MESSAGES), **measured)

    @property
    def final_accuracy(self) -> float | None:
        """The mean of the last WINDOW evaluations."""
        accuracies = [r["test_accuracy"] for r in self.rows if r["test_accuracy"] is not None][-WINDOW:]
        return sum(accuracies) / len(accuracies) if accuracies else None

    @property
    def seconds_per_round(self) -> float | None:
        return self.rows[-1]["wall_s"] / len(self.rows) if self.rows else None


def run_federation(
    config: RunConfig, plans: dict[int, Plan], progress: Callable[[str], None], slow_connections: int
) -> None:
    """Run ``config`` on a fresh federation (the hostile agents of ``plans`` in it, client → its plan, and the
    stranger knocking, when there are any), into its folder; what the folder would not hold goes to its
    MEASURED."""
    run_dir = Path(config.out).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    plan_files = {client: run_dir / plan_name(client) for client in plans}
    for client, plan in plans.items():
        plan.save(plan_files[client])
    error = ""
    with federation(config, plan_files, progress) as (fed, gateway):
        rss = PeakRss([proc.pid for name, proc in fed.procs.procs if name in ("superlink", WARM_SERVERAPP)])
        rss.start()
        stranger = Stranger(fed, gateway, run_dir, sorted(plans), slow_connections) if plans else None
        if stranger:
            stranger.start()
        try:
            run_on(fed, config, progress)
        except LaunchError as exc:
            if not plans:
                raise
            error = str(exc)
            progress(f"the hostile run failed: {error}")
        finally:
            peak = rss.result()
            if stranger:
                stranger.halt.set()
                stranger.join()
    measured = {"peak_rss_mb": peak, "error": error, "probes": stranger.probes if stranger else [],
                "stranger_error": stranger.error if stranger else "",
                "slow": stranger.slow if stranger else {}, "attackers": sorted(plans)}  # fmt: skip
    (run_dir / MEASURED).write_text(json.dumps(measured, indent=1))


def plan_name(client: int) -> str:
    return f"plan-{client}.json"


def attacks_log(client: int) -> str:
    return f"attacks-{client}.jsonl"


# ----- what the server made of each attack ---------------------------------------------------------------------
def attack_outcomes(run: Run, attacker: int) -> list[dict[str, Any]]:
    """A row per attack in hostile client ``attacker``'s log: its round, whether the server (or the SuperLink
    before it) refused it, and the reason. The server's refusals are matched to the attacks in order: each reply of
    the hostile device (its partition) it refuses is a ``rejected`` entry of the round it closes in; an honest reply
    is refused nothing but, when it answers the server asking again after an attack, "late" if the round closed
    without it (a round with its quorum does not wait for a node that failed); an attack answering a round its
    partition then counts in was taken."""
    log = [json.loads(line) for line in _read(run.folder / attacks_log(attacker)).splitlines()]
    server_log = _read(run.folder / SERVER_LOG)
    superlink_log = _read(run.folder / "logs" / "superlink.log")
    gateway_log = _read(run.folder / "logs" / "gateway" / "access.log")
    too_large = re.search(r'"POST /v1/fleet/push-object [^"]*" 413 ', gateway_log)
    settled = {m["message_id"] for m in run.messages}
    rows = {r["round"]: r for r in run.rows}
    rejections = [(r["round"], x) for r in run.rows for x in r["rejected"] if x["client"] == attacker]
    sent = [e for e in log if "skipped" not in e and e["delivery"] != FORGED]
    honest_rounds = {e["round"] for e in sent if e["attack"] == "honest"}
    last_of_round = {e["round"]: e for e in sent}
    outcomes = []
    for entry in log:
        round_, name = entry["round"], entry["attack"]
        row = {"client": attacker, "round": round_, "attack": name, "delivery": entry["delivery"]}
        if name == "honest":
            if rejections and rejections[0][1]["round"] == round_ and rejections[0][1]["reason"].startswith("late"):
                rejections.pop(0)  # the honest update of an attacked round, after it closed without the device
            continue
        if "skipped" in entry:
            outcomes.append({**row, "sent": False, "refused": None, "by": "—", "reason": entry["skipped"]})
            continue
        if entry["delivery"] == FORGED:
            outcomes.append({**row, "sent": True, **_forged_outcome(entry, run, superlink_log)})
            continue
        closed = rows.get(round_)
        taken = (
            entry is last_of_round[round_]
            and round_ not in honest_rounds
            and closed is not None
            and attacker in closed["clients"]
        )
        if taken:
            outcomes.append({**row, "sent": True, "refused": False, "by": "—",
                             "reason": f"TAKEN: round {round_} counts partition {attacker}'s update"})  # fmt: skip
        elif entry["answers"] not in settled:
            outcomes.append({**row, "sent": True, "refused": True, "by": "before the server",
                             "reason": "the server never received it (no reply to its message settled)"})  # fmt: skip
        elif rejections:
            closed_in, rejection = rejections.pop(0)
            where = f"{SERVER_LOG}, {ROUNDS}" if rejection["reason"] in server_log else ROUNDS
            note = "" if closed_in == round_ else f" (matched in round {closed_in}'s row: check)"
            by = f"server ({where})"
            if too_large and UNDELIVERED in rejection["reason"]:
                by = f"gateway (413: over the run's bound), then {by}"
            outcomes.append({**row, "sent": True, "refused": True, "by": by,
                             "reason": rejection["reason"] + note})  # fmt: skip
        else:
            outcomes.append({**row, "sent": True, "refused": False, "by": "—",
                             "reason": f"no refusal of it in {ROUNDS}"})  # fmt: skip
    return outcomes


def _forged_outcome(entry: dict[str, Any], run: Run, superlink_log: str) -> dict[str, Any]:
    """A forged reply reached the server when it settled a message with it (its marked training time), and was taken
    unless the server refused an update of that partition in that round; else the error its push met at the device's
    own SuperNode, or the SuperLink's log line about it, if it wrote one."""
    settled = [m for m in run.messages if abs(m["train_s"] - entry["marker"]) < 1e-6]
    if settled:
        trip = settled[0]
        row = next((r for r in run.rows if r["round"] == entry["round"]), {"rejected": []})
        refusals = [x["reason"] for x in row["rejected"] if x["client"] == trip["partition"]]
        if refusals:
            return {"refused": True, "by": "server", "reason": refusals[0]}
        said = [line for line in superlink_log.splitlines() if entry["target"] in line]
        then = f"; that node's own reply: {_strip_ansi(said[0]).strip()}" if said else ""
        return {"refused": False, "by": "—", "reason": f"TAKEN: the server counted it as node {trip['node']}'s "
                f"reply (partition {trip['partition']}, round {entry['round']}){then}"}  # fmt: skip
    if "push_refused" in entry:  # its own SuperNode did not take it whole (seen: the task's push session had ended)
        return {"refused": True, "by": "the attacker's SuperNode", "reason": entry["push_refused"]}
    said = [line.strip() for line in superlink_log.splitlines() if entry["target"] in line]
    reason = _strip_ansi(said[0]) if said else "not stored: the SuperLink wrote no line about it"
    return {"refused": True, "by": "SuperLink", "reason": reason}


def _strip_ansi(text: str) -> str:
    """A log line without its colour codes and runs of blanks."""
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# ----- the result ----------------------------------------------------------------------------------------------
def met(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def report(
    config: RunConfig, plans: dict[int, Plan], clean: Run | None, hostile: Run, outcomes: list[dict[str, Any]]
) -> tuple[str, dict[str, Any]]:
    """result.md's text and result.json's figures."""
    probes, stranger_error = hostile.probes, hostile.stranger_error
    tried = [o for o in outcomes if o["sent"]]
    refused = [o for o in tried if o["refused"]]
    deadline_rounds = [r["round"] for r in hostile.rows if r["closed_by"] != "all"]
    completed = len(hostile.rows) if (hostile.folder / SUMMARY).exists() else 0
    stranger_refused = bool(probes) and not stranger_error and all(p["refused"] for p in probes)
    delta = ratio = None
    if clean and clean.final_accuracy is not None and hostile.final_accuracy is not None:
        delta = 100 * (hostile.final_accuracy - clean.final_accuracy)
    if clean and clean.peak_rss_mb["sum"]:
        ratio = hostile.peak_rss_mb["sum"] / clean.peak_rss_mb["sum"]
    slow_ratio, slow_messages = hostile.slow_connections_ratio()
    posted = re.search(r"the gateway takes object uploads of at most (\d+) bytes", _read(hostile.folder / SERVER_LOG))
    upload_bound = int(posted.group(1)) if posted else None  # the run's, as its ServerApp posted it (contract.uploads)
    attacked = {client: _ranges(sorted(plan.rounds)) for client, plan in plans.items()}
    figures = {
        "clients": config.clients,
        "attackers": sorted(plans),
        "rounds": config.rounds,
        "rounds_completed": completed,
        "rounds_closed_by_deadline": deadline_rounds,
        "attacks_tried": len(tried),
        "attacks_refused": len(refused),
        "attacks_not_sent": [o["attack"] for o in outcomes if not o["sent"]],
        "accuracy": {"clean": clean.final_accuracy if clean else None, "hostile": hostile.final_accuracy},
        "accuracy_delta_points": delta,
        "seconds_per_round": {
            "clean": clean.seconds_per_round if clean else None,
            "hostile": hostile.seconds_per_round,
        },
        "server_peak_rss_mb": {"clean": clean.peak_rss_mb if clean else None, "hostile": hostile.peak_rss_mb},
        "server_peak_rss_ratio": ratio,
        "upload_bound_bytes": upload_bound,
        "stranger_refused": stranger_refused,
        "slow_connections": {**hostile.slow, "honest_messages_while_held": slow_messages},
        "slow_connections_round_ratio": slow_ratio,
        "hostile_run_error": hostile.error or None,
        "stranger_error": stranger_error or None,
        "attacks": outcomes,
        "stranger": probes,
    }
    ok = {
        "rounds": completed == config.rounds and not hostile.error and not deadline_rounds,
        "attacks": bool(tried) and len(refused) == len(tried),
        "accuracy": delta is not None and abs(delta) <= 1,
        "rss": ratio is not None and ratio <= 1.2,
        "stranger": stranger_refused,
        "slow": slow_ratio is not None and slow_ratio <= SLOW_RATIO_BAR,
    }
    clean_acc = f"{clean.final_accuracy:.4f}" if clean and clean.final_accuracy is not None else "— (no clean run)"
    hostile_acc = f"{hostile.final_accuracy:.4f}" if hostile.final_accuracy is not None else "—"
    rss_clean = f"{clean.peak_rss_mb['sum']:.0f}" if clean else "—"
    lines = [
        f"# Hostile devices and a stranger: {config.dataset} ({config.partition}), {config.clients} clients, "
        f"{config.strategy}, {config.rounds} rounds of {config.local_steps} local steps, link {config.profile}, "
        f"seed {config.seed}; "
        + "; ".join(f"client {client} attacks in rounds {rounds}" for client, rounds in attacked.items()),
        "",
        "| criterion | measured | |",
        "|---|---|---|",
        f"| every round completes, none held to its deadline | {completed} of {config.rounds}"
        + (f"; closed by the deadline: rounds {deadline_rounds}" if deadline_rounds else "; none by its deadline")
        + (f"; {_cell(hostile.error)}" if hostile.error else "")
        + f" | {met(ok['rounds'])} |",
        f"| every attack refused, with its reason | {len(refused)} of {len(tried)} | {met(ok['attacks'])} |",
        f"| final accuracy (mean of the last {WINDOW} evaluations) within 1 point of the clean run | {hostile_acc} vs "
        f"{clean_acc}" + (f" ({delta:+.2f} points)" if delta is not None else "") + f" | {met(ok['accuracy'])} |",
        f"| server peak RSS (SuperLink + SuperExec + ServerApp) within 20 % | {hostile.peak_rss_mb['sum']:.0f} MB vs "
        f"{rss_clean} MB" + (f" ({100 * (ratio - 1):+.1f} %)" if ratio is not None else "") + f" | {met(ok['rss'])} |",
        f"| the stranger refused | {sum(p['refused'] for p in probes)} of {len(probes)} tries"
        + (f"; its probing failed: {_cell(stranger_error)}" if stranger_error else "")
        + f" | {met(ok['stranger'])} |",
        f"| honest devices' messages at most {SLOW_RATIO_BAR:g}x slower while the stranger holds slow connections "
        "on the gateway (median round trip, during / before) | "
        + (
            f"{slow_ratio:.2f}x over {slow_messages} messages in {_slow_span(hostile.slow)}"
            if slow_ratio is not None
            else f"not measured ({_slow_span(hostile.slow) or 'the run ended before the stranger held them'})"
        )
        + f" | {met(ok['slow'])} |",
        "",
        f"All at once: {met(all(ok.values()))}. Seconds per round: hostile "
        f"{_seconds(hostile.seconds_per_round)}, clean {_seconds(clean.seconds_per_round if clean else None)}. "
        "The gateway's bound on one reply's upload while the hostile run went: "
        + (f"{upload_bound} bytes ({SERVER_LOG})." if upload_bound else "none posted."),
        "",
        f"## The attacks (`{hostile.folder.name}/attacks-CLIENT.jsonl`)",
        "",
        "| client | round | attack | how | refused | by | reason |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {o['client']} | {o['round']} | {_cell(o['attack'])} | {o['delivery']} | {_refused(o)} | {o['by']} | "
            f"{_cell(o['reason'])} |"
            for o in sorted(outcomes, key=lambda o: (o["round"], o["client"]))
        ),
        "",
        f"## The stranger (in client {min(plans)}'s network namespace, no client certificate; slow connections from "
        f"clients {', '.join(map(str, sorted(plans)))}')",
        "",
        "| try | answer | refused |",
        "|---|---|---|",
        *(f"| {_cell(p['probe'])} | {_cell(p['answer'])} | {'yes' if p['refused'] else '**NO**'} |" for p in probes),
        "",
        "## The server's peak RSS (VmHWM, MB)",
        "",
        "| process | clean | hostile |",
        "|---|---|---|",
        *(
            f"| {role} | {clean.peak_rss_mb[role] if clean else '—'} | {hostile.peak_rss_mb[role]} |"
            for role in [*SERVER_ROLES.values(), "sum"]
        ),
    ]
    return "\n".join(lines), figures


def _slow_span(slow: dict[str, float]) -> str:
    """How long the slow connections were held, and what the gateway did with them."""
    if not slow:
        return ""
    return (f"{slow['end'] - slow['start']:.0f} s from {slow['addresses']} addresses ({slow['opened']} opened, "
            f"{slow['closed_by_gateway']} closed by the gateway, {slow['failed']} refused, {slow['open']} open at the "
            "end)")  # fmt: skip


def _ranges(rounds: list[int]) -> str:
    """1, 3, 5, ..., 75 for an arithmetic sequence of more than four; else the list."""
    steps = {b - a for a, b in itertools.pairwise(rounds)}
    if len(rounds) > 4 and len(steps) == 1:
        return f"{rounds[0]}, {rounds[1]}, {rounds[2]}, ..., {rounds[-1]}"
    return ", ".join(map(str, rounds))


def _refused(outcome: dict[str, Any]) -> str:
    return "not sent" if not outcome["sent"] else "yes" if outcome["refused"] else "**NO**"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="lan", help="a link profile with a testbed (not loopback)")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--rounds", type=int, help="default: the fewest that give each attack but the forged a round")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--attackers", type=int, default=ATTACKERS, help="hostile clients (the last partitions)")
    parser.add_argument("--honest-every", type=int, default=2, help="every K-th round is honest (round 1 attacked)")
    parser.add_argument("--slow-connections", type=int, default=SLOW_CONNECTIONS,
                        help="slow connections the stranger holds from each hostile client's address")  # fmt: skip
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacks", help="comma-separated attack names (default: all, --list shows them)")
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    parser.add_argument("--no-clean", action="store_true", help="the hostile run only (no accuracy or RSS check)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-hostile-clients"))
    parser.add_argument("--report-only", action="store_true", help="no runs: the result from the run folders")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{a.delivery:6}  {name}" for name, a in ATTACKS.items()))
        return 0
    names = [n.strip() for n in args.attacks.split(",")] if args.attacks else list(ATTACKS)
    if unknown := [n for n in names if n not in ATTACKS]:
        print(f"unknown attacks {unknown}; --list shows them", file=sys.stderr)
        return 2
    if args.honest_every < 2:
        print("--honest-every must be at least 2 (every K-th round is honest)", file=sys.stderr)
        return 2
    if not 1 <= args.attackers < args.clients or args.slow_connections < 1:
        print("--attackers must be at least 1 and fewer than --clients, --slow-connections at least 1", file=sys.stderr)
        return 2
    attackers = list(range(args.clients - args.attackers, args.clients))
    shares = {client: names[i :: len(attackers)] for i, client in enumerate(attackers)}  # the attacks dealt round-robin
    rounds = args.rounds or max(rounds_needed(share, args.honest_every) for share in shares.values())
    try:
        plan_rounds = {client: schedule(share, rounds, args.honest_every) if share else {}
                       for client, share in shares.items()}  # fmt: skip
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    interrupt_on_signals()
    out = args.out.resolve()

    def config_for(name: str) -> RunConfig:
        return build_config(None, dataset=args.dataset, partition=args.partition, clients=args.clients, rounds=rounds,
                            local_steps=args.local_steps, seed=args.seed, profile=args.profile,
                            out=str(out / name))  # fmt: skip

    def progress(line: str) -> None:
        print("   " + line, flush=True)

    config = config_for("hostile")
    run_dir = Path(config.out).resolve()
    plans = {client: Plan(plan_rounds[client], run_dir / attacks_log(client),
                          run_dir / "logs" / f"supernode-{VICTIM}.log", run_dir / "logs" / f"agent-{VICTIM}.log")
             for client in attackers}  # fmt: skip
    who = f"clients {', '.join(map(str, attackers))}"
    if not args.report_only:
        finals = sum(ATTACKS[n].delivery == FINAL for n in names)
        attacked = len(set().union(*plan_rounds.values()))
        print(f"{len(names)} attacks ({finals} that answer a round) by {who} in {attacked} of {rounds} rounds")
        runs = [] if args.no_clean else [("clean", f"{who} honest throughout", {})]
        runs.append(("hostile", f"{who} attack", plans))
        for i, (name, what, with_plans) in enumerate(runs, 1):
            print(f"== [{i}/{len(runs)}] {name}: {what}", flush=True)
            run_federation(config_for(name), with_plans, progress, args.slow_connections)
    else:
        config = build_config(run_dir / CONFIG)
        plans = {client: Plan.load(run_dir / plan_name(client)) for client in attackers}
    clean = None if args.no_clean or not (out / "clean" / MEASURED).exists() else Run.load(out / "clean")
    hostile = Run.load(run_dir)
    outcomes = [o for client in attackers for o in attack_outcomes(hostile, client)]
    text, figures = report(config, plans, clean, hostile, outcomes)
    write_result(out, text, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

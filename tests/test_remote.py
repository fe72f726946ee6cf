"""Devices joining a remote server on loopback: ``edgefl server`` (Flower's SuperLink with TLS and node
authentication), ``edgefl client`` per device (edge agent + SuperNode), runs submitted with
``edgefl run --federation remote``; a server crash and restart; refusals and bad input as one clear line."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgefl.cli import build_parser
from edgefl.gateway import RUNNING
from edgefl.processes import free_port, process_tree
from edgefl.remote import ClientSpec, systemd_unit
from tests.conftest import REPO, edgefl, processes_of

FAST = ["--dataset", "digits", "--partition", "iid", "--clients", "2", "--rounds", "2", "--local-steps", "3"]
WAIT_S = 120.0


class Command:
    """An ``edgefl`` command running in the background, its output lines collected as they come."""

    def __init__(self, *args: str, prefix: list[str] | None = None) -> None:
        """``edgefl ARGS``, inside ``prefix`` (e.g. ``ip netns exec NS``)."""
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "edgefl.cli", *args], cwd=REPO,
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float = WAIT_S) -> str:
        """The next output line matching ``pattern``; fails if the command exits or the time runs out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.seen}"
                continue
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s:.0f} s: {self.seen}")

    def kill_tree(self) -> None:
        """SIGKILL the command and everything it started, as a crash of its machine would."""
        tree = process_tree([self.proc.pid])
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):  # ended in between: its parent's end signals it
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def _one_line_error(done: subprocess.CompletedProcess[str], needle: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgefl: error: "), done.stderr
    assert needle in lines[0], lines[0]


def _start_server(certs: Path, port: int, out: Path) -> tuple[Command, str, str]:
    """``edgefl server`` admitting node-0 and node-1; returns it and the client and run command lines it printed."""
    server = Command("server", "--listen", f"127.0.0.1:{port}", "--certs", str(certs), "--out", str(out),
                     "--auth-keys", str(certs / "node-0.pub"), str(certs / "node-1.pub"))  # fmt: skip
    server.wait_for("each device joins with")
    join_line = server.wait_for(r"^\s+edgefl client ").strip()
    return server, join_line, server.wait_for(r"^\s+edgefl run ").strip()


@pytest.mark.federation
def test_clients_join_a_tls_server_survive_its_restart_and_unknown_nodes_are_refused(
    tmp_path: Path, edgefl_main
) -> None:
    certs, port = tmp_path / "certs", free_port()
    assert edgefl_main("certs", "--out", str(certs), "--node-keys", "3", "--submitters", "1").returncode == 0
    server_dir = tmp_path / "server"
    server, join_line, submit_line = _start_server(certs, port, server_dir)
    clients = []
    try:
        for i in range(2):  # the exact line the server printed, with I and N filled in
            argv = shlex.split(join_line.replace("node-I", f"node-{i}").replace(" I ", f" {i} ").replace(" N", " 2"))
            assert argv[:2] == ["edgefl", "client"] and "--root-cert" in argv and "--auth-key" in argv
            clients.append(Command(*argv[1:], "--dataset", "digits", "--out", str(tmp_path / f"client-{i}"),
                                   "--ready-file", str(tmp_path / f"client-{i}.ready")))  # fmt: skip
        for i, client in enumerate(clients):
            joined = client.wait_for(f"joined 127.0.0.1:{port}")
            assert (tmp_path / f"client-{i}.ready").read_text() == joined + "\n"  # written before it was printed
        # The submit line the server printed: through the gateway, with a submitter certificate.
        remote = shlex.split(submit_line.replace("submitter-I", "submitter-0").replace(" --clients N ...", ""))[2:]
        assert (
            remote[:4] == ["--federation", "remote", "--server", f"127.0.0.1:{port}"] and "--submitter-cert" in remote
        )
        first = edgefl("run", *FAST, *remote, "--out", str(tmp_path / "run-1"), timeout=300)
        assert first.returncode == 0, first.stderr
        rows = [json.loads(line) for line in (tmp_path / "run-1" / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2] and all(r["clients"] == [0, 1] for r in rows)
        # The ServerApp wrote the run on the server's side; the submitter got the same files streamed back.
        (on_server,) = (server_dir / "runs").glob("run-1-*")
        for name in ("rounds.jsonl", "messages.jsonl", "summary.json", "global.onnx", "checkpoint.npz"):
            assert (tmp_path / "run-1" / name).read_bytes() == (on_server / name).read_bytes(), name
        assert (tmp_path / "run-1" / ".remote-run").read_text() == on_server.name + "\n"  # what --resume goes on in
        assert (tmp_path / "run-1" / "accuracy_vs_time.png").exists()

        # A node whose key the server does not know is refused, in the client's one line and in the server's log.
        stranger = edgefl("client", "--server", f"127.0.0.1:{port}", "--root-cert", str(certs / "ca.pem"),
                          "--partition-id", "0", "--num-partitions", "2", "--dataset", "digits",
                          "--auth-key", str(certs / "node-2.key"), "--out", str(tmp_path / "stranger"))  # fmt: skip
        _one_line_error(stranger, "refused this SuperNode")
        server.wait_for("refused a SuperNode")
        assert "No SuperNode found with the given public key" in (server_dir / "logs" / "superlink.log").read_text()

        # The server's machine crashes and comes back on the same port: the clients' SuperNodes rejoin.
        server.kill_tree()
        server, _, _ = _start_server(certs, port, server_dir)
        for client in clients:
            client.wait_for(f"joined 127.0.0.1:{port}")
        second = edgefl("run", *FAST, *remote, "--out", str(tmp_path / "run-2"), timeout=300)
        assert second.returncode == 0, second.stderr
        assert "round   2/2" in second.stdout
    finally:
        for command in [*clients, server]:
            if command.proc.poll() is None:
                assert command.interrupt() == 130
    for folder in ("server", "client-0", "client-1", "stranger", "run-1", "run-2"):
        assert not processes_of(tmp_path / folder), folder


@pytest.mark.federation
def test_wrong_ca_is_one_clear_line_for_client_and_run(tmp_path: Path, edgefl_main) -> None:
    """The server as a user starts it; the refused commands in this process (``edgefl.cli.main``)."""
    certs, other, port = tmp_path / "certs", tmp_path / "other", free_port()
    for folder in (certs, other):
        assert edgefl_main("certs", "--out", str(folder), "--submitters", "1").returncode == 0
    ready = tmp_path / "s.ready"
    server = Command("server", "--listen", f"127.0.0.1:{port}", "--certs", str(certs), "--out", str(tmp_path / "s"),
                     "--ready-file", str(ready), "--allow-any-device")  # fmt: skip
    try:
        assert server.wait_for("^gateway ") in ready.read_text().splitlines()  # written before it was printed
        wrong = ["--server", f"127.0.0.1:{port}", "--root-cert", str(other / "ca.pem")]
        client = edgefl_main("client", *wrong, "--partition-id", "0", "--num-partitions", "2", "--dataset", "digits",
                        "--out", str(tmp_path / "c"))  # fmt: skip
        _one_line_error(client, "does not verify")
        submitter = ["--submitter-cert", str(other / "submitter-0.pem")]
        run = edgefl_main("run", *FAST, "--federation", "remote", *wrong, *submitter, "--out", str(tmp_path / "r"))
        _one_line_error(run, "does not verify")
        # The server's CA but a submitter certificate another CA signed: the gateway refuses it, in one line.
        right = ["--server", f"127.0.0.1:{port}", "--root-cert", str(certs / "ca.pem"), *submitter]
        run = edgefl_main("run", *FAST, "--federation", "remote", *right, "--out", str(tmp_path / "r"))
        _one_line_error(run, "refused submitter-0.pem")
    finally:
        assert server.interrupt() == 130
    assert not ready.exists()
    for folder in ("s", "c", "r"):
        assert not processes_of(tmp_path / folder)


CLIENT = ["client", "--insecure", "--num-partitions", "2", "--dataset", "digits"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*CLIENT, "--server", "localhost", "--partition-id", "0"], "is not HOST:PORT"),
        ([*CLIENT, "--server", "127.0.0.1:9", "--partition-id", "2"], "--partition-id must be in 0..1"),
        ([*CLIENT, "--server", "127.0.0.1:9", "--partition-id", "0", "--connect-timeout", "1"], "cannot reach"),
        ([*CLIENT, "--server", "127.0.0.1:9", "--partition-id", "0", "--auth-key", "k"], "needs TLS"),
        ([*CLIENT, "--server", "127.0.0.1:9", "--partition-id", "0", "--startup-timeout", "0"], "--startup-timeout"),
        (
            [
                "client",
                "--server",
                "127.0.0.1:9",
                "--partition-id",
                "0",
                "--num-partitions",
                "2",
                "--insecure",
                "--dataset",
                "mnist",
            ],
            "mnist needs --data-dir",
        ),
        (["client", "--server", "127.0.0.1:9", "--partition-id", "0", "--num-partitions", "2"], "--root-cert"),
        (
            ["run", *FAST, "--federation", "remote", "--server", "127.0.0.1:9", "--insecure", "--connect-timeout", "1"],
            "cannot reach",
        ),
        (["run", *FAST, "--federation", "remote", "--server", "127.0.0.1:9"], "--root-cert"),
        (
            ["run", *FAST, "--federation", "remote", "--server", "127.0.0.1:9", "--root-cert", "ca.pem"],
            "--submitter-cert",
        ),
        (["run", *FAST, "--server", "127.0.0.1:9"], "are for --federation remote"),
        (["server", "--listen", "127.0.0.1:9", "--insecure", "--auth-keys", "a.pub"], "needs TLS"),
        (["server", "--listen", "127.0.0.1:9"], "--certs DIR"),
        (["server", "--listen", "127.0.0.1:9", "--insecure"], "refusing to serve without device authentication"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], needle: str, tmp_path: Path, edgefl_main) -> None:
    """In this process, through ``edgefl.cli.main``; ``tests/test_cli_errors.py`` has a case as a user types it."""
    done = edgefl_main(*args, "--out", str(tmp_path / "out"))
    _one_line_error(done, needle)
    assert not processes_of(tmp_path / "out")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="runs the client as an unprivileged user: needs root to switch")
def test_device_profile_without_cgroup_permission_fails_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    client = [*CLIENT, "--server", "127.0.0.1:9", "--partition-id", "0", "--device-profile", "rpi4", "--out", str(out)]
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "edgefl.cli", *client]
    with tempfile.TemporaryDirectory() as home:  # where the unprivileged user may write (matplotlib's cache)
        Path(home).chmod(0o777)
        done = subprocess.run(
            argv, capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, "HOME": home}
        )
    _one_line_error(done, "device profiles need root")
    assert not out.exists()


def test_systemd_unit_runs_the_same_client_command(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("")
    spec = ClientSpec("10.0.0.5:9092", 1, 4, tmp_path / "ca.pem", tmp_path / "node-1.key", "digits",
                      device_profile="rpi4", out=tmp_path / "client")  # fmt: skip
    unit = systemd_unit(spec, "root")  # an emulated rpi4: its cgroups need root
    lines = unit.splitlines()
    assert "User=root" in lines and "NoNewPrivileges=yes" in lines and "ProtectSystem=full" in lines
    assert "After=network-online.target" in lines and "Wants=network-online.target" in lines
    assert "Restart=on-failure" in lines and "WantedBy=multi-user.target" in lines
    exec_start = shlex.split(next(line for line in lines if line.startswith("ExecStart="))[len("ExecStart=") :])
    assert exec_start[:3] == [sys.executable, "-m", "edgefl.cli"]
    args = build_parser().parse_args(exec_start[3:])
    assert args.command == "client" and args.install_systemd is None
    assert (args.server, args.partition_id, args.num_partitions) == ("10.0.0.5:9092", 1, 4)
    assert (args.root_cert, args.auth_key, args.out) == (spec.root_cert, spec.auth_key, spec.out)
    assert (args.dataset, args.device_profile, args.insecure) == ("digits", "rpi4", False)
    assert (args.connect_timeout, args.startup_timeout) == (spec.connect_timeout_s, spec.startup_timeout_s)


def test_certs_revoke_changes_only_the_revocation_list(tmp_path: Path, edgefl_main) -> None:
    """``edgefl certs --revoke``: the CA and the other files stay as they were; a gateway noted as serving with them
    that stopped (here: its folder is gone) is forgotten, and the command says none was reloaded; anything but a
    certificate of that CA, or other requests beside it, is one line."""
    certs = tmp_path / "certs"
    assert edgefl_main("certs", "--out", certs, "--submitters", "2").returncode == 0
    ca = (certs / "ca.pem").read_bytes()
    stopped = certs / RUNNING / "4194305"
    stopped.parent.mkdir()
    stopped.write_text(str(tmp_path / "gone"))
    done = edgefl_main("certs", "--out", certs, "--revoke", certs / "submitter-1.pem")
    assert done.returncode == 0 and "revoked" in done.stdout, done.stderr
    assert "no gateway is serving with these certificates" in done.stdout and not stopped.exists(), done.stdout
    assert (certs / "ca.pem").read_bytes() == ca
    _one_line_error(edgefl_main("certs", "--out", certs, "--revoke", certs / "ca.pem", "--submitters", "1"), "alone")
    _one_line_error(edgefl_main("certs", "--out", certs, "--revoke", certs / "server.key"), "not a certificate of")


def _installing(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A unit file's path and the ``edgefl client --install-systemd`` command that writes it."""
    unit = tmp_path / "edgefl-client-0.service"
    return unit, ("client", "--server", "127.0.0.1:9", "--insecure", "--partition-id", "0", "--num-partitions", "2",
                  "--dataset", "digits", "--out", str(tmp_path / "c"), "--install-systemd", str(unit))  # fmt: skip


def test_install_systemd_writes_the_unit_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edgefl_main
) -> None:
    """The unit runs the device as the user who ran sudo (``nobody`` here), never as root unless named."""
    unit, client = _installing(tmp_path)
    monkeypatch.setenv("SUDO_USER", "nobody")
    done = edgefl_main(*client)
    assert done.returncode == 0, done.stderr
    assert "systemctl enable --now edgefl-client-0.service" in done.stdout
    text = unit.read_text()
    assert "ExecStart=" in text and "--insecure" in text and "\nUser=nobody\n" in text
    assert not (tmp_path / "c").exists()


def test_install_systemd_refuses_root_unless_named_and_a_profile_without_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edgefl_main
) -> None:
    unit, client = _installing(tmp_path)
    monkeypatch.delenv("SUDO_USER", raising=False)  # the suite's folder belongs to root: the default is root
    _one_line_error(edgefl_main(*client), "would run the device as root")
    _one_line_error(edgefl_main(*client, "--run-as", "no-such-user-here"), "no such user")
    _one_line_error(edgefl_main(*client, "--run-as", "nobody", "--device-profile", "rpi4"), "needs root")
    (tmp_path / "c").mkdir()  # a folder the device's user could not write
    _one_line_error(edgefl_main(*client, "--run-as", "nobody"), "chown nobody")
    assert not unit.exists()
    assert edgefl_main(*client, "--run-as", "root", "--device-profile", "rpi4").returncode == 0
    assert "\nUser=root\n" in unit.read_text()


def test_the_server_writes_its_ready_file_as_it_prints_how_to_join(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edgefl_main
) -> None:
    """``edgefl server --ready-file`` (bench/aarch64_check.sh waits for it), in this process with the SuperLink and
    the gateway stood in for: an earlier server's file is replaced, by the very lines the server prints, before
    it first waits for joins (its first poll is interrupted: Ctrl-C); the file is gone once the server stopped."""
    ready = tmp_path / "server.ready"
    ready.write_text("an earlier server's\n")
    at_first_poll = []

    def interrupt(_: float) -> None:
        at_first_poll.append(ready.read_text())
        raise KeyboardInterrupt

    monkeypatch.setattr("edgefl.remote.start_superlink", lambda procs, argv: None)
    monkeypatch.setattr("edgefl.remote.Gateway.start", lambda self, procs: procs.log_dir / "gateway")
    monkeypatch.setattr("edgefl.remote.time", SimpleNamespace(sleep=interrupt))
    done = edgefl_main("server", "--listen", f"127.0.0.1:{free_port()}", "--insecure", "--allow-any-device",
                       "--out", tmp_path / "s", "--ready-file", ready)  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert at_first_poll == [done.stdout] and "each device joins with" in done.stdout
    assert not ready.exists()

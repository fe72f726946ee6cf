"""A remote run's folder echoed to its submitter (``contract.run_folder``: ``RunFolder`` with ``echo``, ``Mirror``):
every file comes back whole, the checkpoint once, before the run's last word (its summary, its error or a stop),
and an echo cut short or garbled is refused, not written. A resumed remote run goes on in the server's folder of
the run it resumes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.supercore.exit.exit_handler import trigger_exit_handlers

from contract.run_folder import (
    CHECKPOINT,
    CONFIG,
    ECHO,
    ECHO_CHUNK,
    GLOBAL_ONNX,
    MESSAGES,
    REMOTE_RUN,
    ROUNDS,
    SERVER_ERROR,
    SUMMARY,
    Checkpoint,
    Mirror,
    RunFolder,
    echo_signature,
    read_rounds,
)
from contract.settings import build_config, save_config
from edgefl.launcher import RUN_LOG, EchoStream, follow, prepare_run_dir
from edgefl.processes import LaunchError, ProcessGroup
from fl_server.app import STOPPED, run_app, run_in_folder


def _echoed(text: str) -> list[dict]:
    return [json.loads(line.removeprefix(ECHO)) for line in text.splitlines() if line.startswith(ECHO)]


def _a_run(folder: RunFolder, rounds: int) -> None:
    """What the ServerApp writes over ``rounds`` rounds: a row, a message and a checkpoint each, then the model."""
    rng = np.random.default_rng(0)
    for r in range(1, rounds + 1):
        folder.append(ROUNDS, {"round": r, "test_accuracy": 0.5})
        folder.append(MESSAGES, {"message_id": str(r)})
        params = rng.standard_normal(40_000).astype(np.float32)  # 160 kB: several echoed chunks
        folder.save_checkpoint(Checkpoint(r, params, r, np.ones(r), params / 2))
    folder.write(GLOBAL_ONNX, rng.bytes(3 * ECHO_CHUNK + 5))


@pytest.fixture
def server(tmp_path: Path) -> Path:
    path = tmp_path / "server"
    path.mkdir()
    return path


def test_every_file_comes_back_whole_and_the_checkpoint_once_before_the_summary(
    server: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = RunFolder(server, echo=True)
    _a_run(folder, rounds=3)
    folder.write(SUMMARY, b'{"rounds": 3}\n')
    text = capsys.readouterr().out
    files = [r["file"] for r in _echoed(text) if r.get("part") == 0]
    assert files == [GLOBAL_ONNX, CHECKPOINT, SUMMARY]  # not every round's checkpoint: the last, before the end
    out = tmp_path / "submitter"
    out.mkdir()
    mirror = Mirror(out)
    assert mirror.feed(text) == [] and mirror.close() == []
    for name in (ROUNDS, MESSAGES, CHECKPOINT, GLOBAL_ONNX, SUMMARY):
        assert (out / name).read_bytes() == (server / name).read_bytes(), name
    assert RunFolder(out).read_checkpoint().round == 3
    assert sorted(p.name for p in out.iterdir()) == sorted([ROUNDS, MESSAGES, CHECKPOINT, GLOBAL_ONNX, SUMMARY])


def test_an_echo_cut_short_or_garbled_is_refused_and_not_written(
    server: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = RunFolder(server, echo=True)
    _a_run(folder, rounds=2)
    folder.write(SERVER_ERROR, b"RuntimeError: boom\n")
    lines = capsys.readouterr().out.splitlines()
    checkpoint = [i for i, line in enumerate(lines) if f'"file": "{CHECKPOINT}"' in line]
    assert len(checkpoint) > 2
    out = tmp_path / "submitter"
    out.mkdir()
    # what the submitter had: kept when the new one is refused
    RunFolder(out).save_checkpoint(Checkpoint(1, np.ones(3, np.float32)))
    had = (out / CHECKPOINT).read_bytes()

    cut = Mirror(out)  # the stream ended one chunk short of the checkpoint (its last word never came)
    assert cut.feed("\n".join(lines[: checkpoint[-1]])) == []
    assert cut.close() == [
        f"{CHECKPOINT}: its echo ended after {len(checkpoint) - 1} of {len(checkpoint)} parts; not written"
    ]
    assert (out / CHECKPOINT).read_bytes() == had and not (out / SERVER_ERROR).exists()

    gap = Mirror(out)  # a chunk lost in the middle
    refused = gap.feed("\n".join(lines[: checkpoint[1]] + lines[checkpoint[1] + 1 :]))
    assert refused == [f"{CHECKPOINT}: part 2 of its echo came without the parts before it; not written"]
    assert (out / CHECKPOINT).read_bytes() == had and (out / SERVER_ERROR).read_text() == "RuntimeError: boom\n"

    record = json.loads(lines[checkpoint[0]].removeprefix(ECHO))  # a chunk altered but well-formed
    record["data"] = record["data"][:-8] + ("A" * 8 if record["data"][-8:] != "A" * 8 else "B" * 8)
    altered = [*lines[: checkpoint[0]], ECHO + json.dumps(record), *lines[checkpoint[0] + 1 :]]
    assert Mirror(out).feed("\n".join(altered)) == [f"{CHECKPOINT}: its echo does not match its SHA-256; not written"]
    assert (out / CHECKPOINT).read_bytes() == had

    torn = [*lines[: checkpoint[0]], lines[checkpoint[0]][:100], *lines[checkpoint[0] + 1 :]]  # a line cut mid-way
    refused = Mirror(out).feed("\n".join(torn))
    assert refused[0].startswith("a garbled echo line") and len(refused) == 2, refused
    assert (out / CHECKPOINT).read_bytes() == had
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("record", [{"file": "../evil", "row": {}}, {"file": CONFIG, "part": 0, "parts": 1,
                                    "sha256": "", "data": ""}, {"file": ["x"], "row": {}}, [1, 2]])  # fmt: skip
def test_an_echo_writes_nothing_but_the_files_of_a_run_folder(tmp_path: Path, record: object) -> None:
    refused = Mirror(tmp_path).feed(ECHO + json.dumps(record))
    assert len(refused) == 1 and ("is not a file an echo may write" in refused[0] or "garbled" in refused[0])
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / "evil").exists()


def test_a_stopped_run_echoes_its_checkpoint_then_says_it_stopped(
    server: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flower's exit on a signal (flwr stop: its heartbeat fails, it raises SIGINT in itself) runs its exit handlers
    while the ServerApp is mid-run, then unwinds it with SystemExit; its log is still streamed meanwhile."""
    folder = RunFolder(server, echo=True)

    def stopped_mid_run() -> None:
        _a_run(folder, rounds=2)
        trigger_exit_handlers(run_before_force_exit=True)
        raise SystemExit(1)

    with pytest.raises(SystemExit):
        run_in_folder(folder, stopped_mid_run)
    text = capsys.readouterr().out
    assert [r["file"] for r in _echoed(text) if r.get("part") == 0] == [GLOBAL_ONNX, CHECKPOINT, SERVER_ERROR]
    out = tmp_path / "submitter"
    out.mkdir()
    Mirror(out).feed(text)
    assert (out / SERVER_ERROR).read_text() == STOPPED == (server / SERVER_ERROR).read_text()
    assert RunFolder(out).read_checkpoint().round == 2
    trigger_exit_handlers(run_before_force_exit=True)  # Flower's exit after the run's end: no stop to record
    assert (server / SERVER_ERROR).read_text() == STOPPED and _echoed(capsys.readouterr().out) == []


def test_the_submitter_keeps_a_stopped_runs_checkpoint_and_says_why_it_ended(
    server: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The submitter's side of a stop: the streamed log (here replayed by ``cat``) is mirrored until the run's last
    word; ``follow`` then ends with the server's reason, the checkpoint beside it for ``--resume``."""
    folder = RunFolder(server, echo=True)
    _a_run(folder, rounds=2)
    folder.write(SERVER_ERROR, STOPPED.encode())
    stream = tmp_path / "stream.txt"
    stream.write_text("INFO : some line of Flower's own\n" + capsys.readouterr().out)
    run_dir = tmp_path / "submitter"
    run_dir.mkdir()
    said: list[str] = []
    config = build_config(dataset="digits", rounds=5, out=str(run_dir))
    with ProcessGroup(run_dir / "logs", {"PATH": os.environ["PATH"]}) as procs:
        procs.start(RUN_LOG, ["cat", str(stream)])
        echo = EchoStream(procs.log_dir / f"{RUN_LOG}.log", run_dir, procs, said.append)
        echo.await_last_word(timeout_s=60)
        assert (run_dir / SERVER_ERROR).read_text() == STOPPED and RunFolder(run_dir).read_checkpoint().round == 2
        with pytest.raises(LaunchError, match="the server failed: stopped before the run's end"):
            follow(config, run_dir, procs, said.append, echo)
    assert [r["round"] for r in read_rounds(run_dir)] == [1, 2]
    assert not [line for line in said if line.startswith("not mirrored")], said


def _context(run_id: int, config: dict) -> Context:
    return Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=config)


def test_a_resumed_remote_run_goes_on_in_its_folder_cut_back_to_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "server" / ".flwr"))
    config = build_config(dataset="digits", out="runs/r1")
    first = tmp_path / "server" / "runs" / "r1-7"
    first.mkdir(parents=True)
    folders: list[RunFolder] = []
    run_app(_context(7, {"resume-folder": "", **config.to_run_config()}), lambda c, f: folders.append(f))
    assert folders[-1].path == first and folders[-1].echo
    _a_run(folders[-1], rounds=3)
    with open(first / ROUNDS, "a") as f:  # round 4's row, written before its checkpoint when the server died
        f.write(json.dumps({"round": 4}) + "\n")
    capsys.readouterr()

    run_app(_context(9, {"resume-folder": "r1-7", **config.to_run_config()}), lambda c, f: folders.append(f))
    assert folders[-1].path == first and [r["round"] for r in read_rounds(first)] == [1, 2, 3]
    out = tmp_path / "submitter"
    out.mkdir()
    (out / ROUNDS).write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 2, 3, 4)))
    Mirror(out).feed(capsys.readouterr().out)  # the submitter's rows, cut back as the server's were
    assert (out / ROUNDS).read_bytes() == (first / ROUNDS).read_bytes()

    for unknown in ("r1-8", "..", "../runs/r1-7"):  # no checkpoint there, or not a folder of its runs
        with pytest.raises(Exception, match="nothing to resume: this server has no checkpoint of the run"):
            run_app(_context(10, {"resume-folder": unknown, **config.to_run_config()}), lambda c, f: None)
    assert "nothing to resume" in (tmp_path / "server" / "runs" / "r1-10" / SERVER_ERROR).read_text()


def test_a_remote_run_resumes_only_where_it_names_the_servers_folder(tmp_path: Path) -> None:
    remote = {"federation": "remote", "server": "127.0.0.1:9092", "insecure": True}
    config = build_config(dataset="digits", **remote, out=str(tmp_path / "r"))
    run_dir = prepare_run_dir(config)
    save_config(config, run_dir / CONFIG)
    RunFolder(run_dir).save_checkpoint(Checkpoint(2, np.ones(3, np.float32)))
    with pytest.raises(LaunchError, match="does not name the server's folder of the run"):
        prepare_run_dir(config, resume=True)
    (run_dir / REMOTE_RUN).write_text("r-7\n")
    assert prepare_run_dir(config, resume=True) == run_dir
    assert not (prepare_run_dir(config) / REMOTE_RUN).exists()  # a fresh run names none until it is submitted


def test_signed_echoes_are_mirrored_and_a_line_without_the_servers_signature_is_not(
    server: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over TLS the ServerApp signs each line with the secret only the server and its submitters hold: a device
    whose words reach the log (a line of its own choosing, unsigned or signed with another key) writes nothing."""
    key = os.urandom(32)
    folder = RunFolder(server, echo=True, echo_key=key)
    _a_run(folder, rounds=1)
    folder.write(SUMMARY, b'{"rounds": 1}\n')
    text = capsys.readouterr().out
    row = json.dumps({"file": ROUNDS, "row": {"round": 99}})
    forged = [ECHO + row, ECHO + f"{echo_signature(os.urandom(32), row)} {row}", ECHO + "0" * 64 + " " + row]
    out = tmp_path / "submitter"
    out.mkdir()
    mirror = Mirror(out, key)
    refused = mirror.feed("\n".join([*forged, text]))
    assert refused == ["an echo line without the ServerApp's signature; not written"] * 3 and mirror.close() == []
    assert (out / ROUNDS).read_bytes() == (server / ROUNDS).read_bytes()
    assert (out / SUMMARY).read_bytes() == (server / SUMMARY).read_bytes()
    unsigned = RunFolder(tmp_path / "other", echo=True)  # a server without the secret: nothing of it is taken
    (tmp_path / "other").mkdir()
    unsigned.append(ROUNDS, {"round": 1})
    assert Mirror(out, key).feed(capsys.readouterr().out) == [
        "an echo line without the ServerApp's signature; not written"
    ]

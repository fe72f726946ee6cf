"""The files a run leaves in ``runs/NAME/``: ``rounds.jsonl`` (one object per closed round), ``messages.jsonl``
(one object per message round trip), ``summary.json``, ``checkpoint.npz`` (what ``edgefl run --resume``
continues from), ``global.onnx`` (the final model) and ``server_error.txt`` when the server failed; the ServerApp's
log ``server.log``; and, written by ``edgefl run`` on the submitter, the resolved ``config.toml`` (what ``--resume``
and ``edge bench RUN`` rebuild the run from) and the plots ``accuracy_vs_{time,rounds,bytes}.png``. Every name is a
constant here and no other module spells one; the checkpoint is saved and read through ``RunFolder`` too
(``RunFolder(run_dir).read_checkpoint()`` for a tool reading a finished run).

The ServerApp writes them through ``RunFolder``. In a run submitted from another machine
(``--federation remote``) it also echoes every write on its output as ``ECHO`` lines, which Flower streams to
the submitter (``flwr log --stream``); there a ``Mirror`` writes the same files into the submitter's folder. A
whole file is echoed base64 in chunks, each naming the file's SHA-256; the checkpoint, written every round, is
echoed only before the run's last word (its summary or its error), so the submitter can resume it or bench its
model. Over TLS each line is signed with a secret only the submitters and the server hold (``ECHO_KEY``), and the
Mirror writes nothing a line without the signature says. The submitter's folder names the server's folder of the
run (``REMOTE_RUN``); a resumed run goes on there,
from the server's own checkpoint, and first echoes its rounds.jsonl whole, cut back to that checkpoint.

A round's row is appended before its checkpoint is written, so after a crash rounds.jsonl may run ahead of the
checkpoint (never behind); a resumed run first cuts it back to the checkpoint's round."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import statistics
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROUNDS = "rounds.jsonl"
MESSAGES = "messages.jsonl"
SUMMARY = "summary.json"
CHECKPOINT = "checkpoint.npz"
STRATEGY_KEY = "strategy:"  # a checkpoint's arrays of the strategy's state are named "strategy:NAME"
AGGREGATE_KEY = "aggregate:"  # and those of the aggregation rule's state (centered clipping's centre) "aggregate:NAME"
GLOBAL_ONNX = "global.onnx"
SERVER_ERROR = "server_error.txt"
SERVER_LOG = "server.log"  # the ServerApp's log (``fl_server.app.run_in_folder``); not echoed
CONFIG = "config.toml"  # the resolved config, written by ``edgefl run`` before it starts the run
PLOT_TIME = "accuracy_vs_time.png"  # ``edgefl.report.plot_single``'s plots (``edgefl report --out`` writes the same)
PLOT_ROUNDS = "accuracy_vs_rounds.png"
PLOT_BYTES = "accuracy_vs_bytes.png"
PLOTS = (PLOT_TIME, PLOT_ROUNDS, PLOT_BYTES)
RUN_FILES = (ROUNDS, MESSAGES, SUMMARY, CHECKPOINT, GLOBAL_ONNX, SERVER_ERROR, SERVER_LOG, CONFIG, *PLOTS)


ECHO = "edgefl-result "
ECHO_KEY = "echo.key"  # the secret echo lines are signed with (HMAC-SHA256): made by ``edgefl certs --submitters``,
# held by the submitters and copied by ``edgefl server`` beside its runs; no device has it
ECHO_CHUNK = 48_000  # bytes of a binary file per echoed line (base64: 64 kB)
REMOTE_RUN = ".remote-run"  # in a remote run's folder on the submitter: the server's folder of the run
ECHOED_ROWS = (ROUNDS, MESSAGES)
ECHOED_FILES = (ROUNDS, SUMMARY, CHECKPOINT, GLOBAL_ONNX, SERVER_ERROR)  # rounds.jsonl: a resumed run's, whole
LAST_WORDS = (SUMMARY, SERVER_ERROR)  # a run writes one of them last; the checkpoint is echoed before it
_say_lock = threading.RLock()  # one echoed line at a time: rows come from the evaluator's thread too


@dataclass(frozen=True)
class RunFolder:
    """Where the ServerApp writes a run; ``echo``: also say its writes on stdout (see the module docstring)."""

    path: Path
    echo: bool = False
    echo_key: bytes | None = None  # sign each echoed line (``ECHO_KEY``); None: lines unsigned (--insecure servers)

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    @property
    def server_log(self) -> Path:
        return self.path / SERVER_LOG

    def save_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Written to a temporary file and renamed, so a crash never leaves half a checkpoint. Not echoed here:
        an echoing folder sends the checkpoint just before the run's last word (``write``)."""
        tmp = self.path / (CHECKPOINT + ".tmp.npz")
        norms = np.asarray(checkpoint.recent_norms, dtype=np.float64)
        momentum = np.asarray(checkpoint.momentum, dtype=np.float32)
        state = {STRATEGY_KEY + key: value for key, value in checkpoint.strategy.items()}
        state |= {AGGREGATE_KEY + key: value for key, value in checkpoint.aggregate.items()}
        np.savez(tmp, round=np.int64(checkpoint.round), params=checkpoint.params, wall_s=np.float64(checkpoint.wall_s),
                 recent_norms=norms, momentum=momentum, **state)  # fmt: skip
        os.replace(tmp, self.checkpoint_path)

    def read_checkpoint(self) -> Checkpoint | None:
        """The run's checkpoint, or None when it has none."""
        if not self.checkpoint_path.exists():
            return None
        with np.load(self.checkpoint_path) as data:
            momentum = data["momentum"] if "momentum" in data else np.zeros(0, np.float32)  # older checkpoints
            strategy = {key.removeprefix(STRATEGY_KEY): data[key] for key in data.files if key.startswith(STRATEGY_KEY)}
            rule = {key.removeprefix(AGGREGATE_KEY): data[key] for key in data.files if key.startswith(AGGREGATE_KEY)}
            round_, wall_s, norms = int(data["round"]), float(data["wall_s"]), data["recent_norms"]
            return Checkpoint(round_, data["params"], wall_s, norms, momentum, strategy, rule)

    def append(self, name: str, row: dict[str, Any]) -> None:
        """One row of ``rounds.jsonl`` or ``messages.jsonl``."""
        line = json.dumps(row)
        with open(self.path / name, "a") as f:
            f.write(line + "\n")
        self._say({"file": name, "row": row})

    def write(self, name: str, data: bytes) -> None:
        """A whole file (summary, model, error), replaced atomically; the run's last word comes after the
        checkpoint's echo."""
        tmp = self.path / (name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path / name)
        if self.echo and name in LAST_WORDS and (self.path / CHECKPOINT).exists():
            self._say_file(CHECKPOINT, (self.path / CHECKPOINT).read_bytes())
        self._say_file(name, data)

    def resend(self, name: str) -> None:
        """Echo the file as it is (a resumed run's rounds.jsonl, cut back to its checkpoint)."""
        path = self.path / name
        self._say_file(name, path.read_bytes() if path.exists() else b"")

    def _say_file(self, name: str, data: bytes) -> None:
        if not self.echo:
            return
        digest = hashlib.sha256(data).hexdigest()
        chunks = [data[i : i + ECHO_CHUNK] for i in range(0, len(data), ECHO_CHUNK)] or [b""]
        for part, chunk in enumerate(chunks):
            encoded = base64.b64encode(chunk).decode()
            self._say({"file": name, "part": part, "parts": len(chunks), "sha256": digest, "data": encoded})

    def _say(self, record: dict[str, Any]) -> None:
        if self.echo:
            text = json.dumps(record)
            signature = f"{echo_signature(self.echo_key, text)} " if self.echo_key else ""
            with _say_lock:
                sys.stdout.write(ECHO + signature + text + "\n")
                sys.stdout.flush()


def echo_signature(key: bytes, text: str) -> str:
    """HMAC-SHA256 of an echoed record's JSON text under ``key``, in hex: the ServerApp's, which a device cannot
    make (a device's words reach the log the submitter mirrors, but not the key)."""
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def read_echo_key(path: Path) -> bytes:
    """The secret in ``path`` (``ECHO_KEY``, hex text)."""
    return bytes.fromhex(path.read_text().strip())


def remote_folder_name(run: str, run_id: int | str) -> str:
    """The folder, under the server's ``runs/``, of the run ``run`` submitted from another machine as Flower's run
    ``run_id``; a resumed run goes on in the folder of the run it resumes."""
    return f"{run}-{run_id}"


@dataclass
class _Parts:
    """The chunks of one echoed file that have come so far."""

    parts: int
    sha256: str
    chunks: list[bytes] = field(default_factory=list)


class Mirror:
    """Rebuilds a remote run's folder on the submitter from the ``ECHO`` lines of its log stream, fed in the order
    they came. A row is appended as it comes; a whole file is written (atomically) once all its chunks have come in
    order and their SHA-256 is the one each names. An echo cut short or garbled is refused with its reason and not
    written: the file keeps what it had."""

    def __init__(self, out: Path, key: bytes | None = None) -> None:
        """``key``: the run's echo lines must carry its signature (``echo_signature``); any other is refused."""
        self.out = out
        self.key = key
        self._pending: dict[str, _Parts] = {}
        self._broken: set[str] = set()  # files whose echo was refused: their parts until the next echo are dropped

    def feed(self, text: str) -> list[str]:
        """Mirror the ``ECHO`` lines of ``text``; returns the reasons of what was refused."""
        refused: list[str] = []
        for line in text.splitlines():
            if line.startswith(ECHO):
                text = line.removeprefix(ECHO)
                if self.key:
                    signature, _, text = text.partition(" ")
                    if not hmac.compare_digest(signature, echo_signature(self.key, text)):
                        refused.append("an echo line without the ServerApp's signature; not written")
                        continue
                try:
                    self._take(json.loads(text), refused)
                except (ValueError, TypeError, KeyError, AttributeError, binascii.Error) as exc:
                    refused.append(f"a garbled echo line ({type(exc).__name__}: {exc})")
        return refused

    def close(self) -> list[str]:
        """The stream ended: every file not complete is refused."""
        refused = [self._cut(name) for name in self._pending]
        self._pending.clear()
        return refused

    def _cut(self, name: str) -> str:
        pending = self._pending[name]
        return f"{name}: its echo ended after {len(pending.chunks)} of {pending.parts} parts; not written"

    def _take(self, record: dict[str, Any], refused: list[str]) -> None:
        name = record["file"]
        if name not in (ECHOED_ROWS if "row" in record else ECHOED_FILES):
            refused.append(f"{str(name)[:80]!r} is not a file an echo may write; not written")
            return
        if "row" in record:
            with open(self.out / name, "a") as f:
                f.write(json.dumps(record["row"]) + "\n")
            return
        part, parts, digest = int(record["part"]), int(record["parts"]), str(record["sha256"])
        chunk = base64.b64decode(record["data"], validate=True)
        pending = self._pending.get(name)
        if part == 0:
            if pending is not None:  # a new echo of the file began before the last one ended
                refused.append(self._cut(name))
            self._pending[name] = pending = _Parts(parts, digest)
            self._broken.discard(name)
        elif pending is None or (pending.parts, pending.sha256, len(pending.chunks)) != (parts, digest, part):
            self._pending.pop(name, None)
            if name not in self._broken:
                self._broken.add(name)
                refused.append(f"{name}: part {part} of its echo came without the parts before it; not written")
            return
        pending.chunks.append(chunk)
        if len(pending.chunks) < parts:
            return
        data = b"".join(self._pending.pop(name).chunks)
        if hashlib.sha256(data).hexdigest() != digest:
            refused.append(f"{name}: its echo does not match its SHA-256; not written")
            return
        tmp = self.out / (name + ".mirror.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.out / name)


@dataclass(frozen=True)
class MessageTrip:
    """One message round trip, a row of ``messages.jsonl``. ``sent_at`` is the server host's monotonic clock when
    the push began (as in the agents' ``task`` log lines, which name the same ``message_id``); ``round_trip_s``
    lasts until the reply was pulled; ``train_s`` is the client's training for the updates it carried;
    ``held_s`` how long the client held the message before answering it (training, waiting for an update);
    ``path_s`` = ``round_trip_s`` − ``held_s``, the message path R: links, Flower's transfers and the device's
    side of taking and sending a message; ``objects_*`` count Flower objects, one HTTP request each over the
    link."""

    message_id: str
    node: int
    partition: int
    sent_at: float
    round_trip_s: float
    train_s: float
    held_s: float
    path_s: float
    rounds: list[int]
    bytes_down: int
    bytes_up: int
    objects_down: int
    objects_up: int


def read_rounds(run_dir: Path, name: str = ROUNDS) -> list[dict[str, Any]]:
    """The rows of ``rounds.jsonl`` (or another of the run's JSON-lines files)."""
    path = run_dir / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_rounds(run_dir: Path, last_round: int) -> None:
    """Keep the rows of rounds 1..``last_round`` (and drop a line a crash cut short); atomic like checkpoints."""
    path = run_dir / ROUNDS
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row["round"] <= last_round:
            kept.append(line + "\n")
    tmp = run_dir / (ROUNDS + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


@dataclass(frozen=True)
class Checkpoint:
    """The server's state after a closed round: all a resumed run needs. DGA's server side is just the round
    counter and the global model; the clients restart from that global model (see ``fl_server.engine``)."""

    round: int
    params: np.ndarray  # the global model after ``round``
    wall_s: float = 0.0  # the run's wall clock when the round closed
    recent_norms: np.ndarray = field(default_factory=lambda: np.zeros(0))  # (client, norm) rows: ``InfluenceBound``'s
    momentum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # ``ServerMomentum``'s; empty: none
    strategy: dict[str, np.ndarray] = field(default_factory=dict)  # the strategy's server half's ``state()``
    aggregate: dict[str, np.ndarray] = field(default_factory=dict)  # the aggregation rule's (``fl_server.robust``)


def regime(trips: list[dict[str, Any]]) -> dict[str, float | None]:
    """The regime a run measured, from its ``messages.jsonl`` rows: R, the message path (``message_path_s``: the
    median ``path_s`` of the messages that carried training), and T, a round's training on a client
    (``round_train_s``: the median of their ``train_s`` per round carried). R/T is what decides what DGA can gain
    (``strategies.dga.regime_bounds``). None when no message carried training."""
    carried = [t for t in trips if t["train_s"] > 0]
    if not carried:
        return {"message_path_s": None, "round_train_s": None}
    return {
        "message_path_s": statistics.median(t["path_s"] for t in carried),
        "round_train_s": statistics.median(t["train_s"] / max(1, len(t["rounds"])) for t in carried),
    }


def summarize(config: dict[str, Any], rows: list[dict[str, Any]], trips: list[dict[str, Any]]) -> dict[str, Any]:
    """The run in one object; ``config`` is the resolved config as a dict, ``rows`` and ``trips`` its rounds.jsonl
    and messages.jsonl. ``time_to_target_s`` and ``bytes_to_target`` (up + down, all clients) are measured through
    the first round whose accuracy reaches ``target_accuracy``; None when no round does."""
    evaluated = [r for r in rows if r["test_accuracy"] is not None]
    accuracies = [r["test_accuracy"] for r in evaluated]
    wall = rows[-1]["wall_s"] if rows else 0.0
    target = config.get("target_accuracy")
    reached = [i for i, r in enumerate(rows) if target is not None and (r["test_accuracy"] or 0) >= target]
    first = reached[0] if reached else None
    steps = sum(len(r["clients"]) for r in rows) * config["local_steps"]
    return {
        "strategy": config["strategy"],
        "dataset": config["dataset"],
        "model": config["model"],
        "partition": config["partition"],
        "clients": config["clients"],
        "rounds": len(rows),
        "local_steps": config["local_steps"],
        "compress": config["compress"],
        "compress_down": config["compress_down"],
        "seed": config["seed"],
        "final_accuracy": accuracies[-1] if accuracies else None,
        "eval_examples": evaluated[-1].get("eval_examples") if evaluated else None,  # test examples it was scored on
        "best_accuracy": max(accuracies) if accuracies else None,
        "final_loss": evaluated[-1]["test_loss"] if evaluated else None,
        "wall_clock_s": wall,
        "seconds_per_round": wall / len(rows) if rows else None,
        "rounds_per_hour": 3600 * len(rows) / wall if wall > 0 else None,
        "local_steps_per_s": steps / wall if wall > 0 else None,
        "bytes_up": sum(r["bytes_up"] for r in rows),
        "bytes_down": sum(r["bytes_down"] for r in rows),
        "target_accuracy": target,
        "time_to_target_s": None if first is None else rows[first]["wall_s"],
        "bytes_to_target": None if first is None else sum(r["bytes_up"] + r["bytes_down"] for r in rows[: first + 1]),
        "rejected_updates": sum(len(r["rejected"]) for r in rows),
        "link_profile": config["profile"],
        "link_backend": config["link_backend"],
        "device_profile": config["device_profile"],
        "device_backend": config["device_backend"],
        **regime(trips),
    }


def summary_bytes(summary: dict[str, Any]) -> bytes:
    """summary.json's content: NaN and Inf written as null."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
    return (json.dumps(clean, indent=2) + "\n").encode()

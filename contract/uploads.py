"""The bytes one object upload may carry at the gateway: a bound each run's ServerApp derives from its run and the
gateway (nginx's ``client_max_body_size`` on ``/v1/fleet/push-object``) enforces, so a reply larger than its run
allows is refused (413) before Flower's SuperLink stores any of it or the ServerApp pulls it.

An edgefl reply is one object holding every update it carries (``contract.wire``): the rounds an agent has ready,
at most D + 1 (DGA's staleness bound D; 0 for the rest), and, answering a server that asks again, as many kept
ones besides: 2(D + 1) updates, each payload at most the dense float32 one (``strategies.codecs.dense_payload_size``:
what every decoder refuses beyond), plus headers (``reply_bytes_at_most``).

Who starts a SuperLink beside a gateway puts the gateway's folder in the SuperLink's environment (``ENV``); its
ServerApps post their run's bound there (``posted``: a file named by the ServerApp's pid, taken back at the run's
end, and one whose process is gone is not counted) and the gateway's limit becomes the largest bound of the runs
under way, or ``NO_RUN_LIMIT`` (Flower's own apps, whose arrays go in chunks of 5 MiB, post nothing) when none is.
nginx is reloaded (SIGHUP to its master, whose pid file is in the folder) and ``posted`` returns once nginx has
started the workers that enforce it and the old ones have exited (after the requests they were serving). Where
there is no gateway (a federation on loopback) nothing is posted.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("edgefl.uploads")

ENV = "EDGEFL_GATEWAY_DIR"
NO_RUN_LIMIT = 16 * 1024 * 1024  # nginx's "16m": a run's app (flwr run) and Flower's own apps' 5 MiB chunks
LIMIT_CONF = "upload_limit.conf"  # included by the gateway's push-object location
POSTED = "posted"  # one file per ServerApp: its pid, holding its run's bound
PID_FILE, ERROR_LOG = "nginx.pid", "error.log"
UPDATE_HEADER = 4096  # bytes of one update's entry in a reply's header: far above what contract.wire writes
REPLY_HEADER = 64 * 1024  # and of the rest of a reply: the header's fixed fields, Flower's object envelope
RELOAD_TIMEOUT_S = 10.0
RELOAD_POLL_S = 0.02


def reply_bytes_at_most(delay: int, dense_payload: int) -> int:
    """The most bytes a reply of a run may push as one object: 2(D + 1) updates of at most ``dense_payload`` bytes
    each, with their headers."""
    return 2 * (delay + 1) * (dense_payload + UPDATE_HEADER) + REPLY_HEADER


def limit_conf(limit: int) -> str:
    """The directive the gateway includes in its object-upload location."""
    return f"client_max_body_size {limit};\n"


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def current_limit(folder: Path) -> int:
    """The largest bound posted in ``folder`` by a ServerApp still running; ``NO_RUN_LIMIT`` when there is none."""
    bounds = []
    for posted in (folder / POSTED).glob("*"):
        with contextlib.suppress(OSError, ValueError):
            if alive(int(posted.name)):
                bounds.append(int(posted.read_text()))
    return max(bounds) if bounds else NO_RUN_LIMIT


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One writer and reload of the gateway in ``folder`` at a time (two runs starting at once, a revocation)."""
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _reload(folder: Path) -> str | None:
    """SIGHUP to the nginx master of ``folder``; return once it started new workers and the old ones exited (after
    the requests they were serving), or why not (None: reloaded)."""
    errors = folder / ERROR_LOG
    offset = errors.stat().st_size if errors.exists() else 0
    try:
        os.kill(int((folder / PID_FILE).read_text()), signal.SIGHUP)
    except (OSError, ValueError) as exc:
        return f"could not signal it: {exc}"
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while time.monotonic() < deadline:  # nginx's master logs the workers it starts and the old ones' exit
        with open(errors, "rb") as text:
            text.seek(offset)
            said = text.read()
        if b"start worker process " in said and b" exited with code " in said:
            return None
        time.sleep(RELOAD_POLL_S)
    return f"it did not reload in {RELOAD_TIMEOUT_S:.0f} s (its old workers' connections keep what they read)"


def reload(folder: Path) -> str | None:
    """Have the gateway of ``folder`` read its files again (e.g. a new revocation list), as ``_reload``."""
    with _locked(folder):
        return _reload(folder)


def _apply(folder: Path) -> None:
    """Write the limit of the runs under way and reload nginx (``_reload``); a failed reload is a warning:
    connections the old workers still serve keep the previous limit."""
    with _locked(folder):
        limit = current_limit(folder)
        conf = folder / LIMIT_CONF
        if conf.is_file() and conf.read_text() == limit_conf(limit):
            return
        conf.with_suffix(".tmp").write_text(limit_conf(limit))
        conf.with_suffix(".tmp").replace(conf)
        if failed := _reload(folder):
            log.warning("edgefl: the gateway's object uploads are not bounded at %d bytes yet: %s", limit, failed)
        else:
            log.info("edgefl: the gateway takes object uploads of at most %d bytes", limit)


@contextlib.contextmanager
def posted(bound: int, folder: str | None = None) -> Iterator[None]:
    """While the ``with`` runs, this process's run allows object uploads of ``bound`` bytes at the gateway whose
    folder is ``folder`` (default: ``ENV``; nothing without one)."""
    folder = folder if folder is not None else os.environ.get(ENV, "")
    if not folder:
        yield
        return
    where = Path(folder)
    mine = where / POSTED / str(os.getpid())
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text(str(bound))
    _apply(where)
    try:
        yield
    finally:
        mine.unlink(missing_ok=True)
        _apply(where)

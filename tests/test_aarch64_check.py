"""bench/aarch64_check.sh where apt's sources are in deb822 form only, and its one line whenever it stops early
(the check itself needs root, qemu and tens of minutes: tests/ runs only its first steps, with stand-in tools)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "bench" / "aarch64_check.sh"
DEB822 = """Types: deb
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""
TWO_URIS = "http://a.example/debian/ http://b.example/debian"
ONE_LINE = "deb http://old.example/debian bookworm main\n"


def _mirror(root: Path) -> subprocess.CompletedProcess[str]:
    """The script's ``debian_mirror`` on a machine whose root file system is at ``root``."""
    source = ["bash", "-c", 'source "$1"; debian_mirror "$2"', "bash", SCRIPT, root]
    return subprocess.run(source, capture_output=True, text=True, timeout=30)


def _sources(root: Path, files: dict[str, str]) -> Path:
    (root / "etc/apt/sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (root / "etc/apt" / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "mirror"),
    [
        ({"sources.list.d/debian.sources": DEB822}, "http://mirror.example/debian"),  # no sources.list
        ({"sources.list": "deb [arch=arm64] http://old.example/debian/ bookworm main\n"}, "http://old.example/debian"),
        ({"sources.list.d/extra.list": "deb http://deb.example/debian bookworm main\n"}, "http://deb.example/debian"),
        ({"sources.list.d/s.sources": f"Types: deb\nURIs: {TWO_URIS}\n"}, "http://a.example/debian"),
        ({"sources.list.d/debian.sources": DEB822, "sources.list": ONE_LINE}, "http://mirror.example/debian"),
        ({"sources.list.d/security.sources": DEB822.split("\n\n")[1]}, ""),  # no Debian mirror named
        ({}, ""),  # no source at all
    ],
)
def test_the_mirror_is_found_in_either_form_of_apt_sources(tmp_path: Path, files: dict[str, str], mirror: str) -> None:
    found = _mirror(_sources(tmp_path, files))
    assert found.returncode == 0 and found.stdout.strip() == mirror, found.stderr
    assert found.stderr == ""


def test_a_stop_says_why_in_one_line(tmp_path: Path) -> None:
    """apt-get fails (a stand-in, on PATH before the real one): the check stops with the command, its status and
    the log, in one line; before, it ended silently (at the mirror look-up already, on a deb822-only machine)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "mkdir", "sed", "nice", "tee", "awk", "sort", "readlink"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")  # the check needs root; it never gets as far as using it
    (bin_dir / "apt-get").write_text("#!/bin/sh\nexit 100\n")
    for stand_in in ("id", "apt-get"):
        (bin_dir / stand_in).chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(
        [shutil.which("bash"), SCRIPT, "--cache", tmp_path / "cache", "--out", out],
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir)},
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("aarch64_check: error: stopped at line "), line
    assert '"nice -n 19 apt-get update -qq >> "$LOG" 2>&1" failed (exit 100)' in line
    assert line.endswith(f"; see {out / 'aarch64_check.log'}"), line

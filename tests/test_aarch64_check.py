"""bench/aarch64_check.sh where apt's sources are in deb822 form only, its one line whenever it stops early, and
its waits for ``edgefl server`` and ``edgefl client`` through their ``--ready-file`` (the check itself needs root,
qemu and tens of minutes: tests/ runs only its first steps and its functions, with stand-in tools)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from edgefl.cli import build_parser
from edgefl.remote import cmd_client, cmd_server
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


def _sourced(script: str, *args: object, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """Bash ``script`` after sourcing the check (its functions), with ``args`` as $2.. and ``path`` as PATH."""
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    argv = ["bash", "-c", f'source "$1"; {script}', "bash", SCRIPT, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


def test_the_wait_returns_once_the_ready_file_appears(tmp_path: Path) -> None:
    """A background process writes the ready file as the commands do (a rename) only once the wait has looked for
    it in vain: the wait's first poll interval (a stand-in ``sleep``) lets it go through a FIFO."""
    ready, go, polled, bin_dir = tmp_path / "server.ready", tmp_path / "go", tmp_path / "polled", tmp_path / "bin"
    os.mkfifo(go)
    bin_dir.mkdir()
    (bin_dir / "sleep").write_text(
        f'#!/bin/sh\n[ -e "{polled}" ] || {{ : >"{polled}"; echo go >"{go}"; }}\nexec {shutil.which("sleep")} "$@"\n'
    )
    (bin_dir / "sleep").chmod(0o755)
    writer = '(read -r _ <"$3"; echo serving >"$2.partial"; mv "$2.partial" "$2") &'
    done = _sourced(f'{writer} wait_ready "$2" "$!" "edgefl server" "$4" 30', ready, go, tmp_path / "server.out",
                    path=f"{bin_dir}:{os.environ['PATH']}")  # fmt: skip
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stderr
    assert polled.exists() and ready.read_text() == "serving\n"


@pytest.mark.parametrize(("before", "timeout"), [("", "1"), ("STARTUP_TIMEOUT_S=1;", "")])  # or the script's default
def test_the_wait_stops_in_one_line_naming_what_it_waited_for(tmp_path: Path, before: str, timeout: str) -> None:
    """The process keeps running (this test's own) and never writes the file: one line when the deadline passed."""
    ready, out = tmp_path / "client.ready", tmp_path / "client.out"
    done = _sourced(f'{before} wait_ready "$2" "$3" "edgefl client" "$4" {timeout}', ready, os.getpid(), out)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == f"aarch64_check: error: edgefl client was not ready within 1 s (no {ready}); see {out}\n"


def test_the_wait_stops_when_the_command_exits_first(tmp_path: Path) -> None:
    """The command exited before it was ready: its last lines, then the one line."""
    ready, out = tmp_path / "server.ready", tmp_path / "server.out"
    out.write_text("starting\nedgefl: error: cannot listen on 127.0.0.1:9092\n")
    done = _sourced('true & gone=$!; wait "$gone"; wait_ready "$2" "$gone" "edgefl server" "$3" 30', ready, out)
    assert done.returncode == 2, done.stdout + done.stderr
    *tail, line = done.stderr.splitlines()
    assert tail == out.read_text().splitlines()
    assert line == f"aarch64_check: error: edgefl server exited before it wrote {ready}; see {out}"


def _script_commands() -> dict[str, tuple[list[str], list[str]]]:
    """The check's ``edgefl server`` and ``edgefl client`` command lines (their words, variables unexpanded) and
    the ``wait_ready`` that follows each, by command."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    commands = re.findall(r'(?:"\$EDGEFL"|\bedgefl) (server|client) (--.*?) >', text)
    waits = {shlex.split(words)[2]: shlex.split(words) for words in re.findall(r"^wait_ready (.*)$", text, re.M)}
    return {name: (shlex.split(words), waits[f"edgefl {name}"]) for name, words in commands}


def test_each_command_writes_its_ready_file_where_the_check_waits_for_it() -> None:
    """Nothing the commands print is waited for: each command line of the check parses with edgefl's own parser
    (so its --ready-file is a flag of that command, run by its function) and names the file its wait looks at
    (the client's inside the chroot, at $ROOTFS on this machine)."""
    commands = _script_commands()
    assert sorted(commands) == ["client", "server"]
    for name, func in (("server", cmd_server), ("client", cmd_client)):
        words, (ready, pid, _, output) = commands[name]
        ready_file = words[words.index("--ready-file") + 1]
        assert ready == {"server": ready_file, "client": "$ROOTFS" + ready_file}[name]
        assert pid == "$!" and output == f"$OUT/{name}.out"
        args = build_parser().parse_args([name, *(re.sub(r"\$\{?\w+\}?", "1", word) for word in words)])
        assert args.func is func and args.ready_file == Path(re.sub(r"\$\{?\w+\}?", "1", ready_file))

"""One error model (contract.errors): ``EdgeflError`` is a user's mistake (the command prints it in one line and
exits 2), ``PeerError`` a message from the other end that cannot be taken (the receiver logs it and refuses the
message). The project's packages raise no bare ``ValueError``/``RuntimeError``: each is one of those, or an
``assert`` of an invariant the code itself keeps, or a ``RuntimeError`` subclass named for what happened."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from contract.errors import EdgeflError, PeerError
from contract.settings import ConfigError, JobError
from contract.wire import WireError
from edge.agent import AgentError
from strategies.codecs.base import CodecError, MalformedUpdate
from strategies.downlink import DownlinkError
from strategies.fedavg import CheckpointError
from strategies.spec import SpecError
from tests.conftest import REPO

PACKAGES = ("strategies", "contract", "ml", "edge", "fl_client", "fl_server", "netem", "edgefl")
BARE = ("ValueError", "RuntimeError")


def bare_raises(root: Path) -> list[tuple[str, int, str]]:
    """(path, line, class) of every ``raise ValueError``/``raise RuntimeError``, called or not."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in BARE:
                    found.append((path.relative_to(root).as_posix(), node.lineno, exc.id))
    return found


def test_no_bare_value_or_runtime_error_is_raised() -> None:
    left = [f"{path}:{line} raises {name}" for path, line, name in bare_raises(REPO)]
    assert not left, "raise an EdgeflError or PeerError subclass (or assert an invariant) instead:\n" + "\n".join(left)


def test_the_scan_finds_a_bare_raise(tmp_path: Path) -> None:
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "bad.py").write_text(
        "def f():\n    raise ValueError('x')\n\n\ndef g():\n    raise RuntimeError\n"
    )
    assert bare_raises(tmp_path) == [("strategies/bad.py", 2, "ValueError"), ("strategies/bad.py", 6, "RuntimeError")]


@pytest.mark.parametrize("error", [WireError, CodecError, MalformedUpdate, DownlinkError, AgentError, JobError])
def test_a_peers_bad_message_is_a_peer_error(error: type[Exception]) -> None:
    assert issubclass(error, PeerError) and not issubclass(error, EdgeflError)


@pytest.mark.parametrize("error", [ConfigError, SpecError, CheckpointError])
def test_a_users_mistake_is_an_edgefl_error(error: type[Exception]) -> None:
    assert issubclass(error, EdgeflError) and not issubclass(error, PeerError)


@pytest.mark.parametrize(
    ("error", "old_base"),
    [(WireError, ValueError), (CodecError, ValueError), (DownlinkError, ValueError), (AgentError, RuntimeError)],
)
def test_a_peer_error_keeps_its_old_base(error: type[Exception], old_base: type[Exception]) -> None:
    """Every ``except ValueError``/``except RuntimeError`` written before PeerError still catches it."""
    assert issubclass(error, old_base)


def test_the_two_bases_are_disjoint() -> None:
    assert not issubclass(PeerError, EdgeflError) and not issubclass(EdgeflError, PeerError)


def test_contract_errors_imports_nothing() -> None:
    tree = ast.parse((REPO / "contract" / "errors.py").read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]

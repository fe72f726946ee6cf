"""Flower's one door (``contract.flower``): the installed flwr is one the door was checked against, every digest
it records is the installed code's, every internal name it hands out is there, code that differs is refused or
left stock in one line, and no module but the door imports Flower's internals."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from flwr.app import Message, RecordDict

import contract.flower as flower
from contract.errors import EdgeflError
from tests.conftest import REPO

# Flower's public API: any name of these modules' ``__all__`` (flwr.common: its top-level names) may be imported
PUBLIC = ("flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.serverapp.strategy", "flwr.simulation", "flwr.common")
DOOR = REPO / "contract" / "flower.py"
SKIPPED = ("tests", ".venv", "runs")  # tests stand in for Flower's own processes with its internals
TABLES = {
    "TUNED_SOURCE": flower.TUNED_SOURCE,
    "COUNT_SOURCE": flower.COUNT_SOURCE,
    "RUNTIME_SOURCE": flower.RUNTIME_SOURCE,
    "GRID_SOURCE": flower.GRID_SOURCE,
    "LAUNCH_SOURCE": flower.LAUNCH_SOURCE,
    "SUBMIT_SOURCE": flower.SUBMIT_SOURCE,
    "PULL_SOURCE": flower.PULL_SOURCE,
}


def test_the_installed_flower_is_one_the_door_was_checked_against() -> None:
    """Fails on any flwr but FLWR_CHECKED's: read the code every table names in the new version, update the
    digests that moved (and the code that relies on them), then add the version."""
    assert importlib.metadata.version("flwr") in flower.FLWR_CHECKED
    assert flower.INSTALLED in flower.FLWR_CHECKED


@pytest.mark.parametrize("table", TABLES)
def test_every_recorded_digest_is_the_installed_code(table: str) -> None:
    found = {name: flower.source_digest(flower.resolve(name)) for name in TABLES[table]}
    assert found == TABLES[table]
    assert flower.why_differs(TABLES[table], "uses") is None


def test_every_internal_name_is_there() -> None:
    for name, (module, attribute) in flower.INTERNAL.items():
        found = getattr(flower, name)
        if attribute is None:
            assert isinstance(found, ModuleType) and found.__name__ == module, name
        else:
            assert found is getattr(importlib.import_module(module), attribute), name


def test_the_door_imports_nothing_of_flower_until_a_name_is_used() -> None:
    """A process pays for the internals it uses only (the Runtime API client's import FastAPI)."""
    code = "import sys, contract.flower, contract.transport; print(sorted(m for m in sys.modules if 'flwr' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_name_the_installed_flower_lacks_is_refused_in_one_line(monkeypatch) -> None:
    monkeypatch.setitem(flower.INTERNAL, "Gone", ("flwr.supercore.no_such_module", "Gone"))
    with pytest.raises(EdgeflError) as refused:
        from contract.flower import Gone  # noqa: F401
    message = str(refused.value)
    assert "\n" not in message and "flwr.supercore.no_such_module.Gone" in message
    assert f"flwr {flower.INSTALLED} has no" in message
    assert f"checked against flwr {' and '.join(flower.FLWR_CHECKED)}" in message
    with pytest.raises(AttributeError):
        flower.__getattr__("not_a_flower_name")


def test_code_that_differs_refuses_the_runtime_api_client(monkeypatch) -> None:
    """The agent's task server has no stock client to fall back to: it refuses to start, in one line."""
    from fl_client.tasks import TaskServer

    monkeypatch.setitem(flower.RUNTIME_SOURCE, "flwr.app.metadata.Metadata.__init__", "0000000000000000")
    flower.refuse_unless_runtime_api.cache_clear()
    try:
        with pytest.raises(EdgeflError) as refused:
            TaskServer("127.0.0.1:1", None)
    finally:
        flower.refuse_unless_runtime_api.cache_clear()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"flwr {flower.INSTALLED} is installed but flwr.app.metadata.Metadata.__init__ is not")
    assert "the code edgefl serves tasks by (source digest" in message


def test_a_runs_serverapp_is_started_warm_only_where_superexec_is_the_checked_code(monkeypatch, tmp_path) -> None:
    """SuperExec starts ``flwr-serverapp`` by name from PATH, where the launcher puts the warm one's shim; where its
    code differs, no fork server or shim is started: Flower starts its own ServerApp."""
    from edgefl.launcher import SHIMS, flower_env, start_warm_serverapp
    from edgefl.processes import ProcessGroup

    assert flower.serverapp_command() == "flwr-serverapp"
    launch = "flwr.supercore.superexec.executor.subprocess_executor.SubprocessExecutor.launch"
    monkeypatch.setitem(flower.LAUNCH_SOURCE, launch, "0000000000000000")
    assert flower.serverapp_command() is None
    reason = flower.why_differs(flower.LAUNCH_SOURCE, flower.WARM)
    assert reason is not None
    assert reason.startswith(f"{launch} is not the code edgefl starts a run's ServerApp warm by (source digest")
    with ProcessGroup(tmp_path / "logs", flower_env(tmp_path)) as procs:
        start_warm_serverapp(procs, (), tmp_path / SHIMS)
        assert procs.procs == [] and not (tmp_path / SHIMS).exists()


def _app_and_home(tmp_path: Path) -> tuple[Path, Path]:
    """A run's app folder as ``edgefl run`` packages it, and a FLWR_HOME naming a SuperLink nobody serves."""
    import tomli_w

    from contract.settings import build_config
    from edgefl.launcher import app_project, write_flwr_home
    from edgefl.processes import free_port

    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(tomli_w.dumps(app_project("edgefl", build_config(), tmp_path)))
    write_flwr_home(tmp_path / ".flwr", f"127.0.0.1:{free_port()}", None)
    return app, tmp_path / ".flwr"


def test_flwr_run_in_this_process_is_refused_in_flowers_words_on_one_line(tmp_path: Path, capfd) -> None:
    """``flwr run`` called in the submitter's process, against a SuperLink nobody serves: Flower's reason on one
    line; its words kept from this process's output; FLWR_HOME as it was."""
    app, home = _app_and_home(tmp_path)
    before = os.environ.get("FLWR_HOME")
    with pytest.raises(EdgeflError) as refused:
        flower.flwr_run(app, "edgefl", home)
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("Connection to the SuperLink is unavailable.")
    assert os.environ.get("FLWR_HOME") == before
    assert capfd.readouterr() == ("", "")


def test_flwr_run_whose_code_differs_is_left_to_its_command(monkeypatch, tmp_path: Path) -> None:
    app, home = _app_and_home(tmp_path)
    monkeypatch.setitem(flower.SUBMIT_SOURCE, "flwr.cli.run.run.run", "0000000000000000")
    assert flower.flwr_run(app, "edgefl", home) is None


def test_another_flower_version_is_refused_or_left_stock_naming_both(monkeypatch) -> None:
    import contract.transport as transport

    monkeypatch.setattr(flower, "INSTALLED", "9.9.9")
    checked = " or ".join(flower.FLWR_CHECKED)
    expected = f"flwr 9.9.9 is installed; edgefl serves tasks by flwr {checked}'s code only"
    with pytest.raises(EdgeflError, match="^" + re.escape(expected) + "$"):
        flower.refuse_unless_checked(flower.RUNTIME_SOURCE, flower.RUNTIME_API)
    assert transport.why_stock() == f"flwr 9.9.9 is installed; edgefl tunes flwr {checked}'s code only"


def test_set_message_id_is_what_the_message_reports(flower_task) -> None:
    message = Message(RecordDict(), dst_node_id=1, message_type="train")
    flower.set_message_id(message, "abc")
    assert message.metadata.message_id == "abc"


def _bare(kind: type) -> object:
    """A grid of class ``kind`` without a connection: its push and pull given by the test."""
    grid = kind.__new__(kind)
    grid.pull_interval = 0.0  # InMemoryGrid's
    return grid


@pytest.mark.parametrize("grid_class", ["flwr.superlink.grid.http_grid.HttpGrid",
                                        "flwr.superlink.grid.inmemory_grid.InMemoryGrid"])  # fmt: skip
def test_a_metered_grid_is_what_flowers_send_and_receive_calls(grid_class: str) -> None:
    """What GRID_SOURCE's digests guard: Flower's send_and_receive pushes and pulls through the instance's
    methods, so the baseline's meter sees every message and reply of Flower's own FedAvg."""
    kind = flower.resolve(grid_class)
    grid = _bare(kind)
    replies = [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in ("m1", "m2")]
    grid.push_messages = lambda messages: [f"m{i + 1}" for i, _ in enumerate(messages)]
    grid.pull_messages = lambda ids: [reply for reply in replies if reply.metadata.reply_to_message_id in ids]
    seen: list[str] = []

    def metered(kind_of: str):
        def wrap(original):
            def call(arg):
                seen.append(kind_of)
                return original(arg)

            return call

        return wrap

    flower.meter_grid(grid, metered("push"), metered("pull"))
    assert list(kind.send_and_receive(grid, ["a", "b"], timeout=None)) == replies
    assert seen == ["push", "pull"]


def test_the_baseline_meter_is_refused_on_code_it_was_not_checked_against(monkeypatch) -> None:
    kind = flower.resolve("flwr.superlink.grid.http_grid.HttpGrid")
    monkeypatch.setitem(flower.GRID_SOURCE, flower.STRATEGY_LOOP, "0000000000000000")
    with pytest.raises(EdgeflError, match=r"FedAvg\.start is not the code edgefl meters Flower.s FedAvg by"):
        flower.meter_grid(_bare(kind), lambda push: push, lambda pull: pull)
    monkeypatch.undo()
    with pytest.raises(EdgeflError, match="not OtherGrid"):
        flower.meter_grid(_bare(type("OtherGrid", (kind,), {})), lambda push: push, lambda pull: pull)


def _flower_imports(path: Path) -> list[str]:
    """``module.name`` (``module`` for ``import module``) of every flwr import in ``path`` (TYPE_CHECKING too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "flwr"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "flwr":
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _public(imported: str) -> bool:
    if imported in PUBLIC:
        return True
    module, _, name = imported.rpartition(".")
    if module not in PUBLIC or name.startswith("_"):
        return False
    found = importlib.import_module(module)
    exported = getattr(found, "__all__", None) or [n for n in dir(found) if not n.startswith("_")]
    return name in exported and not isinstance(getattr(found, name, None), ModuleType)


def test_no_module_but_the_door_imports_flowers_internals() -> None:
    internal: dict[str, set[str]] = {}
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO)
        if relative.parts[0] in SKIPPED or path == DOOR:
            continue
        names = {imported for imported in _flower_imports(path) if not _public(imported)}
        if names:
            internal[relative.as_posix()] = names
    assert internal == {}, "import these from contract.flower (add them to its INTERNAL_NAMES)"


def test_the_scan_sees_an_internal_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nfrom flwr.app import Message\nfrom flwr.app.message import make_message\n"
        "from flwr.common import serde, Metadata\nimport flwr.supercore.exit\nfrom flwr_datasets import x\n"
        "if TYPE_CHECKING:\n    from flwr.serverapp.strategy import _x\n"
    )
    internal = [name for name in _flower_imports(module) if not _public(name)]
    assert internal == ["flwr.app.message.make_message", "flwr.common.serde", "flwr.supercore.exit",
                        "flwr.serverapp.strategy._x"]  # fmt: skip

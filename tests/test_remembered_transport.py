"""The SuperNode's transport as an agent learns it (``contract.transport.remembered_transport``): found once per
installed flwr code by ``remember_transport`` (which imports the SuperNode's loop), then read without importing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from contract import flower
from contract.flower import TUNED_SOURCE, code_key
from contract.transport import FAST, STOCK, STOCK_ENV, remember_transport, remembered_transport, why_stock


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(STOCK_ENV, raising=False)
    return tmp_path


def test_found_once_then_remembered() -> None:
    assert remembered_transport() is None
    found = remember_transport()
    assert found == (STOCK if why_stock() else FAST)
    assert remembered_transport() == found


def test_other_flwr_code_is_found_again(monkeypatch: pytest.MonkeyPatch) -> None:
    remember_transport()
    first = next(iter(TUNED_SOURCE))
    monkeypatch.setitem(TUNED_SOURCE, first, "0" * 16)  # the code edgefl checks against is another one
    assert remembered_transport() is None


def test_the_key_follows_the_files_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module file rewritten in place (another size or modification time) is other code: found again."""
    module = tmp_path / "start_client_internal.py"
    module.write_text("def start_client_internal(): ...\n")
    monkeypatch.setattr(flower, "_installed_file", lambda relative: module)
    before = code_key(TUNED_SOURCE)
    assert code_key(TUNED_SOURCE) == before
    module.write_text("def start_client_internal(): return None\n")
    assert code_key(TUNED_SOURCE) != before


def test_the_key_imports_none_of_the_code_it_names() -> None:
    probe = (
        "import sys; from contract.flower import TUNED_SOURCE, code_key; code_key(TUNED_SOURCE); "
        "print(sorted(q.rsplit('.', 1)[0] for q in TUNED_SOURCE if q.rsplit('.', 1)[0] in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_stock_by_setting_needs_no_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STOCK_ENV, STOCK)
    assert remembered_transport() == STOCK

"""The SuperNode's transport as an agent learns it (``contract.transport.remembered_transport``): found once per
installed flwr code by ``remember_transport`` (which imports the SuperNode's loop), then read without importing it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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


def test_the_key_reads_the_installed_files_without_importing_them() -> None:
    module = "flwr.supernode.start_client_internal"
    assert code_key(TUNED_SOURCE) != code_key({**TUNED_SOURCE, f"{module}.not_there": "0" * 16})
    if module not in sys.modules:  # this process has not imported the SuperNode's loop: nor did code_key
        code_key(TUNED_SOURCE)
        assert module not in sys.modules


def test_stock_by_setting_needs_no_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STOCK_ENV, STOCK)
    assert remembered_transport() == STOCK

"""``contract.run_folder`` owns every file of a run: no other module spells a run file's name, and the checkpoint
is saved and read through ``RunFolder`` (the strategy's state included)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from contract import run_folder
from contract.run_folder import CHECKPOINT, PLOTS, RUN_FILES, Checkpoint, RunFolder
from tests.conftest import REPO

PACKAGES = ("strategies", "contract", "ml", "edge", "fl_client", "fl_server", "netem", "edgefl", "bench")


def test_no_module_but_run_folder_spells_a_run_files_name() -> None:
    owner = Path(run_folder.__file__).resolve()
    names = set(RUN_FILES)
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.resolve() == owner:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert found == [], "use the constants of contract/run_folder.py:\n" + "\n".join(found)


def test_the_run_files_are_all_named() -> None:
    assert len(set(RUN_FILES)) == len(RUN_FILES)
    assert {"config.toml", "server.log", CHECKPOINT, *PLOTS} <= set(RUN_FILES)


def test_a_checkpoint_round_trips_through_the_run_folder_with_the_strategys_state(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    assert folder.read_checkpoint() is None
    params = np.arange(6, dtype=np.float32)
    strategy = {"c": np.full(6, 0.5, np.float32), "c/2": np.arange(3, dtype=np.float64), "count": np.int64(4)}
    folder.save_checkpoint(Checkpoint(3, params, 7.5, np.array([0.5, 0.25]), params / 2, strategy))
    checkpoint = folder.read_checkpoint()
    assert checkpoint is not None and checkpoint.round == 3 and checkpoint.wall_s == 7.5
    np.testing.assert_array_equal(checkpoint.params, params)
    np.testing.assert_array_equal(checkpoint.recent_norms, [0.5, 0.25])
    np.testing.assert_array_equal(checkpoint.momentum, params / 2)
    assert sorted(checkpoint.strategy) == ["c", "c/2", "count"]
    for key, value in strategy.items():
        np.testing.assert_array_equal(checkpoint.strategy[key], value)
        assert checkpoint.strategy[key].dtype == np.asarray(value).dtype, key
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]  # written atomically: no temporary file left

    folder.save_checkpoint(Checkpoint(4, params))  # the defaults: no norms, no momentum, no strategy state
    again = folder.read_checkpoint()
    assert again is not None and again.round == 4 and again.strategy == {}
    assert again.momentum.size == 0 and again.recent_norms.size == 0


def test_saving_a_checkpoint_echoes_nothing_until_the_runs_last_word(tmp_path: Path, capsys) -> None:
    """An echoing folder sends the checkpoint once, just before the summary or the error (``RunFolder.write``)."""
    folder = RunFolder(tmp_path, echo=True)
    folder.save_checkpoint(Checkpoint(1, np.ones(3, np.float32), strategy={"s": np.zeros(2)}))
    assert capsys.readouterr().out == ""
    folder.write(run_folder.SUMMARY, b"{}\n")
    echoed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(run_folder.ECHO)]
    assert [f'"file": "{CHECKPOINT}"' in line for line in echoed] == [True, False]

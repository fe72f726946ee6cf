"""The server's model card (``ml.model_card``): built once (in a child process) and read after; a new card for
anything it is made from (the seed, the model, the data's shape, torch's version, the models' code); an unwritable
cache skipped; the evaluation graph fed a round's parameters gives torch's numbers and logits, for the CNN and the
LSTM; and with a warm card the server's whole model path imports no torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ml.model_card
from contract.settings import parse_partition
from ml.catalog import ModelError
from ml.data import CHAR_VOCAB, SEQ_LEN, Dataset, Rows, encode_chars, load_dataset, one_partition
from ml.model_card import build_card, card_path, model_card
from ml.models import build_model, get_flat_params, set_flat_params
from ml.onnx import INPUT_NAME, OUTPUT_NAME, inference_session, scores, with_parameters
from ml.trainer import evaluate
from tests.conftest import REPO


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "edgefl" / "models"


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


def text_dataset() -> Dataset:
    """Next-character windows over a seeded random text of common words: the LSTM's data, small."""
    words = np.random.default_rng(0).choice(["the", "king", "shall", "not", "be", "my", "lord"], 3000)
    windows = np.lib.stride_tricks.sliding_window_view(encode_chars(" ".join(words)), SEQ_LEN + 1)[::10]
    x, y = windows[:, :SEQ_LEN], windows[:, SEQ_LEN].astype(np.int64)
    return Dataset("text", "text", Rows(x[:-300]), y[:-300], Rows(x[-300:]), y[-300:], len(CHAR_VOCAB), None)


def test_a_card_is_built_once_then_read(digits: Dataset, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    card = model_card(digits, seed=3)
    (written,) = cache.glob("*.npz")
    assert written == card_path(digits, 3, "auto") and written.name.startswith("cnn-")
    assert not list(cache.glob("*partial*"))
    seeded = build_model(digits, 3)
    np.testing.assert_array_equal(card.params, get_flat_params(seeded))
    assert card.layout == tuple((name, tuple(p.shape)) for name, p in seeded.named_parameters())

    monkeypatch.setattr(ml.model_card, "ProcessPoolExecutor", None)  # a hit builds nothing
    again = model_card(digits, seed=3, model="cnn")  # auto is the CNN: the same card
    np.testing.assert_array_equal(again.params, card.params)
    assert (again.layout, again.graph) == (card.layout, card.graph)


def test_a_card_is_keyed_by_all_it_is_made_from(
    digits: Dataset, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = card_path(digits, 0, "auto")
    assert card_path(digits, 0, "cnn") == path
    fashion_shape = Dataset(
        "other", "image", Rows(np.zeros((1, 28, 28), np.uint8), 255.0), digits.y_train[:1],
        Rows(np.zeros((1, 28, 28), np.uint8), 255.0), digits.y_test[:1], 10, None,
    )  # fmt: skip
    others = {card_path(digits, 1, "auto"), card_path(digits, 0, "resnet8"), card_path(fashion_shape, 0, "auto")}
    with monkeypatch.context() as patch:
        patch.setattr(ml.model_card, "version", lambda package: "0.0")
        others.add(card_path(digits, 0, "auto"))  # another torch
    code = tmp_path / "ml"
    code.mkdir()
    for source in ml.model_card.SOURCES:
        shutil.copy(REPO / "ml" / source, code / source)
    monkeypatch.setattr(ml.model_card, "__file__", str(code / "model_card.py"))
    assert card_path(digits, 0, "auto") == path  # the same code
    (code / "models.py").write_text((code / "models.py").read_text().replace("CNN_HIDDEN = 64", "CNN_HIDDEN = 32"))
    others.add(card_path(digits, 0, "auto"))  # a model's code changed
    assert path not in others and len(others) == 5


def test_an_unwritable_cache_is_skipped(digits: Dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    card = model_card(digits, seed=0)
    np.testing.assert_array_equal(card.params, get_flat_params(build_model(digits, 0)))
    assert blocked.read_text() == "a file where the cache folder would be"


def test_a_model_that_does_not_fit_is_refused(digits: Dataset, cache: Path) -> None:
    with pytest.raises(ModelError, match="takes text data"):
        model_card(digits, seed=0, model="char-lstm")
    assert not cache.exists()


@pytest.mark.parametrize("kind", ["image", "text"])
def test_the_graph_with_a_rounds_parameters_gives_torchs_numbers(kind: str, digits: Dataset) -> None:
    """The CNN and the LSTM: the evaluation graph with other parameters baked in gives torch's logits, loss and
    accuracy on them; parameters that do not fit the layout are refused."""
    dataset = digits if kind == "image" else text_dataset()
    card = build_card(dataset, seed=0, model="auto")
    params = card.params + np.random.default_rng(1).normal(0, 0.05, card.params.size).astype(np.float32)
    model = build_model(dataset, 0)
    set_flat_params(model, params)
    x, y = dataset.x_test[:], dataset.y_test
    session = inference_session(with_parameters(card.graph, params, card.layout), threads=1)
    logits = session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]
    with torch.no_grad():
        np.testing.assert_allclose(logits, model.eval()(torch.from_numpy(x)).numpy(), atol=1e-4)
    loss, accuracy = evaluate(model, x, y)
    loss_sum, correct = scores(logits, y)
    assert correct / len(y) == accuracy
    assert loss_sum / len(y) == pytest.approx(loss, rel=1e-5)
    with pytest.raises(ModelError, match="parameter vector"):
        with_parameters(card.graph, params[:-1], card.layout)


NO_TORCH = """
import json, sys
from contract.run_folder import Checkpoint, RunFolder
from contract.settings import build_config
import fl_server.app
from fl_server.engine import PulledReplies, ServerLoop
config = build_config(dataset="digits", partition="iid", clients=2, rounds=1, seed=0, out=sys.argv[1])
from pathlib import Path
Path(config.out).mkdir()
loop = ServerLoop(None, config, RunFolder(Path(config.out)), PulledReplies(None, "stock"))
loop.evaluator.submit({"round": 1, "wall_s": 1.0}, Checkpoint(1, loop.engine.global_params))
loop.evaluator.close()
loop.evaluator.export(loop.engine.global_params)
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] == "torch")))
"""


def test_a_warm_card_keeps_torch_out_of_the_server(
    digits: Dataset, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's model path — the loop's start model and layout, a round's evaluation, the final model's export —
    in a fresh interpreter, with the card and the split cached (as ``edgefl run``'s pre-run check leaves them; the
    card built here, in this process that has torch already, not in a child as the check builds it)."""
    monkeypatch.setattr(ml.model_card, "_build_in_child", build_card)
    model_card(digits, seed=0)
    one_partition(digits, parse_partition("iid"), 2, 0, 0)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(tmp_path / "run")], capture_output=True, text=True, cwd=REPO, env=env
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    assert (tmp_path / "run" / "global.onnx").is_file()


def test_a_one_thread_session_runs_on_its_callers_thread(digits: Dataset) -> None:
    """The background evaluation's session: onnxruntime starts no thread of its own, so the work runs on the niced
    thread that calls it."""
    card = build_card(digits, seed=0, model="auto")
    threads = len(os.listdir("/proc/self/task"))
    session = inference_session(with_parameters(card.graph, card.params, card.layout), threads=1)
    session.run([OUTPUT_NAME], {INPUT_NAME: digits.x_test[:]})
    assert len(os.listdir("/proc/self/task")) == threads

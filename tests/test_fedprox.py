"""FedProx: both halves against an independent reference — the server half against Flower's own
``flwr.serverapp.strategy.FedProx.aggregate_train``, the client half against torch's SGD on the FedProx objective
written as a loss — μ = 0 as FedAvg, and the ``fedprox:MU`` setting."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.app.metadata import Metadata
from flwr.serverapp.strategy import FedProx
from torch import nn

from ml.models import get_flat_params, set_flat_params
from ml.trainer import LocalTrainer
from strategies.fedavg import FedAvgClient, FedAvgServer, apply_update
from strategies.fedprox import FedProxClient, FedProxSettings
from strategies.registry import STRATEGIES, client_half, parse_strategy, server_half
from strategies.spec import SpecError
from strategies.strategy import PLAIN, Contribution, LocalObjective, ServerSetup

SHAPES = {"weight": (3, 4), "bias": (3,)}  # nn.Linear(4, 3)'s parameters, in its parameters() order
SIZE = sum(int(np.prod(shape)) for shape in SHAPES.values())


def _reply(params: dict[str, np.ndarray], num_examples: int) -> Message:
    """A client's training reply as Flower's FedAvg/FedProx expects it: its model under "arrays" and its
    examples under "num-examples" of its one MetricRecord."""
    sent = Metadata(
        run_id=1, message_id=f"{num_examples:064d}", src_node_id=1, dst_node_id=2, reply_to_message_id="",
        group_id="1", created_at=time.time(), ttl=3600, message_type="train",
    )  # fmt: skip
    content = RecordDict({
        "arrays": ArrayRecord({name: Array(value) for name, value in params.items()}),
        "metrics": MetricRecord({"num-examples": num_examples}),
    })  # fmt: skip
    return Message(content, reply_to=Message(RecordDict(), metadata=sent))


def _flat(params: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([params[name].ravel() for name in SHAPES]).astype(np.float32)


def test_the_server_half_is_flowers_fedprox_aggregation() -> None:
    """Three clients' models (random, weighted by 5, 17 and 40 examples): Flower's FedProx averages the models,
    edgefl's FEDPROX row averages the deltas w_i − wᵍ and steps wᵍ + Δ̄; the two global models agree (rtol 1e-6)."""
    rng = np.random.default_rng(3)
    global_params = {name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}
    clients = [
        ({name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}, n) for n in (5, 17, 40)
    ]
    arrays, _ = FedProx(proximal_mu=0.1).aggregate_train(1, [_reply(params, n) for params, n in clients])
    assert arrays is not None
    flower = _flat({name: arrays[name].numpy() for name in SHAPES})

    server = STRATEGIES["fedprox"].server(parse_strategy("fedprox:0.1"), ServerSetup(SIZE, 3))
    assert type(server) is FedAvgServer  # FedProx's server is FedAvg's
    start = _flat(global_params)
    summed = server.open(SIZE)
    for source, (params, n) in enumerate(clients):
        server.add(summed, _flat(params) - start, Contribution(source, 1, 1, n))
    edgefl = apply_update(start, server.close(summed, summed.mean()))

    by_hand = sum(n * _flat(params).astype(np.float64) for params, n in clients) / sum(n for _, n in clients)
    np.testing.assert_allclose(flower, by_hand, rtol=1e-5, atol=1e-6)  # the reference is what it says it is
    np.testing.assert_allclose(edgefl, flower, rtol=1e-6, atol=1e-6)
    assert server.message_state(0) is None and server.state() == {}  # nothing beside the model, no state


# ----- the client half -------------------------------------------------------------------------------------------
ROWS, BATCH, SEED, STEPS, LR = 10, 4, 11, 7, 0.3


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.normal(size=(ROWS, 4)).astype(np.float32), rng.integers(0, 3, size=ROWS).astype(np.int64)


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _batches(steps: int) -> list[np.ndarray]:
    """The rows of each of LocalTrainer's minibatches, drawn as it draws them (seeded, reshuffled every epoch)."""
    rng = np.random.default_rng(SEED)
    order, at, batches = rng.permutation(ROWS), 0, []
    for _ in range(steps):
        if at + BATCH > ROWS:
            order, at = rng.permutation(ROWS), 0
        batches.append(order[at : at + BATCH])
        at += BATCH
    return batches


def _edgefl_steps(objective: LocalObjective | None, momentum: float, model: nn.Module | None = None) -> np.ndarray:
    """STEPS steps of LocalTrainer on ``objective`` (None: the default, PLAIN) from ``model``'s parameters."""
    x, y = _data()
    model = model or _model()
    trainer = LocalTrainer(model, x, y, BATCH, LR, momentum, SEED)
    if objective is None:
        trainer.train_steps(STEPS)
    else:
        trainer.train_steps(STEPS, objective)
    return get_flat_params(model)


def _reference_steps(
    loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], momentum: float
) -> np.ndarray:
    """STEPS steps of torch's SGD on ``loss_of(model, xb, yb)`` by autograd, the batches LocalTrainer draws."""
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for rows in _batches(STEPS):
        optimizer.zero_grad()
        loss_of(model, torch.from_numpy(x[rows]), torch.from_numpy(y[rows])).backward()
        optimizer.step()
    return get_flat_params(model)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_client_half_minimises_fedprox_objective(momentum: float) -> None:
    """LocalTrainer with FedProxClient(μ)'s objective = torch's SGD on CE + μ/2 Σ‖w − wᵗ‖² by autograd, same
    batches, with and without heavy-ball momentum. The formula is the one of the paper and of Flower's FedProx
    docstring, μ/2‖w − wᵗ‖²; Flower's code snippet adds μ/2 Σ‖w − wᵗ‖ (the norm, not its square), whose
    gradient is not μ (w − wᵗ): the test follows the formula."""
    mu = 0.5
    start = get_flat_params(_model())
    got = _edgefl_steps(FedProxClient(mu).objective(start), momentum)

    anchors = [p.detach().clone() for p in _model().parameters()]

    def fedprox_loss(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        proximal = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchors, strict=True))
        return nn.functional.cross_entropy(model(xb), yb) + mu / 2 * proximal

    expected = _reference_steps(fedprox_loss, momentum)
    plain = _reference_steps(lambda model, xb, yb: nn.functional.cross_entropy(model(xb), yb), momentum)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert np.abs(expected - plain).max() > 1e-3  # the proximal term moved the result: the test can tell


def test_the_proximal_term_holds_the_model_at_its_start() -> None:
    """A huge μ against few steps: the local model barely leaves wᵗ, where FedAvg's moves away."""
    start = get_flat_params(_model())
    held = _edgefl_steps(LocalObjective(mu=1.0 / LR, anchor=start), 0.0)  # μη = 1: each step lands on wᵗ − η∇f(w)
    free = _edgefl_steps(None, 0.0)
    assert np.linalg.norm(held - start) < 0.5 * np.linalg.norm(free - start)


def test_mu_zero_is_fedavg_exactly() -> None:
    """FedProxClient(0) gives a plain objective, and its local steps are FedAvg's to the bit."""
    client = FedProxClient(0.0)
    start = get_flat_params(_model())
    assert client.objective(start).plain
    assert not FedProxClient(0.01).objective(start).plain
    np.testing.assert_array_equal(_edgefl_steps(client.objective(start), 0.9), _edgefl_steps(PLAIN, 0.9))
    np.testing.assert_array_equal(_edgefl_steps(client.objective(start), 0.9), _edgefl_steps(None, 0.9))


def test_the_anchor_is_the_model_the_round_started_from() -> None:
    """The client half anchors each round at the model it starts from (the global model it holds), held by
    value: training moves the model, not the anchor."""
    settings = parse_strategy("fedprox:0.25")
    client = client_half(settings)
    assert isinstance(client, FedProxClient) and client.mu == 0.25
    global_model = get_flat_params(_model())
    client.receive_global(0, global_model)
    start = client.start_params()
    objective = client.objective(start)
    assert objective.mu == 0.25
    np.testing.assert_array_equal(objective.anchor, global_model)
    model = _model()
    set_flat_params(model, start)
    _edgefl_steps(objective, 0.0, model)
    np.testing.assert_array_equal(objective.anchor, global_model)
    assert isinstance(server_half(settings, ServerSetup(SIZE, 2)), FedAvgServer)
    assert isinstance(client, FedAvgClient)


# ----- the setting -----------------------------------------------------------------------------------------------
def test_the_setting_is_fedprox_mu() -> None:
    settings = parse_strategy("fedprox:0.01")
    assert isinstance(settings, FedProxSettings)
    assert (settings.label, settings.mu, settings.delay, settings.buffer) == ("fedprox:0.01", 0.01, 0, 0)
    assert parse_strategy(settings.label) == settings
    assert parse_strategy("FedProx:0").label == "fedprox:0"


@pytest.mark.parametrize("text", ["fedprox", "fedprox:-1", "fedprox:1:x", "fedprox:nan", "fedprox:x"])
def test_a_fedprox_setting_without_a_usable_mu_is_one_line(text: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse_strategy(text)
    assert "fedprox" in str(raised.value) and "\n" not in str(raised.value)

"""SCAFFOLD: the server half's control variates against the paper's formulas (option II) on small vectors, its
checkpointed state, the client half's correction and local steps against an independent reference, the round
engine carrying each client's correction, a toy problem where SCAFFOLD removes FedAvg's client drift, and the
``scaffold`` setting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from contract.run_folder import Checkpoint, RunFolder
from contract.settings import ConfigError, build_config
from ml.models import get_flat_params
from ml.trainer import LocalTrainer
from strategies.fedavg import FedAvgClient, FedAvgServer
from strategies.registry import STRATEGIES, client_half, parse_strategy, server_half
from strategies.rounds import RoundEngine
from strategies.scaffold import ScaffoldClient, ScaffoldServer
from strategies.spec import SpecError
from strategies.strategy import Contribution, ServerSetup
from tests.test_rounds import LAYOUT, _update

N, K, LR = 4, 5, 0.1


def _server(momentum: float = 0.0, clients: int = N, size: int = 4) -> ScaffoldServer:
    return ScaffoldServer(ServerSetup(size, clients, K, momentum, lambda _round: LR))


def _round(server: ScaffoldServer, round_: int, updates: dict[int, tuple[list[float], int]]) -> np.ndarray:
    """One round of ``updates`` (partition → (Δy, examples)) through open/add/close: the step it takes."""
    summed = server.open(4)
    for source, (delta, n) in updates.items():
        server.add(summed, np.array(delta, np.float32), Contribution(source, round_, round_, n))
    return server.close(summed, summed.mean())


D1, D2 = [0.5, -1.0, 0.25, 2.0], [-0.5, 0.75, 1.0, 0.0]  # Δy of partitions 0 and 2 in round 1
E1 = [1.0, 0.5, -0.5, 0.125]  # Δy of partition 0 in round 2


def test_round_one_sets_the_variates_of_option_ii() -> None:
    """c = c_i = 0 at first: c_i⁺ = −Δy_i/(Kη), c ← (1/N) Σ_{i∈S} c_i⁺ over all N = 4 clients though 2 trained;
    each client is sent c − c_i, one that never trained c; the step is FedAvg's example-weighted mean of Δy."""
    server = _server()
    assert [server.message_state(i) for i in range(N)] == [None] * N  # nothing learnt yet: nothing sent
    assert server.state()["c"].shape == (4,) and not server.state()["c"].any()
    step = _round(server, 1, {0: (D1, 1), 2: (D2, 3)})
    np.testing.assert_allclose(step, (1 * np.array(D1) + 3 * np.array(D2)) / 4, rtol=1e-6)

    c0, c2 = -np.array(D1) / (K * LR), -np.array(D2) / (K * LR)
    c = (c0 + c2) / N
    state = server.state()
    assert sorted(state) == ["c", "c/0", "c/2"]
    np.testing.assert_allclose(state["c"], c, rtol=1e-6)
    np.testing.assert_allclose(state["c/0"], c0, rtol=1e-6)
    np.testing.assert_allclose(state["c/2"], c2, rtol=1e-6)
    np.testing.assert_allclose(server.message_state(0), c - c0, rtol=1e-6)
    np.testing.assert_allclose(server.message_state(2), c - c2, rtol=1e-6)
    np.testing.assert_allclose(server.message_state(1), c, rtol=1e-6)  # never trained: c_i = 0
    np.testing.assert_allclose(server.message_state(3), c, rtol=1e-6)
    assert all(server.message_state(i).dtype == np.float32 for i in range(N))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_round_two_refreshes_a_variate_from_the_previous_c(momentum: float) -> None:
    """Round 2, partition 0 again: c_0⁺ = c_0 − c + (x − y)(1 − β)/(Kη) with round 1's c, Δc_0 = c_0⁺ − c_0,
    c ← c + Δc_0 / N; partition 2's variate stays. β = 0.9 scales (x − y) by 1 − β (β = 0: option II as written)."""
    scale = (1 - momentum) / (K * LR)
    server = _server(momentum)
    _round(server, 1, {0: (D1, 1), 2: (D2, 3)})
    c0, c2 = -scale * np.array(D1), -scale * np.array(D2)
    c = (c0 + c2) / N
    np.testing.assert_allclose(server.state()["c"], c, rtol=1e-6)

    step = _round(server, 2, {0: (E1, 2)})
    np.testing.assert_allclose(step, E1, rtol=1e-6)  # one update: the mean is it
    c0_new = c0 - c + scale * -np.array(E1)
    c_new = c + (c0_new - c0) / N
    state = server.state()
    np.testing.assert_allclose(state["c/0"], c0_new, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["c/2"], c2, rtol=1e-6)
    np.testing.assert_allclose(state["c"], c_new, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(server.message_state(0), c_new - c0_new, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(server.message_state(1), c_new, rtol=1e-5, atol=1e-6)


def test_a_round_uses_the_learning_rate_of_its_own_round() -> None:
    """With a schedule, Δy of round r is divided by K η_r (the rate the client trained it at)."""
    server = ScaffoldServer(ServerSetup(4, 1, K, 0.0, lambda round_: 0.1 * round_))
    _round(server, 1, {0: (D1, 1)})
    np.testing.assert_allclose(server.state()["c/0"], -np.array(D1) / (K * 0.1), rtol=1e-6)
    server = ScaffoldServer(ServerSetup(4, 1, K, 0.0, lambda round_: 0.1 * round_))
    _round(server, 2, {0: (D1, 1)})
    np.testing.assert_allclose(server.state()["c/0"], -np.array(D1) / (K * 0.2), rtol=1e-6)


def test_the_variates_survive_a_checkpoint(tmp_path: Path) -> None:
    """state() → RunFolder.save_checkpoint → read_checkpoint → restore(): a fresh server sends every client the same
    correction as the one checkpointed, and takes the next round to the same variates."""
    server = _server()
    _round(server, 1, {0: (D1, 1), 2: (D2, 3)})
    folder = RunFolder(tmp_path)
    folder.save_checkpoint(Checkpoint(1, np.zeros(4, np.float32), strategy=server.state()))
    checkpoint = folder.read_checkpoint()
    assert checkpoint is not None and sorted(checkpoint.strategy) == ["c", "c/0", "c/2"]

    restored = _server()
    restored.restore(checkpoint.strategy)
    for source in range(N):
        np.testing.assert_array_equal(restored.message_state(source), server.message_state(source))
    _round(server, 2, {0: (E1, 2)})
    _round(restored, 2, {0: (E1, 2)})
    assert sorted(restored.state()) == sorted(server.state())
    for key, value in server.state().items():
        np.testing.assert_array_equal(restored.state()[key], value)


def test_a_state_snapshot_is_not_changed_by_later_rounds() -> None:
    """The checkpoint is written from another thread: a state() taken after round 1 still holds round 1's."""
    server = _server()
    _round(server, 1, {0: (D1, 1)})
    snapshot = {key: value.copy() for key, value in server.state().items()}
    taken = server.state()
    _round(server, 2, {0: (E1, 1)})
    for key, value in snapshot.items():
        np.testing.assert_array_equal(taken[key], value)


@pytest.mark.parametrize(
    "state",
    [
        {"c": np.zeros(5, np.float32)},  # the wrong model size
        {"c/0": np.zeros((2, 2), np.float32)},
        {"momentum": np.zeros(4, np.float32)},  # not a control variate
        {"c/x": np.zeros(4, np.float32)},  # not a partition
        {"c/-1": np.zeros(4, np.float32)},
    ],
)
def test_restore_refuses_what_is_not_a_control_variate(state: dict[str, np.ndarray]) -> None:
    with pytest.raises(ValueError):
        _server().restore(state)


def test_fedavg_refuses_a_strategy_state() -> None:
    """A SCAFFOLD checkpoint resumed as FedAvg is refused, not silently dropped."""
    with pytest.raises(ValueError, match="keeps no state"):
        FedAvgServer().restore({"c": np.zeros(4, np.float32)})
    FedAvgServer().restore({})


# ----- the client half -------------------------------------------------------------------------------------------
def test_the_client_steps_with_the_correction_it_was_sent() -> None:
    """receive_global(r, x, c − c_i): the objective's drift is that vector (a copy); an older global model changes
    nothing; a newer one without a vector clears the drift (a plain objective)."""
    client = ScaffoldClient()
    x1, drift = np.ones(4, np.float32), np.array([0.5, -0.5, 1.0, 0.0], np.float32)
    client.receive_global(1, x1, drift)
    sent = drift.copy()
    drift[0] = 99.0  # the sender's buffer is reused: the client holds its own copy
    objective = client.objective(client.start_params())
    np.testing.assert_array_equal(objective.drift, sent)
    assert objective.mu == 0.0 and not objective.plain

    client.receive_global(0, np.zeros(4, np.float32), np.full(4, 7.0, np.float32))  # older than held
    assert client.global_round == 1
    np.testing.assert_array_equal(client.start_params(), x1)
    np.testing.assert_array_equal(client.objective(x1).drift, sent)

    client.receive_global(2, 2 * x1, None)
    assert client.global_round == 2 and client.objective(2 * x1).plain
    assert ScaffoldClient().objective(x1).plain  # nothing received: FedAvg's steps


ROWS, BATCH, SEED, STEPS = 10, 10, 3, 6  # one batch of every row: the batch is the same every step


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(8)
    return rng.normal(size=(ROWS, 4)).astype(np.float32), rng.integers(0, 3, size=ROWS).astype(np.int64)


def _model() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(4, 3)


def test_the_local_steps_add_the_correction_to_every_gradient() -> None:
    """LocalTrainer on ScaffoldClient's objective = torch's SGD (momentum 0) on CE + ⟨c − c_i, w⟩ by autograd
    (whose gradient is ∇CE + c − c_i), same batches; and not plain SGD's result."""
    x, y = _data()
    size = sum(p.numel() for p in _model().parameters())
    drift = np.random.default_rng(2).normal(size=size).astype(np.float32)
    client = ScaffoldClient()
    client.receive_global(0, get_flat_params(_model()), drift)

    model = _model()
    LocalTrainer(model, x, y, BATCH, LR, 0.0, SEED).train_steps(STEPS, client.objective(client.start_params()))
    got = get_flat_params(model)

    def reference(with_drift: bool) -> np.ndarray:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
        linear = torch.from_numpy(drift) if with_drift else torch.zeros(size)
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
            (loss + torch.dot(linear, torch.nn.utils.parameters_to_vector(model.parameters()))).backward()
            optimizer.step()
        return get_flat_params(model)

    np.testing.assert_allclose(got, reference(True), atol=1e-6)
    assert np.abs(reference(True) - reference(False)).max() > 1e-2  # the correction mattered


def test_a_correction_of_the_wrong_size_is_refused_by_the_trainer() -> None:
    x, y = _data()
    client = ScaffoldClient()
    client.receive_global(0, get_flat_params(_model()), np.zeros(3, np.float32))
    trainer = LocalTrainer(_model(), x, y, BATCH, LR, 0.0, SEED)
    with pytest.raises(ValueError, match="drift has 3 values"):
        trainer.train_steps(1, client.objective(client.start_params()))


# ----- end to end, without Flower --------------------------------------------------------------------------------
def test_the_engine_sends_each_client_its_correction() -> None:
    """Two clients, two rounds: round 1's messages carry nothing; round 2's carry the server's message_state of
    the client's partition, c − c_i, different per client; each closed round reports the variates as its state."""
    strategy = ScaffoldServer(ServerSetup(4, 2, K, 0.0, lambda _round: LR))
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=2, num_clients=2, strategy=strategy)
    for node, partition in ((10, 0), (11, 1)):
        request = engine.next_request(node, partition)
        assert request is not None and request.global_round == 0 and request.state is None
    assert engine.receive(10, [_update([1, 2, 3, 4], 1, n=1)], partition=0) == []
    assert engine.receive(11, [_update([-1, 0, 1, 0], 1, n=3)], partition=1) == []
    (closed,) = engine.close_rounds(now=0)
    assert sorted(closed.strategy_state) == ["c", "c/0", "c/1"]
    np.testing.assert_allclose(engine.global_params, [-0.5, 0.5, 1.5, 1.0], rtol=1e-6)  # (1·Δ₀ + 3·Δ₁) / 4

    c0, c1 = -np.array([1, 2, 3, 4]) / (K * LR), -np.array([-1, 0, 1, 0]) / (K * LR)
    c = (c0 + c1) / 2
    for node, partition, own in ((10, 0, c0), (11, 1, c1)):
        request = engine.next_request(node, partition)
        assert request is not None and (request.global_round, request.next_round) == (1, 2)
        assert request.state is not None
        np.testing.assert_array_equal(request.state, strategy.message_state(partition))
        np.testing.assert_allclose(request.state, c - own, rtol=1e-6)
    assert engine.next_request(10, 0) is None  # in flight: nothing more to send


# The toy problem: client i's loss is ½ (w − a_i)ᵀ H_i (w − a_i); different curvatures make FedAvg's K local
# steps drift toward each client's own optimum, and its fixed point is not the global optimum.
H = [np.diag([2.0, 0.2]), np.diag([0.2, 2.0])]
A = [np.array([1.0, 0.0]), np.array([0.0, 1.0])]
OPTIMUM = np.linalg.solve(H[0] + H[1], H[0] @ A[0] + H[1] @ A[1])  # of the mean loss: (10/11, 10/11)
TOY_K, TOY_LR, TOY_ROUNDS = 10, 0.1, 30


def _federate(server: FedAvgServer, clients: list[FedAvgClient]) -> np.ndarray:
    """TOY_ROUNDS rounds of both clients, each taking the global model and its server's vector, then TOY_K
    gradient steps by hand on its loss plus its objective's drift: the global model at the end."""
    x = np.zeros(2, np.float32)
    for round_ in range(1, TOY_ROUNDS + 1):
        summed = server.open(2)
        for i, client in enumerate(clients):
            client.receive_global(round_ - 1, x, server.message_state(i))
            start = client.start_params()
            drift = client.objective(start).drift
            y = start.astype(np.float64)
            for _ in range(TOY_K):
                y = y - TOY_LR * (H[i] @ (y - A[i]) + (0 if drift is None else drift))
            server.add(summed, (y - start).astype(np.float32), Contribution(i, round_, round_, 10))
        x = (x + server.close(summed, summed.mean())).astype(np.float32)
    return x


def test_scaffold_removes_the_client_drift_that_fedavg_keeps() -> None:
    """Same K, η, rounds: SCAFFOLD's global model reaches the optimum of the mean loss, FedAvg's stops short
    (its fixed point is biased by the drift of the K local steps): what Karimireddy et al. show."""
    setup = ServerSetup(2, 2, TOY_K, 0.0, lambda _round: TOY_LR)
    scaffold = _federate(ScaffoldServer(setup), [ScaffoldClient(), ScaffoldClient()])
    fedavg = _federate(FedAvgServer(), [FedAvgClient(), FedAvgClient()])
    scaffold_error, fedavg_error = np.linalg.norm(scaffold - OPTIMUM), np.linalg.norm(fedavg - OPTIMUM)
    assert scaffold_error < 1e-4, scaffold_error
    assert fedavg_error > 0.05, fedavg_error  # not a matter of more rounds: FedAvg's fixed point is elsewhere


# ----- the setting -----------------------------------------------------------------------------------------------
def test_the_setting_is_scaffold_without_a_parameter() -> None:
    settings = parse_strategy("scaffold")
    assert (settings.label, settings.delay, settings.buffer) == ("scaffold", 0, 0)
    assert isinstance(client_half(settings), ScaffoldClient)
    setup = ServerSetup(4, 2, K, 0.0, lambda _round: LR)
    assert isinstance(server_half(settings, setup), ScaffoldServer)
    assert STRATEGIES["scaffold"].mean_only
    with pytest.raises(SpecError, match="takes no parameter") as raised:
        parse_strategy("scaffold:1")
    assert "\n" not in str(raised.value)


def test_scaffold_takes_only_the_plain_mean() -> None:
    """A robust rule would drop updates the control variate counted: refused with one line."""
    with pytest.raises(ConfigError, match="aggregate mean") as raised:
        build_config(strategy="scaffold", aggregate="median")
    assert "\n" not in str(raised.value)
    assert build_config(strategy="scaffold").strategy == "scaffold"


def test_the_variate_does_not_depend_on_the_order_updates_arrive_in() -> None:
    """c sums the clients' Δc_i in the order of their partitions, not of arrival: a deployment's replies arrive in
    any order, and the same round must give the same c to the last bit (as a simulation's does)."""
    rng = np.random.default_rng(4)
    size = 200_000  # summed in arrival order, ~76 of these float32 entries differ between the two orders
    updates = {source: rng.normal(size=size).astype(np.float32) for source in range(5)}
    setup = ServerSetup(size, 5, 7, 0.9, lambda _round: 0.03)
    variates = []
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
        server = ScaffoldServer(setup)
        summed = server.open(size)
        for source in order:
            server.add(summed, updates[source], Contribution(source, 1, 1, 10))
        server.close(summed, summed.mean())
        variates.append(server.variate)
    assert variates[0].tobytes() == variates[1].tobytes()

"""Update validation: malformed updates (NaN/Inf, wrong shape) are refused by the decoders, each with its reason
in the round engine's rejections; every other update is bounded by the other clients' norms
(``strategies.validation``), from the run's first reply on, and a step that is not finite is refused whole."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.codecs import CompressorState
from strategies.codecs.dense import NoCompression
from strategies.fedavg import WeightedMean
from strategies.rounds import ClosedRound, RoundEngine, Update
from strategies.validation import NORM_CHUNK, NORM_FACTOR, InfluenceBound, l2_norm

LAYOUT = (("w", (3,)), ("b", (2,)))
SIZE = 5


def _contribution(values: np.ndarray, round_: int = 1, layout=LAYOUT) -> Update:
    """A dense payload as a (possibly broken) client would send it: the client codec itself refuses NaN."""
    codec = NoCompression()
    payload = codec.encode(values.astype(np.float32), layout, CompressorState(np.random.default_rng(0)))
    return Update(round_, codec.stype, payload, 10)


def _engine(clients: int = 4, history: np.ndarray | None = None) -> RoundEngine:
    engine = RoundEngine(
        np.zeros(SIZE, np.float32), LAYOUT, rounds=3, num_clients=clients, validator=InfluenceBound(history=history)
    )
    for client in range(clients):
        engine.next_request(client)
    return engine


def _round(engine: RoundEngine, updates: dict[int, np.ndarray], round_: int = 1) -> ClosedRound:
    """Every client's update for ``round_`` in the order given, then the round closed."""
    for client, values in updates.items():
        assert engine.receive(client, [_contribution(values, round_)]) == []
    [closed] = engine.close_rounds(now=0.0)
    for client in updates:
        engine.next_request(client)
    return closed


def test_a_first_reply_of_3e38_cannot_overflow_or_capture_the_round() -> None:
    """The run's first reply, before any norm is known, is bounded by the round's other updates: the model stays
    finite and moves by at most a quarter (its weight) of NORM_FACTOR times the others' median norm."""
    engine = _engine()
    honest = {client: np.full(SIZE, 0.1 * client) for client in (1, 2, 3)}
    closed = _round(engine, {0: np.full(SIZE, 3e38), **honest})
    assert closed.clipped == [0] and closed.step_refused is None
    others = sorted(float(np.linalg.norm(u)) for u in honest.values())
    attacker = NORM_FACTOR * others[1] * np.ones(SIZE) / np.sqrt(SIZE)
    expected = (attacker + sum(honest.values())) / 4
    np.testing.assert_allclose(closed.global_params, expected, rtol=1e-5)


@pytest.mark.parametrize("clients, attackers", [(2, 1), (4, 1), (8, 1), (8, 2)])
def test_an_adaptive_attacker_at_its_bound_cannot_ratchet_it(clients: int, attackers: int) -> None:
    """Attackers that know their bound and send just under it every round (colluding: each one's norms are the
    others' history) stay at NORM_FACTOR times the honest clients' norms over 30 rounds, with 2, 4 and 8 clients."""
    bound = InfluenceBound()
    honest_norm = 1.0
    sent = []
    for _ in range(30):
        for client in range(clients):
            if client < attackers:
                limit = bound.bound(client)
                norm = 1e6 if limit is None else limit * 0.999
                sent.append(norm)
            else:
                norm = honest_norm
            bound.clip(client, np.full(SIZE, norm / np.sqrt(SIZE), np.float32), bound.bound(client))
    assert max(sent[attackers:]) <= NORM_FACTOR * honest_norm * (1 + 1e-6), max(sent)
    assert max(max(bound.norms[client]) for client in range(attackers)) <= NORM_FACTOR * honest_norm * (1 + 1e-6)


def test_a_clients_own_norms_never_enter_its_bound() -> None:
    bound = InfluenceBound(history=np.array([[0, 1e6], [0, 1e6], [1, 1.0], [2, 2.0]]))
    assert bound.bound(0) == pytest.approx(NORM_FACTOR * 1.5)  # the median of clients 1 and 2's
    assert bound.bound(1) == pytest.approx(NORM_FACTOR * (1e6 + 2.0) / 2)  # the others set it, client 0 among them


def test_a_clipped_update_keeps_its_direction_and_its_recorded_norm_is_the_bound() -> None:
    bound = InfluenceBound(history=np.array([[1, 1.0]]))
    clipped = bound.clip(0, np.array([3e30, 4e30, 0, 0, 0], np.float32), bound.bound(0))
    assert clipped.clipped and f"clipped: L2 norm 5e+30 to {NORM_FACTOR:g}" in clipped.reason
    np.testing.assert_allclose(clipped.update, np.array([0.6, 0.8, 0, 0, 0]) * NORM_FACTOR, rtol=1e-6)
    assert list(bound.norms[0]) == [NORM_FACTOR]


def test_dgas_alternating_honest_norms_are_not_clipped_and_a_hundredfold_update_is() -> None:
    """Norms from DGA D = 1, digits, 300 local steps a round (the median of 4 clients in rounds 1–8): a round
    that continues the client's own model moves it 20x less than the next, which starts from a new average. Each
    client is counted by its largest recent norm, so its small ones do not pull the bound down."""
    bound = InfluenceBound()
    for norm in (9.115, 0.108, 2.063, 0.097, 1.369, 0.083, 0.387, 0.069):
        for client in range(4):
            clipped = bound.clip(client, np.full(SIZE, norm / np.sqrt(SIZE)), bound.bound(client))
            assert not clipped.clipped, norm
    assert bound.clip(0, np.full(SIZE, 100 * 2.063 / np.sqrt(SIZE)), bound.bound(0)).clipped


def test_a_round_with_no_other_client_is_bounded_by_the_models_norm() -> None:
    engine = RoundEngine(np.full(SIZE, 2.0, np.float32), LAYOUT, rounds=3, num_clients=1, validator=InfluenceBound())
    engine.next_request(0)
    closed = _round(engine, {0: np.full(SIZE, 1e30)})
    assert closed.clipped == [0]
    np.testing.assert_allclose(closed.global_params, np.full(SIZE, 4.0), rtol=1e-6)


def test_a_step_that_is_not_finite_is_refused_and_the_run_goes_on() -> None:
    """Without a bound (no validator), a finite update on a model near float32's limit would make it Inf: the
    round closes, the model stays where it was, and the next round moves it."""
    engine = RoundEngine(np.full(SIZE, 3e38, np.float32), LAYOUT, rounds=3, num_clients=1)
    engine.next_request(0)
    closed = _round(engine, {0: np.full(SIZE, 3e38)})
    assert closed.step_refused == "the new global model is not finite"
    np.testing.assert_array_equal(closed.global_params, np.full(SIZE, 3e38, np.float32))
    closed = _round(engine, {0: np.full(SIZE, -1e38)}, round_=2)
    assert closed.step_refused is None and np.isfinite(closed.global_params).all()


def test_the_weighted_mean_sums_in_float64() -> None:
    """n_k · Δ_k of a finite float32 update overflowed float32 before (3e38 x 10 examples): now it is exact."""
    mean = WeightedMean(SIZE)
    mean.add(np.full(SIZE, 3e38, np.float32), 10)
    mean.add(np.full(SIZE, -3e38, np.float32), 10)
    np.testing.assert_array_equal(mean.mean(), np.zeros(SIZE, np.float32))


def test_the_history_survives_a_checkpoint_and_reads_older_ones() -> None:
    bound = InfluenceBound()
    for client, norm in ((0, 1.0), (1, 2.0), (0, 3.0)):
        bound.record(client, norm)
    again = InfluenceBound(history=bound.history_rows())
    assert {client: list(norms) for client, norms in again.norms.items()} == {0: [1.0, 3.0], 1: [2.0]}
    older = InfluenceBound(history=np.array([0.5, 0.25]))  # a checkpoint's plain norms, before clients were kept
    assert older.bound(0) == pytest.approx(NORM_FACTOR * 0.5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_updates_are_refused_as_malformed(bad: float) -> None:
    engine = _engine()
    values = np.ones(SIZE)
    values[3] = bad
    [rejection] = engine.receive(0, [_contribution(values)])
    assert rejection.reason.startswith("malformed:") and "NaN or Inf" in rejection.reason


def test_an_update_of_the_wrong_shape_is_refused_as_malformed() -> None:
    engine = _engine()
    [rejection] = engine.receive(0, [_contribution(np.ones(SIZE + 1), layout=(("w", (SIZE + 1,)),))])
    assert rejection.reason.startswith("malformed:") and f"P={SIZE}" in rejection.reason


def test_refused_updates_leave_the_aggregate_untouched() -> None:
    engine = _engine(clients=2, history=np.array([[0, 1.0], [1, 1.0]]))
    assert engine.receive(0, [_contribution(np.full(SIZE, 0.2))]) == []
    nan = np.full(SIZE, np.nan)
    assert engine.receive(1, [_contribution(nan)])[0].reason.startswith("malformed")
    [closed] = engine.close_rounds(now=0.0)  # the refused client answered the round but is not in its mean
    assert closed.clients == [0]
    np.testing.assert_allclose(closed.global_params, np.full(SIZE, 0.2), rtol=1e-6)
    assert engine.receive(1, [_contribution(np.full(SIZE, 0.4))])[0].reason.startswith("repeated")


def test_bad_bound_settings_are_refused() -> None:
    """No setting reaches them (the server uses this module's constants): a bad one is a programming error."""
    with pytest.raises(AssertionError, match="norm_factor"):
        InfluenceBound(norm_factor=1.0)
    with pytest.raises(AssertionError, match="per_client"):
        InfluenceBound(per_client=0)


def test_the_norm_is_summed_in_float64_across_chunks() -> None:
    """``l2_norm`` over several chunks equals numpy's float64 norm, for values whose squares overflow float32."""
    rng = np.random.default_rng(0)
    update = (rng.standard_normal(3 * NORM_CHUNK + 5) * 1e20).astype(np.float32)
    expected = float(np.linalg.norm(update.astype(np.float64)))
    assert l2_norm(update) == pytest.approx(expected, rel=1e-12)
    assert l2_norm(np.zeros(0, np.float32)) == 0.0

"""Robust aggregation (``--aggregate``): Flower's median, trimmed mean and Krum through fl_server.robust, and
centered clipping, on hand examples, inside the round engine, and as a config setting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from contract.errors import EdgeflError
from contract.run_folder import Checkpoint, RunFolder
from contract.settings import build_config
from fl_server.engine import RunState
from fl_server.robust import CC_ITERATIONS, make_aggregator, nearest_neighbour_mixing, restore_rule, rule_state
from strategies.codecs import make_client_codec, parse_codec
from strategies.fedavg import CheckpointError
from strategies.rounds import RoundEngine, Update
from strategies.spec import SpecError, parse_aggregate

LAYOUT = (("w", (3,)),)


def _updates(*rows: list[float]) -> list[tuple[np.ndarray, int]]:
    return [(np.array(row, dtype=np.float32), 10 * (k + 1)) for k, row in enumerate(rows)]


def test_mean_is_the_engines_own_streaming_mean() -> None:
    assert make_aggregator(parse_aggregate("mean")) is None


def test_median_per_coordinate() -> None:
    median = make_aggregator(parse_aggregate("median"))
    result = median(_updates([1, 10, -1], [2, 30, -3], [3, 20, -2]))
    np.testing.assert_array_equal(result, [2, 20, -2])
    assert result.dtype == np.float32


def test_trimmed_mean_drops_the_extremes_of_each_coordinate() -> None:
    rows = [[1, 0, 5], [2, 0, 5], [3, 0, 5], [4, 0, 5], [100, -100, 5]]
    trimmed = make_aggregator(parse_aggregate("trimmed-mean:0.2"))(_updates(*rows))
    # 20 % of 5 values: one cut at each end of every coordinate.
    np.testing.assert_allclose(trimmed, [3, 0, 5])
    untrimmed = make_aggregator(parse_aggregate("trimmed-mean:0"))(_updates(*rows))
    np.testing.assert_allclose(untrimmed, np.mean(rows, axis=0))


def test_krum_picks_the_update_closest_to_its_neighbours() -> None:
    rows = [[1.0, 1.0, 1.0], [1.1, 0.9, 1.0], [0.9, 1.0, 1.1], [1.0, 1.1, 0.9], [50.0, -50.0, 50.0]]
    chosen = make_aggregator(parse_aggregate("krum:1"))(_updates(*rows))
    assert any(np.array_equal(chosen, np.float32(row)) for row in rows[:4])
    # With every honest update at the same point, that point wins outright.
    same = make_aggregator(parse_aggregate("krum:1"))(_updates([2, 2, 2], [2, 2, 2], [2, 2, 2], [2, 2, 2], [-9, 9, -9]))
    np.testing.assert_array_equal(same, [2, 2, 2])


def test_centered_clipping_moves_at_most_tau_over_n_from_its_centre_and_keeps_the_centre() -> None:
    """Round 1 starts from the coordinate-wise median; each of the rule's steps moves the centre by at most τ (the
    factor times the median distance to it), so an update as far off as it likes leaves the aggregate among the
    honest ones; in round 2 the centre is round 1's aggregate, so identical updates there give themselves back."""
    honest = [[1.0, 1.0, 1.0], [1.2, 0.8, 1.0], [0.8, 1.1, 0.9], [1.0, 0.9, 1.1]]
    rule = make_aggregator(parse_aggregate("centered-clip:1"))
    median = np.median(np.array([*honest, [1e6, -1e6, 1e6]]), axis=0)
    first = rule(_updates(*honest, [1e6, -1e6, 1e6]))
    tau = np.median([np.linalg.norm(np.array(row) - median) for row in [*honest, [1e6, -1e6, 1e6]]])
    assert first.dtype == np.float32 and np.linalg.norm(first - median) <= CC_ITERATIONS * tau + 1e-6
    assert np.all(np.abs(first - 1.0) < 0.3), first
    np.testing.assert_allclose(rule.centre, first, rtol=1e-6)
    again = rule(_updates(*[list(first)] * 4))
    np.testing.assert_allclose(again, first, rtol=1e-6)
    flipped = make_aggregator(parse_aggregate("centered-clip:1"))
    flipped(_updates(*honest, [1.0, 1.0, 1.0]))  # a centre near the honest updates
    pulled = flipped(_updates(*honest, [-1e6, -1e6, -1e6]))  # then one points far the other way
    assert np.all(pulled > 0.5), pulled  # still with the honest ones, where the mean is at -2e5


def test_a_poisoned_client_does_not_move_the_median_but_moves_the_mean() -> None:
    honest = [[0.1, -0.2, 0.3], [0.2, -0.1, 0.1], [0.3, -0.3, 0.2]]
    clean = make_aggregator(parse_aggregate("median"))(_updates(*honest))
    # A fourth client that is as far off as it likes: the median of 4 stays within the honest values' range.
    poisoned = make_aggregator(parse_aggregate("median"))(_updates(*honest, [1e6, -1e6, 1e6]))
    low, high = np.min(honest, axis=0), np.max(honest, axis=0)
    assert np.all(poisoned >= low) and np.all(poisoned <= high)
    assert np.max(np.abs(poisoned - clean)) <= np.max(high - low)
    assert np.max(np.abs(np.mean([*honest, [1e6, -1e6, 1e6]], axis=0))) > 1e5


def _contribution(values: list[float]) -> Update:
    encoded = make_client_codec(parse_codec("none"), LAYOUT, seed=0).encode(np.array(values, dtype=np.float32), 1)
    stype, payload = encoded.stype, encoded.payload
    return Update(1, stype, payload, 10)


def test_the_engine_aggregates_a_round_with_the_rule() -> None:
    engine = RoundEngine(
        np.zeros(3, np.float32), LAYOUT, rounds=1, num_clients=3, aggregator=make_aggregator(parse_aggregate("median"))
    )
    for client, values in enumerate([[1, 1, 1], [2, 2, 2], [900, 900, 900]]):
        engine.next_request(client)
        assert engine.receive(client, [_contribution(values)]) == []
    [closed] = engine.close_rounds(now=0.0)
    np.testing.assert_array_equal(closed.global_params, [2, 2, 2])
    assert sorted(closed.clients) == [0, 1, 2]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("average", "unknown aggregation"),
        ("median:3", "'median' takes no parameter"),
        ("trimmed-mean", "needs a fraction BETA in .0, 0.5. as in 'trimmed-mean:VALUE'"),
        ("trimmed-mean:0.5", "needs a fraction BETA in .0, 0.5."),
        ("trimmed-mean:x", "needs a fraction BETA"),
        ("krum:-1", "needs a whole number F ≥ 0"),
        ("krum:1.5", "needs a whole number F ≥ 0"),
        ("centered-clip", "needs a factor TAU > 0"),
        ("centered-clip:0", "needs a factor TAU > 0"),
        ("mean:nnm", "the only option is ':nnm', after one of median"),
        ("centered-clip:1:nmm", "the only option is ':nnm'"),
        ("median:nnm:nnm", "the only option is ':nnm'"),
    ],
)
def test_bad_rules_are_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message) as err:
        make_aggregator(parse_aggregate(text))
    assert "\n" not in str(err.value)
    with pytest.raises(EdgeflError, match=message):
        build_config(aggregate=text)


def test_the_rule_is_a_config_setting() -> None:
    assert build_config().aggregate == "mean"
    assert build_config(aggregate="krum:1").aggregate == "krum:1"
    assert build_config(aggregate="centered-clip:1:nnm").aggregate_spec.options == ("nnm",)


def test_nearest_neighbour_mixing_leaves_far_updates_with_their_own_kind() -> None:
    """Six heterogeneous honest updates and two sign-flipped at twice their length: centered clipping alone is pulled
    toward the flips; mixed first, each honest update becomes the mean of the six honest ones (its n − ⌊n/4⌋ = 6
    nearest), the flips only each other and four honest, and the rule lands within the honest updates' spread."""
    rng = np.random.default_rng(0)
    honest = [np.array([1.0, 0.0, 0.0]) + rng.normal(0, 0.3, 3) for _ in range(6)]
    flip = -2 * np.mean(honest, axis=0)
    updates = _updates(*honest, flip, flip)
    mixed = nearest_neighbour_mixing(updates)
    for (update, n), (_, count) in zip(mixed[:6], updates[:6], strict=True):
        np.testing.assert_allclose(update, np.mean(honest, axis=0), rtol=1e-5)
        assert n == count
    target = np.mean(honest, axis=0)
    plain = make_aggregator(parse_aggregate("centered-clip:1"))(updates)
    with_mixing = make_aggregator(parse_aggregate("centered-clip:1:nnm"))(updates)
    assert np.linalg.norm(with_mixing - target) < 0.5 * np.linalg.norm(plain - target), (plain, with_mixing)
    assert np.linalg.norm(with_mixing - target) < 0.1 * np.linalg.norm(target)


def test_mixing_identical_updates_changes_nothing() -> None:
    rows = [[1.0, 2.0, 3.0]] * 4
    for text in ("median:nnm", "trimmed-mean:0.25:nnm", "krum:1:nnm", "centered-clip:1:nnm"):
        np.testing.assert_allclose(make_aggregator(parse_aggregate(text))(_updates(*rows)), rows[0], rtol=1e-6)


def test_centered_clippings_centre_survives_a_checkpoint(tmp_path: Path) -> None:
    """rule_state → RunFolder.save_checkpoint → RunState on resume: the resumed rule (mixing before it too) starts
    from the centre it had, and closes the next round as the uninterrupted one does — where a fresh rule, starting
    from the median, does not."""
    round_1 = _updates([1.0, 0.0, 0.0], [0.8, 0.2, 0.0], [1.2, -0.1, 0.1], [0.9, 0.0, 0.2], [-5.0, 5.0, 5.0])
    round_2 = _updates([0.0, 1.0, 0.0], [0.1, 0.9, 0.0], [3.0, 3.0, 3.0], [0.0, 1.1, 0.1], [-5.0, -5.0, 5.0])
    running = make_aggregator(parse_aggregate("centered-clip:1:nnm"))
    running(round_1)
    RunFolder(tmp_path).save_checkpoint(Checkpoint(1, np.zeros(3, np.float32), aggregate=rule_state(running)))

    resumed = RunState(build_config(aggregate="centered-clip:1:nnm"), RunFolder(tmp_path), np.zeros(3, np.float32))
    np.testing.assert_array_equal(rule_state(resumed.aggregator)["centre"], rule_state(running)["centre"])
    expected = running(round_2)
    np.testing.assert_array_equal(resumed.aggregator(round_2), expected)
    fresh = make_aggregator(parse_aggregate("centered-clip:1:nnm"))(round_2)
    assert np.abs(fresh - expected).max() > 1e-3, (fresh, expected)


def test_a_rule_that_keeps_no_state_refuses_one() -> None:
    assert rule_state(make_aggregator(parse_aggregate("median"))) == {}
    assert rule_state(make_aggregator(parse_aggregate("centered-clip:1"))) == {}  # no round yet
    restore_rule(make_aggregator(parse_aggregate("median")), {})
    with pytest.raises(CheckpointError, match="this rule keeps none"):
        restore_rule(make_aggregator(parse_aggregate("trimmed-mean:0.1:nnm")), {"centre": np.zeros(3)})
    with pytest.raises(CheckpointError, match="this rule keeps none"):
        restore_rule(None, {"centre": np.zeros(3)})  # the mean

"""Update validation: malformed updates (NaN/Inf, wrong shape) are refused by the decoders, norm outliers by
``strategies.validation``; every refusal reaches the round engine's rejections with its reason."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from strategies.codecs import CompressorState
from strategies.codecs.dense import NoCompression
from strategies.rounds import RoundEngine, Update
from strategies.validation import NORM_CHUNK, NormOutlierFilter, l2_norm

LAYOUT = (("w", (3,)), ("b", (2,)))
SIZE = 5


def _contribution(values: np.ndarray, round_: int = 1, layout=LAYOUT) -> Update:
    """A dense payload as a (possibly broken) client would send it: the client codec itself refuses NaN."""
    codec = NoCompression()
    payload = codec.encode(values.astype(np.float32), layout, CompressorState(np.random.default_rng(0)))
    return Update(round_, codec.stype, payload, 10)


def _engine(clients: int = 4, norms: list[float] | None = None) -> RoundEngine:
    engine = RoundEngine(
        np.zeros(SIZE, np.float32),
        LAYOUT,
        rounds=3,
        num_clients=clients,
        validator=NormOutlierFilter(norms=norms or []),
    )
    for client in range(clients):
        engine.next_request(client)
    return engine


def test_norm_outlier_is_refused_with_the_reason_and_others_pass() -> None:
    rng = np.random.default_rng(0)
    honest = [rng.normal(0, 1, SIZE) for _ in range(3)]
    engine = _engine(norms=[float(np.linalg.norm(u)) for u in honest])
    median = float(np.median([np.linalg.norm(u) for u in honest]))
    poisoned = honest[0] / np.linalg.norm(honest[0]) * median * 50
    assert engine.receive(0, [_contribution(honest[1])]) == []
    [rejection] = engine.receive(1, [_contribution(poisoned)])
    assert rejection.client == 1 and rejection.round == 1
    assert rejection.reason.startswith("outlier:") and "upper quartile" in rejection.reason
    # Just under the bound is accepted: the filter refuses outliers, not large-ish updates.
    borderline = honest[2] / np.linalg.norm(honest[2]) * median * 9
    assert engine.receive(2, [_contribution(borderline)]) == []


def test_the_history_follows_accepted_norms_only() -> None:
    check = NormOutlierFilter(norm_factor=10, history=4, min_history=2)
    assert check.check(np.full(SIZE, 1.0)) is None  # nothing to compare with yet
    assert check.check(np.full(SIZE, 1.0)) is None
    assert check.check(np.full(SIZE, 100.0)) is not None
    assert len(check.norms) == 2  # the refused norm did not enter the history
    for _ in range(4):  # honest updates that shrink move the median with them (short history)
        assert check.check(np.full(SIZE, 0.01)) is None
    assert check.check(np.full(SIZE, 1.0)) is not None


def test_a_finite_float32_update_too_large_to_square_in_float32_is_still_an_outlier() -> None:
    check = NormOutlierFilter(norm_factor=10, min_history=1, norms=[1.0])
    huge = np.full(SIZE, 1e30, np.float32)  # finite, but its float32 norm would be inf
    reason = check.check(huge)
    assert reason is not None and "L2 norm 2.236e+30 " in reason, reason
    assert check.norms == deque([1.0])


def test_dgas_alternating_honest_norms_pass_and_a_hundredfold_update_does_not() -> None:
    """Norms from DGA D = 1, digits, 300 local steps a round (the median of 4 clients in rounds 1–8): a round
    that continues the client's own model moves it 20x less than the next, which starts from a new average.
    Round 1 closed with 2 clients, the others with 4 (the median of the history was 0.108 when round 3's 2.063
    came: refused as a 19x outlier by a median-based bound)."""
    check = NormOutlierFilter()
    for round_, norm in enumerate((9.115, 0.108, 2.063, 0.097, 1.369, 0.083, 0.387, 0.069), start=1):
        for _ in range(2 if round_ == 1 else 4):
            assert check.check(np.full(SIZE, norm / np.sqrt(SIZE))) is None, (round_, norm)
    assert check.check(np.full(SIZE, 100 * 2.063 / np.sqrt(SIZE))) is not None


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
    engine = _engine(clients=2, norms=[1.0, 1.0, 1.0])
    assert engine.receive(0, [_contribution(np.full(SIZE, 0.2))]) == []
    nan = np.full(SIZE, np.nan)
    assert engine.receive(1, [_contribution(nan)])[0].reason.startswith("malformed")
    [closed] = engine.close_rounds(now=0.0)  # the refused client answered the round but is not in its mean
    assert closed.clients == [0]
    np.testing.assert_allclose(closed.global_params, np.full(SIZE, 0.2), rtol=1e-6)
    assert engine.receive(1, [_contribution(np.full(SIZE, 0.4))])[0].reason.startswith("repeated")


def test_bad_filter_settings_are_refused() -> None:
    """No setting reaches them (the server uses this module's constants): a bad one is a programming error."""
    with pytest.raises(AssertionError, match="norm_factor"):
        NormOutlierFilter(norm_factor=1.0)
    with pytest.raises(AssertionError, match="min_history"):
        NormOutlierFilter(history=2, min_history=3)


def test_the_norm_is_summed_in_float64_across_chunks() -> None:
    """``l2_norm`` over several chunks equals numpy's float64 norm, for values whose squares overflow float32."""
    rng = np.random.default_rng(0)
    update = (rng.standard_normal(3 * NORM_CHUNK + 5) * 1e20).astype(np.float32)
    expected = float(np.linalg.norm(update.astype(np.float64)))
    assert l2_norm(update) == pytest.approx(expected, rel=1e-12)
    assert l2_norm(np.zeros(0, np.float32)) == 0.0

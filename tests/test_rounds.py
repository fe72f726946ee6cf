"""The server's round engine: who is sent what and when, the weighted mean, refusals, stragglers."""

import numpy as np

from strategies.codecs import make_client_codec, parse_codec
from strategies.dga import DGAServer
from strategies.rounds import RoundEngine, Update, pipeline_window

LAYOUT = (("w", (4,)),)


def _update(values: list[float], round_: int, n: int = 1) -> Update:
    encoded = make_client_codec(parse_codec("none"), LAYOUT, seed=0).encode(np.array(values, dtype=np.float32), round_)
    stype, payload = encoded.stype, encoded.payload
    return Update(round_, stype, payload, n)


def test_fedavg_lock_step_and_example_weighted_mean() -> None:
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=2, num_clients=2)
    first = engine.next_request(1)
    assert first is not None and first.global_round == 0 and first.next_round == 1 and first.last_round == 1
    assert engine.next_request(1) is None  # FedAvg cannot prefetch: round 2 needs round 1's model
    assert engine.next_request(2) is not None
    assert engine.receive(1, [_update([1, 1, 1, 1], 1, n=3)]) == []
    assert engine.close_rounds(now=0) == []  # waits for client 2
    assert engine.receive(2, [_update([5, 5, 5, 5], 1, n=1)]) == []
    closed = engine.close_rounds(now=0)
    assert [c.round for c in closed] == [1] and closed[0].closed_by == "all"
    np.testing.assert_allclose(engine.global_params, [2, 2, 2, 2])  # (3·1 + 1·5) / 4
    second = engine.next_request(1)
    assert second is not None and second.global_round == 1 and second.next_round == 2


def test_dga_asks_for_d_plus_one_rounds_per_message_one_message_at_a_time() -> None:
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=10, num_clients=1, strategy=DGAServer(3))
    first = engine.next_request(7)
    assert first is not None and first.global_round == 0 and (first.next_round, first.last_round) == (1, 4)
    assert engine.next_request(7) is None  # one message in flight
    engine.receive(7, [_update([1, 1, 1, 1], r) for r in (1, 2)])  # it answered before training rounds 3, 4
    assert [c.round for c in engine.close_rounds(now=0)] == [1, 2]
    second = engine.next_request(7)
    assert second is not None and second.global_round == 2 and (second.next_round, second.last_round) == (3, 6)
    engine.receive(7, [_update([1, 1, 1, 1], r) for r in range(3, 7)])
    assert [c.round for c in engine.close_rounds(now=0)] == [3, 4, 5, 6]
    third = engine.next_request(7)
    assert third is not None and third.global_round == 6 and (third.next_round, third.last_round) == (7, 10)


def test_no_message_when_it_would_bring_nothing_new() -> None:
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=10, num_clients=2, strategy=DGAServer(1))
    assert engine.next_request(1) is not None and engine.next_request(2) is not None
    engine.receive(1, [_update([1, 1, 1, 1], r) for r in (1, 2)])  # client 1 is at its staleness bound
    assert engine.close_rounds(now=0) == []  # client 2 has not answered
    assert engine.next_request(1) is None  # same global model, no round it may train: nothing to send


def test_after_an_early_reply_the_next_message_brings_the_global_model() -> None:
    """A client that answered early (round 1 of the three D = 2 allows) is sent nothing until round 1 closes;
    a client whose reply lacked the round the server waits for is asked again."""
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=10, num_clients=2, strategy=DGAServer(2))
    assert engine.next_request(1) is not None and engine.next_request(2) is not None
    engine.receive(1, [_update([1, 1, 1, 1], 1)])
    assert engine.next_request(1) is None  # round 1 has its update; a message now would bring nothing
    engine.receive(2, [])
    again = engine.next_request(2)
    assert again is not None and again.global_round is None and again.next_round == 1
    engine.receive(2, [_update([3, 3, 3, 3], 1)])
    assert [c.round for c in engine.close_rounds(now=0)] == [1]
    nxt = engine.next_request(1)
    assert nxt is not None and nxt.global_round == 1 and (nxt.next_round, nxt.last_round) == (2, 4)


def test_refusals_leave_the_global_model_untouched() -> None:
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=5, num_clients=1, strategy=DGAServer(1))
    engine.next_request(1)
    reasons = engine.receive(1, [_update([1, 1, 1, 1], 3)])  # needs global of round 1: not sent yet
    assert [r.reason.split(":")[0] for r in reasons] == ["unrequested"]
    (repeated,) = engine.receive(1, [_update([1, 1, 1, 1], 1), _update([9, 9, 9, 9], 1)])
    assert repeated.reason.startswith("repeated") and not repeated.invalid
    engine.close_rounds(now=0)
    np.testing.assert_allclose(engine.global_params, [1, 1, 1, 1])
    bad = Update(2, _update([0, 0, 0, 0], 2).stype, b"\x00garbage", 1)
    (malformed,) = engine.receive(1, [bad])
    assert malformed.reason.startswith("malformed") and malformed.invalid
    # The client moved on from round 2 (it will not train it again), so the round closes without an update.
    [closed] = engine.close_rounds(now=0)
    assert (closed.round, closed.clients, closed.closed_by) == (2, [], "all")
    np.testing.assert_allclose(engine.global_params, [1, 1, 1, 1])
    assert engine.receive(1, [_update([5, 5, 5, 5], 2)])[0].reason.startswith("repeated")
    request = engine.next_request(1)
    assert request is not None and (request.next_round, request.global_round) == (3, 2)
    assert engine.receive(1, [_update([1, 1, 1, 1], 3)]) == []
    engine.close_rounds(now=0)
    np.testing.assert_allclose(engine.global_params, [2, 2, 2, 2])


def test_a_round_closes_without_the_updates_it_refused() -> None:
    """Three of four updates refused as unusable: the round closes on the fourth, and the refused clients are
    asked for the next round, not for the one they already answered."""
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=3, num_clients=4, quorum=0.5)
    garbage = Update(1, _update([0, 0, 0, 0], 1).stype, b"\x00garbage", 1)
    for client in range(4):
        engine.next_request(client)
    assert engine.receive(0, [_update([4, 4, 4, 4], 1)]) == []
    for client in (1, 2):
        assert engine.receive(client, [garbage])[0].invalid
    assert engine.close_rounds(now=0) == []  # client 3 has not answered yet
    assert engine.receive(3, [garbage])[0].invalid
    [closed] = engine.close_rounds(now=0)
    assert closed.clients == [0] and closed.closed_by == "all"
    np.testing.assert_allclose(closed.global_params, [4, 4, 4, 4])
    request = engine.next_request(1)
    assert request is not None and (request.next_round, request.global_round) == (2, 1)


def test_a_silent_client_holds_a_round_only_until_its_deadline() -> None:
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=3, num_clients=3, quorum=0.5, deadline_s=10.0)
    engine.start_clock(100.0)
    for client in (1, 2, 3):
        engine.next_request(client)
    engine.receive(1, [_update([1, 1, 1, 1], 1)])
    assert engine.close_rounds(now=109.0) == []  # deadline not reached, and 1 < ceil(0.5·3)
    engine.receive(2, [_update([3, 3, 3, 3], 1)])
    assert engine.close_rounds(now=109.9) == []
    closed = engine.close_rounds(now=110.0)
    assert closed[0].closed_by == "deadline" and sorted(closed[0].clients) == [1, 2]
    np.testing.assert_allclose(engine.global_params, [2, 2, 2, 2])
    # The straggler's late update is refused, and it is moved on to the current round.
    (late,) = engine.receive(3, [_update([100, 100, 100, 100], 1)])
    assert late.reason.startswith("late") and not late.invalid  # a straggler, not a broken client
    request = engine.next_request(3)
    assert request is not None and request.next_round == 2 and request.global_round == 1


def test_rounds_closed_together_keep_their_own_global_model() -> None:
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=3, num_clients=1, strategy=DGAServer(2))
    engine.next_request(1)
    engine.receive(1, [_update([1, 1, 1, 1], 1), _update([2, 2, 2, 2], 2)])
    first, second = engine.close_rounds(now=0)
    np.testing.assert_allclose(first.global_params, [1, 1, 1, 1])
    np.testing.assert_allclose(second.global_params, [3, 3, 3, 3])


def test_a_pipelined_client_holds_two_messages_and_gets_a_new_global_model_at_once() -> None:
    """DGA with window 2 (``pipeline_window``): a client is sent a second message beside the first, so it has one
    to answer as soon as its next round is trained; after each reply it is sent another while it may still train
    a round; a new global model goes out as soon as the round closes, beyond the window."""
    assert pipeline_window(delay=2, buffer=0, everyone=True) == 2
    assert pipeline_window(delay=0, buffer=0, everyone=True) == 1  # FedAvg's lock-step
    assert pipeline_window(delay=2, buffer=0, everyone=False) == 1  # partial participation
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=10, num_clients=1, strategy=DGAServer(2), window=2)
    first, second = engine.next_request(7), engine.next_request(7)
    assert first is not None and first.global_round == 0 and second is not None and second.global_round is None
    assert engine.next_request(7) is None  # two in flight
    engine.receive(7, [_update([1, 1, 1, 1], 1)])
    assert [c.round for c in engine.close_rounds(now=0)] == [1]
    model, spare = engine.next_request(7), engine.next_request(7)
    assert model is not None and model.global_round == 1  # beyond the window: the client now holds three
    assert spare is None
    engine.receive(7, [_update([1, 1, 1, 1], r) for r in (2, 3)])
    engine.receive(7, [_update([1, 1, 1, 1], 4)])  # round 4 needs round 1's model, which it holds
    engine.close_rounds(now=0)
    assert engine.next_request(7).global_round == 4


def test_an_update_claiming_more_examples_than_its_partition_has_is_refused_not_counted() -> None:
    """A weight of 10⁶ against partitions of 10 and 30 examples would make the mean that client's update: it is
    refused with the reason (never clamped), still answers its round, and the round is the other client's alone.
    A partition whose size is not known cannot have its weight checked: refused too."""
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=2, num_clients=2, partition_sizes={1: 10, 2: 30})
    assert engine.next_request(1) is not None and engine.next_request(2) is not None
    (inflated,) = engine.receive(1, [_update([100, 100, 100, 100], 1, n=10**6)])
    assert inflated.invalid
    assert inflated.reason == "num_examples 1000000 is more than partition 1's 10 training examples"
    assert engine.receive(2, [_update([3, 3, 3, 3], 1, n=30)]) == []  # exactly its partition: counted
    (closed,) = engine.close_rounds(now=0)
    assert (closed.clients, closed.closed_by) == ([2], "all")
    np.testing.assert_allclose(engine.global_params, [3, 3, 3, 3])
    assert engine.next_request(3) is not None
    (unknown,) = engine.receive(3, [_update([1, 1, 1, 1], 2, n=1)])
    assert unknown.invalid and "size of partition 3 is not known" in unknown.reason


def test_a_lost_reply_or_an_error_asks_the_client_once_to_send_its_kept_updates_again() -> None:
    """``lost`` (another reply took the message's place at the SuperLink) and ``fail`` (Flower's error) mark the
    client: its next message says resend, the one after does not."""
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=3, num_clients=2)
    first = engine.next_request(1)
    assert first is not None and not first.resend
    engine.lost(1)
    again = engine.next_request(1)
    assert again is not None and again.resend and again.next_round == 1
    assert engine.receive(1, [_update([1, 1, 1, 1], 1)]) == []
    engine.next_request(2)
    engine.fail(2, raised=False)
    after_error = engine.next_request(2)
    assert after_error is not None and after_error.resend and after_error.global_round == 0  # the model again
    assert engine.receive(2, []) == []
    later = engine.next_request(2)
    assert later is not None and not later.resend

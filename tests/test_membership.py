"""Who trains which partition (``fl_server.membership``), without Flower."""

from __future__ import annotations

from fl_server.membership import Membership


def test_a_second_claim_waits_as_a_spare_and_takes_over_when_the_first_leaves() -> None:
    members = Membership()
    assert members.connected({1, 2, 3}) == []
    assert members.to_ask() == [1, 2, 3] and members.to_ask() == []  # each node is asked once
    assert members.identified(1, 0) and members.identified(2, 1)
    assert not members.identified(3, 1)  # partition 1 is node 2's: node 3 waits
    assert members.admitted == {1: 0, 2: 1} and members.spares == {3: 1}
    assert members.connected({1, 3}) == [2]  # node 2 left: its spare takes over
    assert members.admitted == {1: 0, 3: 1} and members.spares == {}


def test_a_refused_node_is_never_asked_again_and_is_forgotten_when_it_leaves() -> None:
    members = Membership()
    members.connected({7})
    assert members.to_ask() == [7]
    members.refuse(7, "this device is partition 2 of 3")
    assert members.connected({7}) == [] and members.to_ask() == [] and members.refused == {7}
    members.connected(set())
    assert members.refused == set()

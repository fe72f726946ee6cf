"""Who trains which partition (``fl_server.membership``), without Flower."""

from __future__ import annotations

from fl_server.membership import Membership


def test_a_second_claim_waits_as_a_spare_and_takes_over_when_the_first_leaves() -> None:
    members = Membership()
    assert members.connected({1, 2, 3}) == []
    assert members.to_ask() == [1, 2, 3] and members.to_ask() == []  # each node is asked once
    assert members.identified(1, 0, 10) and members.identified(2, 1, 20)
    assert not members.identified(3, 1, 20)  # partition 1 is node 2's: node 3 waits
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


def test_a_partitions_size_is_the_runs_split_where_the_server_made_it() -> None:
    members = Membership({0: 100, 1: 80}, split=True)
    members.connected({1, 2, 3})
    assert members.identified(1, 0, 100)
    assert not members.identified(2, 1, 10**6) and members.refused == {2}  # not partition 1's 80
    assert not members.identified(3, 1, 0) and members.refused == {2, 3}
    assert members.sizes == {0: 100, 1: 80}


def test_without_the_split_a_partitions_first_declaration_is_its_size_for_the_run() -> None:
    members = Membership()
    members.connected({1, 2})
    assert members.identified(1, 0, 50) and members.sizes == {0: 50}
    assert not members.identified(2, 0, 60) and members.refused == {2}  # a spare may not declare another size
    members.connected({3})  # node 1 left; the partition's next node must declare the same
    assert not members.identified(3, 0, 5000) and members.refused == {3}
    members.connected({3, 4})
    assert members.identified(4, 0, 50) and members.admitted == {4: 0} and members.sizes == {0: 50}


def test_an_answer_lost_to_flower_is_asked_again_once_the_node_is_seen() -> None:
    members = Membership()
    members.connected({7, 8})
    assert members.to_ask() == [7, 8]
    members.retry(7, "Node is not available")  # e.g. its heartbeat expired
    members.refuse(8, "AgentError: this device is partition 2 of 3")
    assert members.to_ask() == []
    members.connected({7, 8})
    assert members.to_ask() == [7] and members.refused == {8}
    assert members.identified(7, 0, 10) and members.partition(7) == 0 and members.partition(8) is None

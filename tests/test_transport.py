"""Flower's waits as edgefl tunes them (``contract.transport``): the check that guards the change, the fallback to
stock Flower, and what the tuned SuperNode does with its idle polls. Each case runs in a fresh interpreter, as
the SuperNode and the ServerApp do, so this process's Flower stays stock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from contract.transport import IDLE_POLL_S
from tests.conftest import REPO


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, **env},
    )  # fmt: skip


def test_the_installed_flower_is_the_code_edgefl_tunes() -> None:
    """Fails after a Flower upgrade that moves any of the waits edgefl changes: re-read them, then update the
    digests in contract.flower (TUNED_SOURCE; the run would otherwise go on with stock Flower, slower)."""
    done = _python("from contract.transport import why_stock; print(why_stock())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_tune_changes_flowers_waits() -> None:
    done = _python("""
        import time
        from contract.transport import tune
        from flwr.supernode import start_client_internal as loop
        from flwr.supercore.inflatable import inflatable_utils as objects
        print(tune())
        pull = objects.pull_objects.__kwdefaults__
        print(loop.time is time, pull["initial_backoff"], pull["max_time"], objects.get_num_workers(8))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fast", "False", "0.01", "60.0", "8"]


def test_code_that_differs_falls_back_to_stock_flower_with_one_line() -> None:
    done = _python("""
        import time
        import contract.transport as transport
        from flwr.supernode import start_client_internal as loop
        from flwr.supercore.inflatable import inflatable_utils as objects
        name = "flwr.supernode.start_client_internal._push_messages"
        transport.TUNED_SOURCE[name] = "0000000000000000"  # as after an upgrade
        print(transport.tune())
        print(loop.time is time, objects.pull_objects.__kwdefaults__["initial_backoff"])
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stock", "True", "1"]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "_push_messages is not the code edgefl tunes" in lines[0], lines


def test_the_installed_flower_serializes_as_edgefl_counts() -> None:
    """Fails after a Flower upgrade that changes the serialization ``message_bytes`` mirrors: re-read it, then
    update contract.flower.COUNT_SOURCE (wire sizes would otherwise be counted by serializing whole messages
    again)."""
    done = _python("from contract.transport import why_counted_whole; print(why_counted_whole())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_a_serialization_that_differs_is_counted_whole_to_the_same_bytes() -> None:
    """A 2 MB reply counted by arithmetic, and again, as after an upgrade, by serializing it: the same bytes, and
    only the arithmetic holds under a megabyte on top of the reply."""
    done = _python("""
        import tracemalloc
        import contract.transport as transport
        from contract.messages import TrainReply
        from contract.wire import reply_content
        from flwr.app import Message
        from flwr.supercore.task_identity import TaskIdentity
        from strategies.rounds import Update
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # Flower builds messages in tasks
        reply = Message(reply_content(TrainReply(0, (Update(1, "edgefl.none.v1", bytes(2 << 20), 1),))),
                        dst_node_id=1, message_type="train")
        for digest in (None, "0000000000000000"):
            if digest:
                transport.COUNT_SOURCE["flwr.app.message.configrecord.ConfigRecord.deflate"] = digest
                transport.why_counted_whole.cache_clear()
            tracemalloc.start()
            counted = transport.message_bytes(reply)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            print(counted[0], counted[1], peak < 1 << 20)
        print(transport.why_counted_whole())
    """)
    assert done.returncode == 0, done.stderr
    arithmetic, whole, why = done.stdout.strip().splitlines()
    assert arithmetic.split()[:2] == whole.split()[:2]
    assert (arithmetic.split()[2], whole.split()[2]) == ("True", "False")
    assert "ConfigRecord.deflate is not the code edgefl counts by" in why


def test_edgefl_transport_stock_leaves_flower_as_it_is() -> None:
    done = _python("from contract.transport import tune; print(tune())", EDGEFL_TRANSPORT="stock")
    assert done.returncode == 0 and done.stdout.strip() == "stock"
    assert "EDGEFL_TRANSPORT=stock" in done.stderr


def test_an_idle_supernode_backs_off_and_a_message_resets_its_poll(monkeypatch) -> None:
    import contract.transport as transport

    slept: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    idle = transport._IdleBackoff()
    for _ in range(12):
        idle.wait()
    idle.received()
    idle.wait()
    assert slept[0] == IDLE_POLL_S[0] and slept[-1] == IDLE_POLL_S[0]
    assert slept[:12] == sorted(slept[:12])
    assert max(slept) == IDLE_POLL_S[1]
    clock = transport._TunedClock(idle)
    clock.sleep(transport.STOCK_REPLY_S)
    clock.sleep(0.2)  # any other sleep of Flower's is left as it is
    assert slept[-2:] == [transport.REPLY_POLL_S, 0.2]


def test_the_pipelined_supernode_pulls_and_pushes_independently(monkeypatch) -> None:
    """Flower's loop pulls one message, then waits for its reply. Tuned, a pull that finds nothing still lets the
    loop go on to the push; the push sends the replies there are (handing Flower's ``_push_messages`` the list it
    took, so it never waits) and otherwise waits at most the idle poll — none right after a message came."""
    import contract.transport as transport

    slept: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    pulled: list[int | None] = [None, 5]
    pushed: list[list[str]] = []

    class State:
        def __init__(self) -> None:
            self.replies: list[str] = []

        def get_messages_legacy(self, *, is_reply: bool) -> list[str]:
            assert is_reply
            taken, self.replies = self.replies, []
            return taken

    def push(*, state, object_store, send, push_object) -> None:  # Flower's _push_messages, which waits for one
        pushed.append(list(state.get_messages_legacy(is_reply=True)))

    idle = transport._IdleBackoff()
    pipeline = transport._Pipeline(lambda **_: pulled.pop(0), push, idle)
    state = State()
    kwargs = {"state": state, "object_store": None, "send": None, "push_object": None}
    assert pipeline.pull() == transport.NO_RUN  # nothing pulled: the loop goes on to push
    pipeline.push(**kwargs)  # no reply: it looked for one every REPLY_POLL_S up to the idle poll, then backs off
    assert pushed == [] and slept and set(slept) == {transport.REPLY_POLL_S}
    assert idle.delay > IDLE_POLL_S[0]
    assert pipeline.pull() == 5  # a message: no idle wait before pushing what there is
    slept.clear()
    pipeline.push(**kwargs)
    assert pushed == [] and slept == []
    state.replies = ["reply-1", "reply-2"]
    pipeline.push(**kwargs)
    assert pushed == [["reply-1", "reply-2"]] and idle.delay == IDLE_POLL_S[0]

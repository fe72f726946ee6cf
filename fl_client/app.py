"""edgefl's ClientApp. Flower would start it in a fresh process for every message; edgefl runs it inside the
edge agent's long-lived process instead (``fl_client.node``: the SuperNode runs with ``--isolation process`` and
the agent claims its tasks over the Runtime API), so the model, data, optimizer and codec memory stay in memory
between messages; the agent keeps one session per Flower run id. Node config: ``partition-id``,
``num-partitions``."""

from __future__ import annotations

import dataclasses

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from contract.errors import EdgeflError
from contract.wire import parse_instruction, reply_content
from edge.agent import EdgeAgent


class ClientAppError(EdgeflError, RuntimeError):
    """edgefl's ClientApp started where it cannot work; ``str()`` is one line for the user."""


app = ClientApp()
_agent: EdgeAgent | None = None


def attach(agent: EdgeAgent) -> None:
    """The agent this process's ClientApp hands its messages to (``fl_client.node``)."""
    global _agent
    _agent = agent


@app.train()
def train(msg: Message, context: Context) -> Message:
    if _agent is None:
        raise ClientAppError(
            "edgefl's ClientApp runs inside the edge agent (python -m fl_client.node) beside a SuperNode started "
            "with --isolation process, not in a process of its own"
        )
    instr = parse_instruction(msg.content)
    partition_id, num_partitions = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    reply = _agent.train(instr, partition_id, num_partitions, msg.metadata.run_id)
    return Message(reply_content(dataclasses.replace(reply, reply_key=instr.reply_key)), reply_to=msg)

"""The ClientApp: a relay. Flower runs it in a fresh process for every message, so it holds no state and
imports no torch; it hands the instruction to the edge agent over a local socket and returns the agent's
updates. Node config: ``agent`` (the agent's socket path), ``partition-id``, ``num-partitions``."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from edge.protocol import call_agent
from fl_client.wire import TrainReply, UpdateMeta, parse_instruction, reply_content

AGENT_TIMEOUT_S = 3600.0

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    instr = parse_instruction(msg.content)
    header = {
        "op": "train",
        "partition-id": int(context.node_config["partition-id"]),
        "num-partitions": int(context.node_config["num-partitions"]),
        "job": instr.job,
        "next-round": instr.next_round,
        "last-round": instr.last_round,
        "global-round": -1 if instr.broadcast is None else instr.broadcast.round,
    }
    blob = b""
    if instr.broadcast is not None:
        header["broadcast"], blob = instr.broadcast.header(), instr.broadcast.blob()
    reply, updates_blob = call_agent(str(context.node_config["agent"]), header, blob, AGENT_TIMEOUT_S)
    if "error" in reply:
        raise RuntimeError(f"edge agent: {reply['error']}")
    updates = [UpdateMeta(**meta) for meta in reply["updates"]]
    content = reply_content(TrainReply(reply["partition-id"], updates, updates_blob, reply.get("health", {})))
    return Message(content, reply_to=msg)

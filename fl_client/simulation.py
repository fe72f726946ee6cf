"""edgefl's ClientApp on Flower's Simulation Engine (``--federation simulation``): the deployment's own
``edge.agent.Session`` — partition, model, optimizer, codec memory, DGA bookkeeping, broadcast reference —
trained by a Ray actor for one virtual client at a time.

Between messages a client's session lives where Flower keeps a node's state, in its ``Context.state``: pickled
into one ConfigRecord without the partition's rows, which are attached again from this worker's cache of the data
set. A message is answered with the rounds it asks for (``next_round`` to ``last_round``) that the session can
train, trained at once: a pipelined run (FedAvg, DGA) asks for one round at the modelled moment the deployment's
agent would start it, FedBuff and partial participation for every round the message unlocks, up to DGA's
staleness bound (``fl_server.simulation``). Node config (set by Flower): ``partition-id``, ``num-partitions``.
"""

from __future__ import annotations

import pickle
from functools import lru_cache

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from contract.messages import TrainReply
from contract.settings import ClientJob
from contract.transport import SIMULATION
from contract.wire import parse_instruction, reply_content
from edge.agent import Session, check_partition
from ml.data import Dataset, cut_partition, load_dataset, one_partition

app = ClientApp()
SESSION = "edgefl-session"


@lru_cache(maxsize=2)
def _job(text: str) -> ClientJob:
    """The run's job, parsed once per worker (every message carries it)."""
    return ClientJob.from_json(text)


@lru_cache(maxsize=2)
def _dataset(name: str, data_dir: str) -> Dataset:
    return load_dataset(name, data_dir or None)


@lru_cache(maxsize=4096)
def _partition(job: ClientJob, partition_id: int) -> Dataset:
    """A client's rows, cut once per worker from its copy of the data set (a few MB for a whole split)."""
    dataset = _dataset(job.dataset, job.data_dir)
    return cut_partition(dataset, one_partition(dataset, job.partition_spec, job.clients, job.seed, partition_id))


def _session(context: Context, job: ClientJob, partition_id: int) -> Session:
    """The client's session from its node state, or a new one on its first message."""
    if SESSION in context.state:
        session: Session = pickle.loads(bytes(context.state[SESSION]["pickle"]))  # our own node state
        session.attach(_partition(job, partition_id))
        return session
    return Session(job, partition_id, job.clients, data=_partition(job, partition_id))


@app.train()
def train(msg: Message, context: Context) -> Message:
    instr = parse_instruction(msg.content)
    job = _job(instr.job)
    partition_id = int(context.node_config["partition-id"])
    check_partition(job, partition_id, int(context.node_config["num-partitions"]))
    if not instr.asks_for_rounds:
        size = len(_partition(job, partition_id).y_train)
        reply = TrainReply(partition_id, (), {}, SIMULATION, partition_size=size, reply_key=instr.reply_key)
        return Message(reply_content(reply), reply_to=msg)
    session = _session(context, job, partition_id)
    session.take_instruction(instr)
    while session.can_train() and session.next_round <= instr.last_round:
        session.train_next()
    ready = session.take_outbox()
    context.state[SESSION] = ConfigRecord({"pickle": pickle.dumps(session)})
    reply = TrainReply(partition_id, tuple(ready), {}, SIMULATION, partition_size=session.num_examples,
                       reply_key=instr.reply_key)  # fmt: skip
    return Message(reply_content(reply), reply_to=msg)

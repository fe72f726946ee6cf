"""In-process federated simulation with EXACT staleness, for the ablation benchmarks.

Before round t every client sampled for it (all, without partial participation) receives the global model of
round t − D − 1, never a newer one (in a deployment
the engine hands out the newest model it has, so the real staleness is at most D; D = 0 is FedAvg). Each client
is the deployment's own ``edge.agent.Session`` (its partition, trainer, codec and the strategy's client half),
trained round by round with its ``train_one_round``; the server's decode, the strategy's server half
(``fl_server.engine.strategy_half``), global momentum and ``apply_update`` are the RoundEngine's. No Flower and
no threads, so that only the algorithm differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from contract.settings import RunConfig
from edge.agent import Session
from fl_server.engine import strategy_half
from ml.data import load_dataset
from ml.models import build_model, get_flat_params, set_flat_params
from ml.trainer import evaluate
from strategies.codecs import dense_payload_size, server_compressor
from strategies.downlink import BroadcastEncoder
from strategies.fedavg import apply_update, global_momentum
from strategies.strategy import Contribution


@dataclass
class SimResult:
    """Test accuracy at the evaluated rounds, and the uplink payload bytes of every round (all clients)."""

    clients: int  # per round
    dense_bytes: int  # one client's update as dense float32 (the `none` payload)
    eval_rounds: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    bytes_up: list[int] = field(default_factory=list)

    @property
    def bytes_per_update(self) -> float:
        """Mean payload of one client's update."""
        return sum(self.bytes_up) / (len(self.bytes_up) * self.clients)


def simulate(config: RunConfig, lr_at: Callable[[int], float] | None = None, eval_every: int = 1) -> SimResult:
    """Run ``config`` (its strategy, codec, data, partition and training settings); ``lr_at(round)`` (1-based),
    when given, replaces the job's learning-rate schedule; the global model is evaluated every ``eval_every``
    rounds and after the last."""
    if config.strategy_spec.buffer:
        raise ValueError("FedBuff's steps follow the arrival order of updates, which this simulation has no clock for")
    job = config.client_job()
    clients = [Session(job, j, config.clients) for j in range(config.clients)]
    dataset = load_dataset(config.dataset, config.data_dir or None)
    model = build_model(dataset, config.seed, config.model)
    history = {0: get_flat_params(model)}
    broadcaster = BroadcastEncoder(config.downlink_spec, history[0], clients[0].layout, config.seed)
    size = history[0].size
    server = strategy_half(config, size)
    for client in clients:
        client.strategy.receive_global(0, history[0], server.message_state(client.partition_id))
    delay = server.delay
    result = SimResult(config.per_round, dense_payload_size(size))
    momentum = global_momentum(config.codec_spec, size)
    for r in range(1, config.rounds + 1):
        summed, sent_bytes = server.open(size), 0
        for client in clients:
            j = client.partition_id
            if not client.sampler.trains(j, r):
                continue
            if r - delay - 1 >= 0:  # x̂ of that round, as the (compressed) broadcast delivers it
                held = r - delay - 1
                broadcast = broadcaster.broadcast(held, history[held], client.broadcast.round)
                client.strategy.receive_global(held, client.broadcast.receive(broadcast), server.message_state(j))
            start = client.strategy.start_params()
            update, sent = client.train_one_round(r, start, None if lr_at is None else lr_at(r))
            client.strategy.record_sent(r, sent)
            decoded = server_compressor(update.stype).decode(update.payload, client.layout)
            server.add(summed, decoded, Contribution(j, r, r, update.num_examples))
            sent_bytes += len(update.payload)
        step = server.close(summed, summed.mean())
        history[r] = apply_update(history[r - 1], momentum.step(step) if momentum else step)
        history.pop(r - delay - 1, None)  # no client needs it any more
        result.bytes_up.append(sent_bytes)
        if r % eval_every == 0 or r == config.rounds:
            set_flat_params(model, history[r])
            result.eval_rounds.append(r)
            result.accuracy.append(evaluate(model, dataset.x_test, dataset.y_test)[1])
    return result

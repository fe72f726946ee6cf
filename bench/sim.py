"""In-process federated simulation with EXACT staleness, for the ablation benchmarks.

Before round t every client receives the global model of round t − D − 1, never a newer one (in a deployment
the engine hands out the newest model it has, so the real staleness is at most D; D = 0 is FedAvg). It uses the
pieces a deployment uses — ml.trainer.LocalTrainer on each client's partition, strategies.dga's client
bookkeeping, the uplink codec from make_client_codec, and the server's decode + WeightedMean + apply_update as
the RoundEngine does — without Flower, so that only the algorithm differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ml.data import load_dataset
from ml.models import build_model, get_flat_params, param_layout, set_flat_params
from ml.partition import partition_indices
from ml.trainer import LocalTrainer, evaluate
from strategies.codecs import dense_payload_size, make_client_codec, parse_codec, server_compressor
from strategies.codecs.base import layout_info
from strategies.dga import DelayedAveragingClient
from strategies.fedavg import WeightedMean, apply_update


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. codec is the uplink codec spec; eval_every evaluates every that many rounds (and
    after the last)."""

    dataset: str = "fashion-mnist"
    partition: str = "dirichlet:0.3"
    clients: int = 4
    rounds: int = 40
    local_steps: int = 10
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    delay: int = 0
    correction: bool = True
    codec: str = "none"
    eval_every: int = 1


@dataclass
class SimResult:
    """Test accuracy at the evaluated rounds, and the uplink payload bytes of every round (all clients)."""

    clients: int
    dense_bytes: int  # one client's update as dense float32 (the `none` payload)
    eval_rounds: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    bytes_up: list[int] = field(default_factory=list)

    @property
    def bytes_per_update(self) -> float:
        """Mean payload of one client's update."""
        return sum(self.bytes_up) / (len(self.bytes_up) * self.clients)


def simulate(config: SimConfig, lr_at: Callable[[int], float] | None = None) -> SimResult:
    """Run config; lr_at(round) (1-based), when given, sets every client's learning rate for that round."""
    dataset = load_dataset(config.dataset)
    parts = partition_indices(dataset, config.partition, config.clients, config.seed)
    model = build_model(dataset, config.seed)
    layout = param_layout(model)
    codec_spec = parse_codec(config.codec)
    momentum = 0.0 if codec_spec.holds_momentum else config.momentum
    history = {0: get_flat_params(model)}
    trainers, clients, codecs = [], [], []
    for j, idx in enumerate(parts):
        seed = config.seed * 1000 + j
        local = build_model(dataset, config.seed)
        x, y = dataset.x_train.subset(idx), dataset.y_train[idx]
        trainers.append(LocalTrainer(local, x, y, config.batch_size, config.lr, momentum, seed))
        codecs.append(make_client_codec(codec_spec, layout, seed, config.clients))
        clients.append(DelayedAveragingClient(config.delay, config.correction))
        clients[-1].receive_global(0, history[0])
    result = SimResult(config.clients, dense_payload_size(layout_info(layout).size))
    for r in range(1, config.rounds + 1):
        mean, sent_bytes = WeightedMean(layout_info(layout).size), 0
        for trainer, client, codec, idx in zip(trainers, clients, codecs, parts, strict=True):
            if r - config.delay - 1 >= 0:
                client.receive_global(r - config.delay - 1, history[r - config.delay - 1])
            if lr_at is not None:
                trainer.set_lr(lr_at(r))
            start = client.start_params()
            set_flat_params(trainer.model, start)
            trainer.train_steps(config.local_steps)
            encoded = codec.encode(get_flat_params(trainer.model) - start, r)
            client.record_sent(r, encoded.decoded)
            mean.add(server_compressor(encoded.stype).decode(encoded.payload, layout), len(idx))
            sent_bytes += len(encoded.payload)
        history[r] = apply_update(history[r - 1], mean.mean())
        history.pop(r - config.delay - 1, None)  # no client needs it any more
        result.bytes_up.append(sent_bytes)
        if r % config.eval_every == 0 or r == config.rounds:
            set_flat_params(model, history[r])
            result.eval_rounds.append(r)
            result.accuracy.append(evaluate(model, dataset.x_test, dataset.y_test)[1])
    return result

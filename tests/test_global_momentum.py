"""Global momentum for sparse uplinks (``gm=BETA``): the server's update rule, the round engine and the simulation
moving the model by it, clients training without momentum of their own, and a resumed run keeping it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from contract.run_folder import Checkpoint, RunFolder
from strategies.codecs import make_client_codec, parse_codec
from strategies.fedavg import ServerMomentum, global_momentum
from strategies.rounds import RoundEngine, Update

LAYOUT = (("w", (4,)),)


def test_server_momentum_is_heavy_ball_on_the_mean_update() -> None:
    momentum = ServerMomentum(0.9, 2)
    steps = [momentum.step(np.array(d, np.float32)) for d in ([1, 0], [1, 0], [0, 2])]
    np.testing.assert_allclose(steps, [[1, 0], [1.9, 0], [1.71, 2]], rtol=1e-6)
    resumed = ServerMomentum(0.9, 2, steps[-1])
    np.testing.assert_allclose(resumed.step(np.zeros(2, np.float32)), [1.539, 1.8], rtol=1e-6)
    with pytest.raises(ValueError, match="β must be in"):
        ServerMomentum(1.0, 2)
    with pytest.raises(ValueError, match="buffer has shape"):
        ServerMomentum(0.5, 3, np.zeros(2))


def test_only_a_gm_spec_gets_server_momentum_and_its_clients_train_plain_sgd() -> None:
    assert global_momentum(parse_codec("topk:0.01"), 4) is None
    assert global_momentum(parse_codec("stc:0.01:gm=0.8"), 4).beta == 0.8
    assert parse_codec("stc:0.01:gm=0.8").plain_sgd and not parse_codec("stc:0.01").plain_sgd
    assert parse_codec("dgc:0.99").plain_sgd  # DGC's own momentum correction
    codec = make_client_codec(parse_codec("dgc:0.5:gm=0.9"), (("w", (8, 8)),), 0)
    for server_round in (1, 2, 3):
        codec.encode(np.ones(64, np.float32), server_round)
    assert not codec.state_dict()["momentum"].any()  # DGC with gm keeps no momentum of its own
    assert codec.state_dict()["velocity"].any()  # but still accumulates what it did not send


def _update(value: float, round_: int) -> Update:
    encoded = make_client_codec(parse_codec("none"), LAYOUT, 0).encode(np.full(4, value, np.float32), round_)
    return Update(round_, encoded.stype, encoded.payload, 1)


def test_the_round_engine_moves_the_global_model_by_the_momentum() -> None:
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=3, num_clients=1, momentum=ServerMomentum(0.5, 4))
    momenta = []
    for round_ in (1, 2, 3):
        assert engine.next_request(1) is not None
        engine.receive(1, [_update(1.0, round_)])
        (closed,) = engine.close_rounds(now=0)
        momenta.append(closed.momentum[0])
    assert momenta == [1.0, 1.5, 1.75]  # m = 0.5·m + 1
    np.testing.assert_allclose(engine.global_params, 4.25)  # 1 + 1.5 + 1.75, where FedAvg would be at 3
    plain = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=1, num_clients=1)
    plain.next_request(1)
    plain.receive(1, [_update(1.0, 1)])
    assert plain.close_rounds(now=0)[0].momentum.size == 0


def test_a_checkpoint_keeps_the_momentum_and_an_older_one_reads_as_none(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    folder.save_checkpoint(Checkpoint(2, np.zeros(4, np.float32), momentum=np.full(4, 1.5, np.float32)))
    checkpoint = folder.read_checkpoint()
    resumed = global_momentum(parse_codec("topk:0.5:gm=0.5"), 4, checkpoint.momentum)
    np.testing.assert_allclose(resumed.step(np.ones(4, np.float32)), 1.75)
    np.savez(folder.checkpoint_path, round=2, params=np.zeros(4), wall_s=0.0, recent_norms=np.zeros(0))
    old = folder.read_checkpoint()
    assert old.momentum.size == 0 and not global_momentum(parse_codec("topk:0.5:gm=0.5"), 4, old.momentum).buffer.any()

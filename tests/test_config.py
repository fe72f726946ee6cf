"""Settings: defaults ← TOML ← flags, validation with one-line errors, and the resolved file round-trips."""

import itertools
from pathlib import Path

import numpy as np
import pytest

from contract.errors import EdgeflError
from contract.settings import ConfigError, build_config, load_config, save_config


def test_flags_override_the_file(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('strategy = "dga:4"\ndataset = "digits"\nclients = 3\nlocal-steps = 7\n')
    config = build_config(file, clients=5, lr=None)
    assert (config.strategy, config.dataset, config.clients, config.local_steps) == ("dga:4", "digits", 5, 7)
    assert config.strategy_spec.delay == 4 and config.strategy_spec.correction


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = build_config(None, strategy="DGA:2:nocorrection", target_accuracy=0.7, out=str(tmp_path / "r"))
    save_config(config, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == config and again.strategy == "dga:2:nocorrection" and not again.strategy_spec.correction


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("clients = 0\n", "clients must be at least 1"),
        ('strategy = "no-such-strategy"\n', "unknown strategy 'no-such-strategy'"),
        ('strategy = "dga"\n', "strategy 'dga' needs a whole number of rounds D"),
        ('strategy = "dga:x"\n', "needs a whole number of rounds D in 0..64"),
        ("lr = -1\n", "lr must be positive"),
        ("bogus = 1\n", "unknown setting 'bogus'"),
        ("clients = [\n", "not valid TOML"),
        ('clients = "four"\n', "clients must be a number"),
        ('compress = "zip"\n', "unknown codec 'zip'"),
        ('lr_schedule = "step"\n', "unknown lr-schedule"),
        ('compress_down = "zip"\n', "unknown codec 'zip'"),
        ('compress_down = "stc:0.01:gm=0.9"\n', "put it on --compress, not on --compress-down"),
        ('compress = "int8:gm=0.9"\n', "option of the sparse codecs topk, stc, dgc only"),
    ],
)
def test_bad_settings_say_what_is_wrong_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "bad.toml"
    file.write_text(text)
    with pytest.raises(EdgeflError, match=message) as info:
        build_config(file)
    assert "\n" not in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build_config("/nonexistent/edgefl.toml")


def test_evaluation_sample_is_fixed_by_the_seed_and_drawn_from_the_test_split() -> None:
    from fl_server.engine import evaluation_sample

    x = np.arange(100, dtype=np.float32).reshape(50, 2)
    y = np.arange(50)
    xs, ys = evaluation_sample(x, y, 20, seed=3)
    assert len(ys) == 20 and len(set(ys.tolist())) == 20
    assert np.array_equal(xs, x[ys])  # rows stay paired with their labels
    assert np.array_equal(evaluation_sample(x, y, 20, seed=3)[1], ys)
    assert not np.array_equal(evaluation_sample(x, y, 20, seed=4)[1], ys)
    assert evaluation_sample(x, y, 0, seed=3)[1] is y


def test_cosine_schedule_anneals_from_the_base_rate_over_the_run() -> None:
    from ml.schedule import scheduled_lr

    rates = [scheduled_lr(0.1, "cosine", r, 10) for r in range(1, 11)]
    assert rates[0] == 0.1
    assert abs(rates[5] - 0.05) < 1e-12  # η/2 halfway: ½(1 + cos(π/2))
    assert all(a > b for a, b in itertools.pairwise(rates)) and rates[-1] > 0
    assert scheduled_lr(0.1, "constant", 7, 10) == 0.1

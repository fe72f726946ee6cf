"""The Flower quickstart ClientApp, as the baseline for ``--strategy flower-fedavg``: every message starts a
fresh process that imports torch, loads its partition, builds the model from the received state dict (one
Array per tensor), trains K local steps with a fresh optimizer and replies with the whole state dict (and, for
the records, its partition and training time)."""

from __future__ import annotations

import time

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    import torch

    from contract.settings import parse_partition
    from ml.data import load_dataset
    from ml.models import build_model
    from ml.partition import partition_indices
    from ml.schedule import scheduled_lr
    from ml.trainer import LocalTrainer

    torch.set_num_threads(1)
    job = msg.content["config"]
    pid, num = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    dataset = load_dataset(str(job["dataset"]), str(job["data-dir"]) or None)
    idx = partition_indices(dataset, parse_partition(str(job["partition"])), num, int(job["seed"]))[pid]
    model = build_model(dataset, int(job["seed"]), str(job["model"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainer = LocalTrainer(
        model,
        dataset.x_train.subset(idx),
        dataset.y_train[idx],
        int(job["batch-size"]),
        scheduled_lr(float(job["lr"]), str(job["lr-schedule"]), int(job["server-round"]), int(job["rounds"])),
        float(job["momentum"]),
        seed=int(job["seed"]) * 1000 + pid + 7919 * int(job["server-round"]),
    )
    started = time.perf_counter()
    loss = trainer.train_steps(int(job["local-steps"]))
    train_s = time.perf_counter() - started
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord(
                {"train_loss": loss, "num-examples": len(idx), "train-s": train_s, "partition-id": pid}
            ),
        }
    )
    return Message(content, reply_to=msg)
